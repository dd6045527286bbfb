"""`dspark trace-report` / `dspark calibrate`: where a round's time goes, and the gate's costs, from spans.

Owns turning loaded spans into per-round and per-generation records, the time split and the
summaries; it neither parses files (`traces`) nor fits costs (`calibration`), and it compares
durations only, never timestamps across hosts.

Attribution of one `spec_decode.round` span (the gateway's wall time of the round):
  drafter compute  = `drafter.forward_ms` of its `drafter.draft` and `drafter.commit` children;
  verifier compute = `verifier.forward_ms` of its `verifier.verify` or `verifier.decode` child;
  residual         = wall - drafter compute - verifier compute: network, (de)serialisation,
                     the backends' servicer time outside the forward (of which the verifier's
                     `verifier.queue_ms` is shown apart) and the gateway's own round logic.
The gateway awaits the draft, the verify and the commit one after the other inside the round
span, and each backend times its forward inside its handling of that one message, i.e.
between the gateway's write and its read of the reply. The compute intervals are therefore
disjoint sub-intervals of the round, so the residual is >= 0 on a real run. Only durations
are compared, never timestamps across hosts, so clock offsets between machines do not matter.

The gate's costs fitted from the rounds, and the confidence reliability: `services.analysis.calibration`.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np

from services.analysis.calibration import (GATE_ENV, PLAIN_MS_FLOOR, BucketStat, CostFit,  # noqa: F401 - re-exported
                                           fit_costs, gate_env_lines, reliability)
from services.analysis.breakdown import RoundBreakdown
from services.analysis.traces import Span
from services.gateway.gate import BUCKET_EDGES
from services.gateway.rounds import Round

ROUND = "spec_decode.round"
GENERATE = "gateway.generate"
COUNT_KEYS = ("rounds", "drafted", "submitted", "accepted", "verify_rounds", "margin_skipped_rounds",
              "truncated_rounds", "skipped_after_draft", "plain_rounds", "drafter_failovers", "drafter_failed")
MAX_GENERATION_ROWS = 30  # the text report lists at most this many generations
DECISIONS = ("full", "truncated", "skipped_after_draft", "capped", "margin_skipped", "plain")


@dataclass
class GenerationRecord:
    """One `gateway.generate` span, its rounds, and counts derived from the rounds."""

    trace_id: str
    span_id: str
    mode: str
    start_ns: int
    end_ns: int
    input_tokens: int | None
    output_tokens: int | None
    ttft_ms: float | None
    final: dict
    rounds: list[RoundBreakdown]
    span: Span = field(repr=False)
    prefill: list[Span] = field(default_factory=list, repr=False)

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first (GenAI semantic conventions)."""
        if self.ttft_ms is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.duration_ms - self.ttft_ms) / (self.output_tokens - 1)

    def counts(self) -> dict:
        """The generation's speculation counters recomputed from its round spans."""
        return round_counts(self.rounds, self.span.events)

    @property
    def consistent(self) -> bool | None:
        """Whether the counts from the rounds equal the span's final `spec_decode.*` counters."""
        if not self.final:
            return None
        mine = self.counts()
        return all(mine[k] == self.final[k] for k in COUNT_KEYS if k in self.final)


@dataclass
class Report:
    sources: list[str]
    spans: int
    backend_spans: bool
    generations: list[GenerationRecord]
    rounds: list[RoundBreakdown]
    fit: CostFit
    reliability: list[BucketStat]
    recorded_rounds: int = 0  # of `rounds`, those read from recorded-rounds files


# ---------------------------------------------------------------------------- building
MAX_MS = 1e12  # ~32 years: no timing attribute is larger; keeps every sum and fit finite
MAX_COUNT = 2**53  # counts stay exact as floats


def _bad(span: Span, key: str, value, what: str) -> ValueError:
    text = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    where = f"{span.origin}: " if span.origin else ""
    return ValueError(f"{where}span {span.name!r} {span.span_id}: {key}={text} is not {what}")


