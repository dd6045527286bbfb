"""`dspark trace-report` on synthetic spans with known costs (docs/analysis.md §2): the fit, the time split,
the censored reliability counts, the readers (JSON lines, OTLP-JSON, pretty-printed) and bad input."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from services.analysis.report import (BucketStat, build_report, fit_costs, gate_env_lines, per_k, reliability,
                                      report_to_dict)
from services.analysis.traces import Span, load_spans, span_to_json
from services.gateway.gate import Gate, GateConfig
from services.settings import gate_config

BASE, SLOPE, DRAFT, PLAIN = 300.0, 109.0, 196.0, 303.0  # the reference costs (ms), docs/architecture.md §12
NOISE = 0.03  # relative noise of every synthetic timing


def _ids(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789abcdef") for _ in range(n))


def _ns(ms: float) -> int:
    """ms -> ns, whole microseconds (the JSON-lines exporter's resolution)."""
    return round(ms * 1000) * 1000


def synthetic_spans(seed: int = 7, generations: int = 8, rounds: int = 50) -> tuple[list[Span], list[dict]]:
    """Generations of rounds with known costs: draft DRAFT ms, verify BASE + SLOPE·k ms, plain
    PLAIN ms (each times 1 ± NOISE), backend compute 80% of each call; returns the spans and,
    per generation, the counts they encode."""
    rng = random.Random(seed)
    t = 1_800_000_000 * 10**9
    spans, expected = [], []
    ms = 1_000_000
    for g in range(generations):
        trace = _ids(rng, 32)
        gen_id, gen_start = _ids(rng, 16), t
        counts = dict(rounds=0, drafted=0, submitted=0, accepted=0, verify_rounds=0, margin_skipped_rounds=0,
                      truncated_rounds=0, skipped_after_draft=0, plain_rounds=0)
        for i in range(rounds):
            rid, start = _ids(rng, 16), t
            kind = rng.random()
            attrs = {"spec_decode.round": i + 1, "spec_decode.anchor_margin": rng.uniform(0, 10)}
            if kind < 0.2:  # margin-skipped: plain decode, no draft
                k, a, decision, drafted, draft_ms = 0, 0, "margin_skipped", 0, None
            else:
                k, drafted = rng.randint(1, 5), 5
                a = rng.randint(0, k)
                decision = "full" if k == 5 else "truncated"
                draft_ms = DRAFT * (1 + rng.uniform(-NOISE, NOISE))
                conf = [rng.uniform(-3, 9) for _ in range(5)]
                attrs.update({"spec_decode.draft_ms": draft_ms, "spec_decode.confidence_logits": conf})
            call_ms = (BASE + SLOPE * k if k else PLAIN) * (1 + rng.uniform(-NOISE, NOISE))
            attrs.update({"spec_decode.drafted": drafted, "spec_decode.submitted": k, "spec_decode.accepted": a,
                          "spec_decode.gate_decision": decision, "spec_decode.verify_ms": call_ms})
            if draft_ms is not None:
                d0 = t + ms // 10
                spans.append(Span("drafter.draft", trace, _ids(rng, 16), rid, d0, d0 + _ns(0.8 * draft_ms),
                                  {"drafter.forward_ms": 0.8 * draft_ms}))
                t += _ns(draft_ms)
            v0 = t + ms // 10
            op = "verifier.verify" if k else "verifier.decode"
            spans.append(Span(op, trace, _ids(rng, 16), rid, v0, v0 + _ns(0.8 * call_ms),
                              {"verifier.forward_ms": 0.8 * call_ms, "verifier.queue_ms": 0.5}))
            t += _ns(call_ms) + ms  # 1 ms of commit and gateway time
            spans.append(Span("spec_decode.round", trace, rid, gen_id, start, t, attrs))
            counts["rounds"] += 1
            counts["drafted"] += drafted
            counts["submitted"] += k
            counts["accepted"] += a
            counts["verify_rounds"] += k > 0
            counts["plain_rounds"] += k == 0
            counts["margin_skipped_rounds"] += decision == "margin_skipped"
            counts["truncated_rounds"] += decision == "truncated"
        final = {f"spec_decode.{key}": v for key, v in counts.items()}
        spans.append(Span("gateway.generate", trace, gen_id, None, gen_start, t,
                          {"spec_decode.mode": "gated", "gen_ai.usage.output_tokens": 100,
                           "gen_ai.server.time_to_first_token": 0.25, **final}))
        expected.append(counts)
        t += 50 * ms
    return spans, expected


def write_jsonl(spans: list[Span], path) -> None:
    rng = random.Random(1)
    lines = [json.dumps(span_to_json(s)) for s in spans]
    rng.shuffle(lines)  # exporters write spans in end order, children before parents
    path.write_text("\n".join(lines) + "\n")


def _otlp_value(v):
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    if isinstance(v, list):
        return {"arrayValue": {"values": [_otlp_value(x) for x in v]}}
    return {"stringValue": str(v)}


def write_otlp(spans: list[Span], path) -> None:
    """One ExportTraceServiceRequest (OTLP-JSON, hex ids, times in UnixNano) pretty-printed."""
    doc = {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name",
                                                            "value": {"stringValue": "dspark-gateway"}}]},
                              "scopeSpans": [{"scope": {"name": "dspark"}, "spans": [
                                  {"traceId": s.trace_id, "spanId": s.span_id, "parentSpanId": s.parent_id or "",
                                   "name": s.name, "kind": 1, "startTimeUnixNano": str(s.start_ns),
                                   "endTimeUnixNano": str(s.end_ns),
                                   "attributes": [{"key": k, "value": _otlp_value(v)} for k, v in s.attributes.items()]}
                                  for s in spans]}]}]}
    path.write_text(json.dumps(doc, indent=2))


