"""The start-up cost profile: real rounds timed against the backends before the gateway serves.

This module owns the profile's round script (prefill, then timed decodes, drafts, verifies at
every k = 1..block_size and drafter commits, interleaved), its deadlines and its summary
(`CostProfile`, medians in ms). It must not merge the profile with live timings or choose the
costs in force (`services.gateway.costs.CostTracker` does), decide anything with them (the gate
does) or read the environment (`ProfileSettings` arrives from the entry point's settings).

Every figure is the wall time of one call as the gateway sees it, so each includes its gRPC
round trip; `rpc_overhead_ms` reports how much of that the backends did not spend computing
(wall minus the backend's own `forward_ms`). The drafter commit is a call of its own that every
round of a speculating generation pays; it is timed and kept as `commit_ms`.
docs/gate.md §12 describes the costs in force and how the profile and the live rounds combine.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field
from typing import Sequence

from dspark_proto.v1 import common_pb2
from services.common.settings import VERIFY_MODES, check_choice
from services.gateway.backends import (Backends, DrafterSession, GrpcDrafterSession, GrpcVerifierSession,
                                       VerifierSession)

# Short English text: the profile's prompt (tokenised by the gateway's tokenizer, cut to
# `ProfileSettings.prompt_tokens`). Its content barely matters to the timings; a real sentence
# keeps the MoE routing and the drafts close to those of a served prompt.
PROFILE_PROMPT = ("The lighthouse keeper walked along the shore every evening, counting the ships "
                  "that passed and writing their names in a small book.")


class ProfileError(RuntimeError):
    """The profile could not time every cost (too little room, a backend failed, too little time)."""


@dataclass(frozen=True)
class ProfileSettings:
    """How the start-up profile runs.

    repeats: timed samples of each cost (plain decode, and verify at each k), >= 1.
    prompt_tokens: the prefilled prompt's length (tokens), >= 1.
    call_timeout_s: deadline of each backend call (s). budget_s: deadline of the whole profile
    (s), session opening and closing included. verify_mode: one of VERIFY_MODES (the gateway's).
    Raises ValueError naming the field and value when one is out of range.
    """

    repeats: int = 3
    prompt_tokens: int = 16
    call_timeout_s: float = 30.0
    budget_s: float = 60.0
    verify_mode: str = "batched"

    def __post_init__(self) -> None:
        for name in ("repeats", "prompt_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an integer >= 1")
        for name in ("call_timeout_s", "budget_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e8:
                raise ValueError(f"{name}={value!r}: must be a number of seconds in (0, 1e8)")
        check_choice("verify_mode", self.verify_mode, VERIFY_MODES)


@dataclass(frozen=True)
class CostProfile:
    """The profile's costs: medians of `repeats` timed calls each, in ms of wall time.

    verify_ms[k - 1]: verify of k drafts, k = 1..block_size (len(verify_ms) = block_size).
    draft_ms: one drafter call (a whole block). plain_ms: one plain decode. commit_ms: one
    drafter commit after a round. repeats: timed samples behind each median. rpc_overhead_ms:
    median wall minus the backend's reported compute time, per call kind ("draft", "verify",
    "decode"). elapsed_s: the profile's own wall time (s).
    """

    verify_ms: tuple[float, ...]
    draft_ms: float
    plain_ms: float
    commit_ms: float
    repeats: int
    rpc_overhead_ms: dict[str, float] = field(default_factory=dict)
    elapsed_s: float = 0.0

    def to_dict(self) -> dict:
        """JSON-ready copy (ms, s)."""
        return {"verify_ms": list(self.verify_ms), "draft_ms": self.draft_ms, "plain_ms": self.plain_ms,
                "commit_ms": self.commit_ms, "repeats": self.repeats, "rpc_overhead_ms": dict(self.rpc_overhead_ms),
                "elapsed_s": self.elapsed_s}


@dataclass
class _Samples:
    """Wall times (ms) collected so far; kept outside the coroutine so a timed-out profile
    still knows what it measured."""

    block: int
    verify: dict[int, list[float]] = field(default_factory=dict)
    draft: list[float] = field(default_factory=list)
    plain: list[float] = field(default_factory=list)
    commit: list[float] = field(default_factory=list)
    overhead: dict[str, list[float]] = field(default_factory=dict)

    def add_overhead(self, kind: str, wall_ms: float, forward_ms: float) -> None:
        self.overhead.setdefault(kind, []).append(max(wall_ms - forward_ms, 0.0))

    def summary(self, elapsed_s: float) -> CostProfile:
        """Medians of every cost. Raises ProfileError naming what has no sample yet."""
        missing = [f"verify k={k}" for k in range(1, self.block + 1) if not self.verify.get(k)]
        missing += [name for name in ("draft", "plain", "commit") if not getattr(self, name)]
        if missing:
            raise ProfileError(f"no timed sample of {', '.join(missing)}")
        return CostProfile(
            verify_ms=tuple(statistics.median(self.verify[k]) for k in range(1, self.block + 1)),
            draft_ms=statistics.median(self.draft), plain_ms=statistics.median(self.plain),
            commit_ms=statistics.median(self.commit), repeats=min(len(v) for v in self.verify.values()),
            rpc_overhead_ms={kind: statistics.median(v) for kind, v in sorted(self.overhead.items())},
            elapsed_s=elapsed_s)


def positions_needed(prompt_tokens: int, block: int, repeats: int) -> int:
    """Positions the script uses (tokens): the prompt, a warm-up round of the whole block and,
    per repeat, one decode and one round at each k (at most k + 1 positions each)."""
    per_repeat = 1 + sum(k + 1 for k in range(1, block + 1))
    return prompt_tokens + (block + 1) + repeats * per_repeat


async def time_rounds(verifier: VerifierSession, drafter: DrafterSession, prompt_ids: Sequence[int], block: int,
                      max_seq_len: int, settings: ProfileSettings, samples: _Samples) -> None:
    """Run the profile's script on two open sessions, appending every timing to `samples`.

    prompt_ids: the prompt (token ids, at least one). block: drafts per drafter call (tokens).
    Per repeat: one plain decode, then one round (draft, verify, commit) at each k = 1..block
    in an order rotated by the repeat, so slow drift spreads over every k. A warm-up round of
    the whole block comes first and is not counted (first-call allocations).
    Raises ProfileError when max_seq_len leaves too little room or the drafter returns fewer
    than k drafts; BackendError when a call fails or misses its deadline.
    """
    need = positions_needed(len(prompt_ids), block, settings.repeats)
    if need + 2 > max_seq_len:
        raise ProfileError(f"the profile needs {need} positions; max_seq_len={max_seq_len} leaves too few")
    trace = common_pb2.TraceContext()
    first = await verifier.prefill(prompt_ids, trace)
    await drafter.commit(first.rows, first.first_position, prompt_ids, 0, trace)
    anchor, pos = first.next_token, len(prompt_ids)
    anchor, pos = await _timed_round(verifier, drafter, anchor, pos, block, settings, None)
    for rep in range(settings.repeats):
        t0 = time.perf_counter()
        r = await verifier.decode(anchor, pos, trace)
        wall = (time.perf_counter() - t0) * 1e3
        samples.plain.append(wall)
        samples.add_overhead("decode", wall, r.forward_ms)
        t0 = time.perf_counter()
        await drafter.commit(r.rows, pos, [anchor], pos, trace)
        samples.commit.append((time.perf_counter() - t0) * 1e3)
        anchor, pos = r.next_token, pos + 1
        for i in range(block):
            k = (i + rep) % block + 1
            anchor, pos = await _timed_round(verifier, drafter, anchor, pos, k, settings, samples)


async def _timed_round(verifier: VerifierSession, drafter: DrafterSession, anchor: int, pos: int, k: int,
                       settings: ProfileSettings, samples: _Samples | None) -> tuple[int, int]:
    """One round submitting k drafts at anchor position `pos`, timed into `samples` (None: not
    kept); returns the next (anchor, position). Raises ProfileError when fewer than k drafts
    come back; BackendError when a call fails."""
    trace = common_pb2.TraceContext()
    t0 = time.perf_counter()
    d = await drafter.draft(anchor, pos - 1, trace)
    draft_wall = (time.perf_counter() - t0) * 1e3
    if len(d.tokens) < k:
        raise ProfileError(f"the drafter returned {len(d.tokens)} drafts at position {pos}; the profile needs {k}")
    drafts = list(d.tokens[:k])
    t0 = time.perf_counter()
    v = await verifier.verify(anchor, drafts, pos, settings.verify_mode, trace)
    verify_wall = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    await drafter.commit(v.rows, pos, [anchor, *drafts[:v.accepted]], pos, trace)
    commit_wall = (time.perf_counter() - t0) * 1e3
    if samples is not None:
        samples.draft.append(draft_wall)
        samples.verify.setdefault(k, []).append(verify_wall)
        samples.commit.append(commit_wall)
        samples.add_overhead("draft", draft_wall, d.forward_ms)
        samples.add_overhead("verify", verify_wall, v.forward_ms)
    return v.next_token, pos + v.accepted + 1


async def profile_sessions(verifier: VerifierSession, drafter: DrafterSession, prompt_ids: Sequence[int],
                           block: int, max_seq_len: int, settings: ProfileSettings) -> CostProfile:
    """Time the script on open sessions within `settings.budget_s`; the sessions stay open.

    A profile that runs out of time after every cost has a sample returns what it has.
    Raises ProfileError: too little room, too few drafts, or the budget ran out before every
    cost had a sample. BackendError: a call failed or missed `settings.call_timeout_s`.
    """
    samples, t0, timed_out = _Samples(block), time.perf_counter(), False
    try:
        await asyncio.wait_for(time_rounds(verifier, drafter, prompt_ids, block, max_seq_len, settings, samples),
                               settings.budget_s)
    except asyncio.TimeoutError:
        timed_out = True
    try:
        return samples.summary(time.perf_counter() - t0)
    except ProfileError as exc:
        if timed_out:
            raise ProfileError(f"the budget of {settings.budget_s:g} s ran out: {exc}") from None
        raise


async def profile_backends(backends: Backends, prompt_ids: Sequence[int], block: int, max_seq_len: int,
                           settings: ProfileSettings) -> CostProfile:
    """Open one verifier and one drafter `Session` stream, time the script, close both.

    Each call has `settings.call_timeout_s`; both streams and the whole profile end within
    `settings.budget_s` (closing the streams gets one more call timeout at most).
    Raises ProfileError: no drafter configured, or as `profile_sessions`; BackendError: a
    backend call failed or missed its deadline.
    """
    if backends.drafter is None:
        raise ProfileError("no drafter configured (DSPARK_DRAFTER_TARGET is empty)")
    verifier = GrpcVerifierSession(backends.verifier, settings.call_timeout_s, settings.budget_s)
    drafter = GrpcDrafterSession(backends.drafter, settings.call_timeout_s, settings.budget_s)
    try:
        return await profile_sessions(verifier, drafter, prompt_ids, block, max_seq_len, settings)
    finally:  # a close that fails or hangs cancels its stream (`_Stream.close`)
        await drafter.close()
        await verifier.close()
