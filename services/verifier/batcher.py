"""Verifier step loop: one thread owns the model and runs every request of every session in
shared forwards (continuous batching across generations, prompts included). It is the
verifier's one execution path: a request alone runs as a batch of one.

A step is three verbs over the sessions' records (`services.verifier.work.SessionRecord`,
one per session, carrying its state and its request in flight):

* schedule (`services.common.schedule.Schedule`, pure, the clock passed in): which records
  run this step: every pending decode and verify (a batched verify's whole block; a
  sequential verify one position per step, carried between steps until its first
  mismatch), and at most `prefill_chunk` (C) prompt tokens in all, as chunks of prompts
  (`BatchItem.prefill_chunk`, committed as they run, never rolled back): first the next
  chunk of the prompt part way through, then the oldest queued prompts, each taking what is
  left of the C tokens; before it, the gather wait for the sessions the last step answered;
* run (`_run`): one `Trunk.forward_batch` over every record's `item` (dense ops over every
  row, attention per session);
* absorb (`_absorb`, `services.verifier.work.absorb`): the accept rule, a batched block's
  rollback to what it accepted (a verify block is a transaction), the committed rows, and
  the reply; an incomplete request is carried to the next step.

Requests arrive already admitted (`VerifierEngine.admit_*` validated them and wrote them into
their session's record), so a bad request never reaches a step.

Fairness. A decode or verify waits for the step in flight and then runs in the next one,
which holds at most C prompt rows besides the generations' own, so a running generation is
never stalled for more than one chunk's forward, however long a prompt arrives; the oldest
prompt advances in every step, so no number of running generations can starve it.
Prompts are served oldest first. A burst of short prompts is prefilled C tokens per step,
not one prompt per step.

Results. Only the chunk that ends a prompt resolves its request (next token, margin, the
last min(n, keep_rows) tap rows): bitwise in exact numerics whatever the chunk size and
whatever shares the steps (`dsv4.numerics.ExactNumerics`), to rounding in fast numerics.

A session closed while its request is queued or part way through its prompt (its stream
ended or was cancelled) is dropped from the next step: its future gets UnknownSessionError
and nothing more of it is forwarded; its state is freed by the close. A prefill whose step
fails leaves its session empty again.

The loop drives a plain `Trunk`, a top-k dump wrapper (`services.verifier.topk_diag`, which
records every item of a batch) or a `TPTrunk` (`batchable`): under tensor parallelism a step
is one command that every rank runs as the same batched forward (`services.verifier.tp`),
and a worker that dies or stalls mid-step fails every request of that step with its
`TPWorkerError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch

from dsv4.sampling import GREEDY, SamplingParams
from dsv4.scalars import as_int
from dsv4.trunk import Trunk
from services.common.budget import StepBudget
from services.common.sessions import UnknownSessionError
from services.common.schedule import Schedule, Step
from services.common.step_queue import StepQueue
from services.verifier.engine import (SessionRecord, StepResult, VerifierEngine, VerifyResult,
                                      abandon, absorb)
from services.verifier.topk_diag import TopKDiagTrunk
from services.verifier.tp import TPTrunk

STEP_KINDS = ("batch", "prefill")  # "prefill": the step carried a prompt chunk
DEFAULT_PREFILL_CHUNK = 64  # tokens; bench/bench_prefill_stall.py measured the choice
log = logging.getLogger("dspark.verifier.steps")


def batchable(model: object) -> bool:
    """Whether the step loop can drive `model`: a plain `Trunk`, a top-k dump wrapper over one,
    or a `TPTrunk`; each has `forward_batch`."""
    base = model.model if isinstance(model, TopKDiagTrunk) else model
    return isinstance(base, (Trunk, TPTrunk))


@dataclass(frozen=True)
class StepRecord:
    """One step: kind in STEP_KINDS ("prefill" when it carried a prompt chunk), sessions in
    it, rows forwarded (tokens, the chunk's included), wall time (ms: from taking the step to
    its last answer, the forward, the accept rule and rollbacks); prefill_rows: the
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
    sessions of the last step and their mean, wall time of the last step and the mean (ms),
    rows of the last step (tokens). Zeros before the first such step. Steps that carried a prompt chunk are counted in
    `prefill_steps` only (their `StepRecord`s have the rest)."""

    steps: int = 0
    batch_last: int = 0
    batch_mean: float = 0.0
    ms_last: float = 0.0
    ms_mean: float = 0.0
    prefill_steps: int = 0
    rows_last: int = 0


class StepLoop(StepQueue):
    """The verifier's one execution path: `submit` an admitted session record from any thread,
    get a Future of its result; `prefill` / `decode` / `verify` admit, submit and wait.

    Args:
        engine: the verifier engine whose model (`batchable`) the loop drives.
        on_step: called on the loop thread with a `StepRecord` after every step (metrics;
            None: nothing); what it raises is logged.
        prefill_chunk: C, the most prompt tokens one step forwards (an integer >= 1).
        gather_s: the longest wait (s) before a step for the sessions the previous step
            answered (`services.common.schedule`; 0: start a step as soon as work is queued).
        torch_threads: torch intra-op threads of the loop's thread (None: torch's default).
        budget: the step's verification budget (`services.common.budget.StepBudget`): before
            each step's forward it cuts the verify blocks that carry acceptance estimates to
            the drafts it admits (None: every block is verified whole).
    Raises:
        ValueError: the engine's model is not `batchable`, prefill_chunk
            not an integer >= 1, or gather_s negative or not finite (named with its value).
    Thread safety: every public method may be called from any thread; `close` (or a `with`
    block) stops the loop.
    """

    def __init__(self, engine: VerifierEngine, on_step: Callable[[StepRecord], None] | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, gather_s: float = 0.0,
                 torch_threads: int | None = None, budget: StepBudget | None = None):
        if not batchable(engine.model):
            raise ValueError(f"the step loop drives a plain Trunk, a top-k dump wrapper over one or a TPTrunk, "
                             f"got {type(engine.model).__name__}")
        self.prefill_chunk = as_int("prefill_chunk", prefill_chunk)
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk={self.prefill_chunk}: must be >= 1 (tokens per step)")
        schedule = Schedule(gather_s, self.AWAY_KINDS, self.prefill_chunk)
        super().__init__("verifier", StepStats(), on_step, log, schedule, torch_threads)
        self.engine, self.budget = engine, budget
        self._start()

    AWAY_KINDS = frozenset({"verify"})  # its session commits and drafts on the drafter before the next verify

    def submit(self, record: SessionRecord) -> Future:
        """Queue an admitted record (`VerifierEngine.admit_*`); returns its Future, resolved
        with its StepResult / VerifyResult, or the error the step raised (UnknownSessionError
        when the session closed first).

        Raises:
            ValueError: the session already has a request in the loop (one at a time).
            RuntimeError: the loop is closed.
        Either way the record is not queued again, and a request the loop does not hold is ended.
        """
        return self.submit_all([record])[0]

    def submit_all(self, records: list[SessionRecord]) -> list[Future]:
        """Queue admitted records in one go, so they share the next step (the start-up
        profile's steps); returns their Futures in order. Raises as `submit`, queuing none."""
        try:
            self._enqueue(*records)
        except BaseException:
            with self._cv:
                for r in records:
                    if not self.schedule.in_flight(r.sid):  # never end a request the loop holds
                        r.end()
            raise
        return [r.future for r in records]

    # ------------------------------------------------------------------ a caller that waits
    def prefill(self, sid: int, token_ids, sampling: SamplingParams = GREEDY,
                timeout_s: float | None = None, controls=None, prompt_logprobs: int | None = None) -> StepResult:
        """Admit a prefill (`VerifierEngine.admit_prefill`, with the session's logits
        `controls` or None, and the prompt logprobs it asks for), run it in the next steps and
        wait up to `timeout_s` (s; None: no limit) for its result. Raises what admission or
        the step raises, TimeoutError past the deadline."""
        record = self.engine.admit_prefill(sid, token_ids, sampling, None, controls, prompt_logprobs)
        return self.submit(record).result(timeout_s)

    def decode(self, sid: int, token_id: int, position: int, timeout_s: float | None = None) -> StepResult:
        """As `prefill`, for `VerifierEngine.admit_decode`."""
        return self.submit(self.engine.admit_decode(sid, token_id, position)).result(timeout_s)

    def verify(self, sid: int, anchor: int, drafts, position: int, mode: str = "sequential",
               draft_probs: torch.Tensor | None = None, timeout_s: float | None = None) -> VerifyResult:
        """As `prefill`, for `VerifierEngine.admit_verify`."""
        return self.submit(self.engine.admit_verify(sid, anchor, drafts, position, mode, draft_probs)
                           ).result(timeout_s)

    def rows_per_session(self) -> float:
        """Rows per session of the last batch step (tokens; 1.0 before any)."""
        st = self.stats()
        return st.rows_last / st.batch_last if st.batch_last else 1.0

    def __enter__(self) -> "StepLoop":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the loop thread
    def _step(self, step: Step) -> None:
        """Run and absorb one scheduled step: hold every live session, one forward over every
        record's rows, then resolve the complete requests and carry the rest."""
        t0 = time.perf_counter()
        with contextlib.ExitStack() as held:
            live = []
            for r in sorted(step.requests, key=lambda r: r.sid):  # one lock order: no deadlock
                try:
                    held.enter_context(self.engine.hold(r.sid))
                    live.append(r)
                except UnknownSessionError as exc:  # closed since it was queued: dropped
                    self._finish(r, error=exc)
            if not live:
                return
            if self.budget is not None and any(r.survival is not None for r in live):
                self._apply_budget(step, live)
            items = [r.item(step.chunk(r)) for r in live]
            outs, forward_ms = self._run(live, items)
            if outs is None:
                return
            rows = sum(len(it.tokens) if (it.verify or it.prefill) else 1 for it in items)
            done = [self._absorb(r, out, forward_ms, rows) for r, out in zip(live, outs)]
        # The step's whole wall time, the accept rule and rollbacks included: what the loop is
        # occupied with, so what the step table prices and the simulator replays.
        ms = (time.perf_counter() - t0) * 1e3
        chunk = sum(len(it.tokens) for it in items if it.prefill)
        self._record(StepRecord("prefill" if chunk else "batch", len(live), rows, ms, chunk,
                                sum(p for p, _ in done), sum(t for _, t in done)))

    def _apply_budget(self, step: Step, live: list[SessionRecord]) -> None:
        """Cut the step's budgeted blocks to what the budget admits. The budget only says how
        many drafts a step judges, so a fault in it (a malformed table) is logged and the
        blocks are verified whole rather than failing the step."""
        try:
            self.budget.apply(live, sum(step.chunk(r) if r.op == "prefill" else r.step_rows() for r in live))
        except Exception:
            log.exception("step budget failed; this step verifies every block whole")

    def _run(self, live: list[SessionRecord], items: list) -> tuple[list | None, float]:
        """One `forward_batch` over `items`; returns (outputs, wall ms), or (None, 0) when it
        raised: checked before any state change, so every record of the step gets the error."""
        t0 = time.perf_counter()
        try:
            outs = self.engine.model.forward_batch(items)
        except Exception as exc:
            for r in live:
                abandon(r)
                self._finish(r, error=exc)
            return None, 0.0
        ms = (time.perf_counter() - t0) * 1e3
        self._last_step_s = ms / 1e3  # bounds the next gather (services.common.schedule)
        return outs, ms

    def _absorb(self, r: SessionRecord, out, ms: float, rows: int) -> tuple[int, int]:
        """Take one record's output: (1 when it completed a prompt else 0, tokens it committed)."""
        op = r.op
        try:
            result = absorb(r, out, ms, self.engine.model)
        except Exception as exc:
            abandon(r)
            self._finish(r, error=exc)
            return 0, 0
        if result is None:
            self._carry(r)
            return 0, 0
        # the gateway prices drafts against the rows of the step it shared (docs/gate.md §13)
        self._finish(r, dataclasses.replace(result, step_rows=rows))
        return int(op == "prefill"), getattr(result, "accepted", 0) + 1

    def _drop(self, r: SessionRecord) -> None:
        """Cancelled before its step: nothing ran, so the request just ends."""
        self._release(r, answered=False)
        r.end()

    def _finish(self, r: SessionRecord, result: object = None, error: BaseException | None = None) -> None:
        """Release r's session, end its request, then resolve its future (the session may send
        its next request as soon as its caller sees the reply)."""
        future = r.future
        self._release(r, answered=error is None)
        r.end()
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def _record(self, step: StepRecord) -> None:
        st = self._stats  # only this thread writes the stats
        if step.kind == "batch":
            n = st.steps + 1
            st = StepStats(n, step.sessions, st.batch_mean + (step.sessions - st.batch_mean) / n,
                           step.ms, st.ms_mean + (step.ms - st.ms_mean) / n, st.prefill_steps, step.rows)
        else:
            st = dataclasses.replace(st, prefill_steps=st.prefill_steps + 1)
        self._publish(st, step)



class StepVerifier:
    """A verifier engine with blocking prefill / decode / verify calls, each run through a step
    loop of its own (a batch of one when it is alone): for tools, benchmarks and tests that
    make one request at a time. Every other attribute is the engine's (open_session,
    close_session, committed_tail, next_position, cfg, ...).

    Args:
        engine: the `VerifierEngine`.
        prefill_chunk: the loop's prompt chunk (None: max_seq_len, so a prompt is one forward,
            what `Trunk.prefill` runs); other keywords go to `StepLoop`.
        timeout_s: each call's deadline (s).
    The loop closes with `close()` or when this object is collected.
    """

    def __init__(self, engine: VerifierEngine, prefill_chunk: int | None = None, timeout_s: float = 600.0,
                 **loop_kwargs):
        self.engine, self.timeout_s = engine, timeout_s
        self.steps = StepLoop(engine, prefill_chunk=prefill_chunk or engine.cfg.max_seq_len, **loop_kwargs)
        self._closer = weakref.finalize(self, self.steps.close)

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def prefill(self, sid: int, token_ids, sampling: SamplingParams = GREEDY,
                prompt_logprobs: int | None = None) -> StepResult:
        """`StepLoop.prefill` with this object's deadline."""
        return self.steps.prefill(sid, token_ids, sampling, self.timeout_s, prompt_logprobs)

    def decode(self, sid: int, token_id: int, position: int) -> StepResult:
        """`StepLoop.decode` with this object's deadline."""
        return self.steps.decode(sid, token_id, position, self.timeout_s)

    def verify(self, sid: int, anchor: int, drafts, position: int, mode: str = "sequential",
               draft_probs: torch.Tensor | None = None) -> VerifyResult:
        """`StepLoop.verify` with this object's deadline."""
        return self.steps.verify(sid, anchor, drafts, position, mode, draft_probs, self.timeout_s)

    def close(self) -> None:
        """Stop the loop (idempotent)."""
        self._closer()