@pytest.fixture(scope="module")
def synthetic():
    return synthetic_spans()


def test_fit_recovers_the_synthetic_costs_within_5_percent(synthetic, tmp_path):
    spans, _ = synthetic
    write_jsonl(spans, tmp_path / "t.jsonl")
    fit = build_report(load_spans([tmp_path / "t.jsonl"])).fit
    for got, want in ((fit.verify_base_ms, BASE), (fit.verify_slope_ms, SLOPE), (fit.draft_ms, DRAFT),
                      (fit.plain_ms, PLAIN)):
        assert got == pytest.approx(want, rel=0.05)
    assert fit.distinct_k == 5 and fit.verify_samples + fit.plain_samples == 400


def test_gate_lines_are_ready_to_use_and_clamp_what_the_gate_refuses(synthetic):
    spans, _ = synthetic
    fit = build_report(spans).fit
    lines, notes = gate_env_lines(fit)
    env = dict(line.split("=", 1) for line in lines)
    cfg = gate_config(env)  # the strict parser of docs/gate.md §8 accepts them as printed
    assert cfg.verify_slope_ms == pytest.approx(fit.verify_slope_ms, abs=1e-3)
    assert cfg.plain_ms == pytest.approx(fit.plain_ms, abs=1e-3) and notes == []
    bad = fit.__class__(-12.0, -0.5, 2.0, 0.0, 10, 2, 3, 3, 1.0)
    lines, notes = gate_env_lines(bad)
    env = dict(line.split("=", 1) for line in lines)
    assert env["DSPARK_GATE_VERIFY_BASE_MS"] == "0.000"
    assert env["DSPARK_GATE_PLAIN_MS"] == "0.001"
    assert len(notes) == 3
    gate_config(env)
    huge = fit.__class__(3e7, float("inf"), 2.0, 1e308, 10, 2, 3, 3, 1.0)  # timings near the float limit
    lines, notes = gate_env_lines(huge)
    env = dict(line.split("=", 1) for line in lines)
    assert env["DSPARK_GATE_VERIFY_BASE_MS"] == env["DSPARK_GATE_PLAIN_MS"] == "10000000.000"
    assert len(notes) == 3 and all("above the gate's" in n for n in notes)
    gate_config(env)


def test_time_split_counts_and_generation_figures_from_synthetic_spans(synthetic):
    spans, expected = synthetic
    report = build_report(spans)
    assert len(report.generations) == len(expected) and len(report.rounds) == 400
    for g, want in zip(report.generations, expected):
        got = g.counts()
        assert {k: got[k] for k in want} == want
        assert g.consistent is True
        assert g.ttft_ms == pytest.approx(250.0)
        assert g.tpot_ms == pytest.approx((g.duration_ms - 250.0) / 99)
    for r in report.rounds:
        assert r.drafter_ms == pytest.approx(0.8 * (r.draft_ms or 0.0))
        assert r.verifier_ms == pytest.approx(0.8 * r.verify_ms)
        assert r.residual_ms == pytest.approx(r.wall_ms - r.drafter_ms - r.verifier_ms)
        assert r.residual_ms >= 0
    rows = {row["k"]: row for row in per_k(report.rounds)}
    assert sorted(rows) == [0, 1, 2, 3, 4, 5]
    k3 = [r.verify_ms for r in report.rounds if r.submitted == 3]
    assert rows[3]["verify_ms"]["p50"] == pytest.approx(float(np.percentile(k3, 50)))
    assert rows[3]["verify_ms"]["p99"] == pytest.approx(float(np.percentile(k3, 99)))
    data = report_to_dict(report)
    json.dumps(data, allow_nan=False)
    assert data["gate_decisions"]["margin_skipped"]["rounds"] == sum(e["margin_skipped_rounds"] for e in expected)


def test_reliability_is_censored_exactly_like_the_gate(synthetic):
    spans, _ = synthetic
    report = build_report(spans)
    gate = Gate(GateConfig(decay=1.0))  # undecayed: the gate's own counts are the raw censored counts
    for r in report.rounds:
        if r.confidence_logits is not None:
            gate.observe(list(r.confidence_logits), r.submitted, r.accepted)
    assert [b.observed for b in report.reliability] == list(gate.calibration().observed)
    assert [b.matched for b in report.reliability] == list(gate.calibration().matched)


