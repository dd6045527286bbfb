"""The simulated step loops: the services' own `Schedule` driven by a virtual clock.

A `SimLoop` is one backend's step loop (verifier or drafter) in the event simulation: it admits
requests into the very `services.common.schedule.Schedule` the live loops hold, asks it how
long to gather, takes its steps, prices each step with the step-time model, and releases or
carries each request when the step ends. Only the forward is modelled (a step of R rows over S
sessions takes `step_ms(requests, chunks)` ms of work). A step runs on its loop's `Pool`: alone
on separate hardware, or sharing `--cores` cores with the other loop and the gateway's turns
(`--shared-compute`), where it slows down while more jobs than cores run.

A waiting loop looks at its queue once per virtual instant: an arrival at an idle (or
gathering) loop, or the end of its gather wait, schedules the look after every event already
due at that instant, so requests that arrive together (the replies of one batched drafter
step, generations sent at once) share the step. A served loop's thread takes its step a
fraction of a millisecond after the arrival that woke it (docs/simulate.md §3.2); an event
queue that started the step inside the first arrival's event would give that one request a
step of its own. A loop whose step just ended looks at once, as the served thread, still
running, does.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable

from services.common.budget import StepBudget
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

    def run(self, max_events: int | None = None) -> None:
        """Run events in time order until none is left. Raises RuntimeError when more than
        `max_events` run (None: no bound): a run that cannot finish ends, it does not spin."""
        events, ran = self._events, 0
        while events:
            ran += 1
            if max_events is not None and ran > max_events:
                raise RuntimeError(f"simulation still running after {max_events} events at {self.now:.1f} ms "
                                   f"of virtual time (the event budget of its generations: a stall)")
            t, _, fn, args = heapq.heappop(events)
            self.now = t
            fn(*args)


@dataclass(eq=False)
class Request:
    """One call to a backend: its session, op ("prefill" | "decode" | "verify" on the
    verifier, "commit" | "draft" on the drafter), rows it forwards (a verify k + 1, a decode
    1, a commit the tap rows it writes), prompt tokens still to forward (`left`), tokens it commits when answered (a verify
    accepted + 1, a decode or prefill 1: the verifier's commit rate) and the callback of its
    reply (virtual ms, step rows). A verify block may carry `survival` (per draft, the
    gateway's P(drafts 1..j all accepted)) for the step's budget, which `trim`s it; its
    `tokens` are then capped at the drafts it kept + 1 (what it accepts of them)."""

    sid: int
    op: str
    rows: int = 1
    left: int = 0
    tokens: int = 0
    reply: Callable[[float, int], None] | None = None
    survival: tuple[float, ...] | None = None

    def trim(self, drafts: int) -> None:
        """The step's budget admitted only the first `drafts` drafts of this verify block."""
        self.rows, self.tokens = drafts + 1, min(self.tokens, drafts + 1)
        self.survival = self.survival[:drafts] if drafts else None


class Pool:
    """Compute shared by the jobs that run on it: `cores` cores, processor sharing. Each job
    (a loop's step, a gateway turn) is single-threaded, so it runs at min(1, cores / jobs
    running) of full speed: alone or with fewer jobs than cores at full speed, with more they
    all slow down alike. Separate hardware is one pool per loop (`--shared-compute` off: one
    job at a time, at full speed); `--shared-compute` puts the verifier, the drafter and the
    gateway's turns on one pool of `--cores` (`RunConfig.cores`).

    `background` (`--background`) counts other programs' jobs that are always runnable on the
    same cores (a shared machine): with n jobs of ours running each gets min(1, cores / (n +
    background)) of a core. The step-time model was measured by one job alone on that machine,
    so speeds are relative to that: a job runs at min(1, cores / (n + background)) / min(1,
    cores / (1 + background)) of the model's speed, 1 when it runs alone (docs/simulate.md
    §5.2: why a drafted load on a busy box runs slower than its shape says).

    Raises ValueError when cores < 1 or background is negative or not finite.
    """

    def __init__(self, clock: Clock, cores: float = 1, background: float = 0.0) -> None:
        if not cores >= 1:
            raise ValueError(f"cores={cores}: a pool needs at least one core")
        if not 0.0 <= background < float("inf"):
            raise ValueError(f"background={background}: must be a finite number of jobs >= 0")
        self.clock, self.cores, self.background = clock, cores, background
        self._alone = min(1.0, cores / (1.0 + background))  # one job's share: the model's speed
        self._left: dict[int, float] = {}  # job -> work left (ms at the model's speed)
        self._done: dict[int, Callable[[], None]] = {}
        self._since = 0.0  # when `_left` was last brought up to date (ms)
        self._ids = 0
        self._epoch = 0  # completion events of an older epoch are stale

    def run(self, work_ms: float, done: Callable[[], None]) -> None:
        """Start a job of `work_ms` ms of full-speed work now; `done()` runs when it ends."""
        self._advance()
        self._ids += 1
        self._left[self._ids], self._done[self._ids] = work_ms, done
        self._plan()

    def _speed(self) -> float:
        if not self._left:
            return 1.0
        return min(1.0, self.cores / (len(self._left) + self.background)) / self._alone

    def _advance(self) -> None:
        """Charge the running jobs for the time since the last change."""
        now, speed = self.clock.now, self._speed()
        for job in self._left:
            self._left[job] -= (now - self._since) * speed
        self._since = now

    def _plan(self) -> None:
        """Schedule the next completion at the current speed (older events go stale)."""
        self._epoch += 1
        if self._left:
            job = min(self._left, key=lambda j: (self._left[j], j))
            self.clock.at(self.clock.now + max(self._left[job], 0.0) / self._speed(), self._finish, job, self._epoch)

    def _finish(self, job: int, epoch: int) -> None:
        if epoch != self._epoch:
            return
        self._advance()
        del self._left[job]
        done = self._done.pop(job)
        self._plan()
        done()


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
        budget: the verifier's step budget (`services.common.budget.StepBudget`), applied to
            each step's requests before it is priced, as the served step loop applies it
            before the forward (None: none).
    """

    def __init__(self, clock: Clock, pool: Pool, schedule: Schedule, step_ms: Callable,
                 on_step: Callable | None = None, budget: StepBudget | None = None):
        self.clock, self.pool, self.schedule, self.step_ms, self.on_step = clock, pool, schedule, step_ms, on_step
        self.budget = budget
        self.stats = LoopStats()
        self._state = "idle"  # idle | gathering | stepping
        self._timer = 0  # generation of the gather timer: a stale one does nothing
        self._last_step_s = 0.0
        self._waking = False  # a look at the queue is scheduled for this instant

    def submit(self, request: Request) -> None:
        """`request` arrives now; an idle or gathering loop considers its queue once every
        event due at this instant has run (module docstring)."""
        self.schedule.admit(request, now=self.clock.now / 1e3)
        if self._state in ("idle", "gathering"):
            self._look()

    def _look(self) -> None:
        """Consider the queue once every event due now has run (one look per instant)."""
        if not self._waking:
            self._waking = True
            self.clock.at(self.clock.now, self._wake)

    def _wake(self) -> None:
        self._waking = False
        if self._state in ("idle", "gathering"):
            self._consider()

    def _consider(self) -> None:
        if not self.schedule.pending():
            self._state = "idle"
            return
        wait = self.schedule.wait_s(self.clock.now / 1e3, self._last_step_s)
        if wait <= 1e-9:  # ms -> s rounding may leave a deadline a hair after its own timer
            self._start()
        elif self._state != "gathering":
            self._state = "gathering"
            self._timer += 1
            self.clock.at(self.clock.now + wait * 1e3, self._timeout, self._timer)

    def _timeout(self, timer: int) -> None:
        if timer == self._timer and self._state == "gathering":
            self._state = "idle"  # a wait still left schedules the next timer
            self._look()  # the thread wakes from its timed wait as from an arrival

    def _start(self) -> None:
        self._timer += 1
        self._state = "stepping"
        step = self.schedule.take()
        if self.budget is not None:
            self.budget.apply(step.requests, _rows(step))
        ms = self.step_ms(step)
        t0 = self.clock.now
        self.pool.run(ms, lambda: self._end(step, self.clock.now - t0))

    def _end(self, step, ms: float) -> None:
        """A step ended after `ms` of wall time (its work, slowed by what shared its pool)."""
        now = self.clock.now
        self._last_step_s = ms / 1e3
        rows = _rows(step)
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
        for r in done:
            r.reply(now, rows)
        if self._state == "idle":
            self._consider()


def _rows(step) -> int:
    """Rows a step forwards: each prompt's chunk, every other request's rows."""
    return sum(step.chunk(r) if r.op == "prefill" else r.rows for r in step.requests)
