"""The plumbing every step loop shares: a thread that owns the model, futures, stats
snapshots, closing and the step hook, around the pure policy of `services.common.schedule`.

The verifier's step loop (`services.verifier.batcher`) and the drafter's
(`services.drafter.steps`) differ in what a step runs; this module owns only what they have
in common, so admission, gathering, release and shutdown behave the same in both. Every
decision (which requests a step takes, how long it waits for returning sessions, how many
prompt tokens each prompt forwards) is the `Schedule`'s, fed the monotonic clock here; this
module only waits on a condition variable for as long as the schedule says. It never
forwards a model and knows nothing of what a request asks.

A step has three verbs: `schedule` (here: wait, then `Schedule.take`), `run` and `absorb`
(the subclass's `_step`: one batched model call, then each request's answer or carry).
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Protocol

from services.common.schedule import Schedule, Scheduled, Step


class QueuedRequest(Scheduled, Protocol):
    """What the loop needs of a request: what the schedule reads (`sid`, `op`, `left`) and
    the Future its caller holds."""

    @property
    def future(self) -> Future: ...


class StepQueue:
    """Base of a step loop. A subclass implements `_step(step)` (run and absorb one
    `services.common.schedule.Step` of live requests) and calls `_start()` at the end of its
    `__init__`.

    Args:
        role: "verifier" | "drafter": names the thread, the errors and the log lines.
        stats: the initial stats snapshot (`stats()` returns the latest one).
        on_step: called on the loop thread with each step's record (metrics; None: nothing);
            what it raises is logged, never raised: the loop answers every session.
        log: where a failing hook is logged.
        schedule: the loop's policy (gather window, away kinds, prompt chunk).
        torch_threads: torch intra-op threads of the loop's thread (>= 1; None: torch's
            default for a new thread; `services.common.threads` says why it matters).
    Thread safety: `_enqueue`, `stats`, `forget` and `close` may be called from any thread.
    """

    def __init__(self, role: str, stats: Any, on_step: Callable[[Any], None] | None, log: logging.Logger,
                 schedule: Schedule, torch_threads: int | None = None):
        self.on_step, self._role, self._log = on_step, role, log
        self.schedule = schedule
        self._last_step_s = 0.0  # the previous step's duration (s); set by the subclass on the loop thread
        self._cv = threading.Condition()
        self._closed = False
        self._stats = stats
        self._torch_threads = torch_threads
        self._thread = threading.Thread(target=self._loop, name=f"{role}-steps", daemon=True)

    @property
    def gather_s(self) -> float:
        """The longest gather wait (s) before a step (`services.common.schedule`)."""
        return self.schedule.gather_s

    def _start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        _name_os_thread(self._thread.name)
        if self._torch_threads is not None:
            from services.common.threads import pin_torch_threads  # torch only where a model runs
            pin_torch_threads(self._torch_threads)
        while (step := self._next_step()) is not None:
            self._start_step(step)
            step = None  # hold nothing between steps: a closed session's state is freed at once

    def _start_step(self, step: Step) -> None:
        """Drop the requests cancelled before their step, then run and absorb the rest."""
        live = [r for r in step.requests if id(r) in step.carried or r.future.set_running_or_notify_cancel()]
        for r in step.requests:
            if r not in live:  # cancelled before their step: nothing to forward
                self._drop(r)
        if live:
            step.requests = live
            self._step(step)

    def _step(self, step: Step) -> None:  # run and absorb one step (the subclass's)
        raise NotImplementedError

    def _enqueue(self, *requests: QueuedRequest) -> None:
        """Queue `requests` at once (they share the next step): all of them or, raising, none.

        Raises:
            ValueError: a session already has a request in the loop (one at a time).
            RuntimeError: the loop is closed.
        """
        with self._cv:
            if self._closed:
                raise RuntimeError(f"the {self._role} step loop is closed")
            self.schedule.admit(*requests, now=time.monotonic())
            self._cv.notify()

    def _next_step(self) -> Step | None:
        """Wait for work, then for as long as the schedule gathers, and take the next step
        (None: closed; queued and carried requests then fail with RuntimeError)."""
        with self._cv:
            while not (self.schedule.pending() or self._closed):
                self._cv.wait()
            while not self._closed:
                left = self.schedule.wait_s(time.monotonic(), self._last_step_s)
                if left <= 0:
                    break
                self._cv.wait(left)
            if self._closed:
                started = {id(r) for r in self.schedule.carried}
                for r in self.schedule.drain():
                    if id(r) in started or r.future.set_running_or_notify_cancel():
                        r.future.set_exception(RuntimeError(f"the {self._role} step loop closed"))
                return None
            return self.schedule.take()

    def forget(self, sid: int) -> None:
        """Session `sid` closed: the next step does not wait for it. Unknown ids are ignored."""
        with self._cv:
            self.schedule.forget(sid)
            self._cv.notify()

    def stats(self) -> Any:
        """The steps so far (a snapshot)."""
        with self._cv:
            return self._stats

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the loop after the step in flight; queued requests fail with RuntimeError.
        Waits up to `timeout_s` (s) for the thread; closing twice is a no-op."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _carry(self, r: QueuedRequest) -> None:
        """`r` continues in the next step (its session stays in flight)."""
        with self._cv:
            self.schedule.carry(r)

    def _finish(self, r: QueuedRequest, result: object = None, error: BaseException | None = None) -> None:
        """Release r's session and resolve its future with `result` or `error`; an answered
        session is expected back by the next step (`Schedule.wait_s`)."""
        self._release(r, answered=error is None)
        if error is not None:
            r.future.set_exception(error)
        else:
            r.future.set_result(result)

    def _drop(self, r: QueuedRequest) -> None:
        """`r` was cancelled by its caller before its step: its session may send again."""
        self._release(r, answered=False)

    def _release(self, r: QueuedRequest, answered: bool) -> None:
        """r's session may send again; `answered`: and the next step may wait for it."""
        with self._cv:
            self.schedule.release(r, time.monotonic(), answered)

    def _publish(self, stats: Any, step: Any) -> None:
        """Store the new stats snapshot, then call the step hook with `step`."""
        with self._cv:
            self._stats = stats
        if self.on_step is not None:
            try:
                self.on_step(step)
            except Exception:  # a metrics fault must not stop the loop that answers every session
                self._log.exception("%s step hook failed on %s", self._role, step)


def _name_os_thread(name: str) -> None:
    """Give the calling thread `name` (up to 15 bytes) in the operating system too, where
    Python's own thread names never reach: `top -H`, py-spy and /proc/PID/task/TID/comm then
    tell the step loop from the event loop (bench_serving reads each service's CPU outside its
    step thread so). Linux only (prctl PR_SET_NAME); elsewhere, or when it fails, nothing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, ctypes.c_char_p(name.encode("ascii", "replace")[:15]), 0, 0, 0)  # 15: PR_SET_NAME
    except (OSError, AttributeError):
        pass