def test_reliability_counts_a_miss_only_at_the_first_rejected_position():
    class R:  # the fields `reliability` reads
        def __init__(self, conf, k, a):
            self.confidence_logits, self.submitted, self.accepted = conf, k, a

    stats = reliability([R((7.0, 7.0, -1.0, 2.0, 0.0), 4, 2),   # 2 matches in bucket 5, a miss in bucket 0
                         R((0.5, 7.0, 7.0, 7.0, 7.0), 5, 5),    # 5 matches, nothing censored
                         R((6.0, 1.0, 1.0, 1.0, 1.0), 3, 0),    # one miss at 6.0 (edge: bucket 5)
                         R((2.0, 2.0, 2.0, 2.0, 2.0), 0, 0)])   # not verified: nothing
    got = {b.index: (b.observed, b.matched) for b in stats if b.observed}
    assert got == {0: (1, 0), 2: (1, 1), 5: (7, 6)}
    assert isinstance(stats[0], BucketStat) and stats[5].rate == pytest.approx(6 / 7)


def test_otlp_json_and_pretty_printed_spans_give_the_same_report(synthetic, tmp_path):
    spans, _ = synthetic
    write_jsonl(spans, tmp_path / "a.jsonl")
    write_otlp(spans, tmp_path / "b.json")
    (tmp_path / "c.json").write_text("\n".join(json.dumps(span_to_json(s), indent=4) for s in spans))
    reports = [report_to_dict(build_report(load_spans([tmp_path / f]))) for f in ("a.jsonl", "b.json", "c.json")]
    for other in reports[1:]:
        assert other["fit"] == reports[0]["fit"]
        assert other["generations"] == reports[0]["generations"]
        assert other["rounds"] == reports[0]["rounds"]


def test_progress_bar_reads_the_same_spans(synthetic, tmp_path):
    spans, _ = synthetic
    write_jsonl(spans, tmp_path / "a.jsonl")
    assert load_spans([tmp_path / "a.jsonl"], progress=True) == load_spans([tmp_path / "a.jsonl"], progress=False)


def test_fit_without_two_distinct_k_says_what_is_missing():
    class R:  # the fields `fit_costs` reads
        def __init__(self, k, verify_ms, draft_ms):
            self.submitted, self.verify_ms, self.draft_ms = k, verify_ms, draft_ms

    fit = fit_costs([R(5, 845.0, 196.0), R(5, 850.0, 190.0), R(0, 303.0, None)])
    assert (fit.verify_base_ms, fit.verify_slope_ms) == (None, None)
    assert fit.draft_ms == pytest.approx(193.0) and fit.plain_ms == pytest.approx(303.0)
    assert fit.missing() == ["timed verify rounds over at least two distinct k (have 2 timed verify rounds, 1 distinct k) "
                             "for DSPARK_GATE_VERIFY_BASE_MS and DSPARK_GATE_VERIFY_SLOPE_MS"]
    lines, _ = gate_env_lines(fit)
    assert lines == ["DSPARK_GATE_DRAFT_MS=193.000", "DSPARK_GATE_PLAIN_MS=303.000"]
    empty = fit_costs([])
    assert empty.missing() == ["timed verify rounds over at least two distinct k (have 0 timed verify rounds, 0 distinct k) "
                               "for DSPARK_GATE_VERIFY_BASE_MS and DSPARK_GATE_VERIFY_SLOPE_MS",
                               "rounds with a timed draft for DSPARK_GATE_DRAFT_MS",
                               "timed rounds with k = 0 (plain decode; an always-k recording has none) "
                               "for DSPARK_GATE_PLAIN_MS"]
    assert gate_env_lines(empty) == ([], [])


@pytest.mark.parametrize("content, message", [
    ('{"name": "x"}\nnot json\n', ":1: not a span or an OTLP document"),
    (json.dumps({"name": "x", "context": {"trace_id": "0x1", "span_id": "0x2"}}) + "\n", ":1: trace_id='0x1'"),
    ('{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": "a"}]}]}]}\n', ":1: missing field 'traceId'"),
    ('[1, 2]\n', ":1: not a span or an OTLP document"),
    ('{"a": 1}\n{"b": \n', ":1: not a span"),
])
def test_bad_trace_files_name_the_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError) as err:
        load_spans([path])
    assert str(path) in str(err.value) and message in str(err.value)


def test_truncated_json_names_its_line(tmp_path):
    path = tmp_path / "cut.jsonl"
    good = json.dumps(span_to_json(Span("a", "1" * 32, "2" * 16, None, 10**18, 10**18 + 5)))
    path.write_text(good + "\n" + good + "\n" + good[:40] + "\n")
    with pytest.raises(ValueError, match=r"cut.jsonl:3: not JSON"):
        load_spans([path])


def test_missing_file_and_directory_are_refused(tmp_path):
    with pytest.raises(OSError, match="nope.jsonl"):
        load_spans([tmp_path / "nope.jsonl"])
    with pytest.raises(ValueError, match="is a directory"):
        load_spans([tmp_path])
    with pytest.raises(ValueError, match="empty path"):
        load_spans([""])
