"""Replay recorded rounds through draft-length policies under the cost model (seed "Gating", causal replay).

Policies: plain (no draft), always-k (submit what was recorded), threshold (cut at the first
confidence below t, t chosen leave-one-workload-out), gated (the Gate, cold at the start of each
workload) and gated+margin (the Gate with the pre-draft margin gate; only when the rounds carry
anchor margins and the margin threshold is > 0).

A policy can submit at most the recorded `submitted` length, because only those positions were
verified; submitting n <= submitted gets accepted = min(recorded accepted, n). Round costs come
from the one CostModel: n > 0 costs cost(n) and yields accepted + 1 tokens; n = 0 after drafting
costs draft_ms + plain_ms and yields 1 token; a round without a draft (plain policy, margin
skip, or a recorded round with no confidences) costs plain_ms and yields 1 token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np

from services.gateway.gate import CostModel, Gate, GateConfig
from services.gateway.rounds import Round, RoundLog

POLICIES = ("plain", "always-k", "threshold", "gated", "gated+margin")


@dataclass
class PolicyResult:
    """Totals of one policy over some rounds: tokens, time (ms) and round counters."""

    rounds: int = 0
    tokens: int = 0
    time_ms: float = 0.0
    submitted: int = 0
    accepted: int = 0
    truncated: int = 0
    skipped_after_draft: int = 0
    margin_skipped_rounds: int = 0
    zero_accept_rounds: int = 0
    zero_accept_cost_ms: float = 0.0

    @property
    def tok_s(self) -> float:
        """Tokens per second (round-weighted: total tokens / total time)."""
        return 1000.0 * self.tokens / self.time_ms if self.time_ms else 0.0

    def add(self, other: PolicyResult) -> None:
        """Accumulate `other` into these totals."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def to_dict(self) -> dict:
        """Counters plus tok_s."""
        return {**asdict(self), "tok_s": self.tok_s}


def score_round(rec: Round, n: int | None, cost: CostModel, out: PolicyResult) -> None:
    """Add one replayed round to `out`. n=None: no draft (plain step); else n drafts submitted.

    Raises ValueError when n exceeds the recorded submitted length.
    """
    out.rounds += 1
    if n is None:
        out.tokens += 1
        out.time_ms += cost.plain_ms
        return
    if not 0 <= n <= rec.submitted:
        raise ValueError(f"policy submitted n={n}, outside [0, recorded submitted={rec.submitted}]")
    if n == 0:
        out.tokens += 1
        out.time_ms += cost.skipped_after_draft_ms()
        out.skipped_after_draft += int(rec.submitted > 0)
        return
    accepted = min(rec.accepted, n)
    out.tokens += accepted + 1
    out.time_ms += cost.round_ms(n)
    out.submitted += n
    out.accepted += accepted
    out.truncated += int(n < rec.submitted)
    if accepted == 0:
        out.zero_accept_rounds += 1
        out.zero_accept_cost_ms += cost.round_ms(n) - cost.plain_ms


def threshold_length(rec: Round, threshold: float) -> int:
    """Leading drafted positions with confidence >= threshold, capped at the recorded submitted."""
    n = 0
    for c in rec.confidence_logits[: rec.submitted]:
        if c < threshold:
            break
        n += 1
    return n


def replay_fixed(rounds: Sequence[Round], cost: CostModel, policy: str, threshold: float = -math.inf) -> PolicyResult:
    """plain, always-k or threshold (at `threshold`) over `rounds`. Raises ValueError on another policy."""
    out = PolicyResult()
    for rec in rounds:
        if policy == "plain" or not rec.confidence_logits:
            n = None
        elif policy == "always-k":
            n = rec.submitted
        elif policy == "threshold":
            n = threshold_length(rec, threshold)
        else:
            raise ValueError(f"unknown fixed policy {policy!r}")
        score_round(rec, n, cost, out)
    return out


def replay_gated(rounds: Sequence[Round], config: GateConfig, use_margin: bool) -> PolicyResult:
    """Causal replay through a cold Gate (enabled regardless of config.enabled).

    use_margin=False zeroes the margin threshold; True keeps config.margin_threshold.
    """
    gate_config = replace(config, enabled=True, margin_threshold=config.margin_threshold if use_margin else 0.0)
    gate, cost, out = Gate(gate_config), gate_config.cost_model(), PolicyResult()
    for rec in rounds:
        if not rec.confidence_logits:
            score_round(rec, None, cost, out)
            continue
        if not gate.should_draft(rec.anchor_margin):
            out.margin_skipped_rounds += 1
            score_round(rec, None, cost, out)
            continue
        n = gate.choose_length(rec.confidence_logits, rec.submitted)
        gate.observe(rec.confidence_logits, n, min(rec.accepted, n))
        score_round(rec, n, cost, out)
    return out


