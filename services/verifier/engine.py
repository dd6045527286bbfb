"""Verifier engine: per-generation target sessions and the admission of prefill, decode and
draft-block verify requests.

Owns the target model's sessions (one `SessionRecord` each), the accept rule and each
session's committed tail, and is the one place that validates what a client sends (token
ids, positions, block sizes); it never runs a forward (the step loop,
`services.verifier.batcher`, runs every request), drafts, gates or counts rounds, and knows
nothing of gRPC. How a forward's output completes a request (`absorb`: row judging,
rollback to the accepted prefix, chunk gathering, commit) and the `SessionRecord` /
`StepResult` / `VerifyResult` records live in `services.verifier.work`; they are
re-exported here, so the engine module stays the verifier's one import.

Dimension legend: V = vocab, T = len(dspark_target_layer_ids), D = dim, k = drafts in a
block, a = accepted drafts (0 <= a <= k), W = window_size.

Row contract (docs/architecture.md §3). A session's committed tokens are x[0..n]; the target
state holds positions 0..n-1 and x[n] is the anchor (the target's argmax at n-1).
A verify of (anchor, drafts, position=n) forwards [anchor, d1..dk] at positions n..n+k,
accepts the longest prefix a with d_{i+1} == argmax(logits at n+i), and returns the bonus
token argmax(logits at n+a), the new anchor's top1 - top2 margin, and the tap rows of
positions n..n+a: exactly what the target consumed and committed (the bonus token has not
been forwarded; it is the next round's anchor). A decode returns the row of the position it
consumed. After either request the state holds positions 0..n+a and `next_position` = n+a+1.

Correctness policy.
  Asserted (tests/test_verifier_engine.py):
    * sequential verify is exact w.r.t. plain decode: it forwards one position at a time
      and stops at the first mismatch, so nothing uncommitted enters the state; a greedy
      speculative chain verified sequentially is token-for-token the plain greedy chain;
    * batched verify's per-position logits and rows match k+1 sequential decodes within
      rel. 1e-4 in fp32 (quantisation simulation off), at positions that wrap the ring and
      straddle compressor boundaries;
    * rollback restores exactly what the rejected positions changed (ring slots, compressor
      and indexer accumulators, entry counts): continuations after a rollback equal a clean
      run that forwarded only the committed positions within that tolerance, and the
      continuation tokens are identical whichever rejected suffix was rolled back.
  Not claimed: bitwise equality of the committed state across different rejected suffixes.
  The committed positions were computed inside a (k+1)-row forward whose MoE routing
  batches and attention shapes depend on the rejected rows, so their kv / compressor rows
  differ in the last bits between suffixes.
  Reported, never asserted: those committed-state differences, and the first token where
  batched and plain greedy chains diverge with the top1 - top2 margin there (GEMM shapes
  change reduction order; docs/architecture.md §12 shows such drift turning into different
  tokens).

Inputs. This engine is the one boundary that validates what arrives over the wire: token
ids and positions must be integers (Python ints, numpy / torch integer scalars), drafts a
list / tuple / 1-D integer tensor; anything else (floats, strings, bools, sets) raises
ValueError naming the value. Ids must lie in [0, vocab_size), a prompt must fit
max_seq_len, a decode or verify block must start at the session's next position and end
before max_seq_len, and a batched block on an exact-numerics trunk holds at most
`EXACT_ROWS` tokens. Every check runs before the session changes, so the trunk below only
ever sees valid calls.
`admit_prefill` / `admit_decode` / `admit_verify` run these checks and write the request
into the session's record; the step loop runs it inside a batched forward (a batch of one
when it is alone) and takes its output back through `absorb`. The loop feeds a prompt in
chunks (`BatchItem.prefill_chunk`); `absorb` gathers them and the last one returns the
prefill's result (bitwise whatever the chunks in exact numerics, where `Trunk.prefill` runs
the same exact tiles; to rounding in fast numerics).

Sampling (docs/sampling.md). A session's `SamplingParams` are set by its prefill and fixed
for its life; greedy (the default) is the argmax rule above, unchanged. At T > 0 the token
at position t is chosen from the logits of t - 1 by `services.verifier.choice`: the coupled
rule takes the Gumbel-max draw keyed by (seed, t) and accepts a draft when it equals it; the
rejection rule accepts with probability min(1, p/q) given the drafts' distributions
(`draft_probs`, required then) and resamples from the residual. Both decide each position
from its own logits row, so sequential and batched verify agree whenever their logits do.
Every result carries the logprob record (raw target distribution) of each token it chose.

Committed rows. Each session keeps the tap rows of its last window_size committed
positions and its anchor (`services.verifier.committed`), so a replacement drafter can be
primed after the session's drafter failed (`committed_tail`).
"""

from __future__ import annotations


import numpy as np
import torch

