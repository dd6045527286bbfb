"""One speculative round as an immutable record, and the one fold every round counter comes from.

This module owns `RoundRecord` and the `RoundStats` / `GateStats` fold (a round's `Reason`
is `services.gateway.gate`'s, which decides most of them). It must not decide anything: it records and adds up what the scheduler, the gate and the
replay decided. Counts are in tokens, times in ms.

A round is described once, by a `RoundRecord`: what was decided and why, how many tokens were
drafted, submitted, accepted and committed, and its timings. The scheduler makes one per live
round and the replay one per replayed round. Every count of rounds — the per-generation
`SpecStats` of the final response, the gateway's `Stats` RPC, the replay's per-policy results
— is a `RoundStats` folded from records with `add`, and totals are `merge`d folds. The
Prometheus counters (`GatewayMetrics.record_round`) and the recorded-rounds file
(`RoundRecord.to_round`) read the same record. The gate decides and keeps only its estimator:
it counts nothing.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, fields

from services.gateway.gate import (BUCKET_EDGES, NUM_BUCKETS, PRE_DRAFT_SKIPS, Calibration, CostModel, LengthChoice,
                                   Reason, bucket_label)
from services.gateway.rounds import Round
from services.gateway.values import finite_float, is_integer, short_repr

# The span attribute `spec_decode.gate_decision` and the metric names use these words.
DECISIONS = ("full", "truncated", "skipped_after_draft", "capped", "margin_skipped", "plain")


# The three pre-draft skips share the public word "margin_skipped" (the wire's counter
# `margin_skipped_rounds`); their reasons tell them apart.
_DECISION = {Reason.FULL: "full", Reason.NO_DRAFTER: "plain", Reason.DRAFTER_FAILED: "plain",
             Reason.NO_ROOM: "capped", Reason.BUDGET: "capped", Reason.REGIME: "plain",
             **{r: "margin_skipped" for r in PRE_DRAFT_SKIPS}}
# Rounds decided before the pre-draft gate was asked (it is asked in every other round).
_BEFORE_PRE_DRAFT_GATE = (Reason.NO_DRAFTER, Reason.NO_ROOM, Reason.REGIME)


def drafted_reason(drafted: int, choice: LengthChoice) -> Reason:
    """Why a round that drafted `drafted` tokens submitted `choice.k` of them: the gate cut
    below its cap (COST), the cap (the request's max_draft_tokens, max_tokens / max_seq_len,
    see `Scheduler._max_drafts`) cut the block (BUDGET), or nothing did (FULL)."""
    if choice.cut:
        return Reason.COST
    return Reason.BUDGET if choice.k < drafted else Reason.FULL


def _count(name: str, value: object) -> None:
    if not is_integer(value) or value < 0:
        raise ValueError(f"RoundRecord.{name}={short_repr(value)} must be an integer >= 0")


@dataclass(frozen=True)
class RoundRecord:
    """One round, as decided and as it went.

    reason: why it submitted what it did (`decision` is the public word for it).
    drafted: draft tokens produced (0: no draft). submitted: drafts sent to verify (k; 0 = a
    plain decode step). accepted: drafts the verifier accepted (the bonus token not counted).
    cost: the cost model (ms) the round is priced under (the generation's snapshot, or the
    replay's). confidence_logits: the drafter's confidence logits, one per drafted position;
    None without a confidence head or without a draft call. anchor_margin: the anchor's top1 -
    top2 logit, None when unknown. draft_ms, verify_ms, plain_ms: measured wall times (ms) of
    the draft call, the verify call (k > 0) and the decode call (k = 0); None when not measured
    or not made. choice: the gate's length decision with what it read and weighed
    (`LengthChoice`: survival, lambda, value per k), None when the round made none; asked: the
    drafts sent to verify before the verifier's step budget cut the block (None: not cut, so
    `submitted`); regime: when the gateway's model regime decided the round (more than one
    generation in flight: docs/gate.md §14), what it weighed, (generations in flight, plain
    tok/ms, draft tok/ms); None otherwise. lent_streak: the gate decided the round inside a
    losing streak its band lent it (docs/gate.md §6: a skip it did not learn itself; a probe
    on the band's schedule); a probe and its priced loss are in `choice`.

    Counts are stored as int (numpy integers accepted). Raises ValueError naming the field
    when a count is not an integer >= 0, accepted > submitted, submitted > drafted, submitted >
    len(confidence_logits), a reason that needs a draft has none (or one that forbids it has
    one), or a timing is not None or a finite number >= 0.
    """

    reason: Reason
    drafted: int
    submitted: int
    accepted: int
    cost: CostModel
    confidence_logits: tuple[float, ...] | None = None
    anchor_margin: float | None = None
    draft_ms: float | None = None
    verify_ms: float | None = None
    plain_ms: float | None = None
    choice: LengthChoice | None = None
    asked: int | None = None
    regime: tuple[int, float, float] | None = None
    lent_streak: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.reason, Reason):
            raise ValueError(f"RoundRecord.reason={short_repr(self.reason)} must be a Reason")
        for name in ("drafted", "submitted", "accepted"):
            _count(name, getattr(self, name))
            object.__setattr__(self, name, int(getattr(self, name)))  # numpy counts fold as plain ints
        if not self.accepted <= self.submitted <= self.drafted:
            raise ValueError(f"RoundRecord needs accepted={self.accepted} <= submitted={self.submitted}"
                             f" <= drafted={self.drafted}")
        if self.confidence_logits is not None and self.submitted > len(self.confidence_logits):
            raise ValueError(f"RoundRecord.submitted={self.submitted} exceeds "
                             f"{len(self.confidence_logits)} confidence logits")
        if (self.drafted > 0) != (self.reason in (Reason.FULL, Reason.BUDGET, Reason.COST)):
            raise ValueError(f"RoundRecord.reason={self.reason.value} does not fit drafted={self.drafted}")
        for name in ("draft_ms", "verify_ms", "plain_ms"):
            value = getattr(self, name)
            if value is not None and not (finite_float(value) is not None and value >= 0):
                raise ValueError(f"RoundRecord.{name}={short_repr(value)} must be None or a finite number >= 0")

    @property
    def decision(self) -> str:
        """The public word for `reason` (one of DECISIONS): a cut by the gate is "truncated",
        or "skipped_after_draft" when it cut to k = 0."""
        if self.reason is Reason.COST:
            return "skipped_after_draft" if self.submitted == 0 else "truncated"
        return _DECISION[self.reason]

    @property
    def committed(self) -> int:
        """Tokens the round committed to the verifier's cache: the accepted drafts plus one
        (the bonus token, or the plain step's token). Stop checks may stream fewer."""
        return self.accepted + 1

    @property
    def gate_saw_draft(self) -> bool:
        """The gate chose this round's length (it had drafts with confidences)."""
        return self.drafted > 0 and self.confidence_logits is not None

    @property
    def modelled_ms(self) -> float:
        """The round's price under `cost` (ms): cost(k) when verified, draft + plain when cut to
        0 after drafting, a plain step when nothing was drafted."""
        if self.submitted > 0:
            return self.cost.round_ms(self.submitted)
        return self.cost.skipped_after_draft_ms() if self.drafted else self.cost.plain_ms

    def to_round(self, workload: str) -> Round:
        """The round as a line of a recorded-rounds file (docs/gate.md), under `workload`.

        A round that drafted nothing is a line with no confidences (docs/gate.md §9): replay
        prices it as a plain step under every policy, and calibration reads its plain_ms.

        Raises ValueError when the round drafted without confidences (replay needs them) or the
        workload is not a usable label (see `rounds.check_workload`).
        """
        if self.confidence_logits is None and self.drafted:
            raise ValueError("a drafted round without confidence logits cannot be recorded")
        c = self.choice
        return Round(workload=workload, confidence_logits=self.confidence_logits or (), submitted=self.submitted,
                     accepted=self.accepted, anchor_margin=self.anchor_margin, draft_ms=self.draft_ms,
                     verify_ms=self.verify_ms, plain_ms=self.plain_ms,
                     survival=c.survival if c is not None and c.survival else None,
                     values=c.values if c is not None and c.values else None,
                     rate=c.rate if c is not None else None, probe_loss=c.probe_loss if c is not None else None,
                     lent_streak=True if self.lent_streak else None)

    def why(self) -> str:
        """One line: what the round submitted and why, with the decision's inputs (the line
        `dspark trace-report --rounds` prints from a round span's attributes)."""
        c = self.choice
        return explain(self.reason.value, self.submitted, self.drafted, self.accepted, self.asked,
                       c.survival if c else (), c.rate if c else None, c.values if c else (), self.regime,
                       c.probe_loss if c else None, self.lent_streak)


def _merge(mine: object, theirs: object) -> object:
    """Sum of two counters of the same field; lists add per bucket, flags are or-ed."""
    if isinstance(mine, list):
        return [a + b for a, b in zip(mine, theirs)]
    if isinstance(mine, bool):
        return mine or theirs
    return mine + theirs


@dataclass
class GateStats:
    """The gate's view of folded rounds (the `gate` part of the `Stats` RPC).

    rounds: rounds in which the pre-draft gate was asked (every round with a drafter and
    room to draft); margin_skipped_rounds: those it skipped. drafted_rounds, drafted: rounds
    whose length the gate chose, and their drafts (tokens). truncated (0 < k < max_n) and
    skipped_after_draft (k = 0 < max_n): the gate's cuts. verified_rounds, submitted, accepted:
    the rounds it chose that were verified, and their tokens. zero_accept_rounds and
    zero_accept_cost_ms: of those, the rounds with nothing accepted and their cost (ms) above a
    plain step. bucket_observed, bucket_matched: raw (undecayed) censored per-bucket counts.
    """

    rounds: int = 0
    drafted_rounds: int = 0
    verified_rounds: int = 0
    drafted: int = 0
    submitted: int = 0
    accepted: int = 0
    truncated: int = 0
    skipped_after_draft: int = 0
    margin_skipped_rounds: int = 0
    zero_accept_rounds: int = 0
    zero_accept_cost_ms: float = 0.0
    bucket_observed: list[int] = field(default_factory=lambda: [0] * NUM_BUCKETS)
    bucket_matched: list[int] = field(default_factory=lambda: [0] * NUM_BUCKETS)

    def add(self, r: RoundRecord) -> None:
        """Fold one round in. Positions 0..accepted-1 matched, position `accepted` missed when
        accepted < submitted, later ones are unknown and not counted (censored, as the gate learns)."""
        self.rounds += r.reason not in _BEFORE_PRE_DRAFT_GATE
        self.margin_skipped_rounds += r.reason in PRE_DRAFT_SKIPS
        if not r.gate_saw_draft:
            return
        self.drafted_rounds += 1
        self.drafted += len(r.confidence_logits)
        self.truncated += r.decision == "truncated"
        self.skipped_after_draft += r.decision == "skipped_after_draft"
        if r.submitted == 0:
            return
        self.verified_rounds += 1
        self.submitted += r.submitted
        self.accepted += r.accepted
        if r.accepted == 0:
            self.zero_accept_rounds += 1
            self.zero_accept_cost_ms += r.cost.round_ms(r.submitted) - r.cost.plain_ms
        for pos, c in enumerate(r.confidence_logits[: min(r.accepted + 1, r.submitted)]):
            b = bisect.bisect_right(BUCKET_EDGES, c)
            self.bucket_observed[b] += 1
            self.bucket_matched[b] += pos < r.accepted

    def merge(self, other: GateStats) -> None:
        """Add `other`'s counters into these (totals). The caller serialises access."""
        for f in fields(self):
            setattr(self, f.name, _merge(getattr(self, f.name), getattr(other, f.name)))

    def bucket_match_rates(self) -> list[float | None]:
        """Pooled P(match | bucket) from raw counts; None for a bucket never observed."""
        return [m / o if o else None for m, o in zip(self.bucket_matched, self.bucket_observed)]

    def calibration(self, max_weight: float = 10.0) -> Calibration:
        """Frozen warm-start snapshot for a `Gate`: each bucket's counts scaled down to at most
        `max_weight` observations, so process-wide history cannot outweigh a new generation's own
        rounds for longer than a few decays. Raises ValueError unless max_weight is a finite
        number > 0."""
        weight = finite_float(max_weight)
        if weight is None or weight <= 0:
            raise ValueError(f"max_weight={short_repr(max_weight)} must be a finite number > 0")
        scale = [min(1.0, weight / o) if o else 0.0 for o in self.bucket_observed]
        return Calibration(tuple(m * s for m, s in zip(self.bucket_matched, scale)),
                           tuple(o * s for o, s in zip(self.bucket_observed, scale)))

    def to_dict(self) -> dict:
        """Plain-JSON view: the counters, acceptance_rate (accepted / submitted, None without
        submissions), mean_acceptance_length (tokens per verified round, bonus included; None
        without one) and per bucket its range, counts and pooled match rate."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("bucket_")}
        out["acceptance_rate"] = self.accepted / self.submitted if self.submitted else None
        out["mean_acceptance_length"] = (
            (self.accepted + self.verified_rounds) / self.verified_rounds if self.verified_rounds else None)
        out["buckets"] = [
            {"range": bucket_label(i), "observed": o, "matched": m, "match_rate": rate}
            for i, (o, m, rate) in enumerate(zip(self.bucket_observed, self.bucket_matched, self.bucket_match_rates()))
        ]
        return out


# Keys of the speculation counters, in the order of the span attributes and the Stats RPC.
SPECULATION_KEYS = ("rounds", "drafted", "submitted", "accepted", "verify_rounds", "margin_skipped_rounds",
                    "truncated_rounds", "skipped_after_draft", "plain_rounds", "drafter_failovers", "drafter_failed")


@dataclass
class RoundStats:
    """Counters folded from rounds: one generation's, the process's, or one replayed policy's.

    Every round: rounds, drafted (tokens drafted), submitted, accepted (tokens), verify_rounds
    (k > 0), plain_rounds (k = 0), margin_skipped_rounds, truncated_rounds, skipped_after_draft,
    tokens (committed: accepted + 1 per round), time_ms (the rounds' modelled cost, ms).
    `gate`: the gate's view of the same rounds. drafter_failovers and drafter_failed are not
    round facts: the scheduler's drafter failover sets them on a generation's stats; nor are
    forced_rounds and forced_tokens (jump-forward's rounds, recorded as the rounds without
    drafts they replace), nor unstreamed_accepted (accepted drafts a stop inside their block
    cut from the completion; the scheduler counts them as it streams).
    """

    rounds: int = 0
    drafted: int = 0
    submitted: int = 0
    accepted: int = 0
    verify_rounds: int = 0
    plain_rounds: int = 0
    margin_skipped_rounds: int = 0
    truncated_rounds: int = 0
    skipped_after_draft: int = 0
    tokens: int = 0
    time_ms: float = 0.0
    drafter_failovers: int = 0   # new drafter sessions re-primed after a drafter failed
    drafter_failed: bool = False  # the generation went on with plain decode
    forced_rounds: int = 0  # jump-forward: rounds that verified forced tokens (docs/structured.md §6)
    forced_tokens: int = 0  # forced tokens those rounds committed (not in `tokens`: the record counts the plain step)
    # Accepted drafts after a stop condition inside their round's block: the verifier accepted
    # them (`accepted` counts them, as the gate learns from them), the client never saw them.
    unstreamed_accepted: int = 0
    gate: GateStats = field(default_factory=GateStats)

    def add(self, r: RoundRecord) -> None:
        """Fold one round in (the gate's view too)."""
        decision = r.decision
        self.rounds += 1
        self.drafted += r.drafted
        self.submitted += r.submitted
        self.accepted += r.accepted
        self.verify_rounds += r.submitted > 0
        self.plain_rounds += r.submitted == 0
        self.margin_skipped_rounds += decision == "margin_skipped"
        self.truncated_rounds += decision == "truncated"
        self.skipped_after_draft += decision == "skipped_after_draft"
        self.tokens += r.committed
        self.time_ms += r.modelled_ms
        self.gate.add(r)

    def merge(self, other: RoundStats) -> None:
        """Add `other`'s counters into these (totals; drafter_failed is or-ed). The caller
        serialises access."""
        for f in fields(self):
            if f.name == "gate":
                self.gate.merge(other.gate)
            else:
                setattr(self, f.name, _merge(getattr(self, f.name), getattr(other, f.name)))

    @property
    def acceptance_rate(self) -> float:
        """accepted / submitted (0 when nothing was submitted)."""
        return self.accepted / self.submitted if self.submitted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify round, the bonus token included (0 without verify rounds)."""
        return (self.accepted + self.verify_rounds) / self.verify_rounds if self.verify_rounds else 0.0

    @property
    def tok_s(self) -> float:
        """Committed tokens per second of modelled time (0 without time)."""
        return 1000.0 * self.tokens / self.time_ms if self.time_ms else 0.0

    def speculation_dict(self) -> dict:
        """The speculation counters (SPECULATION_KEYS), acceptance_rate and mean_acceptance_length:
        the `spec_decode.*` attributes of a generation span and the Stats RPC's `speculation`."""
        out = {k: getattr(self, k) for k in SPECULATION_KEYS}
        out.update(acceptance_rate=self.acceptance_rate, mean_acceptance_length=self.mean_acceptance_length)
        return out

    def policy_dict(self) -> dict:
        """A replayed policy's totals: rounds, tokens, time_ms, the gate's counters and tok_s."""
        g = self.gate
        return {"rounds": self.rounds, "tokens": self.tokens, "time_ms": self.time_ms,
                "submitted": self.submitted, "accepted": self.accepted, "truncated": self.truncated_rounds,
                "skipped_after_draft": self.skipped_after_draft, "margin_skipped_rounds": self.margin_skipped_rounds,
                "zero_accept_rounds": g.zero_accept_rounds, "zero_accept_cost_ms": g.zero_accept_cost_ms,
                "tok_s": self.tok_s}


def explain(reason: str, submitted: int, drafted: int, accepted: int, asked: int | None,
            survival, rate: float | None, values, regime=None, probe_loss: float | None = None,
            lent_streak: bool = False) -> str:
    """Why a round submitted what it did, in one line (`RoundRecord.why`, `dspark trace-report
    --rounds`): the drafts submitted of those drafted and the reason, whether it was decided in
    a losing streak its band lent (`lent_streak`), a probe and its priced loss (`probe_loss`,
    tokens; None: not a probe), the model regime's rates when it decided (`regime`: in flight,
    plain and draft tok/ms), the step budget's cut, lambda, each position's survival and
    value(k) per k, and what was accepted."""
    parts = [f"submitted {submitted} of {drafted} ({reason})"]
    if lent_streak:
        parts.append("in a losing streak lent by its band")
    if probe_loss is not None:
        parts.append(f"probe priced {probe_loss:.3g} tokens")
    if regime:
        n, plain, draft = regime
        parts.append(f"regime at {int(n)} in flight: draft {draft:.4g} vs plain {plain:.4g} tok/ms")
    if asked is not None and asked != submitted:
        parts.append(f"the step budget cut {asked} to {submitted}")
    if rate is not None:
        parts.append(f"lambda {rate:.4g} tok/ms")
    if survival:
        parts.append("S " + " ".join(f"{v:.2f}" for v in survival))
    if values:
        parts.append("value(k) " + " ".join(f"{k}:{v:+.3f}" for k, v in enumerate(values)))
    parts.append(f"accepted {accepted}")
    return "; ".join(parts)