def _threshold_totals(
    rounds: Sequence[Round], candidates: np.ndarray, cost: CostModel
) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and time (ms) of the threshold policy at each candidate threshold, vectorised.

    Legend: T = candidate thresholds, R = rounds, K = drafted positions.
    """
    width = max([r.submitted for r in rounds] + [1])
    prefix_min = np.full((len(rounds), width), np.nan)  # [R, K]; NaN >= t is False: pads never count
    for i, r in enumerate(rounds):
        if r.submitted:
            prefix_min[i, : r.submitted] = np.minimum.accumulate(r.confidence_logits[: r.submitted])
    accepted = np.array([r.accepted for r in rounds])  # [R]
    drafted = np.array([bool(r.confidence_logits) for r in rounds])  # [R]
    n = (prefix_min[None, :, :] >= candidates[:, None, None]).sum(axis=2)  # [T, R]
    verified = n > 0
    tokens = np.where(verified, np.minimum(accepted, n) + 1, 1).sum(axis=1)  # [T]
    time = np.where(
        verified,
        cost.draft_ms + cost.verify_base_ms + cost.verify_slope_ms * n,
        np.where(drafted, cost.skipped_after_draft_ms(), cost.plain_ms),
    ).sum(axis=1)
    return tokens, time


def choose_threshold(rounds: Sequence[Round], cost: CostModel) -> float:
    """Confidence threshold maximising total tokens / total time over `rounds`.

    Candidates: every distinct prefix-minimum confidence (where a cut changes), plus -inf (never
    cut) and +inf (always cut to 0); ties go to the lowest threshold (the least cutting).
    """
    cuts = [np.minimum.accumulate(r.confidence_logits[: r.submitted]) for r in rounds if r.submitted]
    values = {float(c) for prefix_min in cuts for c in prefix_min}
    candidates = np.array(sorted(values | {-math.inf, math.inf}))
    tokens, time = _threshold_totals(rounds, candidates, cost)
    return float(candidates[int(np.argmax(tokens / time))])


def lowo_thresholds(groups: dict[str, list[Round]], cost: CostModel) -> dict[str, float]:
    """Leave-one-workload-out: per workload, the threshold chosen on all the other workloads."""
    return {
        name: choose_threshold([r for other, rs in groups.items() if other != name for r in rs], cost)
        for name in groups
    }


@dataclass
class WorkloadReport:
    """One workload's replay: recorded accept rate, results per policy, its LOWO threshold."""

    name: str
    rounds: int
    accept_rate: float | None
    results: dict[str, PolicyResult] = field(default_factory=dict)
    threshold: float | None = None


@dataclass
class ReplayReport:
    """All workloads plus the overall (round-weighted) totals per policy."""

    workloads: list[WorkloadReport]
    overall: WorkloadReport
    config: GateConfig
    source: str


def applicable_policies(log: RoundLog, config: GateConfig, wanted: Sequence[str] = POLICIES) -> tuple[str, ...]:
    """`wanted` minus threshold (needs >= 2 workloads) and gated+margin (needs margins and a threshold > 0)."""
    has_margins = any(r.anchor_margin is not None for r in log.rounds)
    skip = set()
    if len(log.workloads()) < 2:
        skip.add("threshold")
    if not (has_margins and config.margin_threshold > 0):
        skip.add("gated+margin")
    return tuple(p for p in wanted if p not in skip)


def replay_log(log: RoundLog, config: GateConfig, policies: Sequence[str] = POLICIES, source: str = "") -> ReplayReport:
    """Replay every workload of `log` through `policies` (plain and always-k always included).

    Raises ValueError on an unknown policy name.
    """
    unknown = set(policies) - set(POLICIES)
    if unknown:
        raise ValueError(f"unknown policies {sorted(unknown)}; known: {', '.join(POLICIES)}")
    cost, groups = config.cost_model(), log.workloads()
    extra = [p for p in policies if p not in ("plain", "always-k")]
    chosen = applicable_policies(log, config, ["plain", "always-k", *extra])
    thresholds = lowo_thresholds(groups, cost) if "threshold" in chosen else {}
    overall = WorkloadReport("overall", 0, None, {p: PolicyResult() for p in chosen})
    reports = []
    for name, rounds in groups.items():
        submitted = sum(r.submitted for r in rounds)
        report = WorkloadReport(name, len(rounds), sum(r.accepted for r in rounds) / submitted if submitted else None)
        report.threshold = thresholds.get(name)
        for policy in chosen:
            if policy.startswith("gated"):
                report.results[policy] = replay_gated(rounds, config, use_margin=policy == "gated+margin")
            else:
                report.results[policy] = replay_fixed(rounds, cost, policy, thresholds.get(name, -math.inf))
            overall.results[policy].add(report.results[policy])
        overall.rounds += len(rounds)
        reports.append(report)
    total_submitted = sum(r.submitted for r in log.rounds)
    overall.accept_rate = sum(r.accepted for r in log.rounds) / total_submitted if total_submitted else None
    return ReplayReport(reports, overall, config, source)


def comparisons(results: dict[str, PolicyResult], policy: str) -> dict[str, float | None]:
    """vs_plain, vs_always_k (tok/s ratios) and recovered = (x - always) / (plain - always), the
    fraction of the always-k -> plain gap recovered (seed "Gating"); None where always >= plain."""
    x, plain, always = results[policy].tok_s, results["plain"].tok_s, results["always-k"].tok_s
    return {
        "vs_plain": x / plain if plain else None,
        "vs_always_k": x / always if always else None,
        "recovered": (x - always) / (plain - always) if always < plain else None,
    }


def _json_threshold(t: float | None) -> float | str | None:
    return t if t is None or math.isfinite(t) else ("inf" if t > 0 else "-inf")


def _workload_dict(w: WorkloadReport) -> dict:
    return {
        "workload": w.name,
        "rounds": w.rounds,
        "accept_rate": w.accept_rate,
        "threshold": _json_threshold(w.threshold),
        "policies": {p: {**r.to_dict(), **comparisons(w.results, p)} for p, r in w.results.items()},
    }


def report_to_dict(report: ReplayReport) -> dict:
    """JSON-ready report; a non-finite LOWO threshold is written as the string "-inf" or "inf"."""
    return {
        "source": report.source,
        "config": asdict(report.config),
        "policies": list(report.overall.results),
        "workloads": [_workload_dict(w) for w in report.workloads],
        "overall": _workload_dict(report.overall),
    }
