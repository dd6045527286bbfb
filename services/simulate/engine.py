"""One simulated serving run: a gateway's generations over a verifier and a drafter, in virtual time.

Each generation runs the round protocol of `services.gateway.scheduler` (docs/architecture.md
§3) with the gateway's own decision objects: its `RoundPolicy` (regime, the
gate's pre-draft decision and length choice, the caps) over a `Gate`, the shared
`ModelRegime`, and the verifier's `CommitRate` for lambda_sys. The verifier and the drafter
are `SimLoop`s over the services' `Schedule`; sessions open through `SessionTable`. What is
modelled: the forwards (the step-time model), the network (`rpc_ms`, half each way) and what
the drafts are worth (each round replays one recorded round of the stream's workload: its
confidences, anchor margin and accepted length; a round that submits k drafts accepts
min(recorded accepted, k)). docs/simulate.md §3 states the protocol step by step.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Callable

from services.analysis.serving_stats import GenerationTrace
from services.common.schedule import Schedule
from services.common.sessions import SessionLimitError, SessionTable
from services.gateway.decision import CostModel
from services.gateway.gate import PRE_DRAFT_SKIPS, Gate, GateConfig
from services.common.alignment import make_alignment
from services.common.budget import StepBudget, StepTimes
from services.gateway.record import Reason
from services.gateway.load_regime import ModelRegime
from services.gateway.round_policy import RoundPolicy
from services.gateway.rounds import Round
from services.simulate.loops import Clock, Pool, Request, SimLoop
from services.simulate.models import ServiceModel
from services.verifier.step_table import ROW_BUCKETS, CommitRate

VERIFIER_AWAY, DRAFTER_AWAY = frozenset({"verify"}), frozenset({"draft"})
DEFERRED = (*PRE_DRAFT_SKIPS, Reason.REGIME)  # rounds whose commit waits for the next draft
# The event budget per token or prompt chunk (`Gateway.start`): a plain round takes ~10 events
# (call, arrival, look, step, pool, reply, gateway turn), a drafted one ~3 calls of those for
# 1 + accepted tokens; a gather may add a timer per step. 64 leaves room for every shape.
EVENTS_PER_STEP = 64


@dataclass(frozen=True)
class Arm:
    """A policy under test: spec mode ("off" | "always" | "gated"), max drafts per round
    (0 = the block), whether the gateway's model regime runs (docs/gate.md §14), gate settings
    laid over the defaults (e.g. {"win_factor": 1.0}) and the verifier's step budget."""

    name: str
    spec: str
    max_drafts: int = 0
    regime: bool = False  # the gateway runs the model regime (ModelRegime, docs/gate.md §14)
    gate: tuple[tuple[str, object], ...] = ()
    budget: str = "off"  # the verifier's step budget: "off" | "trim" | "full" (RoundPolicy)


@dataclass(frozen=True)
class RunConfig:
    """Everything but the arm and the streams: block size, max_seq_len and the session limit
    (tokens / sessions), the services' gather window (s) and prefill chunk (tokens), whether
    drafter and verifier share one pool of compute, the drafter replicas (each its own step
    loop; a generation's session is placed round robin, as the channel's round_robin places
    streams), and the costs the gates decide with (what
    a deployment's `dspark calibrate` gives: by default the model's own single-stream costs)."""

    block_size: int = 5
    max_seq_len: int = 1 << 20
    max_sessions: int = 256
    gather_s: float = 0.05
    prefill_chunk: int = 64
    shared_compute: bool = False
    cores: int = 1  # the shared pool's cores (processor sharing; docs/simulate.md §3)
    background: float = 0.0  # other programs' always-runnable jobs on the shared pool (docs/simulate.md §5.2)
    drafters: int = 1
    gate_costs: CostModel | None = None  # the gates' cost model; None: the model's single-stream costs
    prime_rows: int = 64  # tap rows a prefill primes the drafter with (the verifier's prefill_keep_rows)
    alignment: str = "gather"  # the verifier's gather rule: free | gather | lockstep | pingpong | rate (alignment.py)