def _real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(span: Span, key: str, default: int | None = 0) -> int | None:
    """Attribute `key` of `span` as a count (an integer in [0, 2^53]); `default` when absent.

    Raises ValueError naming the span, the attribute and its value otherwise (so for every
    attribute reader below)."""
    v = span.attributes.get(key)
    if v is None:
        return default
    if not _real(v) or v < 0 or v > MAX_COUNT or int(v) != v:
        raise _bad(span, key, v, "a count (an integer >= 0)")
    return int(v)


def _duration(span: Span, key: str, scale: float = 1.0) -> float | None:
    """Attribute `key` (a duration, in ms after multiplying by `scale`) of `span`; None when absent."""
    v = span.attributes.get(key)
    if v is None:
        return None
    if not _real(v) or not 0 <= v * scale <= MAX_MS:
        raise _bad(span, key, v, f"a duration (a finite number >= 0{' ms' if scale == 1.0 else ''})")
    return float(v) * scale


def _number(span: Span, key: str) -> float | None:
    """Attribute `key` as a float (inf and NaN allowed: a margin of masked logits); None when absent."""
    v = span.attributes.get(key)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise _bad(span, key, v, "a number")
    return float(v)


def _confidence(span: Span, submitted: int, accepted: int) -> tuple[float, ...] | None:
    """The round's confidence logits: finite numbers, at least one per position the round decided."""
    key = "spec_decode.confidence_logits"
    conf = span.attributes.get(key)
    if conf is None:
        return None
    if not isinstance(conf, (list, tuple)) or not all(_real(c) or c in (math.inf, -math.inf) for c in conf):
        raise _bad(span, key, conf, "a list of numbers (not NaN)")
    if submitted and len(conf) < min(accepted + 1, submitted):
        raise _bad(span, key, conf, f"one logit per decided draft (the round submitted {submitted}, "
                                    f"accepted {accepted})")
    return tuple(float(c) for c in conf)


def _round_breakdown(span: Span, children: list[Span]) -> RoundBreakdown:
    """Raises ValueError naming the span and the attribute: a count or duration of the wrong
    type or out of range, more drafts accepted than submitted, too few confidence logits."""
    a = span.attributes
    draft = [c for c in children if c.name == "drafter.draft"]
    drafter = [c for c in children if c.name.startswith("drafter.")]
    verifier = [c for c in children if c.name in ("verifier.verify", "verifier.decode")]
    draft_ms = _duration(span, "spec_decode.draft_ms")
    drafter_ms = sum(_duration(c, "drafter.forward_ms") or 0.0 for c in drafter)
    if draft_ms is not None and not draft:
        drafter_ms = None  # the round drafted but the drafter's spans are not in the input
    submitted, accepted = _count(span, "spec_decode.submitted"), _count(span, "spec_decode.accepted")
    if accepted > submitted:
        raise _bad(span, "spec_decode.accepted", accepted, f"at most spec_decode.submitted={submitted}")
    return RoundBreakdown(
        trace_id=span.trace_id, span_id=span.span_id, generation_id=span.parent_id,
        index=_count(span, "spec_decode.round"), start_ns=span.start_ns, end_ns=span.end_ns,
        decision=str(a.get("spec_decode.gate_decision", "")), drafted=_count(span, "spec_decode.drafted"),
        submitted=submitted, accepted=accepted, anchor_margin=_number(span, "spec_decode.anchor_margin"),
        verify_ms=_duration(span, "spec_decode.verify_ms"), draft_ms=draft_ms,
        confidence_logits=_confidence(span, submitted, accepted),
        drafter_failures=sum(e.get("name") == "drafter_failed" for e in span.events),
        drafter_failovers=sum(e.get("name") == "drafter_failover" for e in span.events),
        drafter_ms=drafter_ms,
        verifier_ms=(_duration(verifier[0], "verifier.forward_ms") or 0.0) if verifier else None,
        verifier_overhead_ms=_duration(verifier[0], "verifier.queue_ms") if verifier else None,
        children=sorted(children, key=lambda c: c.start_ns))


