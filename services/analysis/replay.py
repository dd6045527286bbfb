"""Replay recorded rounds through draft-length policies under the cost model (docs/gate.md §10).

This module owns the policies' causal replay and their comparison (tok/s, ratios, recovered
gap). It must not read or write files (`rounds.py` does), print (`services/cli.py` does) or
count rounds outside the record fold: every replayed round is one `RoundRecord` folded into
its policy's `RoundStats`.

Reference policies (`references.py`): best fixed k in hindsight, the calibrated gate in
hindsight and the per-round oracle, per workload; the headline figure is the gated policy's
gain over always-k as a fraction of the calibrated-in-hindsight gain.

Policies: plain (no draft), always-k (submit what was recorded), threshold (cut at the first
confidence below t, t chosen leave-one-workload-out), gated (the Gate, cold at the start of each
workload, or with `warm` warm-started from the other workloads' calibration, `replay_warm.py`)
and gated+margin (the Gate with the pre-draft margin gate; only when the rounds carry anchor
margins and the margin threshold is > 0). The gated policies always run the gate enabled,
whatever GateConfig.enabled (DSPARK_GATE) says.

A policy can submit at most the recorded `submitted` length, because only those positions were
verified; submitting n <= submitted gets accepted = min(recorded accepted, n). Round costs come
from the one CostModel: n > 0 costs cost(n) and yields accepted + 1 tokens; n = 0 after drafting
costs draft_ms + plain_ms and yields 1 token; a round without a draft (plain policy, margin
skip, or a recorded round with no confidences) costs plain_ms and yields 1 token.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from services.gateway.decision import pick_length
from services.analysis.calibration import expected_calibration_error
from services.gateway.gate import Calibration, CostModel, Gate, GateConfig
from services.gateway.record import RoundStats
from services.analysis.references import (  # noqa: F401 - replayed_round is re-exported
    EstimateTally,
    References,
    headline,
    reference_results,
    replay_through_gate,
    replayed_round,
)
from services.analysis.replay_warm import lowo_calibrations
from services.gateway.rounds import Round, RoundLog
from services.gateway.warm import WarmStart

POLICIES = ("plain", "always-k", "threshold", "gated", "gated+margin")


def score_round(rec: Round, n: int | None, cost: CostModel, out: RoundStats) -> None:
    """Fold one replayed round into `out`: n=None is a plain step (1 token, plain_ms), n = 0 a
    draft cut to nothing (1 token, draft + plain ms), n > 0 costs cost(n) for accepted + 1 tokens.

    Raises ValueError when n exceeds the recorded submitted length.
    """
    out.add(replayed_round(rec, n, cost))


def threshold_length(rec: Round, threshold: float) -> int:
    """Leading drafted positions with confidence >= threshold, capped at the recorded submitted."""
    n = 0
    for c in rec.confidence_logits[: rec.submitted]:
        if c < threshold:
            break
        n += 1
    return n


def replay_fixed(rounds: Sequence[Round], cost: CostModel, policy: str, threshold: float = -math.inf) -> RoundStats:
    """plain, always-k or threshold (at `threshold`) over `rounds`. Raises ValueError on another policy."""
    out = RoundStats()
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


def replay_gated(
    rounds: Sequence[Round], config: GateConfig, use_margin: bool, tally: EstimateTally | None = None,
    calibration: Calibration | None = None,
) -> RoundStats:
    """Causal replay through a Gate (enabled regardless of config.enabled), cold unless
    `calibration` warm-starts it.

    use_margin=False zeroes the margin threshold; True keeps config.margin_threshold. `tally`
    (optional) collects the gate's estimates against the recorded matches (for the ECE).
    """
    gate_config = replace(config, enabled=True, margin_threshold=config.margin_threshold if use_margin else 0.0)
    return replay_through_gate(rounds, Gate(gate_config, calibration), tally)


def _cut_points(rounds: Sequence[Round]) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """Every (round, position j < submitted) cut point, sorted by its prefix-minimum confidence.

    As t falls to a round's prefix minimum at j, the threshold policy's n for that round grows
    from j to j + 1: one more submitted draft, one more token when j < accepted, and the round
    turns verified when j = 0. Returns (values [E] ascending, is_first [E], is_hit [E], drafted
    rounds, undrafted rounds). Legend: R = rounds, E = cut points (sum of submitted), U = distinct
    confidences.
    """
    lengths = np.fromiter((r.submitted for r in rounds), np.int64, count=len(rounds))  # [R]
    accepted = np.fromiter((r.accepted for r in rounds), np.int64, count=len(rounds))  # [R]
    drafted = sum(bool(r.confidence_logits) for r in rounds)
    prefixes = itertools.chain.from_iterable(r.confidence_logits[: r.submitted] for r in rounds)
    flat = np.fromiter(prefixes, float, count=int(lengths.sum()))  # [E]
    distinct, rank = np.unique(flat, return_inverse=True)  # [U], [E]
    segment = np.repeat(np.arange(len(rounds), dtype=np.int64), lengths)  # [E] round of each position
    # Segmented prefix minimum in one pass: shifting round k's ranks below every earlier round's
    # restarts the running minimum at each round; ranks keep it exact for any finite logits.
    shift = segment * len(distinct)  # [E]
    prefix_rank = np.minimum.accumulate(rank - shift) + shift  # [E]
    position = np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)  # [E] j within its round
    order = np.argsort(prefix_rank, kind="stable")  # [E]
    return (
        distinct[prefix_rank[order]],
        (position == 0)[order],
        (position < np.repeat(accepted, lengths))[order],
        drafted,
        len(rounds) - drafted,
    )


def _suffix_counts(flags: np.ndarray) -> np.ndarray:
    """[E + 1]: entry i = number of True flags at positions >= i."""
    return np.concatenate([np.cumsum(flags[::-1], dtype=np.int64)[::-1], [0]])


def _threshold_totals(
    rounds: Sequence[Round], candidates: np.ndarray, cost: CostModel
) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and time (ms) of the threshold policy at each candidate threshold.

    O((E + T) log E) time and O(E + T) memory (legend: T = candidates, E = cut points): the
    cut points are sorted once (_cut_points) and each candidate reads suffix counts at its
    searchsorted index. Time is built from integer counts, so equal counts give equal times.
    """
    values, first, hit, drafted, undrafted = _cut_points(rounds)
    at = np.searchsorted(values, np.asarray(candidates, dtype=float), side="left")  # [T]: first value >= t
    verified = _suffix_counts(first)[at]  # [T] rounds with n > 0
    submitted = len(values) - at  # [T] drafts submitted
    tokens = len(rounds) + _suffix_counts(hit)[at]  # [T] one per round plus accepted drafts
    time = (
        verified * (cost.draft_ms + cost.verify_base_ms)
        + submitted * cost.verify_slope_ms
        + (drafted - verified) * cost.skipped_after_draft_ms()
        + undrafted * cost.plain_ms
    )
    return tokens, time


