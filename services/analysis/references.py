"""Replay building blocks and the reference policies the gate is measured against (docs/gate.md §10).

This module owns turning one policy decision on a recorded round into a `RoundRecord`, the
causal loop that drives a `Gate` over recorded rounds, and the three reference policies:

- best fixed k in hindsight: the k in 0..K (K = the largest recorded `submitted`) with the
  highest tok/s over the workload; k = 0 drafts nothing (every round a plain step);
- calibrated gate in hindsight: a `Gate` whose estimates are the workload's true per-bucket
  match rates and true hazards per (position class, bucket), measured over all its rounds, and
  which learns nothing (`HindsightGate`); it
  makes every decision through the live gate's rule, so it is the limit of what the confidence
  signal allows that rule;
- per-round oracle: knows each round's accepted count a, submits exactly k = a drafts (all of
  them match), or drafts nothing when that round is better spent on a plain step.

What a recorded round can tell (the same rule for every policy): a round recorded with
submitted = s says accepted = a <= s; positions past s were never verified, so a policy may
submit at most s drafts, and submitting n <= s gets min(a, n) accepted. With a = s the true
accepted count of a longer block is unknown (censored), so the oracle counts a, never more.
The recorded rounds in tests/data are always-k rounds (s = the full block), so the limit
never binds there.

It also keeps the decision rule for independent positions (`survival_of`, `expected_tokens`,
`decide_length`, `round_rate`): the product of per-position marginals the gate priced with before
its conditional estimate (docs/gate.md §4), a reference the tests and analyses compare against.

It must not read files, print, or make live decisions: it replays what was recorded.
"""

from __future__ import annotations

import bisect
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from services.gateway.decision import DEFAULT_WIN_FACTOR, _check_count, _expected_totals, length_decision
from services.gateway.gate import BUCKET_EDGES, NUM_BUCKETS, CostModel, Gate, GateConfig, LengthChoice
from services.gateway.record import Reason, RoundRecord, RoundStats, drafted_reason
from services.gateway.rounds import Round
from services.gateway.values import short_repr

REFERENCES = ("best-fixed-k", "calibrated-hindsight", "oracle")
_MAX_ORACLE_ITERATIONS = 1000  # Dinkelbach converges in a handful; this only bounds a float tie cycle


def _check_probs(match_probs: Sequence[float], n: int) -> None:
    for pos, p in enumerate(match_probs[:n]):
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= p <= 1.0:
            raise ValueError(f"match probability [{pos}]={short_repr(p)} outside [0, 1]")


def survival_of(match_probs: Sequence[float]) -> tuple[float, ...]:
    """The survival curve of independent positions: S_j = prod_{i<=j} p_i (floats in [0, 1]).
    Only right where a position's acceptance does not depend on the earlier ones. Trusted inputs."""
    out, s = [], 1.0
    for p in match_probs:
        s *= p
        out.append(s)
    return tuple(out)


def expected_tokens(match_probs: Sequence[float], n: int) -> float:
    """E[tokens(n)] = 1 + sum_{i<n} prod_{j<=i} p_j for independent positions (tokens; the 1 is
    the bonus or plain token). Raises ValueError unless n is an integer in [0, len(match_probs)]
    and match_probs[:n] are numbers in [0, 1]."""
    n = _check_count("n", n, len(match_probs))
    _check_probs(match_probs, n)
    return _expected_totals(survival_of(match_probs[:n]), n)[n]


def round_rate(cost: CostModel, match_probs: Sequence[float], n: int) -> float:
    """E[tokens(n)] / cost.round_ms(n) for independent positions, tokens per ms. Raises as
    `expected_tokens`."""
    return expected_tokens(match_probs, n) / cost.round_ms(n)


def decide_length(match_probs: Sequence[float], max_n: int, cost: CostModel,
                  win_factor: float = DEFAULT_WIN_FACTOR, floor: int = 0, rate: float | None = None) -> int:
    """The gate's length rule (`decision.length_decision`) on independent positions: the survival
    is `survival_of(match_probs)`. Raises ValueError as `length_decision`, and on a probability
    outside [0, 1] (NaN included) among match_probs[:max_n]."""
    max_n = _check_count("max_n", max_n, len(match_probs))
    _check_probs(match_probs, max_n)
    return length_decision(survival_of(match_probs[:max_n]), max_n, cost, win_factor, floor, rate)[0]


