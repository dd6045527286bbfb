"""How a step loop aligns sessions into steps: which answered sessions the next step waits
for, and until when (docs/simulate.md §6 compares them).

A step's cost is mostly per step on a CPU or a weight-bound GPU, so sessions that meet in one
step share that cost; a session that must first visit the other backend (a verify answer sends
it to the drafter to commit and draft) returns later than one that turns straight around (a
decode). The schedule (`services.common.schedule.Schedule`) asks its alignment, once before
each step, which of the sessions answered earlier and not yet back to await and until when;
it starts the step as soon as all of those are back, or at the deadline.

The strategies, each pure (no clock read, no thread, no I/O):

* `Free`: start as soon as anything is queued (every step takes what is there).
* `Gather` (the default): wait for the sessions the last step answered with a kind that turns
  straight around, if expected back within min(gather_s, the last step's duration): a second
  step would cost about that much again. Sessions sent away are never awaited.
* `Lockstep`: wait for every answered session, away ones included, expected back within
  `cap_s`: every session drafts, then every session verifies in one step.
* `PingPong`: two cohorts (by session id parity) take turns: a step serves one cohort, waiting
  for its members expected back within `cap_s`, while the other cohort is away drafting; the
  next step serves the other. Where a draft is quicker than a verify step, the drafter and the
  verifier both stay busy and every step still holds half the sessions.
* `RateGather`: wait for the answered sessions (away ones included) up to the arrival that
  maximises the step's committed sessions per ms, n / (wait + step_ms(n x rows per session)),
  on the step table: where a step is mostly per-step cost it waits for the cohort, where it
  is mostly per-row cost it starts at once (the same scoring of tokens against ms as the
  step's verification budget, `services.common.budget`).

`Lockstep`, `PingPong` and `RateGather` never await a session already late by more than their
cap (`_expected`): one that stays silent (idle, or gone without closing) costs at most one
wait, not the cap on every step after.

Every wait is bounded (by the window or cap), and what a step computes never depends on the
alignment: only which requests share it.

The default per deployment (`default_alignment`): `gather` on a CPU, where a step's cost grows
with its rows soon enough that waiting for the drafting sessions does not pay
(docs/simulate.md §6); `rate` on a GPU, where a step is weight-bound and the simulator's `gpu`
shape gains with it at every load up to 64 streams (unmeasured on a real GPU).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from services.common.budget import StepTimes


@dataclass(frozen=True)
class Returning:
    """A session answered and not yet back: `sid`; `answered_s`, when the answer left (s, the
    schedule's clock); `gap_s`, how long it took to send again after that kind of answer
    before (s, 0 when never seen); `away`, the answer sent it to the other backend first;
    `last_step`, the step just ended answered it."""

    sid: int
    answered_s: float
    gap_s: float
    away: bool
    last_step: bool

    @property
    def due_s(self) -> float:
        """When it is expected back (s)."""
        return self.answered_s + self.gap_s


class Alignment(Protocol):
    """A gather rule (module docstring). `plan`: from the time `now` (s), the last step's
    duration (s), the sessions of the requests queued for the next step and the sessions
    answered and not yet back, the sessions to await and the deadline (s; <= now: start at
    once). `select`: of the sessions queued when the step starts, those it takes (the rest
    wait for a later step)."""

    name: str

    def plan(self, now: float, last_step_s: float, queued: Sequence[int],
             returning: Sequence[Returning]) -> tuple[set[int], float]: ...

    def select(self, queued: Sequence[int]) -> set[int]: ...


class _TakeAll:
    """A step takes every queued request."""

    def select(self, queued: Sequence[int]) -> set[int]:
        return set(queued)


CAP_S = 1.0  # the longest a lockstep, ping-pong or rate gather waits (s)


def make_alignment(name: str, gather_s: float, shape: Callable[[], tuple[StepTimes | None, float]],
                   cap_s: float = CAP_S) -> "Alignment":
    """The rule named `name` ("free" | "gather" | "lockstep" | "pingpong" | "rate"), what the
    served verifier and the simulator's both build: `gather` waits at most gather_s (s), the
    others at most cap_s; `rate` prices arrivals with `shape` (see `RateGather`). Raises
    ValueError naming an unknown rule."""
    rules = {"free": Free, "gather": lambda: Gather(gather_s), "lockstep": lambda: Lockstep(cap_s),
             "pingpong": lambda: PingPong(cap_s), "rate": lambda: RateGather(shape, cap_s)}
    if name not in rules:
        raise ValueError(f"step alignment={name!r}: must be one of {sorted(rules)}")
    return rules[name]()


def default_alignment(device: str) -> str:
    """The alignment a verifier on `device` ("cpu", "cuda", "cuda:N") runs by default: "rate"
    on a GPU, "gather" elsewhere (module docstring)."""
    return "rate" if device.startswith("cuda") else "gather"


def _check_seconds(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name}={value!r}: must be a finite number of seconds >= 0")
    return float(value)


def _expected(returning: Sequence[Returning], now: float, cap_s: float) -> list[Returning]:
    """The sessions of `returning` worth a wait of up to cap_s (s) from `now`: expected back
    by now + cap_s, and not already late by more than cap_s. A session silent for longer than
    a whole wait past when it was due (idle between requests, or a client gone without
    closing) is not awaited again until it sends: awaiting it would cost every step the cap."""
    return [r for r in returning if now - cap_s <= r.due_s <= now + cap_s]


class Free(_TakeAll):
    """Never waits."""

    name = "free"

    def plan(self, now, last_step_s, queued, returning):
        return set(), now


class Gather(_TakeAll):
    """The sessions the last step answered with a kind that turns straight around, expected
    back within min(gather_s, last step) (module docstring). Raises ValueError on a gather_s
    that is negative or not finite."""

    name = "gather"

    def __init__(self, gather_s: float):
        self.gather_s = _check_seconds("gather_s", gather_s)

    def plan(self, now, last_step_s, queued, returning):
        window = min(self.gather_s, last_step_s)
        if window <= 0:
            return set(), now
        return {r.sid for r in returning if r.last_step and not r.away and r.gap_s < window}, now + window


class Lockstep(_TakeAll):
    """Every answered session expected back within cap_s, away ones included. Raises
    ValueError on a cap_s that is negative or not finite."""

    name = "lockstep"

    def __init__(self, cap_s: float):
        self.cap_s = _check_seconds("cap_s", cap_s)

    def plan(self, now, last_step_s, queued, returning):
        awaited = {r.sid for r in _expected(returning, now, self.cap_s)}
        return awaited, (now + self.cap_s if awaited else now)


class RateGather(_TakeAll):
    """Wait for the arrivals that maximise sessions per step ms (module docstring).

    shape: returns (the loop's step table, ms against rows, or None before one exists; the
    rows one session forwards per step, > 0). cap_s: the longest wait. Without a table it
    behaves as `Gather(cap_s)`. Raises ValueError on a cap_s that is negative or not finite.
    """

    name = "rate"

    def __init__(self, shape: Callable[[], tuple[StepTimes | None, float]], cap_s: float):
        self.shape, self.cap_s = shape, _check_seconds("cap_s", cap_s)
        self._fallback = Gather(cap_s)

    def plan(self, now, last_step_s, queued, returning):
        table, rows = self.shape()
        if table is None:
            return self._fallback.plan(now, last_step_s, queued, returning)
        due = sorted((max(r.due_s, now), r.sid) for r in _expected(returning, now, self.cap_s))
        queued = len(queued)
        best_i, best = 0, queued / max(table.ms_at(max(queued, 1) * rows), 1e-9) if queued else 0.0
        for i, (t, _) in enumerate(due, start=1):
            value = (queued + i) / max((t - now) * 1e3 + table.ms_at((queued + i) * rows), 1e-9)
            if value > best:
                best_i, best = i, value
        if best_i == 0:
            return set(), now
        return {sid for _, sid in due[:best_i]}, now + self.cap_s


class PingPong:
    """Two cohorts take turns (module docstring): session s is in cohort s % 2. Raises
    ValueError on a cap_s that is negative or not finite."""

    name = "pingpong"

    def __init__(self, cap_s: float):
        self.cap_s = _check_seconds("cap_s", cap_s)
        self.turn = 0

    def plan(self, now, last_step_s, queued, returning):
        expected = _expected(returning, now, self.cap_s)
        for _ in range(2):
            awaited = {r.sid for r in expected if r.sid % 2 == self.turn}
            if awaited or any(sid % 2 == self.turn for sid in queued):
                return awaited, (now + self.cap_s if awaited else now)
            self.turn ^= 1  # nobody of this cohort is queued or on the way: the other's turn
        return set(), now

    def select(self, queued):
        mine = {sid for sid in queued if sid % 2 == self.turn}
        self.turn ^= 1
        return mine or set(queued)
