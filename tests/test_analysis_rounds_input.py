"""`dspark calibrate` and `dspark trace-report` read recorded-rounds files (docs/gate.md §9) as
well as span files, telling them apart by content (docs/analysis.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.analysis.report import build_report, recorded_round
from services.analysis.traces import looks_like_rounds
from services.cli import main
from services.gateway.rounds import Round, RoundLog, load_rounds, save_rounds

BUNDLED = Path(__file__).parent / "data" / "bundled_rounds.json"


def timed_log() -> RoundLog:
    """Rounds timed exactly: draft 20 ms, verify 50 + 4·k ms, plain decode 40 ms."""
    rounds = []
    for i in range(12):
        k = 1 + i % 5
        rounds.append(Round("code", (8.0,) * 5, k, min(k, 2), draft_ms=20.0, verify_ms=50.0 + 4.0 * k))
    rounds += [Round("code", (-2.0,) * 5, 0, 0, draft_ms=20.0, plain_ms=40.0)] * 3
    return RoundLog(tuple(rounds), {"source": "test"})


@pytest.fixture
def rounds_path(tmp_path):
    path = tmp_path / "rounds.json"
    save_rounds(timed_log(), path)
    return path


def run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_calibrate_fits_the_recorded_timings(capsys, rounds_path):
    code, out, err = run(capsys, "calibrate", str(rounds_path))
    assert (code, err) == (0, "")
    assert out.splitlines() == ["DSPARK_GATE_DRAFT_MS=20.000", "DSPARK_GATE_VERIFY_BASE_MS=50.000",
                                "DSPARK_GATE_VERIFY_SLOPE_MS=4.000", "DSPARK_GATE_PLAIN_MS=40.000"]


def test_trace_report_json_of_a_rounds_file(capsys, rounds_path):
    code, out, _ = run(capsys, "trace-report", "--json", str(rounds_path))
    doc = json.loads(out)
    assert code == 0 and (doc["spans"], doc["recorded_rounds"], len(doc["rounds"])) == (0, 15, 15)
    assert doc["gate_decisions"]["full"]["rounds"] == 2  # k = 5 of 5 drafted: i = 4, 9
    assert doc["gate_decisions"]["truncated"]["rounds"] == 10
    assert doc["gate_decisions"]["skipped_after_draft"]["rounds"] == 3
    top = doc["reliability"][5]
    # per verified round: positions 0..min(accepted, k - 1) observed; accepted = min(k, 2)
    assert (top["observed"], top["matched"]) == (sum(min(min(1 + i % 5, 2) + 1, 1 + i % 5) for i in range(12)),
                                                 sum(min(1 + i % 5, 2) for i in range(12)))
    assert doc["parts"]["wall_ms"]["n"] == 0  # recorded rounds have no span, so no wall time


def test_trace_report_text_of_the_bundled_rounds(capsys):
    code, out, _ = run(capsys, "trace-report", str(BUNDLED))
    assert code == 0
    assert "0 spans and 1224 recorded rounds from 1 file(s)" in out
    assert "Round time split" not in out  # nothing to split without spans


def test_rounds_and_spans_are_told_apart_by_content(tmp_path, rounds_path):
    assert looks_like_rounds(rounds_path) and looks_like_rounds(BUNDLED)
    spans = tmp_path / "spans.jsonl"
    spans.write_text('{"name": "x", "context": {"trace_id": "0x01", "span_id": "0x02"}}\n')
    renamed = tmp_path / "rounds.jsonl"  # the name does not matter, the content does
    renamed.write_text(rounds_path.read_text())
    assert not looks_like_rounds(spans) and looks_like_rounds(renamed)
    assert not looks_like_rounds(tmp_path) and not looks_like_rounds(tmp_path / "missing")


def test_a_rounds_file_naming_its_format_late_is_still_rounds(capsys, tmp_path):
    # keys in another order, the format past the first 4 KiB: a hand-edited file is still rounds
    doc = json.loads(BUNDLED.read_text())
    late = tmp_path / "late.json"
    late.write_text(json.dumps({"metadata": {**doc["metadata"], "note": "x" * 5000}, "rounds": doc["rounds"],
                                "version": doc["version"], "format": doc["format"]}))
    assert looks_like_rounds(late)
    code, out, _ = run(capsys, "trace-report", str(late))
    assert code == 0 and "0 spans and 1224 recorded rounds from 1 file(s)" in out
    twice = tmp_path / "twice.json"  # a file named twice, or through a link, counts once
    twice.symlink_to(late)
    code, out, _ = run(capsys, "trace-report", str(late), str(late), str(twice))
    assert code == 0 and "0 spans and 1224 recorded rounds from 3 file(s)" in out
    bom = tmp_path / "bom.json"  # a byte-order mark: the rounds reader names it
    bom.write_bytes(b"\xef\xbb\xbf" + BUNDLED.read_bytes())
    code, _, err = run(capsys, "trace-report", str(bom))
    assert code == 2 and "BOM" in err and str(bom) in err
    deep = tmp_path / "deep.json"  # nesting past the decoder's recursion limit inside the sniffed head
    deep.write_text("{" + "[" * 4000)
    code, _, err = run(capsys, "trace-report", str(deep))
    assert code == 2 and str(deep) in err and len(err.splitlines()) == 1
    wide = tmp_path / "wide.json"  # a megabyte key is elided in the error, not printed
    wide.write_text(json.dumps({"k" * (1 << 20): 1}))
    code, _, err = run(capsys, "trace-report", str(wide))
    assert code == 2 and "not a span or an OTLP document" in err and len(err) < 400
    other = tmp_path / "other.json"  # a rounds-shaped object of another format: the rounds reader says so
    other.write_text(json.dumps({**doc, "format": "dspark-spans"}))
    code, _, err = run(capsys, "trace-report", str(other))
    assert code == 2 and "dspark-spans" in err and str(other) in err


def test_a_bad_rounds_file_exits_2_naming_the_file_and_field(capsys, tmp_path):
    doc = json.loads(BUNDLED.read_text())
    doc["rounds"][4]["accepted"] = 9
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    code, _, err = run(capsys, "calibrate", str(bad))
    assert code == 2
    assert err.startswith("dspark calibrate: error: ") and "bad.json" in err and "round 4: field 'accepted'=9" in err


def test_recorded_round_mirrors_the_file():
    rec = load_rounds(BUNDLED).rounds[0]
    row = recorded_round(rec, 0)
    assert (row.submitted, row.accepted, row.verify_ms, row.draft_ms, row.workload) == (
        rec.submitted, rec.accepted, rec.verify_ms, rec.draft_ms, rec.workload)
    assert row.wall_ms is None and row.residual_ms is None
    report = build_report([], ["x"], load_rounds(BUNDLED).rounds)
    assert report.recorded_rounds == len(report.rounds) == 1224