def replayed_round(rec: Round, n: int | None, cost: CostModel, skipped: Reason = Reason.NO_DRAFTER) -> RoundRecord:
    """The record of a policy's replay of `rec`: n=None drafts nothing (`skipped` says why),
    else the recorded draft with n of its drafts submitted (accepted = min(recorded, n)).

    Raises ValueError when n is outside [0, recorded submitted]: only those were verified.
    """
    if n is None:
        return RoundRecord(skipped, 0, 0, 0, cost, anchor_margin=rec.anchor_margin)
    if not 0 <= n <= rec.submitted:
        raise ValueError(f"policy submitted n={n}, outside [0, recorded submitted={rec.submitted}]")
    drafted = len(rec.confidence_logits)
    return RoundRecord(drafted_reason(drafted, LengthChoice(n, rec.submitted)), drafted, n, min(rec.accepted, n),
                       cost, confidence_logits=rec.confidence_logits, anchor_margin=rec.anchor_margin)


def observed_positions(rec: Round) -> range:
    """Draft positions whose outcome the record shows (censored): 0..accepted, but not past submitted."""
    return range(min(rec.accepted + 1, rec.submitted))


@dataclass
class EstimateTally:
    """Per confidence bucket: observed positions, matches, and the sum of the estimates a gate
    held for them when it decided (P(match), unitless). Feeds the ECE (docs/gate.md §10)."""

    observed: list[int] = field(default_factory=lambda: [0] * NUM_BUCKETS)
    matched: list[int] = field(default_factory=lambda: [0] * NUM_BUCKETS)
    estimate_sum: list[float] = field(default_factory=lambda: [0.0] * NUM_BUCKETS)

    def add(self, rec: Round, estimates: Sequence[float]) -> None:
        """Count `rec`'s recorded observed positions against the per-bucket `estimates` [NUM_BUCKETS]."""
        for pos in observed_positions(rec):
            b = bisect.bisect_right(BUCKET_EDGES, rec.confidence_logits[pos])
            self.observed[b] += 1
            self.matched[b] += pos < rec.accepted
            self.estimate_sum[b] += float(estimates[b])

    def merge(self, other: EstimateTally) -> None:
        """Add `other`'s per-bucket counts and sums into these."""
        for name in ("observed", "matched", "estimate_sum"):
            setattr(self, name, [a + b for a, b in zip(getattr(self, name), getattr(other, name))])

    def mean_estimates(self) -> list[float | None]:
        """Mean estimate per bucket over its observed positions; None for a bucket never observed."""
        return [s / o if o else None for s, o in zip(self.estimate_sum, self.observed)]


def replay_through_gate(rounds: Sequence[Round], gate: Gate, tally: EstimateTally | None = None) -> RoundStats:
    """Causal replay of `rounds` through `gate`: pre_draft, choose (capped at the recorded
    submitted), observe what that choice would have verified. `tally` (optional) collects the
    estimates the gate held at each round against every recorded observed position, whether
    or not the gate drafted that round (a suspended gate still holds estimates).
    """
    cost, out = gate.cost, RoundStats()
    for rec in rounds:
        if tally is not None and rec.confidence_logits:
            tally.add(rec, gate.estimates())
        if not rec.confidence_logits:
            out.add(replayed_round(rec, None, cost))
        elif (skip := gate.pre_draft(rec.anchor_margin)) is not None:
            out.add(replayed_round(rec, None, cost, skip))
        else:
            n = gate.choose(rec.confidence_logits, rec.submitted).k
            gate.observe(rec.confidence_logits, n, min(rec.accepted, n))
            out.add(replayed_round(rec, n, cost))
    return out


# ---------------------------------------------------------------------------- best fixed k
def replay_fixed_k(rounds: Sequence[Round], cost: CostModel, k: int) -> RoundStats:
    """Every drafted round submits min(k, recorded submitted); k = 0 drafts nothing (plain steps).

    Raises ValueError unless k is an integer >= 0.
    """
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise ValueError(f"k={short_repr(k)} must be an integer >= 0")
    out = RoundStats()
    for rec in rounds:
        n = None if k == 0 or not rec.confidence_logits else min(int(k), rec.submitted)
        out.add(replayed_round(rec, n, cost))
    return out


def best_fixed_k(rounds: Sequence[Round], cost: CostModel) -> tuple[int, RoundStats]:
    """(k, its totals): the k in 0..max recorded submitted with the highest tok/s; ties go to
    the lowest k. Raises ValueError on no rounds."""
    if not rounds:
        raise ValueError("best fixed k needs at least one round")
    top = max(r.submitted for r in rounds)
    results = [replay_fixed_k(rounds, cost, k) for k in range(top + 1)]
    best = max(range(top + 1), key=lambda k: (results[k].tok_s, -k))
    return best, results[best]


