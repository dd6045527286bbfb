"""The speculative scheduler: one generation as rounds over a verifier and a drafter.

This module owns one generation's round loop (prefill, draft, verify, commit, stream) and the
process totals of finished generations; the generation's drafter side (draft calls, committed
rows, deferred commits, failover) is `services.gateway.drafter_link.DrafterLink`'s. It never
chooses a draft length itself (the gate does; the scheduler only caps it by the token budget
and max_seq_len), never counts rounds outside the record fold (each round is one
`RoundRecord` folded into `RoundStats`), and never talks gRPC (the backend sessions do).

Round protocol (docs/architecture.md §3). After prefill of x[0..n-1] the verifier returns the first
anchor x[n] (streamed as the first completion token) and the prompt's last min(n, W) rows,
which prime the drafter. Each round, with the anchor x[p] at position p:
  1. gated only: the gateway's regime (`ModelRegime.may_draft`, docs/gate.md §14) runs the
     round plain when its throughput model over the step table says the gateway commits more
     tokens per ms without drafting at its concurrency; alone, the pre-draft gate
     (`Gate.pre_draft`): skip drafting when the anchor's logit margin is below
     DSPARK_GATE_MARGIN_THRESHOLD, when drafting has lost at its margin bin (threshold auto)
     or, gate enabled, in the recent drafted rounds (with others in flight, the regime
     drafts the full block instead);
  2. draft d1..dB and confidence logits from anchor x[p], seed position p-1;
  3. length choice k <= B: `always` submits max_n, `gated` asks the gate; max_n caps k by the
     request's max_draft_tokens, the remaining max_tokens (a round adds k+1 tokens at most)
     and the room before max_seq_len;
  4. verify [x[p], d1..dk] at p..p+k (or decode x[p] when k = 0): a accepted, bonus token,
     margin, rows of positions p..p+a;
  5. commit those rows to the drafter, stream d1..da + bonus token by token with the stop
     checks, feed the gate (censored), advance p by a+1.
Every draft reply is checked (`DraftCheck`) before the gate or the verifier sees it; a reply
that fails is discarded whole and counts as a drafter failure. A drafter failure that another
replica may cure (`may_fail_over`: dead, timed out, invalid reply) re-primes a new drafter
session from the generation's `DrafterSupply` (a new stream, which the channel's round_robin
places on a live replica) with the verifier's last min(W, committed) rows and the committed
tokens, and speculation resumes; otherwise, or with the supply spent, the generation continues
with plain decode (identical output under sequential verify). A verifier failure ends it (the
servicer answers UNAVAILABLE). A generation that can never submit a draft (max_tokens <= 2, or
no room before max_seq_len) opens no drafter session at all.

Sampling (docs/sampling.md). A generation's `SamplingParams` go to the verifier's prefill
(fixed for the session) and to every draft request; the drafter draws each draft token at
its absolute position with the request's seed. Under the rejection rule the drafter's q of
the submitted drafts goes with the verify. The verifier chooses every token, so the
scheduler never samples: under the coupled rule the output is the plain-decode sequence for
the seed whatever the drafts, the draft lengths, a failover or spec off were. Each streamed
token carries the verifier's `TokenLogprob`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
import torch

from dsv4.sampling import MAX_LOGPROBS, SamplingParams, TokenLogprob
from services.common.constraint import Constraint, GrammarVocab, vocab_of
from services.common.controls import LogitsControls
from services.common.settings import VERIFY_MODES
from services.common.telemetry import TRACER_NAME, trace_context
from services.gateway.backends import DrafterSession, VerifierSession
from services.gateway.costs import CostTracker
from services.gateway.drafter_link import MAX_DEFERRED_ROWS, DrafterLink
from services.gateway.drafters import DraftCheck, DrafterFaults, DrafterSupply
from services.gateway.events import FinalEvent, GenerationParams, ModelLimits, ProcessStats, TokenEvent
from services.gateway.gate import PRE_DRAFT_SKIPS, Gate, GateConfig
from services.gateway.jump_forward import JumpForward
from services.gateway.load import VerifierLoad
from services.gateway.metrics import GenerationMetrics, NoGenerationMetrics
from services.gateway.load_regime import ModelRegime
from services.gateway.record import Reason, RoundRecord, RoundStats
from services.gateway.round_policy import RoundPolicy
from services.gateway.rounds import Round, check_workload
from services.gateway.tokenizer import Detokenizer, Tokenizer
from services.gateway.warm import WarmBands, WarmStart, sampling_band

SPEC_MODES = ("off", "always", "gated")

# The events, limits and deferral bound are imported from here by the servicer, tests and benches.
__all__ = ["FinalEvent", "GenerationParams", "MAX_DEFERRED_ROWS", "ModelLimits", "ProcessStats", "SPEC_MODES",
           "Scheduler", "TokenEvent"]


class Scheduler:
    """Runs generations; shared by all requests of a gateway (state per generation only).

    Args:
        limits: the served model's limits.
        tokenizer: text <-> ids.
        gate_config: DSPARK_GATE_* settings; `enabled` picks the default spec mode.
        verify_mode: "sequential" or "batched".
        cost_mode: "configured" or "measured" (see `services.gateway.costs`).
        costs: the process's `CostTracker` (None: a new one over `gate_config`'s costs, nothing pinned).
        provider: tracer provider for generation and round spans (None: no spans).
        recorder: a list that receives one `Round` per round (`--record-rounds`): every
            round whose confidences the gate saw, and every round that drafted nothing.
        metrics: `services.gateway.metrics.GatewayMetrics` fed each round's record and each
            finished generation (None: none).
        load: the verifier's step table (`services.gateway.load.VerifierLoad`): the regime
            and the step budget price load with it (docs/gate.md §13), so the costs are
            sampled only from rounds alone in their verifier step (None: no table; every
            round samples the costs).
        regime: the gateway's regime (`services.gateway.load_regime.ModelRegime`): it learns
            from every drafted round and may run gated rounds plain (None: the gates alone
            decide).
        warm: warm-start settings: each gated generation's gate starts from the calibration
            of the finished generations of its sampling band (`services.gateway.warm`;
            None: every gate starts cold).
        step_budget: how gated generations use the verifier's step budget ("off" | "trim" |
            "full", `services.gateway.round_policy`).
    """

    def __init__(self, limits: ModelLimits, tokenizer: Tokenizer, gate_config: GateConfig,
                 verify_mode: str = "batched", cost_mode: str = "configured",
                 provider: TracerProvider | None = None, recorder: list[Round] | None = None, metrics=None,
                 costs: CostTracker | None = None, load: VerifierLoad | None = None,
                 regime: ModelRegime | None = None, warm: WarmStart | None = None, jump_forward: bool = True,
                 step_budget: str = "off"):
        if verify_mode not in VERIFY_MODES:
            raise ValueError(f"verify mode={verify_mode!r}: must be one of {VERIFY_MODES}")
        self.limits, self.tokenizer, self.gate_config = limits, tokenizer, gate_config
        self.verify_mode, self.cost_mode = verify_mode, cost_mode
        self.costs = CostTracker(gate_config.cost_model()) if costs is None else costs
        self.costs.model(cost_mode)  # validates the mode
        self.tracer = (provider or trace.NoOpTracerProvider()).get_tracer(TRACER_NAME)
        self.recorder = recorder
        self.metrics = metrics
        self.load = load
        self.regime = regime
        self.jump_forward = jump_forward  # submit the tokens a grammar forces as certain drafts
        self.step_budget = step_budget
        self.in_flight = 0  # generations inside `generate` (the regime's concurrency)
        self.stats = ProcessStats(warm=None if warm is None else WarmBands(warm))
        self.draft_check = DraftCheck(limits.vocab_size, limits.block_size, limits.reserved_token_ids)
        self.drafter_faults = DrafterFaults()  # process-wide, by reason (the Stats RPC)

    # ------------------------------------------------------------------ validation
    def params(self, prompt: str, prompt_ids: Sequence[int], max_tokens: int, spec: str,
               temperature: float = 0.0, stop_token_ids: Sequence[int] = (), stop: Sequence[str] = (),
               ignore_eos: bool = False, label: str = "live", sampling: SamplingParams | None = None,
               max_drafts: int = 0, constraint: Constraint | None = None,
               controls: LogitsControls | None = None,
               prompt_logprobs: int | None = None) -> GenerationParams:
        """Validate a request into `GenerationParams`. max_drafts: drafted tokens a round may
        submit at most (always: a fixed k; gated: a cap on the gate's choice; 0 = block size).
        prompt_logprobs: None, or the top alternatives (0..MAX_LOGPROBS) of the prompt
        logprobs the first event carries; with it, max_tokens may be 0 (score the prompt only).

        sampling: how tokens are chosen (the servicer builds it, seed included); None is
        `SamplingParams(temperature=temperature)` (seed 0, the coupled rule), otherwise
        `temperature` is ignored. constraint: the output constraint, compiled here against the
        gateway's vocabulary so a bad one is refused before any session opens. controls: the
        logits controls (docs/sampling.md); their stop_ids are set here to the stop token ids
        (eos unless ignore_eos, and stop_token_ids), which min_tokens masks.
        Raises:
            ValueError: naming the value: a bad temperature (NaN, negative), an empty
                prompt, a token id outside [0, vocab), max_tokens < 0, or 0 without prompt
                logprobs, prompt_logprobs outside 0..MAX_LOGPROBS, prompt + max_tokens
                beyond max_seq_len, an unknown spec mode, a stop token id out of range, a blank
                or reserved workload label, max_drafts outside [0, block_size], a constraint
                that does not compile (`ConstraintError`, naming its field) or one with
                ignore_eos (a grammar ends the generation with eos), a controls token id outside
                the vocabulary (named) or min_tokens > max_tokens.
        """
        lim = self.limits
        if sampling is None:
            sampling = SamplingParams(temperature=float(temperature))
        ids = self._prompt_ids(prompt, prompt_ids)
        if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs={prompt_logprobs}: must lie in 0..{MAX_LOGPROBS}")
        if max_tokens < 0 or (max_tokens == 0 and prompt_logprobs is None):
            raise ValueError(f"max_tokens={max_tokens}: must be > 0 (0 only with prompt_logprobs set: "
                             "score the prompt without generating)")
        if len(ids) + max_tokens > lim.max_seq_len:
            raise ValueError(f"prompt of {len(ids)} tokens + max_tokens={max_tokens} exceeds "
                             f"max_seq_len={lim.max_seq_len}")
        spec = spec or ("gated" if self.gate_config.enabled else "always")
        if spec not in SPEC_MODES:
            raise ValueError(f"spec={spec!r}: must be one of {SPEC_MODES}")
        stops = set(stop_token_ids) | (set() if ignore_eos else {lim.eos_token_id})
        bad = [t for t in stops if not 0 <= t < lim.vocab_size]
        if bad:
            raise ValueError(f"stop token id {bad[0]} outside [0, vocab_size={lim.vocab_size})")
        check_workload(label or "live")
        if not 0 <= max_drafts <= lim.block_size:
            raise ValueError(f"max_draft_tokens={max_drafts}: must be in [0, block_size={lim.block_size}] "
                             "(0 = the block size)")
        if constraint is not None:
            if ignore_eos:
                raise ValueError(f"{constraint.field} with ignore_eos: a constrained generation ends with eos "
                                 "once its grammar completes (docs/structured.md)")
            self.grammar_vocab.compile(constraint)
        min_tokens = 0 if controls is None else controls.min_tokens
        controls = None if controls is None else controls.for_generation(stops, lim.vocab_size, max_tokens)
        return GenerationParams(tuple(ids), max_tokens, spec, frozenset(stops), tuple(s for s in stop if s),
                                label or "live", sampling=sampling, max_drafts=max_drafts, constraint=constraint,
                                controls=controls, prompt_logprobs=prompt_logprobs, min_tokens=min_tokens)

    def _prompt_ids(self, prompt: str, prompt_ids: Sequence[int]) -> list[int]:
        """The prompt's token ids: `prompt_ids`, else `prompt` tokenized. Raises ValueError on
        an empty prompt or an id outside [0, vocab_size) (named)."""
        ids = list(prompt_ids) if len(prompt_ids) else self.tokenizer.encode(prompt)
        if not ids:
            raise ValueError("empty prompt: give prompt text or prompt_token_ids")
        vocab = self.limits.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} outside [0, vocab_size={vocab})")
        return ids

    @functools.cached_property
    def grammar_vocab(self) -> GrammarVocab:
        """The tokenizer's grammar vocabulary (built on the first constrained request)."""
        return vocab_of(self.tokenizer, self.limits.vocab_size, self.limits.eos_token_id)

    # ------------------------------------------------------------------ generation
    async def generate(self, p: GenerationParams, verifier: VerifierSession,
                       drafter: DrafterSupply | DrafterSession | None = None
                       ) -> AsyncIterator[TokenEvent | FinalEvent]:
        """Run one generation; yields TokenEvents, then one FinalEvent.

        `drafter`: a `DrafterSupply` (the first session and the failover budget; the caller
        closes it after the generation), one session (no failover; the caller closes it), or
        None (plain decode, as is spec "off"). Sessions are opened only when the generation
        can draft at all. Raises BackendError when the verifier fails; drafter failures,
        invalid draft replies included, are absorbed (failover, else plain decode).
        """
        supply = drafter if drafter is None or isinstance(drafter, DrafterSupply) else DrafterSupply.of(drafter)
        track = self.metrics.generation(p.spec) if self.metrics is not None else NoGenerationMetrics()
        # The span is made current only around each step of the generation, never across a
        # `yield`: the caller may close this generator from another task (a client cancel),
        # and a context attached in one task cannot be detached in another.
        span = self.tracer.start_span("gateway.generate")
        # Counted before the generation's link asks the regime whether to start awake: the
        # regime of the concurrency this generation makes, not of the one before it came.
        self.in_flight += 1
        try:
            gen = _Generation(self, p, verifier, supply if p.spec != "off" else None, track)
            span.set_attribute("gen_ai.operation.name", "text_completion")
            span.set_attribute("gen_ai.request.max_tokens", p.max_tokens)
            span.set_attribute("gen_ai.usage.input_tokens", len(p.prompt_ids))
            span.set_attribute("spec_decode.mode", p.spec)
            span.set_attribute("gen_ai.request.temperature", p.sampling.temperature)
            if not p.sampling.greedy:
                span.set_attribute("gen_ai.request.seed", p.sampling.seed)
                span.set_attribute("spec_decode.sampling_rule", p.sampling.rule)
            if p.request_id:
                span.set_attribute("gen_ai.response.id", p.request_id)
            events = gen.run()
            while True:
                with trace.use_span(span, end_on_exit=False):
                    try:
                        event = await events.__anext__()
                    except StopAsyncIteration:
                        break
                    if isinstance(event, FinalEvent):
                        self._finished(span, event, gen.t0, track)
                track.first_token()
                yield event
        except Exception:
            track.close("error")
            raise
        finally:
            track.close("abort")  # no-op after the final message or an error
            self.in_flight -= 1
            span.end()

    def _finished(self, span, event: FinalEvent, t0: float, track) -> None:
        """A generation ended: its span attributes, the process stats and the metrics."""
        span.set_attribute("gen_ai.usage.output_tokens", event.completion_tokens)
        span.set_attribute("gen_ai.response.finish_reasons", [event.finish_reason])
        span.set_attribute("gen_ai.server.time_to_first_token", event.time_to_first_token_ms / 1e3)
        for k, v in event.counters.speculation_dict().items():
            span.set_attribute(f"spec_decode.{k}", v)
        self.stats.add(event)
        track.finished(event.finish_reason, event.prompt_tokens, event.completion_tokens,
                       event.time_to_first_token_ms / 1e3, time.perf_counter() - t0, event.counters.drafter_failed)


class _Generation:
    """State of one generation (see the module docstring for the round protocol)."""

    def __init__(self, sched: Scheduler, p: GenerationParams, verifier: VerifierSession,
                 drafters: DrafterSupply | None, metrics: GenerationMetrics | NoGenerationMetrics):
        self.s, self.p, self.verifier, self.metrics = sched, p, verifier, metrics
        # The first round is the most permissive (one token out, anchor at the prompt's end):
        # when it cannot submit a draft (see `_max_drafts`), no round can, so no drafter session.
        can_draft = p.max_tokens - 2 > 0 and sched.limits.max_seq_len - 2 - len(p.prompt_ids) > 0
        self.counters = RoundStats()  # folded from this generation's round records
        gate_cfg = sched.gate_config
        if p.spec == "gated":
            gate_cfg = dataclasses.replace(gate_cfg, enabled=sched.limits.confidence_head)
        elif p.spec == "always":
            gate_cfg = dataclasses.replace(gate_cfg, enabled=False)
        self.cost = sched.costs.model(sched.cost_mode)  # snapshot: decisions and records of this generation
        bands, band = sched.stats.warm if p.spec == "gated" else None, sampling_band(p.sampling)
        self.gate = Gate(gate_cfg, None if bands is None else bands.calibration(band), band)
        self.gate.cost = self.cost
        self.policy = RoundPolicy(p.spec, self.gate, sched.regime, None if sched.load is None else sched.load.table,
                                  sched.limits.max_seq_len, p.max_tokens, p.max_drafts, sched.step_budget)
        # a gate that starts in its band's losing streak (docs/gate.md §6) opens no session until it probes
        awake = self.policy.regime_drafts(sched.in_flight, len(p.prompt_ids), 0) and not self.gate.losing()
        self.link = DrafterLink(drafters if can_draft else None, verifier, sched.drafter_faults, metrics,
                                self.counters, awake=awake)
        self.commit_ms = 0.0  # the last round's drafter commit (ms; 0 when held back): a drafter leg
        self.jump: JumpForward | None = None  # the forced runs of a constrained generation
        if p.constraint is not None:
            self.link.constraint = (p.constraint, len(p.prompt_ids))
            if sched.jump_forward:
                lim = sched.limits
                self.jump = JumpForward(sched.grammar_vocab, p.constraint, lim.vocab_size, lim.eos_token_id)
        if p.controls is not None:
            self.link.controls = (p.controls, len(p.prompt_ids))
        self.detok = Detokenizer(sched.tokenizer, p.stop, p.min_tokens)
        self.out: list[int] = []
        self.finish: str | None = None
        self.matched_stop: int | str | None = None
        self.t0 = time.perf_counter()
        self.ttft_ms = 0.0

    async def run(self) -> AsyncIterator[TokenEvent | FinalEvent]:
        """Prefill, then rounds until a stop condition; yields a TokenEvent per round (the first
        anchor's first, with the prompt logprobs when asked), then one FinalEvent. A prompt
        scored without generating (max_tokens 0) yields the FinalEvent alone, with its prompt
        logprobs: no token is streamed and no drafter is primed. Raises BackendError when the
        verifier fails."""
        p = self.p
        with self.s.tracer.start_as_current_span("gateway.prefill") as span:
            first = await self.verifier.prefill(p.prompt_ids, trace_context(span), p.sampling, p.constraint,
                                                p.controls, p.prompt_logprobs)
        self.ttft_ms = (time.perf_counter() - self.t0) * 1e3
        if p.max_tokens == 0:
            self.finish = "length"
            yield self._final(first.prompt_logprobs)
            return
        # Priming the prompt is priced by the regime; a gate that starts in its band's losing
        # streak (docs/gate.md §6) primes nothing until its first probe.
        if not self.policy.regime_drafts(self.s.in_flight, len(p.prompt_ids), 0) or self.gate.losing():
            await self.link.sleep()  # no prime now: a drafter is primed when this generation drafts
        await self.link.commit(first.rows, first.first_position, p.prompt_ids, 0)
        pos, anchor, margin = len(p.prompt_ids), first.next_token, first.margin
        if self.jump is not None:
            self.jump.commit([anchor])
        yield dataclasses.replace(self._emit([anchor], first.logprobs), prompt_logprobs=first.prompt_logprobs)
        while self.finish is None:
            recorded = self.counters.accepted
            a, new, margin, logprobs = await self._round(anchor, pos, margin)
            pos, anchor = pos + a + 1, new[-1]
            if self.jump is not None:
                self.jump.commit(new)
            event = self._emit(new, logprobs)
            drafts = self.counters.accepted - recorded  # this round's accepted drafts (jump-forward's are not)
            self.counters.unstreamed_accepted += drafts - min(drafts, len(event.token_ids))  # a stop inside the block
            yield event
        yield self._final()

    def _final(self, prompt_logprobs: Sequence[TokenLogprob] = ()) -> FinalEvent:
        """The generation's FinalEvent (`finish` set); prompt_logprobs: those of a prompt
        scored without generating."""
        p = self.p
        return FinalEvent(self.finish, len(p.prompt_ids), len(self.out), self.detok.text,
                          self.detok.finish(), self.counters, self._gate_report(), self.ttft_ms, self.matched_stop,
                          p.sampling, self.gate.recent_confidences(),
                          streak=self.gate.streak(),
                          prompt_logprobs=tuple(prompt_logprobs))

    def _gate_report(self) -> dict:
        """The gate's counters of this generation with the gate's current estimate and weight per bucket."""
        out = self.counters.gate.to_dict()
        for bucket, state in zip(out["buckets"], self.gate.to_dict()["buckets"]):
            bucket["estimate"], bucket["weight"] = state["estimate"], state["weight"]
        return out

    def _emit(self, tokens: list[int], logprobs: Sequence[TokenLogprob] = ()) -> TokenEvent:
        """Stream tokens one by one until a stop condition; sets `finish`. logprobs: one per
        token (or none), cut with the tokens."""
        taken, delta = [], ""
        for t in tokens:
            taken.append(t)
            self.out.append(t)
            if t in self.p.stop_token_ids:
                self.finish, self.matched_stop = "stop", t
                break
            delta += self.detok.add(t)
            if self.detok.stopped:
                self.finish, self.matched_stop = "stop", _matched_stop_string(self.detok)
                break
            if len(self.out) >= self.p.max_tokens:
                self.finish = "length"
                break
        return TokenEvent(taken, delta, list(logprobs[:len(taken)]))

    async def _round(self, anchor: int, pos: int, margin: float
                     ) -> tuple[int, list[int], float, tuple[TokenLogprob, ...]]:
        """One round at anchor position `pos`; returns (accepted, new tokens, new anchor margin,
        the new tokens' logprobs)."""
        s = self.s
        with s.tracer.start_as_current_span("spec_decode.round") as span:
            tc = trace_context(span)
            span.set_attribute("spec_decode.round", self.counters.rounds + 1)
            span.set_attribute("spec_decode.anchor_margin", margin)
            plan = await self._plan(anchor, pos, margin, tc)
            if plan.k == 0 and self.jump is not None:
                forced = self.jump.forced(self._max_drafts(s.limits.block_size, pos))
                if forced:
                    return await self._forced_round(anchor, pos, margin, plan, forced, span, tc)
            drafts, k = plan.drafts, plan.k
            asked, t0 = k, time.perf_counter()
            if k > 0:
                q = None if plan.probs is None else plan.probs[:k]
                res = await self.verifier.verify(anchor, drafts[:k], pos, s.verify_mode, tc, q,
                                                 self.policy.survival(plan.conf, k))
                verify_ms = (time.perf_counter() - t0) * 1e3
                if res.admitted is not None and res.admitted < k:  # the step's budget judged a prefix
                    span.set_attribute("spec_decode.admitted", res.admitted)
                    k = res.admitted
                own_rows = k + 1 if s.verify_mode == "batched" else 1  # sequential: one position per step
                alone = self._alone(res, own_rows)
                if alone and k > 0:
                    s.costs.add_verify(k, verify_ms)
            else:
                res = await self.verifier.decode(anchor, pos, tc)
                verify_ms = (time.perf_counter() - t0) * 1e3
                own_rows = 1
                alone = self._alone(res, own_rows)
                if alone:
                    s.costs.add_plain(verify_ms)
            if alone and plan.draft_ms is not None:
                s.costs.add_draft(plan.draft_ms)
            self.policy.observe(plan.conf, k, res.accepted, res.step_rows, own_rows, res.committed_tokens_per_ms,
                                plan.leg_ms, plan.reason)
            a, drafter, t0 = res.accepted, self.link.session, time.perf_counter()
            # the gate or the regime kept this round from drafting: its rows wait for the next draft
            defer = plan.reason in (*PRE_DRAFT_SKIPS, Reason.REGIME)
            # a losing streak's skip holds rows until the next probe; a dear drafter's is far, so
            # past MAX_DEFERRED_ROWS the link lets the session go rather than feed it (gate.md §5b)
            losing = plan.reason is Reason.RECENT_LOSS and self.gate.probes_dear()
            await self.link.commit(res.rows, pos, [anchor, *drafts[:a]], pos, defer, sleep_when_full=losing)
            self.commit_ms = 0.0 if defer else (time.perf_counter() - t0) * 1e3
            if alone and not defer and drafter is not None and self.link.session is drafter:  # a re-prime is no commit cost
                s.costs.add_commit((time.perf_counter() - t0) * 1e3)
            self._record(span, RoundRecord(
                plan.reason, len(drafts), k, a, self.cost,
                confidence_logits=None if plan.conf is None else tuple(plan.conf), anchor_margin=margin,
                draft_ms=plan.draft_ms, verify_ms=verify_ms if k > 0 else None, plain_ms=verify_ms if k == 0 else None,
                choice=self.policy.choice if plan.conf is not None else None, asked=asked if asked != k else None,
                regime=self.policy.regime_inputs() if plan.reason not in _UNDECIDED else None,
                lent_streak=self.gate.probing.lent and plan.reason not in (*_UNDECIDED, Reason.REGIME)))
            return a, [*drafts[:a], res.next_token], res.margin, res.logprobs

    async def _forced_round(self, anchor: int, pos: int, margin: float, plan: _Plan, forced: list[int], span, tc
                            ) -> tuple[int, list[int], float, tuple[TokenLogprob, ...]]:
        """Jump-forward (docs/structured.md §6): a round that would not verify drafts submits
        the run `forced` the grammar forces after the anchor as drafts instead, one verify
        for len(forced) + 1 tokens. The verifier judges them as any drafts (it accepts all of
        them unless its grammar disagrees). Recorded as the round `plan` decided (no drafts
        submitted: the gate and the costs learn nothing from it, the forced tokens are in
        `forced_rounds` / `forced_tokens`); returns as `_round`."""
        s = self.s
        q = self.jump.probs(forced) if self._needs_probs else None
        res = await self.verifier.verify(anchor, forced, pos, s.verify_mode, tc, q)
        a = res.accepted
        defer = plan.reason in (*PRE_DRAFT_SKIPS, Reason.REGIME)  # as the round it replaces
        await self.link.commit(res.rows, pos, [anchor, *forced[:a]], pos, defer)
        self.counters.forced_rounds += 1
        self.counters.forced_tokens += a
        span.set_attribute("spec_decode.forced", a)
        self._record(span, RoundRecord(
            plan.reason, len(plan.drafts), 0, 0, self.cost,
            confidence_logits=None if plan.conf is None else tuple(plan.conf), anchor_margin=margin,
            draft_ms=plan.draft_ms))
        return a, [*forced[:a], res.next_token], res.margin, res.logprobs

    async def _plan(self, anchor: int, pos: int, margin: float, tc) -> _Plan:
        """What this round submits and why: the pre-draft checks (for gated, the gateway's
        regime, then the pre-draft gate), the draft, then the length
        (`always` submits the cap, `gated` asks the gate; without confidences, the cap)."""
        # One regime decision per round: a round that reopened a drafter session because the
        # regime let it draft must not let it go on a second ask (the load may have moved).
        may_draft: bool | None = None
        if self.link.session is None and not self.link.asleep:
            if self.link.backing_off:
                may_draft = self._regime_drafts(pos, len(self.out))
                if not may_draft:
                    return _Plan(Reason.REGIME)  # a full drafter is retried only in a round that may draft
            if not await self.link.retry_full():
                return _Plan(Reason.NO_DRAFTER)
        if self._max_drafts(self.s.limits.block_size, pos) == 0:
            return _Plan(Reason.NO_ROOM)  # one token left (or no room): a draft could not be submitted
        if not (self._regime_drafts(pos, len(self.out)) if may_draft is None else may_draft):
            await self.link.sleep()  # the drafter does nothing for this generation until it drafts again
            return _Plan(Reason.REGIME)
        # asked before a sleeping link wakes: a skipped round re-primes nothing
        skip = self.policy.pre_draft(margin)
        if skip is not None:
            return _Plan(skip)
        asleep, t0 = self.link.asleep, time.perf_counter()
        if not await self.link.wake():
            return _Plan(Reason.NO_DRAFTER)
        if asleep:  # a re-prime: reported with the band's streak (Stats)
            self.gate.probing.wake_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        await self.link.flush()  # the rows of rounds that did not draft, before the drafter drafts
        reply, draft_ms = await self.link.draft(anchor, pos, tc, self.p.sampling, self.s.draft_check,
                                                self._needs_probs)
        if reply is None or not reply.tokens:
            return _Plan(Reason.DRAFTER_FAILED, draft_ms=draft_ms)
        leg_ms = self.commit_ms + (time.perf_counter() - t0) * 1e3  # the commit, any flush, the draft
        drafts, conf = reply.tokens, reply.confidence_logits
        reason, k = self.policy.choose(conf, len(drafts), pos, len(self.out))
        probs = reply.probs if self._needs_probs else None
        return _Plan(reason, drafts, conf, draft_ms, k, probs, leg_ms)

    def _regime_drafts(self, pos: int, emitted: int) -> bool:
        """Whether the gateway's regime lets this generation draft now, at anchor position
        `pos` after `emitted` tokens (always, unless it is gated and the regime at the
        gateway's concurrency is plain: docs/gate.md §14). A live drafter session (primed
        at prefill or by a failover) has nothing to re-prime: its deferred rows are flushed
        as any commit, so the wake price does not apply to it."""
        return self.policy.regime_drafts(self.s.in_flight, pos, emitted, primed=self.link.session is not None)

    @property
    def _needs_probs(self) -> bool:
        """The rejection rule at T > 0 verifies against the drafter's q."""
        return not self.p.sampling.greedy and self.p.sampling.rule == "rejection"

    def _alone(self, reply, own_rows: int) -> bool:
        """Whether a round's wall times (draft, verify or decode, commit) may sample the
        costs: with a step table those are the costs of a round alone in its verifier step
        (the regime and the step budget price the load from the table), so a round whose
        step was shared is left out whole, or load would be charged twice and the regime's
        overhead beyond the step (plain - step(1)) would grow with load; without a table,
        every round."""
        return self.s.load is None or reply.step_rows in (0, own_rows)

    def _max_drafts(self, drafted: int, pos: int) -> int:
        """Drafts a round at anchor position `pos` may submit (`RoundPolicy.max_drafts`)."""
        return self.policy.max_drafts(drafted, pos, len(self.out))

    def _record(self, span, r: RoundRecord) -> None:
        """Publish one round's record: the generation's stats, the round span, the metrics and
        the round recorder all read it."""
        self.counters.add(r)
        for key, value in (("drafted", r.drafted), ("submitted", r.submitted), ("accepted", r.accepted),
                           ("gate_decision", r.decision), ("gate_reason", r.reason.value),
                           ("verify_ms", r.verify_ms if r.submitted else r.plain_ms)):
            span.set_attribute(f"spec_decode.{key}", value)
        if r.draft_ms is not None:
            span.set_attribute("spec_decode.draft_ms", r.draft_ms)
        if r.confidence_logits is not None:  # for the reliability diagram of `dspark trace-report`
            span.set_attribute("spec_decode.confidence_logits", [float(c) for c in r.confidence_logits])
        _decision_attributes(span, r)
        self.metrics.record_round(r)
        # Replay needs a drafted round's confidences; a round that drafted nothing is kept for
        # its plain-decode time (what `dspark calibrate` fits plain_ms from).
        if self.s.recorder is not None and (r.confidence_logits is not None or not r.drafted):
            self.s.recorder.append(r.to_round(self.p.label))


# Rounds that ended before the regime was asked (its inputs would be another round's).
_UNDECIDED = (Reason.NO_DRAFTER, Reason.NO_ROOM)


def _decision_attributes(span, r: RoundRecord) -> None:
    """The length decision's inputs and outputs on the round span (docs/gate.md §9), what
    `dspark trace-report --rounds` explains a round from: survival per position, lambda,
    value(k) per k, the drafts asked before the step budget's cut, the model regime's (in
    flight, plain tok/ms, draft tok/ms) when it decided, a probe's priced loss (tokens) and
    whether the round was decided in a losing streak lent by the band."""
    c = r.choice
    if c is not None and c.survival:
        span.set_attribute("spec_decode.survival", [float(v) for v in c.survival])
    if c is not None and c.rate is not None:
        span.set_attribute("spec_decode.lambda", float(c.rate))
    if c is not None and c.values:
        span.set_attribute("spec_decode.values", [float(v) for v in c.values])
    if r.asked is not None:
        span.set_attribute("spec_decode.asked", r.asked)
    if r.regime is not None:
        span.set_attribute("spec_decode.regime", [float(v) for v in r.regime])
    if c is not None and c.probe_loss is not None:
        span.set_attribute("spec_decode.probe_loss", float(c.probe_loss))
    if r.lent_streak:
        span.set_attribute("spec_decode.lent_streak", True)


@dataclass(frozen=True)
class _Plan:
    """A round's plan before verify: why (`reason`), the drafts, their confidences (None
    without), the draft call's wall time (ms), k, the drafts to submit, their q [n, V]
    fp32 under the rejection rule (else None), and the round's drafter legs (ms)."""

    reason: Reason
    drafts: list[int] = field(default_factory=list)
    conf: list[float] | None = None
    draft_ms: float | None = None
    k: int = 0
    probs: torch.Tensor | None = None
    leg_ms: float | None = None  # the drafter legs of a drafted round: the last commit, a flush, the draft


def _matched_stop_string(detok: Detokenizer) -> str:
    """The stop string a stopped `detok` cut at: the one found first in the decoded
    completion (the first listed among those found at the same place), as the cut itself."""
    full = detok.tokenizer.decode(detok.ids)
    found = [(full.find(s), i) for i, s in enumerate(detok.stop) if s in full]
    return detok.stop[min(found)[1]]

