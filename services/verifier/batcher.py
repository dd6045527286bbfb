"""Verifier step loop: one thread owns the model and runs the pending work of every session
in shared forwards (continuous batching across generations).

Requests arrive already admitted (`VerifierEngine.admit_*` validated them against their
session), so a bad request never reaches a step. Each step is one of two kinds:

* a batch step: every pending decode and verify, one `Trunk.forward_batch` over all their
  rows (dense ops over every row, attention per session). A sequential verify takes one
  position per step and stays in the loop until its first mismatch, so it is batched too.
* a prefill step: one queued prompt, alone (prefill is not chunked yet).

When both kinds are pending the loop alternates them, so a request waits for the step in
flight and at most one prefill step before its own; a prompt waits for at most one batch
step. Every result is what the per-session engine call returns for the same request:
`absorb` applies the same accept rule, rollback and committed rows.

A session closed while its request is queued (its stream ended or was cancelled) is dropped
from the next step: its future gets UnknownSessionError and nothing of it is forwarded; its
state is freed by the close, since the loop only keeps session ids between steps.

Only a plain `Trunk` is batched (`batchable`); a TP driver or a top-k dump wrapper runs
each session's call on its own thread as before (`services.verifier.servicer`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch

from dsv4.batch import BatchItem
from dsv4.trunk import Trunk
from services.common.sessions import UnknownSessionError
from services.verifier.engine import VerifierEngine, Work, absorb

STEP_KINDS = ("batch", "prefill")
log = logging.getLogger("dspark.verifier.steps")


def batchable(model: object) -> bool:
    """Whether the step loop can drive `model`: a plain `Trunk` (it has `forward_batch`)."""
    return isinstance(model, Trunk)


@dataclass(frozen=True)
class StepRecord:
    """One step: kind in STEP_KINDS, sessions in it, rows forwarded (tokens), wall time (ms),
    tokens committed by the requests it completed (a decode 1, a verify accepted + 1, a
    prefill its first anchor 1)."""

    kind: str
    sessions: int
    rows: int
    ms: float
    tokens: int = 0


@dataclass(frozen=True)
class StepStats:
    """Batch steps so far: count, sessions of the last step and their mean, wall time of the
    last step and the mean (ms). Zeros before the first batch step. Prefill steps are not
    counted here (see `StepRecord` for those)."""

    steps: int = 0
    batch_last: int = 0
    batch_mean: float = 0.0
    ms_last: float = 0.0
    ms_mean: float = 0.0


@dataclass(eq=False)  # compared by identity: a request is one call
class _Request:
    work: Work
    future: Future


class StepLoop:
    """The engine loop: `submit` admitted work from any thread, get a Future of its result.

    Args:
        engine: the verifier engine whose model (a `Trunk`) the loop drives.
        on_step: called on the loop thread with a `StepRecord` after every step (metrics;
            None: nothing); what it raises is logged.
    Raises:
        ValueError: the engine's model is not batchable (TP driver, top-k wrapper).
    Thread safety: `submit`, `stats` and `close` may be called from any thread.
    """

    def __init__(self, engine: VerifierEngine, on_step: Callable[[StepRecord], None] | None = None):
        if not batchable(engine.model):
            raise ValueError(f"the step loop drives a plain Trunk, got {type(engine.model).__name__}")
        self.engine, self.on_step = engine, on_step
        self._cv = threading.Condition()
        self._queue: list[_Request] = []
        self._carried: list[_Request] = []  # stepwise verifies between their positions
        self._inflight: set[int] = set()
        self._closed, self._last_kind = False, "prefill"
        self._stats = StepStats()
        self._thread = threading.Thread(target=self._run, name="verifier-steps", daemon=True)
        self._thread.start()

    def submit(self, work: Work) -> Future:
        """Queue admitted `work`; returns a Future resolved with its StepResult / VerifyResult
        (or the error the step raised: UnknownSessionError when the session closed first).

        Raises:
            ValueError: the session already has a request in the loop (one at a time).
            RuntimeError: the loop is closed.
        """
        future: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the verifier step loop is closed")
            if work.sid in self._inflight:
                raise ValueError(f"session {work.sid} already has a request in flight: send one at a time")
            self._inflight.add(work.sid)
            self._queue.append(_Request(work, future))
            self._cv.notify()
        return future

    def stats(self) -> StepStats:
        """The batch steps so far (a snapshot)."""
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

    # ------------------------------------------------------------------ the loop thread
    def _run(self) -> None:
        while True:
            kind, requests = self._next_step()
            if kind is None:
                return
            live = [r for r in requests if r in self._carried or r.future.set_running_or_notify_cancel()]
            self._carried = [r for r in self._carried if r not in requests]
            dropped = [r for r in requests if r not in live]
            self._release(dropped)  # cancelled before their step: nothing to forward
            if live:
                (self._prefill if kind == "prefill" else self._batch)(live)

    def _next_step(self) -> tuple[str | None, list[_Request]]:
        """Wait for work and take the next step's requests (kind None: closed)."""
        with self._cv:
            while not (self._queue or self._carried or self._closed):
                self._cv.wait()
            if self._closed:
                failed, self._queue = self._queue + self._carried, []
                for r in failed:
                    if r in self._carried or r.future.set_running_or_notify_cancel():
                        r.future.set_exception(RuntimeError("the verifier step loop closed"))
                return None, []
            prefills = [r for r in self._queue if r.work.op == "prefill"]
            others = [r for r in self._queue if r.work.op != "prefill"]
            if prefills and (self._last_kind == "batch" or not (others or self._carried)):
                self._queue.remove(prefills[0])
                self._last_kind = "prefill"
                return "prefill", [prefills[0]]
            self._queue = prefills
            self._last_kind = "batch"
            return "batch", self._carried + others

    def _prefill(self, requests: list[_Request]) -> None:
        [r] = requests
        t0 = time.perf_counter()
        try:
            result = self.engine.prefill(r.work.sid, r.work.ids)  # alone: the per-session call itself
        except Exception as exc:  # the session closed, or the forward failed: the caller's error
            self._finish(r, error=exc)
            return
        self._finish(r, result)
        self._record(StepRecord("prefill", 1, len(r.work.ids), (time.perf_counter() - t0) * 1e3, 1))

    def _batch(self, requests: list[_Request]) -> None:
        """One forward over every request's rows; resolve the complete ones, carry the rest."""
        with contextlib.ExitStack() as held:
            live = []
            for r in sorted(requests, key=lambda r: r.work.sid):  # one lock order: no deadlock
                try:
                    live.append((r, held.enter_context(self.engine.hold(r.work.sid))))
                except UnknownSessionError as exc:  # closed since it was queued: dropped
                    self._finish(r, error=exc)
            if not live:
                return
            items = [_item(s.state, r.work) for r, s in live]
            t0 = time.perf_counter()
            try:
                outs = self.engine.model.forward_batch(items)
            except Exception as exc:  # checked before any state change: every request gets it
                for r, _ in live:
                    self._finish(r, error=exc)
                return
            ms = (time.perf_counter() - t0) * 1e3
            rows, tokens = sum(len(it.tokens) if it.verify else 1 for it in items), 0
            for (r, s), out in zip(live, outs):
                try:
                    result = absorb(s, r.work, out, ms, self.engine.model)
                except Exception as exc:
                    self._finish(r, error=exc)
                    continue
                if result is None:
                    self._carried.append(r)
                else:  # the gateway prices drafts against the rows of the step it shared
                    tokens += getattr(result, "accepted", 0) + 1
                    self._finish(r, dataclasses.replace(result, step_rows=rows))
        self._record(StepRecord("batch", len(live), rows, ms, tokens))

    def _finish(self, r: _Request, result: object = None, error: BaseException | None = None) -> None:
        self._release([r])
        if error is not None:
            r.future.set_exception(error)
        else:
            r.future.set_result(result)

    def _release(self, requests: list[_Request]) -> None:
        with self._cv:
            for r in requests:
                self._inflight.discard(r.work.sid)

    def _record(self, step: StepRecord) -> None:
        if step.kind == "batch":
            with self._cv:
                n, st = self._stats.steps + 1, self._stats
                self._stats = StepStats(n, step.sessions, st.batch_mean + (step.sessions - st.batch_mean) / n,
                                        step.ms, st.ms_mean + (step.ms - st.ms_mean) / n)
        if self.on_step is not None:
            try:
                self.on_step(step)
            except Exception:  # a metrics fault must not stop the loop that answers every session
                log.exception("verifier step hook failed on %s", step)


def _item(state, work: Work) -> BatchItem:
    """The batch item of `work`'s next forward: its decode, the next position of a stepwise
    verify, or its whole verify block."""
    if work.op == "decode":
        return BatchItem.decode(state, work.ids[0], work.position)
    if work.stepwise:
        return BatchItem.decode(state, work.ids[work.done], work.position + work.done)
    return BatchItem.block(state, torch.tensor(work.ids), work.position)
