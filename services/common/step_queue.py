"""The plumbing every step loop shares: a queue of per-session requests, one in flight per
session, a thread that owns the model, stats snapshots, closing, and the step hook.

The verifier's step loop (`services.verifier.batcher`) and the drafter's
(`services.drafter.steps`) differ in what a step is; this module owns only what they have in
common, so admission, release and shutdown behave the same in both. It never forwards a model
and knows nothing of what a request asks.

Gathering. A session answered by a step usually sends its next request a few milliseconds
later (its client turns the reply around), and on a CPU a step's cost is mostly per step,
not per row. A loop that started the next step the moment any request was queued would
therefore split the sessions into cohorts that alternate steps, each paying the whole
per-step cost. So before a step the loop waits for the sessions the previous step answered
to queue again, at most the shorter of `gather_s` and the previous step's duration (a
subclass reports it in `_last_step_s`): a second step would cost about that much again, so
waiting longer never pays, and on fast hardware the wait shrinks with the steps. It waits
only for sessions expected back within that window. An answer of a kind in `AWAY_KINDS`
sends its session to the other backend first by the round protocol (a verify reply: the
drafter commits and drafts before the next verify; a draft reply: the verifier verifies
before the next commit), so it is never waited for; after other answers (`_kind`: a
decode, a prefill, a commit, whose draft follows at once) the loop keeps, per session and
kind, how long the session took to send again (`ReturnGaps`) and waits only for those
expected back within the window (a gated generation's decode may be followed by a draft
round on the drafter). It stops waiting as soon as those have queued (or closed,
`forget`), so a lone session never waits. What a step computes never depends on this:
only which requests share it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Protocol


class QueuedRequest(Protocol):
    """What the loop needs of a request: its session id and the Future its caller holds."""

    @property
    def sid(self) -> int: ...

    @property
    def future(self) -> Future: ...


class ReturnGaps:
    """How long each session takes to send its next request after an answer, per kind of
    answer: an exponential average (weight GAP_WEIGHT on the newest gap) of seconds from the
    answer to the next request. Not thread-safe: the step loop calls it under its lock."""

    GAP_WEIGHT = 0.5  # sessions change phase (a gated generation drafting again): follow them fast

    def __init__(self) -> None:
        self._answered: dict[int, tuple[str, float]] = {}  # sid -> (kind, monotonic s of the answer)
        self._gaps: dict[int, dict[str, float]] = {}  # sid -> {kind: mean gap s}

    def answered(self, sid: int, kind: str, now: float) -> None:
        self._answered[sid] = (kind, now)

    def sent(self, sid: int, now: float) -> None:
        """Session `sid` sent a request at `now` (monotonic s): fold the gap since its answer."""
        last = self._answered.pop(sid, None)
        if last is not None:
            kind, t = last
            gaps = self._gaps.setdefault(sid, {})
            old = gaps.get(kind)
            gaps[kind] = now - t if old is None else old + self.GAP_WEIGHT * (now - t - old)

    def expected(self, sid: int) -> float:
        """The gap (s) expected before `sid` sends again after its last answer (0 when unknown)."""
        kind, _ = self._answered.get(sid, ("", 0.0))
        return self._gaps.get(sid, {}).get(kind, 0.0)

    def forget(self, sid: int) -> None:
        self._answered.pop(sid, None)
        self._gaps.pop(sid, None)


class StepQueue:
    """Base of a step loop. A subclass implements `_run` (the loop thread's body) and calls
    `_start()` at the end of its `__init__`.

    Args:
        role: "verifier" | "drafter": names the thread, the errors and the log lines.
        stats: the initial stats snapshot (`stats()` returns the latest one).
        on_step: called on the loop thread with each step's record (metrics; None: nothing);
            what it raises is logged, never raised: the loop answers every session.
        log: where a failing hook is logged.
        gather_s: the longest wait (s, >= 0; 0: none) before a step for the sessions the
            previous step answered (module docstring).
        torch_threads: torch intra-op threads of the loop's thread (>= 1; None: torch's
            default for a new thread; `services.common.threads` says why it matters).
    Raises:
        ValueError: gather_s negative, not finite or not a number (named with its value).
    Thread safety: `_enqueue`, `stats`, `forget` and `close` may be called from any thread.
    """

    def __init__(self, role: str, stats: Any, on_step: Callable[[Any], None] | None, log: logging.Logger,
                 gather_s: float = 0.0, torch_threads: int | None = None):
        if isinstance(gather_s, bool) or not isinstance(gather_s, (int, float)) \
                or not (math.isfinite(gather_s) and gather_s >= 0):
            raise ValueError(f"gather_s={gather_s!r}: must be a finite number of seconds >= 0")
        self.on_step, self._role, self._log = on_step, role, log
        self.gather_s = float(gather_s)
        self._returning: set[int] = set()  # sessions the last step answered, expected back soon
        self._gaps = ReturnGaps()
        self._last_step_s = 0.0  # the previous step's duration (s); set by the subclass on the loop thread
        self._cv = threading.Condition()
        self._queue: list = []
        self._inflight: set[int] = set()
        self._gone: set[int] = set()  # sessions forgotten while in a step: not expected back after it
        self._closed = False
        self._stats = stats
        self._torch_threads = torch_threads
        self._thread = threading.Thread(target=self._loop, name=f"{role}-steps", daemon=True)

    def _start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        if self._torch_threads is not None:
            from services.common.threads import pin_torch_threads  # torch only where a model runs
            pin_torch_threads(self._torch_threads)
        self._run()

    def _run(self) -> None:  # the loop thread's body
        raise NotImplementedError

    def _enqueue(self, request: QueuedRequest) -> Future:
        """Queue `request`; returns its future.

        Raises:
            ValueError: its session already has a request in the loop (one at a time).
            RuntimeError: the loop is closed.
        """
        with self._cv:
            if self._closed:
                raise RuntimeError(f"the {self._role} step loop is closed")
            if request.sid in self._inflight:
                raise ValueError(f"session {request.sid} already has a request in flight: send one at a time")
            self._inflight.add(request.sid)
            self._gaps.sent(request.sid, time.monotonic())
            self._queue.append(request)
            self._cv.notify()
        return request.future

    def _wait_for_work(self, pending: Callable[[], bool]) -> None:
        """With `_cv` held: wait until `pending()` or the loop closes, then gather (module
        docstring): up to min(gather_s, `_last_step_s`) more for the sessions the last step
        answered that are expected back within that window. `pending` is re-evaluated on
        every wake-up."""
        while not (pending() or self._closed):
            self._cv.wait()
        window = min(self.gather_s, self._last_step_s)
        awaited = {sid for sid in self._returning if self._gaps.expected(sid) < window} if window > 0 else set()
        deadline = time.monotonic() + window
        while not self._closed and awaited - self._inflight:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._cv.wait(left)
            awaited &= self._returning  # `forget` drops closed sessions
        self._returning.clear()

    # kinds of answer after which a session goes to the other backend first (a subclass's)
    AWAY_KINDS: frozenset[str] = frozenset()

    def _kind(self, request: QueuedRequest) -> str:
        """The kind of answer `request` gets, for `ReturnGaps` (a subclass names its ops)."""
        return ""

    def forget(self, sid: int) -> None:
        """Session `sid` closed: the next step does not wait for it. Unknown ids are ignored."""
        with self._cv:
            self._gaps.forget(sid)
            if sid in self._inflight:  # its step is running: `_release` must not expect it back
                self._gone.add(sid)
            if sid in self._returning:
                self._returning.discard(sid)
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

    def _finish(self, r: QueuedRequest, result: object = None, error: BaseException | None = None) -> None:
        """Release r's session and resolve its future with `result` or `error`; an answered
        session is expected back by the next step (`_wait_for_work`)."""
        self._release([r], returning=error is None)
        if error is not None:
            r.future.set_exception(error)
        else:
            r.future.set_result(result)

    def _release(self, requests: list, returning: bool = False) -> None:
        """Their sessions may send again; `returning`: and the next step waits for them."""
        now = time.monotonic()
        with self._cv:
            for r in requests:
                self._inflight.discard(r.sid)
                if r.sid in self._gone:
                    self._gone.discard(r.sid)
                    continue
                kind = self._kind(r)
                if returning and kind not in self.AWAY_KINDS:
                    self._returning.add(r.sid)
                    self._gaps.answered(r.sid, kind, now)

    def _publish(self, stats: Any, step: Any) -> None:
        """Store the new stats snapshot, then call the step hook with `step`."""
        with self._cv:
            self._stats = stats
        if self.on_step is not None:
            try:
                self.on_step(step)
            except Exception:  # a metrics fault must not stop the loop that answers every session
                self._log.exception("%s step hook failed on %s", self._role, step)