class RecordedText:
    """A recording's rounds laid out along the text they committed, so a generation reads the
    round at its own text position however it moved there.

    Recorded round i starts at text position starts[i] = sum over j < i of (accepted_j + 1)
    (a round that did not draft committed one token) and the recording is `length` tokens long
    (it wraps). `at(t)` is the first drafted round starting at or after position t (mod
    length): a generation that emitted plain tokens, or accepted fewer drafts than the
    recording did, moves on through the text as the real one would, instead of meeting the
    round it skipped again at its next draft.

    Raises:
        ValueError: a recording without a drafted round (one with confidence_logits).
    """

    def __init__(self, rounds: list[Round]):
        starts = list(itertools.accumulate((r.accepted + 1 for r in rounds), initial=0))
        self.length = starts.pop()
        self.drafted = [r for r in rounds if r.confidence_logits]
        if not self.drafted:
            raise ValueError(f"a recording of {len(rounds)} rounds without a drafted one: nothing to replay")
        self.starts = [t for t, r in zip(starts, rounds) if r.confidence_logits]

    def at(self, position: int) -> Round:
        """The drafted round a draft from text position `position` (tokens, >= 0) replays."""
        i = bisect.bisect_left(self.starts, position % self.length)
        return self.drafted[i % len(self.drafted)]

    def start(self, offset: int) -> int:
        """The text position of drafted round `offset` (mod their number)."""
        return self.starts[offset % len(self.starts)]


@dataclass
class StreamSpec:
    """One generation to run: its stream, arrival (virtual ms), prompt and output lengths
    (tokens), its workload's recording and the drafted round it starts reading at."""

    stream: int
    arrival_ms: float
    prompt: int
    output: int
    text: RecordedText
    offset: int
    then: StreamSpec | None = None  # the stream's next generation (closed loop), sent when this one ends


