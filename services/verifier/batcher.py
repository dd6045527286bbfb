"""Verifier step loop: one thread owns the model and runs the pending work of every session
in shared forwards (continuous batching across generations, prompts included).

Requests arrive already admitted (`VerifierEngine.admit_*` validated them against their
session), so a bad request never reaches a step. Every step is one `Trunk.forward_batch`
(dense ops over every row, attention per session) over:

* every pending decode and verify: a batched verify's whole block; a sequential verify one
  position per step, carried between steps until its first mismatch;
* at most `prefill_chunk` (C) prompt tokens in all, as chunks of prompts
  (`BatchItem.prefill_chunk`, committed as they run, never rolled back): first the next
  chunk of the prompt part way through, then the oldest queued prompts, each taking what is
  left of the C tokens, so several short prompts share one step and at most one prompt is
  ever part way (the last one taken, which goes first in the next step).

Fairness. A decode or verify waits for the step in flight and then runs in the next one,
which holds at most C prompt rows besides the generations' own, so a running generation is
never stalled for more than one chunk's forward, however long a prompt arrives; the oldest
prompt advances in every step, so no number of running generations can starve it.
Prompts are served oldest first (a queued prompt waits for the prompts before it). A burst
of short prompts (many clients connecting at once) is prefilled C tokens per step, not one
prompt per step.

Results. Only the chunk that ends a prompt resolves its request, with what
`VerifierEngine.prefill` returns (next token, margin, the last min(n, keep_rows) tap rows):
bitwise in exact numerics whatever the chunk size and whatever shares the steps
(`dsv4.numerics.ExactNumerics`), to rounding in fast numerics. Decodes and verifies return
what the per-session calls return: `absorb` applies the same accept rule, rollback and
committed rows.

A session closed while its request is queued or part way through its prompt (its stream
ended or was cancelled) is dropped from the next step: its future gets UnknownSessionError
and nothing more of it is forwarded; its state is freed by the close, since the loop only
keeps session ids between steps. A prefill whose step fails leaves its session empty again.

The loop drives a plain `Trunk` or a `TPTrunk` over plain trunks (`batchable`): under
tensor parallelism a step is one command that every rank runs as the same batched forward
(`services.verifier.tp`), and a worker that dies or stalls mid-step fails every request of
that step with its `TPWorkerError`. A top-k dump wrapper records call by call, so it runs
each session's call on its own thread as before (`services.verifier.servicer`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch

from dsv4.batch import BatchItem
from dsv4.trunk import Trunk, as_int
from services.common.sessions import UnknownSessionError
from services.common.schedule import Schedule, Step
from services.common.step_queue import StepQueue
from services.verifier.engine import VerifierEngine, Work, abandon, absorb
from services.verifier.tp import TPTrunk

STEP_KINDS = ("batch", "prefill")  # "prefill": the step carried a prompt chunk
DEFAULT_PREFILL_CHUNK = 64  # tokens; bench/bench_prefill_stall.py measured the choice
log = logging.getLogger("dspark.verifier.steps")


def batchable(model: object) -> bool:
    """Whether the step loop can drive `model`: a plain `Trunk`, or a `TPTrunk` whose ranks
    run plain trunks (no top-k dumps); both have `forward_batch`."""
    return isinstance(model, Trunk) or (isinstance(model, TPTrunk) and model.batchable)


@dataclass(frozen=True)
class StepRecord:
    """One step: kind in STEP_KINDS ("prefill" when it carried a prompt chunk), sessions in
    it, rows forwarded (tokens, the chunk's included), wall time (ms); prefill_rows: the
    prompt chunks' rows (tokens, 0 without one); prefills_done: prompts it completed;
    tokens: tokens committed by the requests it completed (a decode 1, a verify accepted + 1,
    a prefill its first anchor 1)."""

    kind: str
    sessions: int
    rows: int
    ms: float
    prefill_rows: int = 0
    prefills_done: int = 0
    tokens: int = 0


@dataclass(frozen=True)
class StepStats:
    """Steps without a prompt chunk so far (the cost of decoding and verifying alone): count,
    sessions of the last step and their mean, wall time of the last step and the mean (ms).
    Zeros before the first such step. Steps that carried a prompt chunk are counted in
    `prefill_steps` only (their `StepRecord`s have the rest)."""

    steps: int = 0
    batch_last: int = 0
    batch_mean: float = 0.0
    ms_last: float = 0.0
    ms_mean: float = 0.0
    prefill_steps: int = 0


@dataclass(eq=False)  # compared by identity: a request is one call
class _Request:
    work: Work
    future: Future

    @property
    def sid(self) -> int:
        return self.work.sid

    @property
    def op(self) -> str:
        return self.work.op

    @property
    def left(self) -> int:
        return len(self.work.ids) - self.work.done


class StepLoop(StepQueue):
    """The engine loop: `submit` admitted work from any thread, get a Future of its result.

    Args:
        engine: the verifier engine whose model (a `Trunk` or `TPTrunk`) the loop drives.
        on_step: called on the loop thread with a `StepRecord` after every step (metrics;
            None: nothing); what it raises is logged.
        prefill_chunk: C, the most prompt tokens one step forwards (an integer >= 1).
        gather_s: the longest wait (s) before a step for the sessions the previous step
            answered (`services.common.schedule`; 0: start a step as soon as work is queued).
        torch_threads: torch intra-op threads of the loop's thread (None: torch's default).
    Raises:
        ValueError: the engine's model is not batchable (a top-k dump wrapper), prefill_chunk
            not an integer >= 1, or gather_s negative or not finite (named with its value).
    Thread safety: `submit`, `stats` and `close` may be called from any thread.
    """

    def __init__(self, engine: VerifierEngine, on_step: Callable[[StepRecord], None] | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, gather_s: float = 0.0,
                 torch_threads: int | None = None):
        if not batchable(engine.model):
            raise ValueError(f"the step loop drives a plain Trunk or a TPTrunk over plain trunks, "
                             f"got {type(engine.model).__name__}")
        self.prefill_chunk = as_int(prefill_chunk, "prefill_chunk")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk={self.prefill_chunk}: must be >= 1 (tokens per step)")
        schedule = Schedule(gather_s, self.AWAY_KINDS, self.prefill_chunk)
        super().__init__("verifier", StepStats(), on_step, log, schedule, torch_threads)
        self.engine = engine
        self._start()

    def submit(self, work: Work) -> Future:
        """Queue admitted `work`; returns a Future resolved with its StepResult / VerifyResult
        (or the error the step raised: UnknownSessionError when the session closed first).

        Raises:
            ValueError: the session already has a request in the loop (one at a time).
            RuntimeError: the loop is closed.
        """
        return self._enqueue(_Request(work, Future()))

    AWAY_KINDS = frozenset({"verify"})  # its session commits and drafts on the drafter before the next verify

    # ------------------------------------------------------------------ the loop thread
    def _step(self, step: Step) -> None:
        """One forward over every request's rows; resolve the complete ones, carry the rest."""
        with contextlib.ExitStack() as held:
            live = []
            for r in sorted(step.requests, key=lambda r: r.work.sid):  # one lock order: no deadlock
                try:
                    live.append((r, held.enter_context(self.engine.hold(r.work.sid))))
                except UnknownSessionError as exc:  # closed since it was queued: dropped
                    self._finish(r, error=exc)
            if not live:
                return
            items = [_item(s.state, r.work, step.chunk(r)) for r, s in live]
            t0 = time.perf_counter()
            try:
                outs = self.engine.model.forward_batch(items)
            except Exception as exc:  # checked before any state change: every request gets it
                for r, s in live:
                    abandon(s, r.work)
                    self._finish(r, error=exc)
                return
            ms = (time.perf_counter() - t0) * 1e3
            self._last_step_s = ms / 1e3  # bounds the next gather (services.common.schedule)
            rows = sum(len(it.tokens) if (it.verify or it.prefill) else 1 for it in items)
            done = [self._absorb(r, s, out, ms, rows) for (r, s), out in zip(live, outs)]
        chunk = sum(len(it.tokens) for it in items if it.prefill)
        self._record(StepRecord("prefill" if chunk else "batch", len(live), rows, ms, chunk,
                                sum(p for p, _ in done), sum(t for _, t in done)))

    def _absorb(self, r: _Request, s, out, ms: float, rows: int) -> tuple[int, int]:
        """Take one request's output: (1 when it completed a prompt else 0, tokens it committed)."""
        try:
            result = absorb(s, r.work, out, ms, self.engine.model)
        except Exception as exc:
            abandon(s, r.work)
            self._finish(r, error=exc)
            return 0, 0
        if result is None:
            self._carry(r)
            return 0, 0
        # the gateway prices drafts against the rows of the step it shared (docs/gate.md §13)
        self._finish(r, dataclasses.replace(result, step_rows=rows))
        return int(r.work.op == "prefill"), getattr(result, "accepted", 0) + 1

    def _record(self, step: StepRecord) -> None:
        st = self._stats  # only this thread writes the stats
        if step.kind == "batch":
            n = st.steps + 1
            st = StepStats(n, step.sessions, st.batch_mean + (step.sessions - st.batch_mean) / n,
                           step.ms, st.ms_mean + (step.ms - st.ms_mean) / n, st.prefill_steps)
        else:
            st = dataclasses.replace(st, prefill_steps=st.prefill_steps + 1)
        self._publish(st, step)


def _item(state, work: Work, chunk: int) -> BatchItem:
    """The batch item of `work`'s next forward: its decode, the next position of a stepwise
    verify, its whole verify block, or the next `chunk` tokens of its prompt (from position
    work.done, with the tap rows the prefill can still return)."""
    if work.op == "prefill":
        return BatchItem.prefill_chunk(state, work.ids[work.done:work.done + chunk], work.done, work.keep)
    if work.op == "decode":
        return BatchItem.decode(state, work.ids[0], work.position)
    if work.stepwise:
        return BatchItem.decode(state, work.ids[work.done], work.position + work.done)
    return BatchItem.block(state, torch.tensor(work.ids), work.position)
