"""The simulated step loops: the services' own `Schedule` driven by a virtual clock.

A `SimLoop` is one backend's step loop (verifier or drafter) in the event simulation: it admits
requests into the very `services.common.schedule.Schedule` the live loops hold, asks it how
long to gather, takes its steps, prices each step with the step-time model, and releases or
carries each request when the step ends. Only the forward is modelled (a step of R rows over S
sessions takes `step_ms(requests, chunks)` ms of virtual time). With a shared `Pool`
(`--shared-compute`) a step also waits for the other loop's step to finish.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable

from services.common.schedule import Schedule


class Clock:
    """The event queue and its virtual time (`now`, ms). Events at equal times run in the
    order they were scheduled (a sequence number), so a run is deterministic."""

    def __init__(self) -> None:
        self.now = 0.0
        self._events: list = []
        self._seq = 0

    def at(self, t: float, fn: Callable, *args) -> None:
        """Run fn(*args) at virtual time t (ms, >= now)."""
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, fn, args))

    def run(self) -> None:
        """Run events in time order until none is left."""
        events = self._events
        while events:
            t, _, fn, args = heapq.heappop(events)
            self.now = t
            fn(*args)


@dataclass(eq=False)
class Request:
    """One call to a backend: its session, op ("prefill" | "decode" | "verify" on the
    verifier, "commit" | "draft" on the drafter), rows it forwards (a verify k + 1, a decode
    1), prompt tokens still to forward (`left`), tokens it commits when answered (a verify
    accepted + 1, a decode or prefill 1: the verifier's commit rate) and the callback of its
    reply (virtual ms, step rows)."""

    sid: int
    op: str
    rows: int = 1
    left: int = 0
    tokens: int = 0
    reply: Callable[[float, int], None] | None = None


class Pool:
    """Compute shared by the loops (`--shared-compute`): one step at a time, first come first
    served. Without sharing each loop gets its own pool."""

    def __init__(self) -> None:
        self.busy = False
        self.waiting: list[Callable[[], None]] = []

    def acquire(self, fn: Callable[[], None]) -> None:
        if self.busy:
            self.waiting.append(fn)
        else:
            self.busy = True
            fn()

    def release(self) -> None:
        if self.waiting:
            self.waiting.pop(0)()
        else:
            self.busy = False


@dataclass
class LoopStats:
    """What a loop did: steps, sessions and rows summed over its steps without a prompt chunk
    (`batch_*`, the verifier's Info figures), and its busy ms."""

    steps: int = 0
    batch_steps: int = 0
    batch_sessions: int = 0
    busy_ms: float = 0.0
    rows: int = 0
    sessions_hist: dict[int, int] = field(default_factory=dict)


class SimLoop:
    """One backend's step loop in virtual time (module docstring).

    Args:
        clock: the event queue. pool: the compute it steps on. schedule: the services' Schedule.
        step_ms: (requests, step) -> ms of the step's forward.
        on_step: called at each step's end with (requests, rows, ms, end ms); None: nothing.
    """

    def __init__(self, clock: Clock, pool: Pool, schedule: Schedule, step_ms: Callable,
                 on_step: Callable | None = None):
        self.clock, self.pool, self.schedule, self.step_ms, self.on_step = clock, pool, schedule, step_ms, on_step
        self.stats = LoopStats()
        self._state = "idle"  # idle | gathering | waiting (for the pool) | stepping
        self._timer = 0  # generation of the gather timer: a stale one does nothing
        self._last_step_s = 0.0

    def submit(self, request: Request) -> None:
        """`request` arrives now."""
        self.schedule.admit(request, now=self.clock.now / 1e3)
        if self._state in ("idle", "gathering"):
            self._consider()

    def _consider(self) -> None:
        if not self.schedule.pending():
            self._state = "idle"
            return
        wait = self.schedule.wait_s(self.clock.now / 1e3, self._last_step_s)
        if wait <= 1e-9:  # ms -> s rounding may leave a deadline a hair after its own timer
            self._state = "waiting"
            self.pool.acquire(self._start)
        elif self._state != "gathering":
            self._state = "gathering"
            self._timer += 1
            self.clock.at(self.clock.now + wait * 1e3, self._timeout, self._timer)

    def _timeout(self, timer: int) -> None:
        if timer == self._timer and self._state == "gathering":
            self._state = "idle"  # a wait still left schedules the next timer
            self._consider()

    def _start(self) -> None:
        self._timer += 1
        self._state = "stepping"
        step = self.schedule.take()
        ms = self.step_ms(step)
        self.clock.at(self.clock.now + ms, self._end, step, ms)

    def _end(self, step, ms: float) -> None:
        now = self.clock.now
        self._last_step_s = ms / 1e3
        rows = sum(step.chunk(r) if r.op == "prefill" else r.rows for r in step.requests)
        st = self.stats
        st.steps += 1
        st.busy_ms += ms
        st.rows += rows
        if not any(r.op == "prefill" for r in step.requests):
            st.batch_steps += 1
            st.batch_sessions += len(step.requests)
        done = []
        for r in step.requests:
            if r.op == "prefill":
                r.left -= step.chunk(r)
                if r.left > 0:
                    self.schedule.carry(r)
                    continue
            self.schedule.release(r, now / 1e3, answered=True)
            done.append(r)
        if self.on_step is not None:
            self.on_step(step.requests, rows, ms, now)
        self._state = "idle"
        self.pool.release()
        for r in done:
            r.reply(now, rows)
        if self._state == "idle":
            self._consider()