def recorded_round(rec: Round, index: int) -> RoundBreakdown:
    """A recorded round (docs/gate.md §9) as a report round, `index` its place in the file.

    The file keeps no decision, so it is inferred: no draft -> plain, every draft submitted ->
    full, none -> skipped_after_draft, some -> truncated (a cut by max_tokens, "capped", looks
    the same). verify_ms is the recorded verify time, or for k = 0 the recorded plain decode.
    """
    drafted = len(rec.confidence_logits)
    if not drafted:
        decision = "plain"
    elif rec.submitted == drafted:
        decision = "full"
    else:
        decision = "truncated" if rec.submitted else "skipped_after_draft"
    return RoundBreakdown(
        trace_id="", span_id="", generation_id=None, index=index, start_ns=None, end_ns=None, decision=decision,
        drafted=drafted, submitted=rec.submitted, accepted=rec.accepted, anchor_margin=rec.anchor_margin,
        verify_ms=rec.verify_ms if rec.submitted else rec.plain_ms, draft_ms=rec.draft_ms,
        confidence_logits=rec.confidence_logits or None, drafter_failures=0, drafter_failovers=0, drafter_ms=None,
        verifier_ms=None, verifier_overhead_ms=None, workload=rec.workload)


def round_counts(rounds: Sequence[RoundBreakdown], events: Sequence[dict] = ()) -> dict:
    """The gateway's `SpecStats` counts (its `RoundStats` fold, docs/gate.md §7) from traced `rounds`;
    `events`: the generation span's own (a drafter failure while committing the prompt)."""
    d = Counter(r.decision for r in rounds)
    failures = sum(r.drafter_failures for r in rounds) + sum(e.get("name") == "drafter_failed" for e in events)
    failovers = sum(r.drafter_failovers for r in rounds) + sum(e.get("name") == "drafter_failover" for e in events)
    return {"rounds": len(rounds), "drafted": sum(r.drafted for r in rounds),
            "submitted": sum(r.submitted for r in rounds), "accepted": sum(r.accepted for r in rounds),
            "verify_rounds": sum(r.submitted > 0 for r in rounds), "margin_skipped_rounds": d["margin_skipped"],
            "truncated_rounds": d["truncated"], "skipped_after_draft": d["skipped_after_draft"],
            "plain_rounds": sum(r.submitted == 0 for r in rounds),
            # every failure either ends in a failover or leaves the generation on plain decode
            "drafter_failovers": failovers, "drafter_failed": failures > failovers}


def _final(span: Span) -> dict:
    out = {}
    for k in COUNT_KEYS:
        v = span.attr(f"spec_decode.{k}")
        if v is None:
            continue
        if k != "drafter_failed":
            out[k] = _count(span, f"spec_decode.{k}")
        elif isinstance(v, bool) or v in (0, 1):
            out[k] = bool(v)
        else:
            raise _bad(span, f"spec_decode.{k}", v, "a boolean")
    return out


