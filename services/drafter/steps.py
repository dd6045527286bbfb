"""Drafter step loop: one thread owns the DSpark module and runs the pending commits and
drafts of every session in shared calls (continuous batching across generations).

A step has the verifier loop's three verbs (`services.verifier.batcher`): schedule (the same
pure `services.common.schedule.Schedule`: every request queued when the step starts, after
the gather wait), run (`_run`: all commits through one `DSparkDraft.write_main_kv_batch`,
then all drafts through one `DSparkDraft.draft_batch`: dense ops over every session's block
rows, attention per session on its own rings) and absorb (`_absorb`: the step's record, then
each request's reply or error). A request that arrives during a step waits for the next one,
so it waits at most one step.

Results: a commit lands bitwise as the per-session `DrafterEngine.commit` would (keys are
computed row by row); a draft of a step with several sessions equals the per-session draft to
rounding (`draft_batch`: same tokens on the test models, bitwise when the step holds one
draft). Drafts only steer speculation: the verifier decides every emitted token, so a
request's output does not depend on what shared its drafter steps.

A session closed while its request is queued (its stream ended or was cancelled) is dropped
from the next step: its future gets UnknownSessionError and nothing of it runs; its rings are
freed by the close, since the loop keeps only session ids between steps. Each session sends
one request at a time (its stream answers in order), which the loop enforces.

Only the DSpark engine at TP = 1 is batched (`batchable`); the oracle drafters answer each
call on its own thread (`services.drafter.servicer`). Under drafter TP every rank would need
the same batches in the same order; nothing serves the drafter at TP > 1 yet, so the loop
refuses such an engine.
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from dsv4.sampling import GREEDY, DraftSampler, SamplingParams
from services.common.sessions import UnknownSessionError
from services.common.schedule import Schedule, Step
from services.common.step_queue import StepQueue
from services.drafter.engine import DrafterEngine
from services.drafter.interface import SampledDraft

log = logging.getLogger("dspark.drafter.steps")


def batchable(engine: object) -> bool:
    """Whether the step loop can drive `engine`: a `DrafterEngine` over a TP = 1 module."""
    return isinstance(engine, DrafterEngine) and engine.module.tp.world_size == 1


@dataclass(frozen=True)
class StepReply:
    """What a request's future resolves to: `value` (None for a commit; for a draft the
    tokens (list of n ints) and the confidence logits [n] fp32 on CPU or None) and step_ms,
    the wall time (ms) of the step that ran it."""

    value: object
    step_ms: float


@dataclass(frozen=True)
class DraftStepRecord:
    """One step: sessions in it, how many committed and drafted, wall time (ms)."""

    sessions: int
    commits: int
    drafts: int
    ms: float


@dataclass(frozen=True)
class DraftStepStats:
    """Steps so far: count, sessions per step (mean and max), step wall time (mean, ms).
    Zeros before the first step."""

    steps: int = 0
    batch_mean: float = 0.0
    batch_max: int = 0
    ms_mean: float = 0.0


@dataclass(eq=False)  # compared by identity: a request is one call
class _Request:
    sid: int
    op: str  # "commit" | "draft"
    args: tuple
    future: Future
    left: int = 0  # no prompt tokens: the schedule chunks nothing


class DraftStepLoop(StepQueue):
    """The drafter loop: `submit_commit` / `submit_draft` from any thread, get a Future of a `StepReply`.

    Args:
        engine: the DSpark drafter engine whose module the loop drives (TP = 1).
        on_step: called on the loop thread with a `DraftStepRecord` after every step (metrics;
            None: nothing); what it raises is logged.
        gather_s: the longest wait (s) before a step for the sessions the previous step
            answered (`services.common.schedule`; 0: none).
        torch_threads: torch intra-op threads of the loop's thread (None: torch's default).
    Raises:
        ValueError: the engine is not batchable (an oracle drafter, or a TP > 1 shard), or
            gather_s negative or not finite (named with its value).
    Thread safety: submit_*, `stats` and `close` may be called from any thread.
    """

    def __init__(self, engine: DrafterEngine, on_step: Callable[[DraftStepRecord], None] | None = None,
                 gather_s: float = 0.0, torch_threads: int | None = None):
        if not batchable(engine):
            raise ValueError(f"the drafter step loop drives a TP=1 DrafterEngine, got {type(engine).__name__}")
        super().__init__("drafter", DraftStepStats(), on_step, log, Schedule(gather_s, self.AWAY_KINDS),
                         torch_threads)
        self.engine, self.module = engine, engine.module
        self._start()

    def submit_commit(self, sid: int, rows: torch.Tensor, positions: Sequence[int]) -> Future:
        """Queue a commit of rows [R, T*D] (fp32/bf16) at `positions` (see `DrafterEngine.commit`).
        The future fails with the ValueError / UnknownSessionError the engine would raise.
        Raises: as `submit_draft`."""
        request = _Request(sid, "commit", (rows, positions), Future())
        self._enqueue(request)
        return request.future

    def submit_draft(self, sid: int, anchor: int, seed_position: int, params: SamplingParams | None = None,
                     guide=None) -> Future:
        """Queue a draft (see `DrafterEngine.draft`); the future's `StepReply.value` is (tokens,
        confidence logits [n] fp32 on CPU or None), or it fails as the engine's call would.
        params: sampling parameters (None or greedy: the argmax); sampled, the value is a
        `SampledDraft` as `DrafterEngine.draft_sampled` returns (probabilistic drafting).
        guide: a `services.drafter.controls.DraftGuide` masking each slot (None: none); the
        value is then a `SampledDraft` whatever the params (greedy: q one-hot).

        Raises:
            ValueError: the session already has a request in the loop (one at a time).
            RuntimeError: the loop is closed.
        """
        request = _Request(sid, "draft", (anchor, seed_position, params, guide), Future())
        self._enqueue(request)
        return request.future

    AWAY_KINDS = frozenset({"draft"})  # its session is verified before its next commit

    # ------------------------------------------------------------------ the loop thread
    def _step(self, step: Step) -> None:
        """Run and absorb one scheduled step: hold every live session, run its commits then
        its drafts, resolve every future."""
        with contextlib.ExitStack() as held:
            live = []
            for r in sorted(step.requests, key=lambda r: r.sid):  # one lock order: no deadlock with other holders
                try:
                    live.append((r, held.enter_context(self.engine.hold(r.sid))))
                except UnknownSessionError as exc:  # closed since it was queued: dropped
                    self._finish(r, error=exc)
            if not live:
                return
            done, ms = self._run(live)
        self._absorb(live, done, ms)

    def _run(self, live: list) -> tuple[list[tuple[_Request, object, BaseException | None]], float]:
        """The step's commits in one batched write, then its drafts in one batched forward:
        ((request, value, error) per request, wall ms)."""
        t0 = time.perf_counter()
        done = self._commits([(r, s) for r, s in live if r.op == "commit"])
        done += self._drafts([(r, s) for r, s in live if r.op == "draft"])
        ms = (time.perf_counter() - t0) * 1e3
        self._last_step_s = ms / 1e3  # bounds the next gather (services.common.schedule)
        return done, ms

    def _absorb(self, live: list, done: list, ms: float) -> None:
        """Record the step (before any caller sees its reply), then answer each request."""
        commits = sum(r.op == "commit" for r, _ in live)
        self._record(DraftStepRecord(len(live), commits, len(live) - commits, ms))
        for r, value, error in done:
            self._finish(r, StepReply(value, ms), error)

    def _commits(self, commits: list) -> list[tuple[_Request, object, BaseException | None]]:
        """One batched ring write; each commit gets its own error or None."""
        if not commits:
            return []
        try:
            errors = self.module.write_main_kv_batch([s for _, s in commits], [r.args[0] for r, _ in commits],
                                                     [r.args[1] for r, _ in commits])
        except Exception as exc:  # raised before any write: every commit of the step gets it
            return [(r, None, exc) for r, _ in commits]
        return [(r, None, e) for (r, _), e in zip(commits, errors)]

    def _drafts(self, drafts: list) -> list[tuple[_Request, object, BaseException | None]]:
        """Check each draft on its own (a bad one fails alone), then one batched forward for the rest."""
        done, ok = [], []
        for r, s in drafts:
            try:
                self.module.check_draft(s, *r.args[:2])
                ok.append((r, s))
            except ValueError as exc:
                done.append((r, None, exc))
        if not ok:
            return done
        # sampled drafts choose inside the Markov loop, each with its own request's seed and params
        samplers = [DraftSampler(p or GREEDY, seed) if g is not None or not (p is None or p.greedy) else None
                     for _, seed, p, g in (r.args for r, _ in ok)]
        choosers = [s if s is None or r.args[3] is None else r.args[3].wrap(s) for (r, _), s in zip(ok, samplers)]
        try:
            outs = self.module.draft_batch([s for _, s in ok], [r.args[0] for r, _ in ok], [r.args[1] for r, _ in ok],
                                           choosers)
        except Exception as exc:  # the forward failed: every draft of the step gets it
            return done + [(r, None, exc) for r, _ in ok]
        for (r, _), out, sampler in zip(ok, outs, samplers):
            conf = None if out.confidence is None else out.confidence.detach().float().cpu()
            value = (out.tokens, conf) if sampler is None else \
                SampledDraft(out.tokens, conf, sampler.probs()[:len(out.tokens)])
            done.append((r, value, None))
        return done

    def _record(self, step: DraftStepRecord) -> None:
        st, n = self._stats, self._stats.steps + 1  # only this thread writes the stats
        self._publish(DraftStepStats(n, st.batch_mean + (step.sessions - st.batch_mean) / n,
                                     max(st.batch_max, step.sessions), st.ms_mean + (step.ms - st.ms_mean) / n), step)
