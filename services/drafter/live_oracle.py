"""Live oracle drafter: proposes the target's own greedy continuation of the committed tokens.

Owns drafts of known quality for benchmarks and service tests (`Drafter` interface); it is a
measuring device, not a real drafter: each draft costs about one trunk decode per slot, and it
validates the rows it is sent but never uses them.

The service form of the oracle drafter (`dspark serve drafter --oracle`). It holds a copy of
the trunk, follows each session's committed tokens (`observe_tokens`, fed from the commit
messages' token ids) and drafts by greedy-decoding the anchor and the next tokens on a copy
of the session's target state (under sampling, `draft_sampled`: the target's own keyed choice). Every draft it makes is therefore what the verifier would
choose, except where the corruption schedule replaces a token by (token + 1) % vocab_size:
slot j of a draft at seed position p is corrupted when `corrupt_every` > 0 and
(p + j) % corrupt_every == corrupt_every - 1. Confidence logits are `confident` for kept
tokens and `doubtful` for corrupted ones, so a gated run can learn them. Like every drafter
it drafts only positions before max_seq_len (`dsv4.draft_args.draft_length`: fewer than
block_size tokens near the end). Commits are checked with the DSpark engine's rules
(`dsv4.draft_args.check_commit`); their rows are not used.
"""

from __future__ import annotations

import copy
import math
import numbers
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from dsv4.draft_args import as_int_list, check_commit, check_draft_args, check_seed, draft_length
from dsv4.scalars import as_int
from dsv4.sampling import SamplingParams, keyed_choice
from dsv4.trunk import Trunk, TrunkState
from services.common.sessions import SessionHost, SessionTable
from services.drafter.engine import drafter_identity
from services.drafter.interface import Drafter, SampledDraft


# The confidence logits of kept and corrupted draft slots (the reference calibration's top
# bucket, >= 6.0, and its bottom one, < -0.5), so a gated run can learn them apart.
DEFAULT_CONFIDENT = 6.5
DEFAULT_DOUBTFUL = -2.0


@dataclass
class _LiveSession:
    state: TrunkState
    tokens: list[int] = field(default_factory=list)  # committed tokens fed to `state`
    last_position: int = -1  # last position whose row was committed


