"""The step loops' schedule: which queued requests the next step runs, and how long it waits
for more. Pure policy: no thread, no clock read, no I/O; the caller passes the time `now`
(seconds on any monotonic clock) and the previous step's duration. The verifier's and the
drafter's step loops (`services.common.step_queue`) and the discrete-event simulator run this
same object.

Admission. A session has at most one request in the schedule at a time (its stream answers
in order): `admit` refuses a second one. Which sessions may exist at all (the session limit)
is `services.common.sessions.SessionTable.open`'s rule, checked when a session opens.

Gathering. A session answered by a step usually sends its next request a few milliseconds
later (its client turns the reply around), and a step's cost is mostly per step, not per row,
on a CPU or a weight-bound GPU. A loop that started the next step the moment any request was
queued would therefore split the sessions into cohorts that alternate steps, each paying the
whole per-step cost. So before a step the schedule asks its alignment
(`services.common.alignment`: by default `Gather`, min(gather_s, the last step's duration)
for the sessions the last step answered with a kind that turns straight around) which of
the sessions answered and not yet back to await, and until when; it keeps, per session and
kind of answer, how long the session took to send again (`ReturnGaps`), which is when it is
expected back. An answer of a kind in `away_kinds` sends its session to the other backend
first by the round protocol (a verify reply: the drafter commits and drafts before the next
verify; a draft reply: the verifier verifies before the next commit). The wait stops as soon
as the awaited sessions have queued (or closed, `forget`), so a lone session never waits.
What a step computes never depends on this: only which requests share it.

Chunked prefill (`prefill_chunk` C set: the verifier). A step takes every queued or carried
request that is not a prompt, and at most C prompt tokens in all: first the rest of the
prompt part way through (carried), then the oldest queued prompts, each taking what is left
of the C tokens, so several short prompts share one step and at most one prompt is ever part
way (the last one taken). Without C (the drafter) a step takes everything queued.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from services.common.alignment import Alignment, Gather, Returning


class Scheduled(Protocol):
    """What the schedule reads of a request: its session id, its kind of answer (`op`:
    "prefill" | "decode" | "verify" | "commit" | "draft" ...), and for a prompt the tokens it
    still has to forward (`left`; read only of requests whose op is "prefill")."""

    @property
    def sid(self) -> int: ...

    @property
    def op(self) -> str: ...

    @property
    def left(self) -> int: ...


R = TypeVar("R", bound=Scheduled)


class ReturnGaps:
    """How long each session takes to send its next request after an answer, per kind of
    answer: an exponential average (weight GAP_WEIGHT on the newest gap) of seconds from the
    answer to the next request; and, per session answered and not yet back, that answer. A
    session not yet seen after a kind of answer is expected to take what sessions in general
    took after it (the same average over every session's gaps): a generation's prefill is
    answered once, and whether its session turns straight around (a plain decode) or first
    primes the drafter is learned from the sessions before it."""

    GAP_WEIGHT = 0.5  # sessions change phase (a gated generation drafting again): follow them fast

    def __init__(self) -> None:
        self._answered: dict[int, tuple[str, float]] = {}  # sid -> (kind, time s of the answer)
        self._gaps: dict[int, dict[str, float]] = {}  # sid -> {kind: mean gap s}
        self._kinds: dict[str, float] = {}  # kind -> mean gap s over every session

    def answered(self, sid: int, kind: str, now: float) -> None:
        self._answered[sid] = (kind, now)

    def sent(self, sid: int, now: float) -> None:
        """Session `sid` sent a request at `now` (s): fold the gap since its answer."""
        last = self._answered.pop(sid, None)
        if last is not None:
            kind, t = last
            for gaps, key in ((self._gaps.setdefault(sid, {}), kind), (self._kinds, kind)):
                old = gaps.get(key)
                gaps[key] = now - t if old is None else old + self.GAP_WEIGHT * (now - t - old)

    def expected(self, sid: int) -> float:
        """The gap (s) expected before `sid` sends again after its last answer: its own after
        that kind, else every session's after that kind, else 0."""
        kind, _ = self._answered.get(sid, ("", 0.0))
        own = self._gaps.get(sid, {}).get(kind)
        return own if own is not None else self._kinds.get(kind, 0.0)

    def outstanding(self) -> list[tuple[int, str, float]]:
        """(sid, kind, answer time s) of every session answered and not yet back."""
        return [(sid, kind, t) for sid, (kind, t) in self._answered.items()]

    def forget(self, sid: int) -> None:
        self._answered.pop(sid, None)
        self._gaps.pop(sid, None)


@dataclass
class Step(Generic[R]):
    """One step's requests: the ones carried over from the last step first (in the order they
    were carried), then the newly taken ones in arrival order; `chunks`: for each prompt in
    it, the tokens it forwards this step (C set only; keyed by id(request)); `carried`: the
    ids of the requests that ran in the step before (already started)."""

    requests: list[R]
    chunks: dict[int, int] = field(default_factory=dict)
    carried: set[int] = field(default_factory=set)

    def chunk(self, request: R) -> int:
        """The prompt tokens `request` forwards in this step (0: not a prompt, or no C)."""
        return self.chunks.get(id(request), 0)


class Schedule(Generic[R]):
    """The policy of one step loop (module docstring).

    Args:
        gather_s: the longest wait (s, >= 0; 0: none) before a step for the sessions the
            previous step answered.
        away_kinds: kinds of answer after which a session goes to the other backend first
            (never waited for).
        prefill_chunk: C, the most prompt tokens one step forwards (an integer >= 1), or None
            to take every queued request (no prompts are chunked).
        alignment: the gather rule (`services.common.alignment`; None: `Gather(gather_s)`).
    Raises:
        ValueError: gather_s negative, not finite or not a number; prefill_chunk not None or
            an integer >= 1 (named with its value).
    Not thread-safe: a step loop calls it under its own lock.
    """

    def __init__(self, gather_s: float = 0.0, away_kinds: frozenset[str] = frozenset(),
                 prefill_chunk: int | None = None, alignment: Alignment | None = None):
        if isinstance(gather_s, bool) or not isinstance(gather_s, (int, float)) \
                or not (math.isfinite(gather_s) and gather_s >= 0):
            raise ValueError(f"gather_s={gather_s!r}: must be a finite number of seconds >= 0")
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                          or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk={prefill_chunk!r}: must be an integer >= 1 (tokens per step)")
        self.gather_s, self.away_kinds, self.prefill_chunk = float(gather_s), frozenset(away_kinds), prefill_chunk
        self.alignment = Gather(gather_s) if alignment is None else alignment
        self.queue: list[R] = []  # admitted, not yet in a step, in arrival order
        self.carried: list[R] = []  # ran in the last step and continue in the next one
        self._inflight: set[int] = set()  # sessions with a request queued, carried or in a step
        self._gone: set[int] = set()  # forgotten while in flight: not expected back after it
        self._returning: set[int] = set()  # sessions the last step answered (every kind)
        self._gaps = ReturnGaps()
        self._awaited: set[int] | None = None  # the gather of the next step (None: not begun)
        self._gone_since: set[int] = set()  # forgotten since the last step
        self._deadline = 0.0

    # ------------------------------------------------------------------ arrivals
    def admit(self, *requests: R, now: float) -> None:
        """Queue `requests` (in order), sent at `now` (s): all of them or, raising, none.

        Raises:
            ValueError: a session already has a request in the schedule, or two of `requests`
                are of one session (one at a time).
        """
        seen: set[int] = set()
        for r in requests:
            if r.sid in self._inflight or r.sid in seen:
                raise ValueError(f"session {r.sid} already has a request in flight: send one at a time")
            seen.add(r.sid)
        for r in requests:
            self._inflight.add(r.sid)
            self._gaps.sent(r.sid, now)
            self.queue.append(r)

    def forget(self, sid: int) -> None:
        """Session `sid` closed: no step waits for it. Unknown ids are ignored."""
        self._gaps.forget(sid)
        self._gone_since.add(sid)
        if sid in self._inflight:  # its request is still held: `release` must not expect it back
            self._gone.add(sid)
        self._returning.discard(sid)

    # ------------------------------------------------------------------ the next step
    def pending(self) -> bool:
        """Whether a step has work (a queued or carried request)."""
        return bool(self.queue or self.carried)

    def wait_s(self, now: float, last_step_s: float) -> float:
        """Seconds the next step should still wait for returning sessions at `now` (0: start
        it). Call only while `pending()`; the first call after a step asks the alignment who
        is awaited and until when (module docstring). Call again after each arrival, forget
        or timeout; `take` ends the gather."""
        if self._awaited is None:
            outstanding = [Returning(sid, t, self._gaps.expected(sid), kind in self.away_kinds, sid in self._returning)
                           for sid, kind, t in self._gaps.outstanding() if sid not in self._inflight]
            queued = [r.sid for r in self.carried + self.queue]
            self._awaited, self._deadline = self.alignment.plan(now, last_step_s, queued, outstanding)
        self._awaited -= self._gone_since  # `forget` drops closed sessions
        if not self._awaited - self._inflight:  # every awaited session has sent again
            return 0.0
        return max(0.0, self._deadline - now)

    def take(self) -> Step[R]:
        """The next step's requests (module docstring); they leave the queue and the carried
        list, and stay in flight until `release` or `carry`. Ends the gather."""
        self._awaited, self._returning, self._gone_since = None, set(), set()
        carried = {id(r) for r in self.carried}
        chosen = self.alignment.select([r.sid for r in self.queue if r.op != "prefill"])
        later = [r for r in self.queue if r.op != "prefill" and r.sid not in chosen]  # another cohort's turn
        if self.prefill_chunk is None:
            requests = self.carried + [r for r in self.queue if r.op == "prefill" or r.sid in chosen]
            self.queue, self.carried = later, []
            return Step(requests, carried=carried)
        part_way = [r for r in self.carried if r.op == "prefill"]
        waiting = [r for r in self.queue if r.op == "prefill"]
        prompts, chunks = fill_chunks(part_way + waiting, self.prefill_chunk)
        others = [r for r in self.carried if r.op != "prefill"] + \
            [r for r in self.queue if r.op != "prefill" and r.sid in chosen]
        taken = {id(r) for r in prompts}
        self.queue = later + [r for r in waiting if id(r) not in taken]
        self.carried = []
        return Step(others + prompts, chunks, carried)

    def drain(self) -> list[R]:
        """Every queued and carried request, removed (the loop closes and fails them)."""
        out, self.queue, self.carried = self.carried + self.queue, [], []
        for r in out:
            self._inflight.discard(r.sid)
        return out

    # ------------------------------------------------------------------ after a step
    def carry(self, request: R) -> None:
        """`request` ran in the step and continues in the next one (a stepwise verify, a
        prompt part way through); its session stays in flight."""
        self.carried.append(request)

    def release(self, request: R, now: float, answered: bool) -> None:
        """`request` left the schedule at `now` (s): answered (the next step waits for its
        session unless its kind is away or it closed meanwhile) or not (failed, cancelled)."""
        sid = request.sid
        self._inflight.discard(sid)
        if sid in self._gone:
            self._gone.discard(sid)
            return
        if answered:
            self._returning.add(sid)
            self._gaps.answered(sid, request.op, now)

    def returning(self) -> frozenset[int]:
        """The sessions the last step answered that the next one may wait for (diagnostics)."""
        return frozenset(self._returning)

    def in_flight(self, sid: int) -> bool:
        """Whether session `sid` has a request queued, carried or in a step."""
        return sid in self._inflight

    def gone(self) -> frozenset[int]:
        """Sessions forgotten while their request was still held (diagnostics)."""
        return frozenset(self._gone)


def fill_chunks(prompts: list[R], budget: int) -> tuple[list[R], dict[int, int]]:
    """The prompts (in the order given) that `budget` prompt tokens reach, and the tokens each
    forwards (keyed by id(request)): all it has left while the budget lasts, the last one
    taken possibly only part. budget: tokens (>= 1)."""
    taken, chunks = [], {}
    for r in prompts:
        if budget == 0:
            break
        n = min(budget, r.left)
        taken.append(r)
        chunks[id(r)] = n
        budget -= n
    return taken, chunks