# ---------------------------------------------------------------------------- calibrated in hindsight
@dataclass(frozen=True)
class BucketRates:
    """A workload's true per-bucket match rates under censoring (positions 0..accepted observed,
    `accepted` a miss when accepted < submitted). `rates[b]` = matched/observed; a bucket never
    observed takes the workload's pooled rate (1.0 when nothing was observed at all)."""

    rates: tuple[float, ...]
    observed: tuple[int, ...]
    matched: tuple[int, ...]


def hindsight_rates(rounds: Sequence[Round]) -> BucketRates:
    """The true per-bucket match rates of `rounds` (see BucketRates)."""
    tally = EstimateTally()
    for rec in rounds:
        tally.add(rec, [0.0] * NUM_BUCKETS)
    total_obs, total_hit = sum(tally.observed), sum(tally.matched)
    # A bucket the workload never shows at a decided position only ever follows a miss, where
    # its value hardly moves a decision; the pooled rate is the least committal stand-in.
    pooled = total_hit / total_obs if total_obs else 1.0
    rates = tuple(m / o if o else pooled for m, o in zip(tally.matched, tally.observed))
    return BucketRates(rates, tuple(tally.observed), tuple(tally.matched))


def hindsight_hazards(rounds: Sequence[Round], classes: int) -> tuple[tuple[float, ...], ...]:
    """The true hazards of `rounds` per position class (class of position j = min(j, classes -
    1)) and bucket: accepted / reached over the censored observed positions, `classes` tuples
    of NUM_BUCKETS floats; a cell never reached takes its bucket's pooled rate (hindsight_rates)."""
    pooled = hindsight_rates(rounds).rates
    matched = [[0] * NUM_BUCKETS for _ in range(classes)]
    observed = [[0] * NUM_BUCKETS for _ in range(classes)]
    for rec in rounds:
        for pos in observed_positions(rec):
            c, b = min(pos, classes - 1), bisect.bisect_right(BUCKET_EDGES, rec.confidence_logits[pos])
            observed[c][b] += 1
            matched[c][b] += pos < rec.accepted
    return tuple(tuple(m / o if o else pooled[b] for b, (m, o) in enumerate(zip(m_row, o_row)))
                 for m_row, o_row in zip(matched, observed))


def _checked_rates(rates: Sequence[float], name: str) -> tuple[float, ...]:
    values = tuple(float(r) for r in rates)
    if len(values) != NUM_BUCKETS:
        raise ValueError(f"{name}={short_repr(rates)}: need {NUM_BUCKETS} buckets, got {len(values)}")
    for b, r in enumerate(values):
        if not 0.0 <= r <= 1.0:
            raise ValueError(f"{name}[{b}]={short_repr(r)} must be in [0, 1]")
    return values


class HindsightGate(Gate):
    """A `Gate` that knows the true match rates and learns nothing.

    `estimates()` returns the fixed `rates` [NUM_BUCKETS] (P(match), each in [0, 1]);
    `hazards()` returns the fixed `hazards` (one tuple of NUM_BUCKETS rates per position class,
    class of position j = min(j, len(hazards) - 1)), or `rates` at every position when None.
    `learn` (the estimator update) does nothing; `observe` still keeps the gate's long-run
    rate and pre-draft statistics, so every decision runs through the live gate's own rule. Raises
    ValueError naming the value when `rates` or a hazard row has the wrong length or a rate
    outside [0, 1], or `hazards` is empty.
    """

    def __init__(self, config: GateConfig, rates: Sequence[float],
                 hazards: Sequence[Sequence[float]] | None = None) -> None:
        super().__init__(config)
        self._rates = _checked_rates(rates, "rates")
        rows = (self._rates,) if hazards is None else tuple(
            _checked_rates(row, f"hazards[{c}]") for c, row in enumerate(hazards))
        if not rows:
            raise ValueError("hazards must hold at least one position class")
        self._hazards = rows

    def estimates(self) -> tuple[float, ...]:
        """The fixed per-bucket rates given at construction."""
        return self._rates

    def hazards(self) -> tuple[tuple[float, ...], ...]:
        """The fixed hazards given at construction (the rates at every position when none)."""
        return self._hazards

    def learn(self, confidence_logits: Sequence[float], submitted: int, accepted: int) -> None:
        """Nothing: the rates are already the truth."""