class LiveOracleDrafter(SessionHost[_LiveSession], Drafter):
    """Drafter-engine interface over a `Trunk` (see the module docstring).

    Args:
        trunk: a loaded `Trunk` (shared by all sessions; each session has its own state).
        max_sessions: open sessions allowed at once (an integer >= 1).
        corrupt_every: corruption period in positions (an integer >= 0; 0 = never corrupt).
        confident, doubtful: the confidence logits of kept and corrupted tokens (finite reals).
    Raises:
        ValueError: naming the value: max_sessions or corrupt_every not an integer in range
            (bool, float, NaN and str included), confident/doubtful not finite reals.
    """

    def __init__(self, trunk: Trunk, max_sessions: int = 16, corrupt_every: int = 0,
                 confident: float = DEFAULT_CONFIDENT, doubtful: float = DEFAULT_DOUBTFUL):
        if isinstance(corrupt_every, bool) or not isinstance(corrupt_every, numbers.Integral) or corrupt_every < 0:
            raise ValueError(f"corrupt_every={corrupt_every!r}: must be an integer >= 0 (0: never corrupt)")
        for name, value in (("confident", confident), ("doubtful", doubtful)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"{name}={value!r}: must be a finite real number")
        self._table: SessionTable[_LiveSession] = SessionTable(max_sessions)
        self.trunk, self.cfg = trunk, trunk.cfg
        self.corrupt_every, self.confident, self.doubtful = int(corrupt_every), float(confident), float(doubtful)

    observes_tokens = True  # drafts continue the committed tokens, so it must see them

    def identity(self) -> dict:
        """See `drafter_identity` (kind "oracle"; it always reports confidences)."""
        return drafter_identity(self.cfg, True, 1, "oracle")

    def open_session(self) -> int:
        """Open a session with an empty target state. Raises SessionLimitError when full."""
        return self._table.open(_LiveSession(self.trunk.new_state()))

    def last_position(self, sid: int) -> int:
        """The session's last committed position (-1 before the first commit)."""
        return self._table.get(sid).last_position

    def observed_tokens(self, sid: int) -> list[int]:
        """A copy of the committed tokens the session has seen."""
        return list(self._table.get(sid).tokens)

    def observe_tokens(self, sid: int, first_position: int, token_ids: Sequence[int]) -> None:
        """Feed committed tokens of positions first_position.. (the prompt first, then each round's).

        Atomic: the position, every id and the room before max_seq_len are checked before the
        trunk runs, so a rejected call leaves the session as it was.
        Raises:
            ValueError: first_position not an integer or not continuing the tokens already seen;
                token_ids empty, not a sequence, or holding an id that is not an integer in
                [0, vocab_size) (named with its index); positions reaching max_seq_len.
        """
        first = as_int("token_first_position", first_position)
        ids = as_int_list("token_ids", token_ids)
        V, L = self.cfg.vocab_size, self.cfg.max_seq_len
        bad = [(i, t) for i, t in enumerate(ids) if not 0 <= t < V]
        if bad:
            raise ValueError(f"token id {bad[0][1]} at index {bad[0][0]} outside [0, vocab_size={V})")
        with self._table.locked(sid) as s:
            if first != len(s.tokens):
                raise ValueError(f"oracle: token_first_position={first} does not continue the "
                                 f"{len(s.tokens)} committed tokens seen")
            if first + len(ids) > L:
                raise ValueError(f"oracle: tokens of positions {first}..{first + len(ids) - 1} reach past "
                                 f"max_seq_len={L}")
            if not s.tokens:
                self.trunk.prefill(s.state, torch.tensor(ids), taps=False)
            else:
                for i, t in enumerate(ids):
                    self.trunk.decode(s.state, t, first + i, taps=False)
            s.tokens += ids

    def commit(self, sid: int, rows: torch.Tensor, positions: Sequence[int]) -> None:
        """Record committed positions. Rows and positions are checked like the DSpark engine's
        (`dsv4.draft_args.check_commit`: rows [R, row_width] fp32/bf16 and finite; integer,
        consecutive positions below max_seq_len that continue the last committed one; the
        first commit starts at 0 or holds >= window_size rows); the rows are not used
        otherwise, so a resent position is not compared with its first row.
        Raises:
            ValueError: naming the bad value.
        """
        with self._table.locked(sid) as s:
            pos = check_commit(self.cfg, s.last_position, rows, positions)
            s.last_position = max(s.last_position, pos[-1])

    def draft(self, sid: int, anchor: int, seed_position: int) -> tuple[list[int], torch.Tensor]:
        """Greedy continuation of [committed tokens, anchor], corrupted by the schedule: tokens of
        positions p+2..p+n+1 and confidence logits [n] fp32, n = min(block_size,
        max_seq_len - p - 2).

        Raises:
            ValueError: anchor or seed_position not an integer (bool and float included),
                anchor outside [0, vocab_size), seed_position not the last committed position
                (both named), no room for the anchor, or the committed tokens not known up to
                seed_position.
        """
        return self._continue(sid, anchor, seed_position, lambda q, logits: int(logits.argmax()))

    def draft_sampled(self, sid: int, anchor: int, seed_position: int, params: SamplingParams) -> SampledDraft:
        """The target's own choice under `params`: the token of position q is `keyed_choice` of
        the trunk's logits with the TOKEN stream keyed by (seed, q), exactly what the coupled
        verifier picks there; corrupted by the schedule like `draft`. q is one-hot on each
        proposal (the proposal is a function of the context). Raises like `draft`."""
        return self.draft_guided(sid, anchor, seed_position, params, None)

    def draft_guided(self, sid: int, anchor: int, seed_position: int, params: SamplingParams,
                     guide) -> SampledDraft:
        """`draft_sampled` inside a grammar: `guide` (`services.drafter.controls.DraftGuide`, or
        None) masks the trunk's logits before each pick and follows each (corrupted) token."""
        mask = (lambda logits: logits) if guide is None else guide.apply
        tokens, conf = self._continue(sid, anchor, seed_position, lambda q, logits: int(
            keyed_choice(mask(logits).reshape(1, -1), params, [q])[0]), guide)
        probs = torch.nn.functional.one_hot(torch.tensor(tokens, dtype=torch.int64), self.cfg.vocab_size).float()
        return SampledDraft(tokens, conf, probs.reshape(len(tokens), self.cfg.vocab_size))

    def _continue(self, sid: int, anchor: int, seed_position: int,
                  pick: Callable[[int, torch.Tensor], int], guide=None) -> tuple[list[int], torch.Tensor]:
        """Decode the continuation, pick(position, logits [V]) choosing each token (`guide`, if
        any, follows each token as drafted, corrupted ones included); see `draft`."""
        anchor, p = check_draft_args(self.cfg, anchor, seed_position)
        with self._table.locked(sid) as s:
            check_seed(s.last_position, p)
            n = draft_length(self.cfg, p)
            if len(s.tokens) != p + 1:
                raise ValueError(f"oracle: knows {len(s.tokens)} committed tokens, seed position "
                                 f"{p} needs {p + 1}")
            state = copy.deepcopy(s.state) if n else None
        V, every = self.cfg.vocab_size, self.corrupt_every
        tokens, conf, token = [], [], anchor
        for j in range(n):  # decode positions p+1..p+n, all < max_seq_len - 1
            token = pick(p + 2 + j, self.trunk.decode(state, token, p + 1 + j, taps=False).logits.reshape(-1))
            bad = every > 0 and (p + j) % every == every - 1
            tokens.append((token + 1) % V if bad else token)
            if guide is not None:
                guide.took(tokens[-1])
            conf.append(self.doubtful if bad else self.confident)
        return tokens, torch.tensor(conf, dtype=torch.float32)