class Gateway:
    """The simulated gateway of one run (module docstring)."""

    def __init__(self, model: ServiceModel, config: RunConfig, arm: Arm):
        self.model, self.config, self.arm = model, config, arm
        self.clock = Clock()
        self.max_events: int | None = None  # set by `start`
        shared = Pool(self.clock, config.cores, config.background)
        own = lambda: shared if config.shared_compute else Pool(self.clock)  # noqa: E731 - a pool per loop, or one
        self.rows_per_session = float(config.block_size + 1)  # of the verifier's last batch step
        self.verifier = SimLoop(self.clock, own(), Schedule(config.gather_s, VERIFIER_AWAY, config.prefill_chunk,
                                                            make_alignment(config.alignment, config.gather_s,
                                                                           self._shape)),
                                self._verifier_ms, self._verifier_step,
                                StepBudget(self._prices) if arm.budget != "off" else None)
        self.drafters = [SimLoop(self.clock, own(), Schedule(config.gather_s, DRAFTER_AWAY), self._drafter_ms)
                         for _ in range(config.drafters)]
        gateway_ms, loops = model.gateway_ms, (model.verifier_loop, model.drafter_loop)
        self.gateway_turns = _Turns(own(), (lambda _: gateway_ms) if gateway_ms > 0 else None)
        # each backend's event loop, by its step loop's id (`call` looks its reply's turn up)
        self.service_turns = {id(self.verifier): _Turns(own(), loops[0].ms if loops[0] else None)}
        self.service_turns.update({id(d): _Turns(own(), loops[1].ms if loops[1] else None) for d in self.drafters})
        self.placed = 0  # generations placed on drafters so far (round robin)
        self.sessions: SessionTable = SessionTable(config.max_sessions)
        self.admission: list = []  # generations waiting for a verifier session, first come first served
        self.rate = CommitRate()
        self.cost = config.gate_costs or model.single_stream(config.block_size)
        self.regime = (ModelRegime(config.block_size, lambda: self.budget_table, lambda: self.cost)
                       if arm.regime else None)
        self.budget_table = StepTimes(tuple(float(r) for r in ROW_BUCKETS),
                                      tuple(model.verifier_ms(r, 1) for r in ROW_BUCKETS))
        self.gate_config = dataclasses.replace(
            GateConfig(enabled=arm.spec == "gated", draft_ms=self.cost.draft_ms,
                       verify_base_ms=self.cost.verify_base_ms, verify_slope_ms=self.cost.verify_slope_ms,
                       plain_ms=self.cost.plain_ms), **dict(arm.gate))
        self.in_flight = 0  # generations inside `generate` (the regime's concurrency)
        self.traces: dict[int, list[GenerationTrace]] = {}  # per stream, its generations in order
        self.drafted_rounds = self.rounds = self.submitted = 0
        self.decisions: dict[int, list[tuple[str, int, int]]] = {}  # per stream: (reason, k, accepted) per round

    def _shape(self) -> tuple[StepTimes, float]:
        """What a `rate` gather prices arrivals with: the step table and the rows per session
        of the verifier's last batch step."""
        return self.budget_table, self.rows_per_session

    def _prices(self) -> tuple[StepTimes, float]:
        """What the verifier's step budget prices with: its step table (the model's steps
        of one session, as the served verifier's table holds them) and lambda_sys."""
        return self.budget_table, self.rate.tokens_per_ms()

    def _verifier_ms(self, step) -> float:
        rows = sum(step.chunk(r) if r.op == "prefill" else r.rows for r in step.requests)
        return self.model.verifier_ms(rows, len(step.requests))

    def _drafter_ms(self, step) -> float:
        drafts = sum(r.op == "draft" for r in step.requests)
        return self.model.drafter_ms(drafts, sum(r.rows for r in step.requests if r.op == "commit"))

    def _verifier_step(self, requests, rows: int, ms: float, end_ms: float) -> None:
        if not any(r.op == "prefill" for r in requests):
            self.rows_per_session = rows / len(requests)
        tokens = sum(r.tokens for r in requests if r.op != "prefill" or r.left == 0)
        self.rate.add(tokens, ms, end_ms / 1e3)

    def start(self, specs: list[StreamSpec]) -> None:
        """Schedule every generation's arrival and size the run's event budget: EVENTS_PER_STEP
        events per token and prompt chunk of every generation (a round is a few calls, each a
        handful of events), so a run that could not finish stops instead of spinning."""
        steps = 0
        for spec in specs:
            self.clock.at(spec.arrival_ms, self._arrive, spec)
            while spec is not None:
                steps += spec.output + -(-spec.prompt // self.config.prefill_chunk) + 1
                spec = spec.then
        self.max_events = EVENTS_PER_STEP * steps + 10_000

    def run(self) -> None:
        """Run every event. Raises RuntimeError when generations are left unfinished or the
        event budget (`start`) is spent (the simulated loops stalled or spin: a simulator bug
        or a cost model with no progress, never a result)."""
        self.clock.run(self.max_events)
        if self.in_flight:
            raise RuntimeError(f"simulation stalled at {self.clock.now:.1f} ms with {self.in_flight} generations "
                               f"unfinished")

    def _arrive(self, spec: StreamSpec) -> None:
        trace = GenerationTrace(self.clock.now / 1e3)
        self.traces.setdefault(spec.stream, []).append(trace)
        self.in_flight += 1
        gen = _Generation(self, spec, trace)
        try:
            gen.sid = self.sessions.open(gen)
        except SessionLimitError:
            self.admission.append(gen)  # a client retrying until a session frees
            return
        gen.begin()

    def finished(self, gen: _Generation) -> None:
        if gen.spec.then is not None:
            self.clock.at(self.clock.now, self._arrive, gen.spec.then)
        self.sessions.close(gen.sid)
        self.verifier.schedule.forget(gen.sid)
        gen.drafter.schedule.forget(gen.sid)
        self.in_flight -= 1
        if self.admission:
            nxt = self.admission.pop(0)
            nxt.sid = self.sessions.open(nxt)
            nxt.begin()

    def call(self, loop: SimLoop, request: Request) -> None:
        """Send `request` to `loop`; it arrives rpc_ms / 2 later. After its step the reply
        takes the service's event-loop turn (`ServiceModel.verifier_loop` / `drafter_loop`,
        when the model has one), travels rpc_ms / 2 back, then waits its turn at the gateway
        (`gateway_ms`): the verifier's replies and the drafter's alike."""
        half = self.model.rpc_ms / 2
        reply = request.reply
        service = self.service_turns[id(loop)]
        rows = request.left if request.op == "prefill" else None  # a prefill's reply carries its prompt's rows

        def back(at_ms: float, rows_done: int) -> None:  # rpc_ms / 2 to the gateway, then its turn
            if self.gateway_turns.cost is None:
                self.clock.at(at_ms + half, reply, rows_done)
            else:
                self.clock.at(at_ms + half, self.gateway_turns.take, reply, rows_done, 1)

        if service.cost is None:
            request.reply = back
        else:
            request.reply = lambda end_ms, rows_done: self.clock.at(
                end_ms, service.take, lambda done: back(self.clock.now, done), rows_done,
                request.rows if rows is None else rows)
        self.clock.at(self.clock.now + half, loop.submit, request)


class _Turns:
    """One event loop of a service or of the gateway: it takes calls one at a time, each
    `cost(rows)` ms of work on its pool (the shared one under --shared-compute), then passes
    the call's value on. cost None: no event loop is modelled (the value passes at once).

    The gateway's: a step that answers 16 sessions releases their next calls 16 x gateway_ms
    apart, and a drafted round pays three turns (its verify, commit and draft replies) where a
    plain one pays one. A service's: its gRPC and protobuf work on a call, beside its steps
    (docs/simulate.md §5.2)."""

    def __init__(self, pool: Pool, cost: Callable[[int], float] | None):
        self.pool, self.cost = pool, cost
        self.queue: deque[tuple[Callable, int, int]] = deque()
        self.busy = False

    def take(self, then: Callable[[int], None], value: int, rows: int) -> None:
        """Queue a call of `rows` rows; `then(value)` when its turn's work is done."""
        self.queue.append((then, value, rows))
        if not self.busy:
            self._next()

    def _next(self) -> None:
        if not self.queue:
            self.busy = False
            return
        self.busy = True
        then, value, rows = self.queue.popleft()

        def done() -> None:
            self._next()
            then(value)
        self.pool.run(self.cost(rows), done)


class _Generation:
    """One generation's rounds (the scheduler's `_Generation`, its I/O replaced by events)."""

    def __init__(self, gw: Gateway, spec: StreamSpec, trace: GenerationTrace):
        self.gw, self.spec, self.trace = gw, spec, trace
        arm = gw.arm
        self.gate = Gate(gw.gate_config)
        self.gate.cost = gw.cost
        self.policy = RoundPolicy(arm.spec, self.gate, gw.regime, gw.budget_table, gw.config.max_seq_len,
                                  spec.output, arm.max_drafts, budget=arm.budget)
        self.sid = -1
        self.emitted = 0
        self.pos = spec.prompt
        self.text = spec.text
        self.text_pos = spec.text.start(spec.offset)  # where this generation is in the recording
        self.deferred = False  # committed rows held back for the next draft
        self.asleep = False  # the regime let the drafter session go (`DrafterLink.sleep`)
        self.uncommitted = 0  # committed tokens whose tap rows the drafter has not written yet
        self.margin: float | None = None
        self.leg_start: float | None = None  # when the commit before the next draft was sent (virtual ms)
        self.leg_ms: float | None = None  # the last draft's drafter legs (ms)
        self.decisions = gw.decisions.setdefault(spec.stream, [])
        self.drafter = gw.drafters[gw.placed % len(gw.drafters)]
        gw.placed += 1

    # ------------------------------------------------------------------ prefill
    def begin(self) -> None:
        req = Request(self.sid, "prefill", left=self.spec.prompt, tokens=1, reply=self._prefilled)
        self._verifier(req)

    def _verifier(self, req: Request) -> None:
        self.gw.call(self.gw.verifier, req)

    def _prefilled(self, rows: int) -> None:
        self.uncommitted = min(self.spec.prompt, self.gw.config.prime_rows)
        if self.spec.output > 2 and self.policy.spec != "off":
            if self.policy.regime_drafts(self.gw.in_flight, self.pos, self.emitted):
                # The served generation primes the drafter before it streams its first token
                # (`_Generation.run` awaits the prime's commit, then yields): the client's first
                # token waits for that drafter step too (docs/simulate.md §5.2).
                return self._commit(self._first_token)
            self.deferred = self.asleep = True  # primed when it drafts
        self._first_token()

    def _first_token(self) -> None:
        """Stream the prefill's token, then the first round (or the end of a 1-token output)."""
        self._emit(1)
        if self.emitted >= self.spec.output:
            return self._finish()
        self._round()

    def _drafter(self, req: Request) -> None:
        self.gw.call(self.drafter, req)

    def _commit(self, then: Callable[[], None]) -> None:
        """Write the rows committed since the last commit into the drafter, then `then`."""
        rows, self.uncommitted = max(self.uncommitted, 1), 0
        self.leg_start = self.gw.clock.now  # a drafted round's drafter legs: this commit and its draft
        self._drafter(Request(self.sid, "commit", rows=rows, reply=lambda _: then()))

    # ------------------------------------------------------------------ rounds
    def _round(self) -> None:
        # The recorded round at this generation's text position: its anchor margin decides
        # before the draft, its confidences and matches are the draft's.
        rec = self.text.at(self.text_pos)
        self.margin = rec.anchor_margin
        reason = self._plan()
        if reason is not None:
            return self._submit(rec, reason, None, 0)
        self.asleep = False
        if self.deferred:  # the link's flush: the held rows go before the draft
            self.deferred = False
            return self._commit(lambda: self._draft(rec))
        self._draft(rec)

    def _plan(self) -> Reason | None:
        """The pre-draft part of the scheduler's `_plan`: None when the round drafts."""
        p = self.policy
        if p.spec == "off":
            return Reason.NO_DRAFTER
        if p.max_drafts(self.gw.config.block_size, self.pos, self.emitted) == 0:
            return Reason.NO_ROOM
        # as the scheduler asks: a live session (asleep only after the regime's plain) has
        # nothing to re-prime, so no wake price
        if not p.regime_drafts(self.gw.in_flight, self.pos, self.emitted, primed=not self.asleep):
            self.deferred = self.asleep = True
            return Reason.REGIME
        return p.pre_draft(self.margin)

    def _draft(self, rec: Round) -> None:
        start = self.gw.clock.now if self.leg_start is None else self.leg_start

        def drafted(rows: int) -> None:
            self.leg_ms, self.leg_start = self.gw.clock.now - start, None
            conf = rec.confidence_logits[:self.gw.config.block_size]
            reason, k = self.policy.choose(conf, len(conf), self.pos, self.emitted)
            self._submit(rec, reason, conf, k)
        self._drafter(Request(self.sid, "draft", reply=drafted))

    def _submit(self, rec: Round, reason: Reason, conf, k: int) -> None:
        # tokens: what the block commits when verified whole; a step budget's trim caps it
        req = Request(self.sid, "verify" if k else "decode", rows=k + 1 if k else 1, tokens=min(rec.accepted, k) + 1,
                      survival=self.policy.survival(conf, k))

        def verified(rows: int) -> None:
            admitted = req.rows - 1 if k else 0
            accepted = min(rec.accepted, admitted)
            self.decisions.append((reason.value, admitted, accepted))
            self.gw.submitted += admitted
            self._verified(rec, reason, conf, admitted, accepted, rows)
        req.reply = verified
        gw = self.gw
        gw.rounds += 1
        gw.drafted_rounds += conf is not None
        self._verifier(req)

    def _verified(self, rec: Round, reason: Reason, conf, k: int, accepted: int, rows: int) -> None:
        gw = self.gw
        leg, self.leg_ms = self.leg_ms, None
        self.policy.observe(conf, k, accepted, rows, k + 1 if k else 1, gw.rate.tokens_per_ms(),
                            leg if conf is not None else None, reason)
        self.pos += accepted + 1
        self.text_pos += accepted + 1
        self.uncommitted += accepted + 1
        self._emit(accepted + 1)
        if self.emitted >= self.spec.output:
            return self._finish()
        if reason in DEFERRED or self.policy.spec == "off":
            self.deferred = self.deferred or reason in DEFERRED
            return self._round()
        self._commit(self._round)

    def _emit(self, tokens: int) -> None:
        tokens = min(tokens, self.spec.output - self.emitted)
        self.emitted += tokens
        self.trace.arrivals.append((self.gw.clock.now / 1e3, tokens))

    def _finish(self) -> None:
        self.gw.finished(self)