def build_report(spans: Sequence[Span], sources: Sequence[str] = (), recorded: Sequence[Round] = ()) -> Report:
    """Rounds and generations of `spans` (any mix of the three services' spans, any order), and
    the `recorded` rounds of recorded-rounds files (after the spans' rounds, in file order).

    Raises:
        ValueError: naming the span (and the file and line it was read from) and the
            attribute, when a count, duration or confidence logit has the wrong type or range.
    """
    children: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        if s.parent_id is not None:
            children[s.parent_id].append(s)
    rounds = [_round_breakdown(s, children.get(s.span_id, [])) for s in spans if s.name == ROUND]
    by_generation: dict[str | None, list[RoundBreakdown]] = defaultdict(list)
    for r in rounds:
        by_generation[r.generation_id].append(r)
    generations = []
    for s in spans:
        if s.name != GENERATE:
            continue
        rs = sorted(by_generation.get(s.span_id, []), key=lambda r: r.index)
        ttft = _duration(s, "gen_ai.server.time_to_first_token", 1e3)
        prefill = [c for c in children.get(s.span_id, []) if c.name in ("gateway.prefill", "drafter.commit")]
        prefill += [g for p in prefill for g in children.get(p.span_id, [])]
        generations.append(GenerationRecord(
            trace_id=s.trace_id, span_id=s.span_id, mode=str(s.attr("spec_decode.mode", "")),
            start_ns=s.start_ns, end_ns=s.end_ns, input_tokens=_count(s, "gen_ai.usage.input_tokens", None),
            output_tokens=_count(s, "gen_ai.usage.output_tokens", None), ttft_ms=ttft,
            final=_final(s), rounds=rs, span=s, prefill=sorted(prefill, key=lambda c: c.start_ns)))
    generations.sort(key=lambda g: g.start_ns)
    rounds.sort(key=lambda r: (r.start_ns, r.index))
    rounds += [recorded_round(r, i) for i, r in enumerate(recorded)]
    backend = any(s.name.startswith("verifier.") for s in spans)
    return Report(list(sources), len(spans), backend, generations, rounds, fit_costs(rounds), reliability(rounds),
                  len(recorded))


# ---------------------------------------------------------------------------- summaries
def _pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def _stats(values: Sequence[float]) -> dict:
    v = [x for x in values if x is not None]
    return {"n": len(v), "sum": float(sum(v)), "mean": float(np.mean(v)) if v else None,
            "p50": _pct(v, 50), "p99": _pct(v, 99), "min": float(min(v)) if v else None,
            "max": float(max(v)) if v else None}


def parts_summary(rounds: Sequence[RoundBreakdown]) -> dict:
    """Totals and percentiles (ms) of each part of the round time."""
    return {"wall_ms": _stats([r.wall_ms for r in rounds]), "drafter_ms": _stats([r.drafter_ms for r in rounds]),
            "verifier_ms": _stats([r.verifier_ms for r in rounds]),
            "residual_ms": _stats([r.residual_ms for r in rounds]),
            "verifier_overhead_ms": _stats([r.verifier_overhead_ms for r in rounds])}


def per_k(rounds: Sequence[RoundBreakdown]) -> list[dict]:
    """p50/p99 of the round wall, the verify call and its parts, per submitted length k."""
    groups: dict[int, list[RoundBreakdown]] = defaultdict(list)
    for r in rounds:
        groups[r.submitted].append(r)
    out = []
    for k in sorted(groups):
        rs = groups[k]
        row = {"k": k, "rounds": len(rs)}
        for name, values in (("wall_ms", [r.wall_ms for r in rs]), ("verify_ms", [r.verify_ms for r in rs]),
                             ("verifier_ms", [r.verifier_ms for r in rs]),
                             ("residual_ms", [r.residual_ms for r in rs])):
            v = [x for x in values if x is not None]
            row[name] = {"p50": _pct(v, 50), "p99": _pct(v, 99)}
        out.append(row)
    return out


def decision_mix(rounds: Sequence[RoundBreakdown]) -> dict:
    counts = Counter(r.decision for r in rounds)
    names = list(DECISIONS) + sorted(set(counts) - set(DECISIONS))
    return {d: {"rounds": counts[d], "share": counts[d] / len(rounds) if rounds else 0.0} for d in names}


def acceptance_histogram(rounds: Sequence[RoundBreakdown]) -> dict[int, dict[int, int]]:
    """{k: {accepted: verify rounds}} over the rounds that verified (k > 0)."""
    hist: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for r in rounds:
        if r.submitted > 0:
            hist[r.submitted][r.accepted] += 1
    return {k: dict(sorted(v.items())) for k, v in sorted(hist.items())}