def choose_threshold(rounds: Sequence[Round], cost: CostModel) -> float:
    """Confidence threshold maximising total tokens / total time over `rounds`.

    Candidates: every distinct prefix-minimum confidence (where a cut changes), plus -inf (never
    cut) and +inf (always cut to 0); ties go to the lowest threshold (the least cutting).
    """
    candidates = np.unique(np.concatenate([_cut_points(rounds)[0], [-math.inf, math.inf]]))
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
    """One workload's replay: recorded accept rate, results per policy, its LOWO threshold, the
    reference policies (docs/gate.md §10) and the gated policy's estimate tally (for the ECE)."""

    name: str
    rounds: int
    accept_rate: float | None
    results: dict[str, RoundStats] = field(default_factory=dict)
    threshold: float | None = None
    references: References | None = None  # best fixed k, calibrated gate in hindsight, oracle
    tally: EstimateTally | None = None  # the gated policy's estimates against the recorded matches


@dataclass
class ReplayReport:
    """All workloads plus the overall (round-weighted) totals per policy; `skipped`: default
    policies that could not run on these rounds, with the reason."""

    workloads: list[WorkloadReport]
    overall: WorkloadReport
    config: GateConfig
    source: str
    skipped: dict[str, str] = field(default_factory=dict)
    costs: str = "configured"  # which cost shape the config's *_ms fields are (seed, cheap, a file ...)
    warm: WarmStart | None = None  # the gated policies warm-start leave-one-workload-out; None: cold


def skipped_policies(log: RoundLog, config: GateConfig) -> dict[str, str]:
    """Policies that cannot run on `log` under `config` -> why: threshold needs >= 2 workloads,
    gated+margin needs anchor margins and a margin threshold > 0."""
    skip = {}
    if len(log.workloads()) < 2:
        skip["threshold"] = "needs >= 2 workloads, t is chosen leave-one-workload-out"
    if not any(r.anchor_margin is not None for r in log.rounds):
        skip["gated+margin"] = "needs rounds with anchor_margin"
    elif config.margin_threshold <= 0:
        skip["gated+margin"] = "needs margin_threshold > 0 (DSPARK_GATE_MARGIN_THRESHOLD)"
    return skip


