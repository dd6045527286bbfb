"""The gateway's side of an untrusted drafter: reply checks, failure counts, failover budget.

This module owns the content checks of a draft reply, the fault counts by reason and a
generation's budget of drafter sessions. It must not call a drafter (the sessions of
`backends.py` do; it only closes the ones it handed out) or decide when to fail over (the
scheduler does, from `backends.may_fail_over`).

The drafter may be another team's build, version or hardware, so the gateway checks every
draft before the gate or the verifier sees it (`DraftCheck`; the session and position echoes
are checked by `GrpcDrafterSession` itself). A reply that fails a check is discarded whole
and counts as a failed drafter: the generation fails over to a new drafter session or decodes
plainly, exactly as when the drafter died, and its output does not change. `DrafterFaults`
counts failures by reason for the `Stats` RPC; `DrafterSupply` is one generation's budget of
drafter sessions (the first one and `DSPARK_DRAFTER_FAILOVERS` replacements).
"""

from __future__ import annotations

import asyncio
import math
import threading
from typing import Callable, Collection

import torch

from services.gateway.backends import DRAFT_CHECKS, DraftReply, DrafterSession, InvalidDraftReply

FAILURE_REASONS = ("dead", "timeout", "invalid_reply", "full", "error")


class DraftCheck:
    """The content rules of a draft reply for one served model.

    Args:
        vocab_size: token ids must lie in [0, vocab_size).
        block_size: at most this many tokens per reply (the model's dspark_block_size).
        reserved_ids: ids the verifier guarantees it never emits: never a valid draft.

    Raises:
        ValueError: vocab_size or block_size < 1 (named).
    """

    def __init__(self, vocab_size: int, block_size: int, reserved_ids: Collection[int] = ()):
        if vocab_size < 1 or block_size < 1:
            raise ValueError(f"draft check: vocab_size={vocab_size} and block_size={block_size} must be >= 1")
        self.vocab_size, self.block_size = vocab_size, block_size
        self.reserved_ids = frozenset(reserved_ids)

    def __call__(self, reply: DraftReply, need_probs: bool = False) -> None:
        """Check `reply` (tokens: list[int] of length T; confidence_logits: T floats or None;
        probs: [T, V] fp32 or None). need_probs: the rejection rule is in force, so q must come.

        Raises:
            InvalidDraftReply: naming the check and the offending value: T > block_size, a
                token id outside [0, vocab_size) or reserved, a confidence count other than T,
                a NaN or infinite confidence; q missing when needed, or not [T, V], not finite,
                negative, or zero at a drafted token (it cannot have been drawn from q).
        """
        tokens, conf = reply.tokens, reply.confidence_logits
        if len(tokens) > self.block_size:
            raise InvalidDraftReply("block_size", f"{len(tokens)} tokens, block_size is {self.block_size}")
        for i, t in enumerate(tokens):
            if not 0 <= t < self.vocab_size:
                raise InvalidDraftReply("token_range", f"token id {t} at index {i} outside "
                                                       f"[0, vocab_size={self.vocab_size})")
            if t in self.reserved_ids:
                raise InvalidDraftReply("reserved_token", f"token id {t} at index {i} is reserved "
                                                          f"(the model never emits it)")
        self._check_probs(reply, need_probs)  # after the token checks: it indexes q by token
        if conf is None:
            return
        if len(conf) != len(tokens):
            raise InvalidDraftReply("confidence_count", f"{len(conf)} confidence logits for {len(tokens)} tokens")
        for i, c in enumerate(conf):
            if not math.isfinite(c):
                raise InvalidDraftReply("confidence_finite", f"confidence logit {c} at index {i} is not finite")


    def _check_probs(self, reply: DraftReply, need: bool) -> None:
        q, tokens = reply.probs, reply.tokens
        if q is None:
            if need and tokens:
                raise InvalidDraftReply("draft_probs", "no draft probabilities under the rejection rule")
            return
        if tuple(q.shape) != (len(tokens), self.vocab_size):
            raise InvalidDraftReply("draft_probs", f"shape {list(q.shape)}, expected [{len(tokens)}, {self.vocab_size}]")
        if not bool(torch.isfinite(q).all()) or bool((q < 0).any()):
            raise InvalidDraftReply("draft_probs", "probabilities must be finite and >= 0")
        drawn = q[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.int64)] if tokens else q[:0, 0]
        if bool((drawn <= 0).any()):
            i = int((drawn <= 0).nonzero()[0, 0])
            raise InvalidDraftReply("draft_probs", f"token {tokens[i]} at index {i} has probability 0 in its q")