def latency_summary(generations: Sequence[GenerationRecord]) -> dict:
    """p50/p99 (and the rest of `_stats`) of TTFT, TPOT and duration over generations (ms)."""
    return {"ttft_ms": _stats([g.ttft_ms for g in generations]), "tpot_ms": _stats([g.tpot_ms for g in generations]),
            "duration_ms": _stats([g.duration_ms for g in generations])}


def _generation_dict(g: GenerationRecord) -> dict:
    return {"trace_id": g.trace_id, "span_id": g.span_id, "mode": g.mode, "input_tokens": g.input_tokens,
            "output_tokens": g.output_tokens, "duration_ms": g.duration_ms, "ttft_ms": g.ttft_ms,
            "tpot_ms": g.tpot_ms, "counts": g.counts(), "final": g.final, "consistent": g.consistent}


def _round_dict(r: RoundBreakdown) -> dict:
    d = {k: v for k, v in asdict(r).items() if k not in ("children", "start_ns", "end_ns")}
    d["confidence_logits"] = None if r.confidence_logits is None else list(r.confidence_logits)
    d.update(wall_ms=r.wall_ms, residual_ms=r.residual_ms)
    return d


def _finite(value):
    """`value` with every NaN or infinite float (in lists and dicts too) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def report_to_dict(report: Report) -> dict:
    """The report as JSON-ready data (no NaN or inf: such a value would be None)."""
    lines, notes = gate_env_lines(report.fit)
    return _finite({
        "sources": report.sources, "spans": report.spans, "recorded_rounds": report.recorded_rounds,
        "backend_spans": report.backend_spans,
        "generations": [_generation_dict(g) for g in report.generations],
        "latency": latency_summary(report.generations),
        "parts": parts_summary(report.rounds), "per_k": per_k(report.rounds),
        "gate_decisions": decision_mix(report.rounds),
        "acceptance_histogram": {str(k): {str(a): n for a, n in v.items()}
                                 for k, v in acceptance_histogram(report.rounds).items()},
        "reliability": [{"bucket": b.index, "range": b.label, "observed": b.observed, "matched": b.matched,
                         "match_rate": b.rate, "mean_logit": b.mean_logit} for b in report.reliability],
        "bucket_edges": list(BUCKET_EDGES),
        "fit": asdict(report.fit), "fit_missing": report.fit.missing(), "gate_env": lines, "gate_env_notes": notes,
        "rounds": [_round_dict(r) for r in report.rounds],
    })


# ---------------------------------------------------------------------------- text


def why_lines(spans: Sequence[Span]) -> list[str]:
    """One line per round span, in time order: its trace, its round number and why it
    submitted what it did with the decision's inputs (`services.gateway.record.explain`, from
    the attributes docs/gate.md §9 lists). A span without them (an older gateway, a round that
    made no length decision) explains what it has."""
    from services.gateway.record import explain
    lines = []
    for sp in sorted((sp for sp in spans if sp.name == ROUND), key=lambda sp: (sp.start_ns, sp.span_id)):
        a = sp.attr
        line = explain(str(a("spec_decode.gate_reason", "?")), int(a("spec_decode.submitted", 0)),
                       int(a("spec_decode.drafted", 0)), int(a("spec_decode.accepted", 0)), a("spec_decode.asked"),
                       tuple(a("spec_decode.survival", ()) or ()), a("spec_decode.lambda"),
                       tuple(a("spec_decode.values", ()) or ()), tuple(a("spec_decode.regime", ()) or ()),
                       a("spec_decode.probe_loss"), bool(a("spec_decode.lent_streak", False)))
        lines.append(f"{sp.trace_id[:12]} round {a('spec_decode.round', '?')}: {line}")
    return lines