def applicable_policies(log: RoundLog, config: GateConfig, wanted: Sequence[str] = POLICIES) -> tuple[str, ...]:
    """`wanted` minus skipped_policies(log, config), order kept."""
    skip = skipped_policies(log, config)
    return tuple(p for p in wanted if p not in skip)


def _chosen_policies(log: RoundLog, config: GateConfig, policies: Sequence[str] | None) -> tuple[list[str], dict]:
    skip = skipped_policies(log, config)
    policies = (policies,) if isinstance(policies, str) else policies
    if policies is None:
        return [p for p in POLICIES if p not in skip], skip
    requested = list(dict.fromkeys(policies))  # a repeated policy counts once, order kept
    unknown = [p for p in requested if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    blocked = [f"policy {p!r} cannot run: {skip[p]}" for p in requested if p in skip]
    if blocked:
        raise ValueError("; ".join(blocked))
    return list(dict.fromkeys(["plain", "always-k", *requested])), {}


def _accept_rate(rounds: Sequence[Round]) -> float | None:
    submitted = sum(r.submitted for r in rounds)
    return sum(r.accepted for r in rounds) / submitted if submitted else None


def replay_log(
    log: RoundLog,
    config: GateConfig,
    policies: Sequence[str] | None = None,
    source: str = "",
    references: bool = True,
    costs: str = "configured",
    warm: WarmStart | None = None,
) -> ReplayReport:
    """Replay every workload of `log` through plain, always-k and `policies`, and (references=True)
    the reference policies. `costs` names the cost shape of config's *_ms fields for the report.
    `warm`: the gated policies of each workload warm-start from the other workloads' calibration
    (`replay_warm.lowo_calibrations`); None keeps every workload cold.

    policies=None: every policy that applies to `log` (the rest are listed in report.skipped).
    An explicit list is replayed as given, a repeated name once. Raises ValueError on a log
    without rounds, an unknown policy, or a requested policy that cannot run (saying why).
    """
    if not log.rounds:
        raise ValueError(f"{source or 'rounds log'}: no rounds to replay")
    chosen, skipped = _chosen_policies(log, config, policies)
    cost, groups = config.cost_model(), log.workloads()
    thresholds = lowo_thresholds(groups, cost) if "threshold" in chosen else {}
    overall = WorkloadReport("overall", len(log.rounds), _accept_rate(log.rounds), {p: RoundStats() for p in chosen})
    warm_from = lowo_calibrations(groups, config, warm) if warm is not None else {}
    reports = [_replay_workload(name, rounds, config, chosen, thresholds.get(name), references, warm_from.get(name))
               for name, rounds in groups.items()]
    for report in reports:
        for policy in chosen:
            overall.results[policy].merge(report.results[policy])
        if report.tally is not None:
            overall.tally = overall.tally or EstimateTally()
            overall.tally.merge(report.tally)
        if report.references is not None:
            overall.references = overall.references or References(report.references.best_k, {}, None)
            overall.references.merge(report.references)
    if overall.references is not None and len({r.references.best_k for r in reports}) > 1:
        overall.references.best_k = None  # each workload has its own k
    return ReplayReport(reports, overall, config, source, skipped, costs, warm)


def _replay_workload(name: str, rounds: list[Round], config: GateConfig, chosen: Sequence[str],
                     threshold: float | None, references: bool, calibration: Calibration | None) -> WorkloadReport:
    """One workload's report: every chosen policy (the gated ones warm-started from
    `calibration` when given), and the reference policies when asked."""
    report = WorkloadReport(name, len(rounds), _accept_rate(rounds), threshold=threshold)
    cost = config.cost_model()
    for policy in chosen:
        if policy.startswith("gated"):
            tally = EstimateTally() if policy == "gated" else None
            report.results[policy] = replay_gated(rounds, config, use_margin=policy == "gated+margin", tally=tally,
                                                  calibration=calibration)
            if tally is not None:
                report.tally = tally
        else:
            report.results[policy] = replay_fixed(rounds, cost, policy, -math.inf if threshold is None else threshold)
    if references:
        report.references = reference_results(rounds, config)
    return report


def comparisons(results: dict[str, RoundStats], policy: str) -> dict[str, float | None]:
    """vs_plain, vs_always_k (tok/s ratios) and recovered = (x - always) / (plain - always), the
    fraction of the always-k -> plain gap recovered (docs/architecture.md §12); None where
    always >= plain."""
    x, plain, always = results[policy].tok_s, results["plain"].tok_s, results["always-k"].tok_s
    return {
        "vs_plain": x / plain if plain else None,
        "vs_always_k": x / always if always else None,
        "recovered": (x - always) / (plain - always) if always < plain else None,
    }


def _json_threshold(t: float | None) -> float | str | None:
    return t if t is None or math.isfinite(t) else ("inf" if t > 0 else "-inf")


def headline_of(w: WorkloadReport) -> dict[str, float | None] | None:
    """The gate's headline figures for `w` (see references.headline); None without the gated
    policy or the references."""
    if w.references is None or "gated" not in w.results:
        return None
    tok = {p: r.tok_s for p, r in {**w.results, **w.references.results}.items()}
    return headline(tok["gated"], tok["always-k"], tok["calibrated-hindsight"], tok["oracle"])


def calibration_of(w: WorkloadReport) -> dict | None:
    """The gated policy's calibration: ECE of the estimates it decided with against the recorded
    matches, and per bucket the mean estimate, realised rate and counts; None without a tally."""
    t = w.tally
    if t is None:
        return None
    means = t.mean_estimates()
    ece = expected_calibration_error(means, t.matched, t.observed) if sum(t.observed) else None
    buckets = [{"observed": o, "matched": m, "realised": m / o if o else None, "mean_estimate": e}
               for o, m, e in zip(t.observed, t.matched, means)]
    return {"ece": ece, "buckets": buckets}


def _references_dict(refs: References | None) -> dict | None:
    if refs is None:
        return None
    out = {name: stats.policy_dict() for name, stats in refs.results.items()}
    out["best-fixed-k"]["k"] = refs.best_k
    if refs.rates is not None:
        out["calibrated-hindsight"]["bucket_rates"] = list(refs.rates.rates)
    return out


def _workload_dict(w: WorkloadReport) -> dict:
    return {
        "workload": w.name,
        "rounds": w.rounds,
        "accept_rate": w.accept_rate,
        "threshold": _json_threshold(w.threshold),
        "policies": {p: {**r.policy_dict(), **comparisons(w.results, p)} for p, r in w.results.items()},
        "references": _references_dict(w.references),
        "headline": headline_of(w),
        "calibration": calibration_of(w),
    }


def report_to_dict(report: ReplayReport) -> dict:
    """JSON-ready report (every number finite); a non-finite LOWO threshold is written as the
    string "-inf" or "inf". config.enabled is renamed gate_env_enabled: the gated policies
    always run the gate enabled, so the env switch is reported for information only."""
    config = asdict(report.config)
    config["gate_env_enabled"] = config.pop("enabled")
    return {
        "source": report.source,
        "costs": report.costs,
        "warm_start": None if report.warm is None else {"mode": "leave-one-workload-out",
                                                         "max_weight": report.warm.max_weight},
        "config": config,
        "gated_policies_gate_enabled": True,
        "note": "the gated policies always run the gate enabled; config.gate_env_enabled is "
        "DSPARK_GATE, which the replay does not use",
        "policies": list(report.overall.results),
        "skipped_policies": dict(report.skipped),
        "workloads": [_workload_dict(w) for w in report.workloads],
        "overall": _workload_dict(report.overall),
    }


def redecide(rec: Round, config: GateConfig) -> int | None:
    """The length a recorded round's own decision inputs choose under `config`'s win factor and
    floor (`decision.pick_length` over its recorded value(k), E[tokens(max_n)] from its
    recorded survival; a probe round's floor is one draft, as the gate's, else 0): the k it submitted,
    when the gate made the decision it recorded. None when the round recorded no decision (an
    older file, a round the step budget chose)."""
    if not rec.values or rec.survival is None or len(rec.survival) + 1 < len(rec.values):
        return None
    max_n = len(rec.values) - 1
    full = 1.0 + sum(rec.survival[:max_n])
    return pick_length(rec.values, full, config.win_factor, min(1 if rec.probe else 0, max_n))


def redecided(rounds: Sequence[Round], config: GateConfig) -> tuple[int, int]:
    """(rounds whose recorded decision inputs choose the k they submitted, rounds that recorded
    inputs) under `config` (`redecide`)."""
    pairs = [(redecide(r, config), r.submitted) for r in rounds]
    pairs = [(k, sub) for k, sub in pairs if k is not None]
    return sum(k == sub for k, sub in pairs), len(pairs)
