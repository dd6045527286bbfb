"""The plumbing every step loop shares: a queue of per-session requests, one in flight per
session, a thread that owns the model, stats snapshots, closing, and the step hook.

The verifier's step loop (`services.verifier.batcher`) and the drafter's
(`services.drafter.steps`) differ in what a step is; this module owns only what they have in
common, so admission, release and shutdown behave the same in both. It never forwards a model
and knows nothing of what a request asks.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Any, Callable, Protocol


class QueuedRequest(Protocol):
    """What the loop needs of a request: its session id and the Future its caller holds."""

    @property
    def sid(self) -> int: ...

    @property
    def future(self) -> Future: ...


class StepQueue:
    """Base of a step loop. A subclass implements `_run` (the loop thread's body) and calls
    `_start()` at the end of its `__init__`.

    Args:
        role: "verifier" | "drafter": names the thread, the errors and the log lines.
        stats: the initial stats snapshot (`stats()` returns the latest one).
        on_step: called on the loop thread with each step's record (metrics; None: nothing);
            what it raises is logged, never raised: the loop answers every session.
        log: where a failing hook is logged.
    Thread safety: `_enqueue`, `stats` and `close` may be called from any thread.
    """

    def __init__(self, role: str, stats: Any, on_step: Callable[[Any], None] | None, log: logging.Logger):
        self.on_step, self._role, self._log = on_step, role, log
        self._cv = threading.Condition()
        self._queue: list = []
        self._inflight: set[int] = set()
        self._closed = False
        self._stats = stats
        self._thread = threading.Thread(target=self._run, name=f"{role}-steps", daemon=True)

    def _start(self) -> None:
        self._thread.start()

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
            self._queue.append(request)
            self._cv.notify()
        return request.future

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
        """Release r's session and resolve its future with `result` or `error`."""
        self._release([r])
        if error is not None:
            r.future.set_exception(error)
        else:
            r.future.set_result(result)

    def _release(self, requests: list) -> None:
        """Their sessions may send again."""
        with self._cv:
            for r in requests:
                self._inflight.discard(r.sid)

    def _publish(self, stats: Any, step: Any) -> None:
        """Store the new stats snapshot, then call the step hook with `step`."""
        with self._cv:
            self._stats = stats
        if self.on_step is not None:
            try:
                self.on_step(step)
            except Exception:  # a metrics fault must not stop the loop that answers every session
                self._log.exception("%s step hook failed on %s", self._role, step)
