"""The gate's costs and the drafter's confidence reliability, from a report's rounds
(`dspark trace-report` / `dspark calibrate`; the rounds: `services.analysis.breakdown`).

Owns the least-squares cost fit and the censored reliability table; it reads the gate's bucket
edges from `services.gateway.gate` and never changes the gate: it prints the variables to set.

Costs fitted as the gate uses them (`services.gateway.costs`, docs/gate.md §2), from the
gateway's own timings of the calls: verify(k) = base + slope·k by least squares over the
verify rounds' (k = drafts submitted, `spec_decode.verify_ms`); draft ms = mean
`spec_decode.draft_ms`; plain ms = mean `spec_decode.verify_ms` of the rounds with k = 0
(a single-token decode).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from services.analysis.breakdown import RoundBreakdown
from services.gateway.gate import ENV_VARS, NUM_BUCKETS, bucket_index, bucket_label
from services.gateway.values import MAX_COST_MS

GATE_ENV = {f: ENV_VARS[f] for f in ("draft_ms", "verify_base_ms", "verify_slope_ms", "plain_ms")}
PLAIN_MS_FLOOR = 1e-3  # the gate's lower bound on plain_ms (docs/gate.md §8)


@dataclass(frozen=True)
class CostFit:
    """Fitted gate costs (ms) with their sample counts; base/slope None without two distinct k."""

    verify_base_ms: float | None
    verify_slope_ms: float | None
    draft_ms: float | None
    plain_ms: float | None
    verify_samples: int
    distinct_k: int
    draft_samples: int
    plain_samples: int
    verify_rms_ms: float | None

    def missing(self) -> list[str]:
        """What keeps the fit from giving all four costs, in words, each naming the variables it
        leaves unset (empty when complete)."""
        out = []
        if self.verify_base_ms is None:
            out.append(f"timed verify rounds over at least two distinct k (have {self.verify_samples} timed "
                       f"verify rounds, {self.distinct_k} distinct k) for {GATE_ENV['verify_base_ms']} "
                       f"and {GATE_ENV['verify_slope_ms']}")
        if self.draft_ms is None:
            out.append(f"rounds with a timed draft for {GATE_ENV['draft_ms']}")
        if self.plain_ms is None:
            out.append(f"timed rounds with k = 0 (plain decode; an always-k recording has none) for {GATE_ENV['plain_ms']}")
        return out


@dataclass(frozen=True)
class BucketStat:
    """Confidence bucket: censored observations (docs/gate.md §2), matches, mean logit."""

    index: int
    label: str
    observed: int
    matched: int
    mean_logit: float | None

    @property
    def rate(self) -> float | None:
        return self.matched / self.observed if self.observed else None


# ---------------------------------------------------------------------------- costs
def fit_costs(rounds: Iterable[RoundBreakdown]) -> CostFit:
    """Least-squares verify(k) = base + slope·k over verify rounds; means of draft and plain ms."""
    ks, ms, drafts, plains = [], [], [], []
    for r in rounds:
        if r.draft_ms is not None:
            drafts.append(r.draft_ms)
        if r.verify_ms is None:
            continue
        if r.submitted > 0:
            ks.append(r.submitted)
            ms.append(r.verify_ms)
        else:
            plains.append(r.verify_ms)
    base = slope = rms = None
    distinct = len(set(ks))
    # Timings near the float limit overflow to inf (then clamped by `gate_env_lines`), quietly.
    with np.errstate(over="ignore", invalid="ignore"):
        if distinct >= 2:
            x, y = np.asarray(ks, dtype=float), np.asarray(ms, dtype=float)
            design = np.stack([np.ones_like(x), x], axis=1)  # [n, 2]
            (base, slope), *_ = np.linalg.lstsq(design, y, rcond=None)
            base, slope = float(base), float(slope)
            rms = float(np.sqrt(np.mean((y - (base + slope * x)) ** 2)))
        draft = float(np.mean(drafts)) if drafts else None
        plain = float(np.mean(plains)) if plains else None
    return CostFit(base, slope, draft, plain, len(ks), distinct, len(drafts), len(plains), rms)


def gate_env_lines(fit: CostFit) -> tuple[list[str], list[str]]:
    """(`DSPARK_GATE_*=value` lines for the costs the fit has, notes on clamped values).

    Values are clamped into what `GateConfig` accepts (docs/gate.md §8): each cost in
    [0, MAX_COST_MS], plain_ms >= 0.001, so the lines can be used as they are.
    """
    lines, notes = [], []
    for name, env in GATE_ENV.items():
        value = getattr(fit, name)
        if value is None:
            continue
        low = PLAIN_MS_FLOOR if name == "plain_ms" else 0.0
        if value < low:
            notes.append(f"{env}: fitted {value:.3f} ms is below {low:g}; clamped")
            value = low
        if not value <= MAX_COST_MS:  # also NaN / inf, from timings near the float limit
            notes.append(f"{env}: fitted {value:.6g} ms is above the gate's {MAX_COST_MS:g} ms; clamped")
            value = MAX_COST_MS
        lines.append(f"{env}={value:.3f}")
    return lines, notes


# ---------------------------------------------------------------------------- calibration
def reliability(rounds: Iterable[RoundBreakdown]) -> list[BucketStat]:
    """Per confidence bucket (the gate's edges): censored match statistics of verified drafts.

    Of a round that submitted k drafts and had a accepted, positions 0..a-1 are matches and
    position a is a miss when a < k; positions after a (and past k) were never decided, so
    they are not counted (censoring, docs/architecture.md §5; the same rule as `Gate.observe`).
    """
    observed, matched = [0] * NUM_BUCKETS, [0] * NUM_BUCKETS
    logit_sum = [0.0] * NUM_BUCKETS
    for r in rounds:
        if not r.confidence_logits or r.submitted <= 0:
            continue
        for pos in range(min(r.accepted + 1, r.submitted)):
            c = r.confidence_logits[pos]
            b = bucket_index(c)
            observed[b] += 1
            matched[b] += pos < r.accepted
            logit_sum[b] += c
    return [BucketStat(b, bucket_label(b), observed[b], matched[b],
                       logit_sum[b] / observed[b] if observed[b] else None) for b in range(NUM_BUCKETS)]


def causal_ece(rounds: Iterable, gate) -> tuple[float | None, list[dict]]:
    """Expected calibration error of a gate's bucket estimates on recorded rounds, replayed causally.

    `rounds`: `services.gateway.rounds.Round`s (confidence_logits, submitted, accepted) in
    order; `gate`: anything with `estimates() -> sequence of NUM_BUCKETS floats` and
    `observe(confidence_logits, submitted, accepted)`, e.g. a fresh `Gate`. Each verified
    round's observed positions (0..accepted, censored at the first miss) are scored with the
    estimates the gate held BEFORE it observed that round, then the round is observed. Returns
    (ECE, per-bucket rows): ECE = sum_b n_b |mean estimate_b - realised match rate_b| / sum_b n_b
    (None without observations); each row has range, observed (n_b), mean_estimate and
    match_rate (None when n_b = 0). Raises ValueError as `gate.observe` does.
    """
    est_sum, hits, count = [0.0] * NUM_BUCKETS, [0] * NUM_BUCKETS, [0] * NUM_BUCKETS
    for r in rounds:
        if r.submitted > 0:
            est = gate.estimates()
            for pos, c in enumerate(r.confidence_logits[: min(r.accepted + 1, r.submitted)]):
                b = bucket_index(c)
                est_sum[b] += est[b]
                hits[b] += pos < r.accepted
                count[b] += 1
        gate.observe(r.confidence_logits, r.submitted, r.accepted)
    rows = [{"range": bucket_label(b), "observed": n, "mean_estimate": s / n if n else None,
             "match_rate": h / n if n else None} for b, (s, h, n) in enumerate(zip(est_sum, hits, count))]
    means = [s / n if n else None for s, n in zip(est_sum, count)]
    ece = expected_calibration_error(means, hits, count) if sum(count) else None
    return ece, rows


def expected_calibration_error(estimates: Sequence[float | None], matched: Sequence[int],
                               observed: Sequence[int]) -> float:
    """Expected calibration error of per-bucket estimates against realised matches (unitless, in [0, 1]).

    ECE = sum_b (observed_b / N) * |estimates_b - matched_b / observed_b|, N = sum_b observed_b:
    the observation-weighted mean gap between what was estimated and what happened. All three
    sequences have one entry per bucket [B]; `estimates_b` is the (mean) P(match) held for the
    bucket's observations, None allowed where observed_b = 0. Counts are censored observations
    (positions 0..accepted, docs/gate.md §2).
    Raises ValueError naming the value when the lengths differ, a count is negative or
    matched_b > observed_b, an estimate of an observed bucket is not in [0, 1], or nothing was
    observed.
    """
    if not len(estimates) == len(matched) == len(observed):
        raise ValueError(f"ECE needs one entry per bucket: {len(estimates)} estimates, {len(matched)} matched, "
                         f"{len(observed)} observed")
    total = 0
    for b, (m, o) in enumerate(zip(matched, observed)):
        if not 0 <= m <= o:
            raise ValueError(f"bucket {b}: need 0 <= matched={m!r} <= observed={o!r}")
        total += o
    if total == 0:
        raise ValueError("ECE of zero observations is undefined")
    error = 0.0
    for b, (e, m, o) in enumerate(zip(estimates, matched, observed)):
        if o == 0:
            continue
        if e is None or not (isinstance(e, (int, float)) and math.isfinite(e) and 0.0 <= e <= 1.0):
            raise ValueError(f"bucket {b}: estimate={e!r} must be a number in [0, 1]")
        error += o / total * abs(e - m / o)
    return error