class DrafterFaults:
    """Process-wide drafter failure counts (the `Stats` RPC's `drafter_failures`). Thread-safe.

    `failures[reason]` counts failed drafter calls by `FAILURE_REASONS`; `invalid[check]`
    breaks "invalid_reply" down by `DRAFT_CHECKS`; `failovers` counts new sessions that took
    over; `plain_generations` counts generations that finished on plain decode after a failure.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.failures = dict.fromkeys(FAILURE_REASONS, 0)
        self.invalid = dict.fromkeys(DRAFT_CHECKS, 0)
        self.failovers = 0
        self.plain_generations = 0

    def failure(self, reason: str, check: str | None = None) -> None:
        """Count one failed call. Raises ValueError for a reason or check not listed above."""
        if reason not in self.failures or (check is not None and check not in self.invalid):
            raise ValueError(f"drafter failure reason={reason!r} check={check!r}: not one of "
                             f"{FAILURE_REASONS} / {DRAFT_CHECKS}")
        with self._lock:
            self.failures[reason] += 1
            if check is not None:
                self.invalid[check] += 1

    def failover(self) -> None:
        with self._lock:
            self.failovers += 1

    def fell_back(self) -> None:
        with self._lock:
            self.plain_generations += 1

    def to_dict(self) -> dict:
        """{"failures": {reason: n}, "invalid_reply": {check: n}, "failovers": n, "plain_generations": n}."""
        with self._lock:
            return {"failures": dict(self.failures), "invalid_reply": dict(self.invalid),
                    "failovers": self.failovers, "plain_generations": self.plain_generations}


class DrafterSupply:
    """One generation's drafter sessions: `open()` hands out the first one and then up to
    `failovers` replacements; afterwards None (plain decode). The scheduler opens; the owner
    of the generation calls `close()`, which closes every session handed out.

    Args:
        factory: opens a new drafter session (a new stream, which the channel's round_robin
            places on a live replica); it must not block.
        failovers: replacements allowed after the first session (>= 0).
        close_sessions: False when the sessions belong to the caller (`of`).

    Raises:
        ValueError: failovers < 0 (named).
    """

    def __init__(self, factory: Callable[[], DrafterSession], failovers: int, close_sessions: bool = True):
        if failovers < 0:
            raise ValueError(f"drafter failovers={failovers}: must be >= 0")
        self._factory, self.failovers, self._close_sessions = factory, failovers, close_sessions
        self.opened: list[DrafterSession] = []
        self._retries = 0  # sessions opened by `retry` (not counted against `failovers`)

    @classmethod
    def of(cls, session: DrafterSession) -> "DrafterSupply":
        """A supply of exactly `session` (no failover); the caller keeps owning and closing it."""
        return cls(lambda: session, 0, close_sessions=False)

    def open(self) -> DrafterSession | None:
        """The next session, or None once the first one and `failovers` replacements are used."""
        if len(self.opened) - self._retries > self.failovers:
            return None
        self.opened.append(self._factory())
        return self.opened[-1]

    @property
    def can_reopen(self) -> bool:
        """Whether `retry` can open another session (False for a caller-owned one, `of`)."""
        return self._close_sessions

    def retry(self) -> DrafterSession | None:
        """A new session after the drafter refused one for capacity (RESOURCE_EXHAUSTED), or
        after the generation let its session go while the gateway's regime kept it plain: it
        does not spend the failover budget, since no replica failed. None for a supply of one
        caller-owned session (`of`), which cannot open another."""
        if not self._close_sessions:
            return None
        self._retries += 1
        self.opened.append(self._factory())
        return self.opened[-1]

    async def close(self) -> None:
        """Close the sessions handed out (unless they belong to the caller). A failed session's
        stream may already be broken: errors while closing are ignored, there is nothing left
        to free then. A cancel while one closes (that stream is then cancelled) does not stop
        the others from closing; it is re-raised once all are done."""
        opened, self.opened = self.opened, []
        if not self._close_sessions:
            return
        cancelled: asyncio.CancelledError | None = None
        for session in opened:
            try:
                await session.close()
            except asyncio.CancelledError as exc:  # that stream is cancelled; the others must go too
                cancelled = exc
            except Exception:
                pass
        if cancelled is not None:
            raise cancelled