def gate_config_for_replay(config: GateConfig) -> GateConfig:
    """The gated policy's settings: the gate enabled, the fixed anchor-margin threshold off."""
    return replace(config, enabled=True, margin_threshold=0.0)


def replay_hindsight(rounds: Sequence[Round], config: GateConfig) -> tuple[BucketRates, RoundStats]:
    """(the true rates, the calibrated-in-hindsight gate's totals) over `rounds`: the gate is
    given the true hazards per (position class, bucket) at config.position_classes."""
    rates = hindsight_rates(rounds)
    hazards = hindsight_hazards(rounds, config.position_classes)
    return rates, replay_through_gate(rounds, HindsightGate(gate_config_for_replay(config), rates.rates, hazards))


# ---------------------------------------------------------------------------- per-round oracle
def oracle_lengths(rounds: Sequence[Round], cost: CostModel) -> list[int | None]:
    """Per round: k = recorded accepted (>= 1), or None (draft nothing, a plain step).

    The set of drafted rounds maximises total tokens / total ms, not each round's own rate: a
    round whose rate beats plain but not the workload's best rate lowers the total. It is found
    exactly by Dinkelbach's iteration: with lam the current rate, draft a round iff (a + 1) -
    lam * cost(a) > 1 - lam * plain_ms; recompute lam; stop when the set no longer changes.
    Rounds without confidences, or with a = 0, are plain steps.
    """
    spec = [replayed_round(r, r.accepted, cost) if r.confidence_logits and r.accepted else None for r in rounds]
    plain = [replayed_round(r, None, cost) for r in rounds]
    gain = np.array([s.committed - p.committed if s else 0.0 for s, p in zip(spec, plain)])  # [R] tokens
    extra = np.array([s.modelled_ms - p.modelled_ms if s else 0.0 for s, p in zip(spec, plain)])  # [R] ms
    possible = np.array([s is not None for s in spec])  # [R]
    base_tokens, base_ms = float(sum(p.committed for p in plain)), float(sum(p.modelled_ms for p in plain))
    chosen = np.zeros(len(rounds), dtype=bool)
    for _ in range(_MAX_ORACLE_ITERATIONS):
        lam = (base_tokens + gain[chosen].sum()) / (base_ms + extra[chosen].sum())  # tokens per ms
        nxt = possible & (gain - lam * extra > 0)
        if np.array_equal(nxt, chosen):
            break
        chosen = nxt
    return [r.accepted if c else None for r, c in zip(rounds, chosen)]


def replay_oracle(rounds: Sequence[Round], cost: CostModel) -> RoundStats:
    """The per-round oracle's totals (see oracle_lengths); it never submits a draft that misses."""
    out = RoundStats()
    for rec, n in zip(rounds, oracle_lengths(rounds, cost)):
        out.add(replayed_round(rec, n, cost))
    return out


# ---------------------------------------------------------------------------- one workload
@dataclass
class References:
    """One workload's reference results: best fixed k (and its k), the calibrated gate in
    hindsight (and the true rates it was given), the per-round oracle. In the overall row
    best_k is None when the workloads' k differ, and rates is None (each has its own)."""

    best_k: int | None
    results: dict[str, RoundStats]
    rates: BucketRates | None

    def merge(self, other: References) -> None:
        """Add `other`'s totals (the overall row: each workload keeps its own k and rates)."""
        for name, stats in other.results.items():
            self.results.setdefault(name, RoundStats()).merge(stats)


def reference_results(rounds: Sequence[Round], config: GateConfig) -> References:
    """The three reference policies over one workload's `rounds` under `config`'s costs."""
    cost = gate_config_for_replay(config).cost_model()
    k, fixed = best_fixed_k(rounds, cost)
    rates, hindsight = replay_hindsight(rounds, config)
    return References(k, {"best-fixed-k": fixed, "calibrated-hindsight": hindsight,
                          "oracle": replay_oracle(rounds, cost)}, rates)


def headline(gated: float, always: float, calibrated: float, oracle: float) -> dict[str, float | None]:
    """The gate's headline figures from tok/s values.

    calibrated_gain: calibrated / always - 1 (the room the confidence signal leaves).
    of_calibrated_gain: (gated - always) / (calibrated - always), None when calibrated <= always.
    of_oracle_gap: (gated - always) / (oracle - always), None when oracle <= always.
    """
    return {
        "calibrated_gain": calibrated / always - 1.0 if always else None,
        "of_calibrated_gain": (gated - always) / (calibrated - always) if calibrated > always else None,
        "of_oracle_gap": (gated - always) / (oracle - always) if oracle > always else None,
    }