from services.common.budget import check_survival
from services.common.sessions import (SessionHost, SessionLimitError, SessionTable,
                                      UnknownSessionError)
from services.common.settings import VERIFY_MODES
from services.verifier.choice import check_draft_probs
from services.verifier.committed import CommittedRows, CommittedTail
from services.verifier.work import SessionRecord, StepResult, VerifyResult, abandon, absorb, top2_margin

from dsv4.sampling import GREEDY, MAX_LOGPROBS, SamplingParams
from dsv4.scalars import as_int
from dsv4.trunk import EXACT_ROWS, Trunk
from services.common.constraint import Constraint, GrammarVocab, resolve_vocab
from services.common.grammar import GrammarState
from services.common.controls import LogitsControls, control_state

__all__ = ["SessionLimitError", "UnknownSessionError", "SessionRecord", "StepResult", "VerifyResult",
           "VerifierEngine", "abandon", "absorb", "per_session_bytes", "top2_margin"]


def per_session_bytes(model) -> int:
    """See `VerifierEngine.per_session_bytes`; `model`: a `Trunk` or a wrapper / TP driver
    holding one as `.model` (measured on that rank-local trunk, so no remote state is made)."""
    base = model
    while not isinstance(base, Trunk) and getattr(base, "model", None) is not None:
        base = base.model
    cfg = base.cfg
    return base.state_bytes(base.new_state()) + cfg.window_size * cfg.tap_width * torch.bfloat16.itemsize

def _token_list(ids: object, name: str) -> list[int]:
    """A list / tuple / 1-D integer tensor or array of token ids -> list of Python ints.

    Raises ValueError naming `name` and the bad value (floats, strings, bools, sets, ...).
    """
    if torch.is_tensor(ids) or isinstance(ids, np.ndarray):
        t = torch.as_tensor(ids)
        if t.ndim != 1 or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor, got shape {tuple(t.shape)} dtype {t.dtype}")
        return [int(v) for v in t.tolist()]
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"{name} must be a list, tuple or 1-D integer tensor of token ids, "
                         f"got {type(ids).__name__}")
    return [as_int(f"{name}[{i}]", v) for i, v in enumerate(ids)]


