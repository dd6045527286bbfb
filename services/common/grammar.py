"""One generation's grammar matcher and the vocabulary mask it puts on a logits row.

`GrammarState` holds an XGrammar matcher over the tokens a generation has committed (or, on
the drafter, drafted): `mask(row)` returns the row with every token the grammar forbids after
those tokens set to -inf, computed on the row's device; `accept(token)` advances it;
`checkpoint()` / `rollback_to(n)` undo tokens accepted tentatively (the drafter's block).
The verifier advances its state only on committed tokens, so a rejected draft never moves it
(docs/structured.md). It holds no request and no model; callers hold the session's lock.

Masks beside the forward. `prefetch(path)` fills, on a worker thread, the bitmask of the
current state and of each state along `path` (a verify's drafts): exactly the states the
verifier's rows will be scored in if the drafts before them are accepted, and the only ones a
row past a rejected draft never needs. The verifier calls it when a decode or verify is
admitted, so the fills run while the request waits for and runs its forward; the row's mask
is then a lookup (docs/structured.md §7). Until the job is done the matcher is the worker's:
every other method waits for it first.

Grammar completion. Where the grammar may end, the model's eos is allowed beside whatever
may continue; once the grammar can continue no further (terminated, or completed with
nothing left to add), eos is the only token allowed, so a generation ends there instead of
padding (the failure of vLLM #55313).

Dimension legend: V = vocab_size (the logits width), W = ceil(V / 32) bitmask words.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xgrammar as xgr

# Mask fills run here (XGrammar's fill is C++; torch's forward releases the GIL too).
_FILLS = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="grammar-fill")


class GrammarError(RuntimeError):
    """The matcher refused a token it was asked to accept (a caller let a forbidden token through)."""


class GrammarState:
    """The matcher of one generation over one compiled grammar.

    Args:
        compiled: `xgrammar.CompiledGrammar` (`services.common.constraint.GrammarVocab.compile`).
        vocab_size: V, the logits width the masks cover.
        eos_token_id: the stop token (forced once the grammar has nothing left to add).
        rollback: tokens `rollback_to` may undo (the drafter's block size; 0 on the verifier).
    Not thread safe (one caller at a time; a `prefetch` job is joined by every method).
    """

    def __init__(self, compiled, vocab_size: int, eos_token_id: int, rollback: int = 0):
        self._matcher = xgr.GrammarMatcher(compiled)  # unlimited rollback (-1)
        self.vocab_size, self.eos_token_id = int(vocab_size), int(eos_token_id)
        self._bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)  # [1, W] int32, CPU
        self.accepted = 0  # tokens accepted so far (rollback counts them back)
        self.any_other_than_eos = True
        self._version, self._filled_at = 0, -1  # state changes so far; the one the bitmask was filled at
        self._tokens: list[int] = []  # the accepted tokens (a prefetched mask's key)
        self._job: Future | None = None  # the prefetch in flight
        # The last prefetch: the accepted count it started at, its path, and the (bitmask [1, W]
        # int32, any_other_than_eos, the [V] bool of forbidden tokens) of each state along the path.
        self._plan: tuple[int, list[int], list[tuple[torch.Tensor, bool, torch.Tensor]]] = (0, [], [])
        self._forbidden: torch.Tensor | None = None  # [V] bool of the current fill, when prefetched
        self.prefetched_hits = 0  # fills answered by a prefetch (bench and tests read it)

    @property
    def finished(self) -> bool:
        """The grammar has nothing left to add: only eos may follow (or eos was accepted)."""
        self._join()
        m = self._matcher
        return m.is_terminated() or (m.is_completed() and not self._fill().any_other_than_eos)

    def allowed(self) -> torch.Tensor:
        """[V] bool on CPU: the tokens the grammar allows next."""
        return self._fill()._unpack()

    def _unpack(self) -> torch.Tensor:
        """[V] bool on CPU: the bitmask as filled, one entry per token."""
        bits = (self._bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        return bits.reshape(-1)[: self.vocab_size].bool()

    def allows(self, token: int) -> bool:
        """Whether `token` is allowed next."""
        return self._fill()._bit(token)

    def mask(self, row: torch.Tensor) -> torch.Tensor:
        """A copy of the logits `row` ([V] or [1, V], any float dtype, any device) with every
        forbidden token at -inf, the bitmask applied on the row's device.

        Raises:
            GrammarError: no token of the vocabulary continues the grammar here (a grammar
                needing text no token spells); the request fails rather than leave it.
        """
        bitmask = self._fill().bitmask
        if not bitmask.any():
            raise GrammarError("no token of the model's vocabulary continues the constraint here")
        flat = row.reshape(1, -1)
        if self._forbidden is not None and flat.device.type == "cpu" and flat.shape[1] == self.vocab_size:
            # prefetched: the bits were unpacked on the worker, so the step thread pays one
            # masked copy (XGrammar's CPU kernel costs ~0.5 ms at V = 129,280 with few bits set)
            return flat.masked_fill(self._forbidden, float("-inf")).reshape(row.shape)
        out = flat.clone()
        xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device, non_blocking=True), vocab_size=self.vocab_size)
        return out.reshape(row.shape)

    def accept(self, token: int) -> None:
        """Advance past `token`. Raises GrammarError: the grammar forbids it."""
        t = int(token)
        self._join()
        if self._matcher.is_terminated():
            if t == self.eos_token_id:
                return  # eos after eos: the generation has ended; nothing to advance
            raise GrammarError(f"token {t} after the grammar terminated")
        if not self.allows(t) or not self._matcher.accept_token(t):
            raise GrammarError(f"token {t} is not allowed by the grammar here")
        self.accepted += 1
        self._tokens.append(t)
        self._version += 1

    def rollback_to(self, accepted: int) -> None:
        """Undo the tokens accepted after the count `accepted` (within `rollback`)."""
        self._join()
        back = self.accepted - int(accepted)
        if back > 0:
            self._matcher.rollback(back)
            self.accepted = int(accepted)
            del self._tokens[self.accepted:]
            self._version += 1

    def prefetch(self, path: list[int]) -> None:
        """Start filling, on a worker thread, the bitmasks of the current state and of the
        states after each prefix of `path` (token ids; a verify's drafts, [] for a decode),
        up to the first token the grammar forbids. Returns at once; the fills are used by the
        mask of a state reached by accepting exactly such a prefix. The matcher is left as it
        was (the job accepts tentatively and rolls back)."""
        self._join()
        self._job = _FILLS.submit(self._fill_path, self.accepted, [int(t) for t in path])

    def _fill_path(self, base: int, path: list[int]) -> None:
        masks: list[tuple[torch.Tensor, bool, torch.Tensor]] = []
        try:
            for j in range(len(path) + 1):
                self._compute()
                masks.append((self._bitmask.clone(), self.any_other_than_eos, ~self._unpack()))
                m = self._matcher
                if j == len(path) or m.is_terminated() or not self._bit(path[j]) or not m.accept_token(path[j]):
                    break  # past a forbidden draft (or eos) no row is scored in this state
                self.accepted += 1
        finally:
            if self.accepted > base:
                self._matcher.rollback(self.accepted - base)
            self.accepted = base
            self._filled_at = -1  # the bitmask holds the path's last state: fill again on use
            self._plan = (base, path, masks)

    def _join(self) -> None:
        """Wait for the prefetch in flight (its errors surface here)."""
        job, self._job = self._job, None
        if job is not None:
            job.result()

    def forced_run(self, limit: int) -> list[int]:
        """The tokens the grammar forces next, at most `limit`: while exactly one token is
        allowed (eos excluded), that token. The matcher is left as it was. These are exactly
        the tokens any rule would choose there (one allowed token wins every draw), which is
        what makes jump-forward exact (docs/structured.md §6); a string the grammar forces but
        the vocabulary can spell several ways is not forced here.
        """
        run, start = [], self.accepted
        try:
            while len(run) < limit and not self.finished:
                token = self._only_token()
                if token is None or token == self.eos_token_id:
                    break
                run.append(token)
                self.accept(token)
        finally:
            self.rollback_to(start)
        return run

    def _only_token(self) -> int | None:
        """The one token the bitmask allows, or None when it allows none or several (a scan
        of the W words, not of the V bits: this runs once per committed token on the gateway)."""
        words = self._fill().bitmask[0]
        nonzero = words.nonzero()
        if nonzero.numel() != 1:
            return None
        index = int(nonzero[0, 0])
        word = int(words[index]) & 0xFFFFFFFF
        if word & (word - 1):
            return None  # two bits or more in the one word
        return index * 32 + word.bit_length() - 1

    # ------------------------------------------------------------------ the bitmask
    def _fill(self) -> "GrammarState":
        """Fill the bitmask for the current state (once per state; from the prefetch when it
        covered this state); eos alone once finished."""
        if self._filled_at != self._version:
            self._join()
            base, path, masks = self._plan
            j = self.accepted - base
            if 0 <= j < len(masks) and self._tokens[base:] == path[:j]:
                self._bitmask.copy_(masks[j][0])
                self.any_other_than_eos, self._forbidden = masks[j][1], masks[j][2]
                self.prefetched_hits += 1
            else:
                self._compute()
                self._forbidden = None
            self._filled_at = self._version
        return self

    def _compute(self) -> None:
        """Fill the bitmask from the matcher (the caller owns it)."""
        m = self._matcher
        if m.is_terminated():
            self._eos_only()
            return
        m.fill_next_token_bitmask(self._bitmask)
        eos_word, eos_bit = self.eos_token_id >> 5, self.eos_token_id & 31
        other = self._bitmask.clone()
        other[0, eos_word] &= ~(1 << eos_bit)
        self.any_other_than_eos = bool(other.any())
        if not self.any_other_than_eos:
            self._eos_only()

    def _bit(self, token: int) -> bool:
        """Whether the bitmask as filled allows `token`."""
        t = int(token)
        return 0 <= t < self.vocab_size and bool((int(self._bitmask[0, t >> 5]) >> (t & 31)) & 1)

    def _eos_only(self) -> None:
        self._bitmask.zero_()
        word, bit = self.eos_token_id >> 5, self.eos_token_id & 31
        value = 1 << bit
        self._bitmask[0, word] = value - (1 << 32) if value >= 1 << 31 else value  # int32 two's complement
        self.any_other_than_eos = False

    @property
    def bitmask(self) -> torch.Tensor:
        """[1, W] int32 on CPU: the last filled bitmask (bit t of word t // 32: token t allowed)."""
        return self._bitmask