class VerifierEngine(SessionHost[SessionRecord]):
    """Sessions over one `Trunk` (TP=1 here; `services.verifier.tp` drives TP > 1).

    Args:
        model: a loaded `Trunk` (or a TP driver with the same interface).
        max_sessions: open sessions allowed at once (>= 1).
        prefill_keep_rows: tap rows a prefill returns (default: window_size, what the
            drafter's rings can hold).
        limit_rule: how max_sessions was chosen, one line for Info
            (`services.common.limits.SessionLimit.rule`; "" when not said).
        vocab: the `GrammarVocab` constrained sessions compile against, or a callable making
            it on first use (None: the byte vocabulary of the model's vocab_size, what a
            checkpoint without tokenizer.json uses; `services.common.constraint.resolve_vocab`).
    Raises:
        ValueError: max_sessions not an integer >= 1, prefill_keep_rows not None or an
            integer >= 0.
    Thread safety: calls on different sessions may run concurrently; calls on one session
    are serialised by its lock.
    """

    def __init__(self, model: Trunk, max_sessions: int = 16, prefill_keep_rows: int | None = None,
                 limit_rule: str = "", vocab=None):
        max_sessions = as_int("max_sessions", max_sessions)
        if max_sessions < 1:
            raise ValueError(f"max_sessions={max_sessions}: must be >= 1")
        if prefill_keep_rows is not None:
            prefill_keep_rows = as_int("prefill_keep_rows", prefill_keep_rows)
            if prefill_keep_rows < 0:
                raise ValueError(f"prefill_keep_rows={prefill_keep_rows}: must be >= 0")
        self.model, self.cfg = model, model.cfg
        self.keep_rows = self.cfg.window_size if prefill_keep_rows is None else prefill_keep_rows
        self._table: SessionTable[SessionRecord] = SessionTable(max_sessions)
        self.limit_rule = limit_rule
        self._session_bytes: int | None = None
        self._vocab = vocab

    @property
    def vocab(self) -> GrammarVocab:
        """The grammar vocabulary (built on first use: unconstrained serving never pays for it)."""
        if not isinstance(self._vocab, GrammarVocab):
            self._vocab = resolve_vocab(self._vocab, self.cfg.vocab_size, self.cfg.eos_token_id)
        return self._vocab

    # ------------------------------------------------------------------ sessions
    def open_session(self) -> int:
        """Open a session; returns its id. Raises SessionLimitError when max_sessions are open."""
        record = SessionRecord(0, self.model.new_state(), CommittedRows(self.cfg.window_size))
        record.sid = self._table.open(record)
        return record.sid

    def session_bytes(self, sid: int) -> int:
        """Bytes of target state held by session `sid` (rings, compressor states, caches)."""
        return self.model.state_bytes(self._get(sid).state)

    def per_session_bytes(self) -> int:
        """Bytes one session holds at most, whatever its length (per TP rank): its target
        state (rings, compressor rows, compressed and indexer caches, all sized for
        max_seq_len when the session opens) and its committed tail (window_size bf16 rows)."""
        if self._session_bytes is None:  # a fresh state's size never changes: measured once
            self._session_bytes = per_session_bytes(self.model)
        return self._session_bytes

    def state_bytes(self) -> int:
        """Bytes of target state held by every open session (per TP rank under tensor parallelism)."""
        return sum(self.model.state_bytes(s.state) for s in self._table.sessions())

    def next_position(self, sid: int) -> int:
        """The position the session's next forwarded token takes (= tokens committed so far - 1 + 1)."""
        return self._get(sid).state.next_position

    def committed_tail(self, sid: int, count: int) -> CommittedTail:
        """The session's last min(count, kept) committed tap rows (count 0: every kept row, at
        most window_size) as bfloat16 [R, T*D], with their first position and the anchor.

        Raises:
            ValueError: count not an integer >= 0, or nothing committed yet (both named).
            UnknownSessionError: `sid` not open.
        """
        count = as_int("rows count", count)
        with self._table.locked(sid) as s:
            return s.committed.tail(count)

    def _get(self, sid: int) -> SessionRecord:
        """The session record (its lock not taken: diagnostics and tests)."""
        return self._table.get(sid)

    def hold(self, sid: int):
        """Context manager: hold session `sid`'s lock and yield its record (the step loop).

        Raises:
            UnknownSessionError: `sid` not open.
        """
        return self._table.locked(sid)

    # ------------------------------------------------------------------ admission
    def admit_prefill(self, sid: int, token_ids: list[int] | torch.Tensor,
                      sampling: SamplingParams = GREEDY, constraint: Constraint | None = None,
                      controls: LogitsControls | None = None,
                      prompt_logprobs: int | None = None) -> SessionRecord:
        """Admit the prompt x[0..n-1] (positions 0..n-1) of `sid`: validate it and make it the
        session's request in flight (`SessionRecord.begin`); returns the record, for
        `StepLoop.submit`. Its result is the first anchor x[n], chosen with `sampling`, which the
        session keeps for every later token. `constraint`: the session's output constraint
        (docs/structured.md), compiled here: every token the session chooses from then on is
        chosen among the tokens its grammar allows. `controls`: its logits controls
        (logit_bias, penalties, min_tokens, bad_words; docs/sampling.md), applied to every row
        it chooses a token from, after the tokens it committed before that row.
        `prompt_logprobs`: None, or the top alternatives (0..MAX_LOGPROBS) of the prompt
        logprobs the result then carries: the raw logprob of every prompt token after the
        first, from the logits of the position before it (docs/sampling.md §5); the head then
        runs over every prompt row.

        Raises:
            ValueError: empty prompt, non-integer ids, ids out of range, prompt longer than
                max_seq_len, session already prefilled, sampling not a SamplingParams, a
                request of `sid` already in flight, a constraint that does not compile
                (`ConstraintError`), controls not a LogitsControls or naming a token id outside
                the vocabulary, prompt_logprobs not an integer in 0..MAX_LOGPROBS (named); the
                session is unchanged then.
            UnknownSessionError: `sid` not open.
        """
        s = self._get(sid)
        if controls is not None and not isinstance(controls, LogitsControls):
            raise ValueError(f"controls must be a services.common.controls.LogitsControls, got {type(controls).__name__}")
        if controls is not None:
            controls.check_vocab(self.cfg.vocab_size)
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a dsv4.sampling.SamplingParams, got {type(sampling).__name__}")
        if s.prefilled:
            raise ValueError(f"session {sid} is already prefilled (next position {s.state.next_position})")
        ids = _token_list(token_ids, "prompt")
        if not ids:
            raise ValueError(f"empty prompt: session {sid} needs at least one token")
        if len(ids) > self.cfg.max_seq_len:
            raise ValueError(f"prompt length {len(ids)} exceeds max_seq_len={self.cfg.max_seq_len}")
        self._check_range(ids)
        if prompt_logprobs is not None:
            prompt_logprobs = as_int("prompt_logprobs", prompt_logprobs)
            if not 0 <= prompt_logprobs <= MAX_LOGPROBS:
                raise ValueError(f"prompt_logprobs={prompt_logprobs}: must lie in 0..{MAX_LOGPROBS}")
        grammar = None
        if constraint is not None:
            grammar = GrammarState(self.vocab.compile(constraint), self.cfg.vocab_size, self.cfg.eos_token_id)
        s.begin("prefill", ids, 0, keep=self.keep_rows, prompt_logprobs=prompt_logprobs)
        s.sampling = sampling  # fixed once the prefill completes (`prefilled`)
        s.controls = control_state(controls, self.cfg.vocab_size, ids, grammar)
        return s

    def admit_decode(self, sid: int, token_id: int, position: int) -> SessionRecord:
        """Admit a decode of one committed token at `position` (the session's next position);
        as `admit_prefill`. Its result is the token chosen at position + 1 (the next anchor;
        the argmax for a greedy session), the raw top1 - top2 margin there, its logprob record
        and the row of `position`.

        Raises:
            ValueError: position or token_id not an integer, position is not the session's
                next position (both named), session not prefilled, id out of range, position
                at or beyond max_seq_len, a request already in flight; the session is unchanged.
            UnknownSessionError: `sid` not open.
        """
        s = self._get(sid)
        token_id = as_int("token_id", token_id)
        position = as_int("position", position)
        self._check_position(sid, s, position)
        if position >= self.cfg.max_seq_len:
            raise ValueError(f"decode position={position}: must be < max_seq_len={self.cfg.max_seq_len}")
        self._check_range([token_id])
        return s.begin("decode", [token_id], position)

    def admit_verify(self, sid: int, anchor: int, drafts: list[int], position: int,
                     mode: str = "sequential", draft_probs: torch.Tensor | None = None,
                     survival=None) -> SessionRecord:
        """Admit a verify of [anchor, d1..dk] at positions position..position+k (module
        docstring); as `admit_prefill`.

        draft_probs [k, V]: the distribution each draft was drawn from; required by a session
        sampling with the rejection rule, ignored otherwise.
        mode "sequential": one position per step, stopping at the first mismatch (exact).
        mode "batched": one (k+1)-position forward, then exact rollback of positions
        n+a+1..n+k (ring slots, compressor accumulators, compressed and indexer caches).
        survival: k floats, P(drafts 1..j all accepted) per draft j (the gateway's estimates):
        the step's budget may then verify only a prefix of the block
        (`services.common.budget`; batched mode only; None or empty: the whole block).
        Raises:
            ValueError: unknown mode; anchor / position not an integer, drafts not a list /
                tuple / 1-D integer tensor of integers (each named); wrong position (named),
                ids out of range, a block that would run past max_seq_len, a batched block
                of more than EXACT_ROWS tokens on an exact-numerics trunk; draft_probs missing
                or malformed under the rejection rule (named); survival of another length than
                the drafts, outside [0, 1] or rising; a request already in flight.
                The session is unchanged then.
            UnknownSessionError: `sid` not open.
        """
        s = self._get(sid)
        if mode not in VERIFY_MODES:
            raise ValueError(f"verify mode={mode!r}: must be one of {VERIFY_MODES}")
        anchor = as_int("anchor", anchor)
        position = as_int("position", position)
        draft_ids = _token_list(drafts, "drafts")
        self._check_position(sid, s, position)
        ids = [anchor, *draft_ids]
        self._check_block(position, ids, mode)
        q = check_draft_probs(s.sampling, draft_probs, len(draft_ids), self.cfg.vocab_size)
        estimates = check_survival(survival, len(draft_ids)) if survival is not None and len(survival) else None
        return s.begin("verify", ids, position, mode, draft_probs=q, survival=estimates)

    def _check_range(self, ids: list[int]) -> None:
        for i, t in enumerate(ids):
            if not 0 <= t < self.cfg.vocab_size:
                raise ValueError(f"token id {t} at index {i} outside [0, vocab_size={self.cfg.vocab_size})")

    def _check_position(self, sid: int, s: SessionRecord, position: int) -> None:
        if not s.prefilled:
            raise ValueError(f"session {sid} has no prompt yet: prefill first")
        if position != s.state.next_position:
            raise ValueError(f"position={position!r} is not session {sid}'s next position "
                             f"{s.state.next_position}")

    def _check_block(self, position: int, ids: list[int], mode: str) -> None:
        """The block [anchor, drafts] at `position` fits max_seq_len, holds valid ids and, batched
        on an exact-numerics trunk, at most EXACT_ROWS tokens (its fixed tile)."""
        k = len(ids) - 1
        if position + k >= self.cfg.max_seq_len:
            raise ValueError(f"verify block at position {position} with {k} drafts runs past "
                             f"max_seq_len={self.cfg.max_seq_len}")
        self._check_range(ids)
        if mode == "batched" and k > 0 and self.model.verify_numerics == "exact" and len(ids) > EXACT_ROWS:
            raise ValueError(f"verify block of {len(ids)} tokens: exact mode verifies at most {EXACT_ROWS} "
                             f"(k <= {EXACT_ROWS - 1} drafts) in one batched forward; use sequential mode "
                             f"or fewer drafts")

