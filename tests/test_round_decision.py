"""A round's record carries its length decision's inputs and outputs (survival per position,
lambda, value(k) per k, the step budget's cut, a probe's priced loss, a lent losing streak): the
recorded-rounds file keeps them, `dspark replay` re-decides from them, and `dspark trace-report
--rounds` explains a round in one line."""

from __future__ import annotations

import dataclasses

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.analysis.report import why_lines
from services.analysis.traces import Span
from services.gateway.gate import PROBE_FIRST, Calibration, Gate, GateConfig, Reason, Streak
from services.gateway.record import RoundRecord
from services.gateway.scheduler import _decision_attributes
from services.cli import main
from services.analysis.replay import redecide, redecided
from services.gateway.rounds import Round, RoundLog, dump_rounds, parse_rounds, decode_rounds_json

CONF_HIGH, CONF_LOW = (4.0, 3.5, 3.0, 2.0, 1.0), (4.0, -1.0, -1.0, -1.0, -1.0)


def _taught_gate() -> Gate:
    """An enabled gate that has seen confident positions accepted and doubtful ones rejected,
    so it cuts a block whose tail is doubtful."""
    gate = Gate(GateConfig(enabled=True))
    for _ in range(30):
        gate.observe(CONF_HIGH, 5, 5)
        gate.observe(CONF_LOW, 5, 1)
    return gate


def _record(gate: Gate, conf, accepted: int) -> RoundRecord:
    choice = gate.choose(conf, 5)
    return RoundRecord(Reason.COST if choice.cut else Reason.FULL, 5, choice.k, min(accepted, choice.k), gate.cost,
                       confidence_logits=conf, choice=choice)


def test_the_recorded_inputs_re_decide_the_submitted_length_through_a_file():
    gate = _taught_gate()
    records = [_record(gate, CONF_HIGH, 5), _record(gate, CONF_LOW, 1)]
    assert [r.submitted for r in records] == [5, 1]  # the doubtful tail is cut
    rounds = [r.to_round("w") for r in records]
    back = parse_rounds(decode_rounds_json(dump_rounds(RoundLog(tuple(rounds))))).rounds
    assert back == tuple(rounds)
    for rec, r in zip(records, back):
        assert r.survival == rec.choice.survival and r.values == rec.choice.values and r.rate == rec.choice.rate
        assert len(r.values) == 6 and r.survival[0] >= r.survival[-1]
        assert redecide(r, gate.config) == rec.submitted
    assert redecided(back, gate.config) == (2, 2)
    # another win factor re-decides differently: the inputs, not the outcome, decide
    assert redecide(back[1], GateConfig(enabled=True, win_factor=100.0)) == 5
    assert redecide(Round("w", CONF_HIGH, 5, 5), gate.config) is None  # an older file: no inputs


def test_one_line_says_why_from_the_record_and_from_the_span():
    gate = _taught_gate()
    rec = _record(gate, CONF_LOW, 1)
    line = rec.why()
    assert line.startswith("submitted 1 of 5 (cost); lambda ") and "; S 1.00 0.0" in line and "; value(k) 0:" in line
    assert line.endswith("accepted 1")
    cut = RoundRecord(Reason.FULL, 5, 2, 1, gate.cost, confidence_logits=CONF_HIGH, choice=rec.choice, asked=5)
    assert "the step budget cut 5 to 2" in cut.why()
    span = Span("spec_decode.round", "ab" * 16, "cd" * 8, None, 10, 20, {
        "spec_decode.round": 3, "spec_decode.gate_reason": "cost", "spec_decode.submitted": 1,
        "spec_decode.drafted": 5, "spec_decode.accepted": 1, "spec_decode.survival": list(rec.choice.survival),
        "spec_decode.lambda": rec.choice.rate, "spec_decode.values": list(rec.choice.values)})
    assert why_lines([span]) == [f"{'ab' * 6} round 3: {line}"]


@pytest.mark.parametrize("field, value, named", [
    ("survival", (1.5,), "'survival'"), ("survival", (0.5,) * 6, "'survival'"),
    ("values", (float("nan"),), "'values'"), ("rate", -1.0, "'rate'")])
def test_bad_decision_fields_are_refused_naming_them(field, value, named):
    with pytest.raises(ValueError, match=named):
        Round("w", CONF_HIGH, 5, 5, **{field: value})


# ---------------------------------------------------------------------------- probes and lent streaks
# A drafter whose draft costs ten plain steps: a probe of one draft is dear (docs/gate.md §5b).
DEAR = GateConfig(enabled=True, draft_ms=240.0, verify_base_ms=20.0, verify_slope_ms=10.0, plain_ms=24.0)
NEVER = (0.0,) * 5  # bucket 1, never accepted below


def _losing_gate(streak: Streak | None = None) -> Gate:
    """A dear gate whose band lent it (when `streak`) recent rounds that lose."""
    return Gate(DEAR, Calibration((0.0,) * 6, (0.0, 10.0, 0.0, 0.0, 0.0, 0.0), [NEVER] * 4, streak))


def _sdk_span(record: RoundRecord):
    """`record` through the scheduler's real span code: an OpenTelemetry SDK span, exported."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("test").start_as_current_span("spec_decode.round") as span:
        span.set_attribute("spec_decode.round", 7)
        for key, value in (("drafted", record.drafted), ("submitted", record.submitted),
                           ("accepted", record.accepted), ("gate_reason", record.reason.value)):
            span.set_attribute(f"spec_decode.{key}", value)
        _decision_attributes(span, record)
    return exporter.get_finished_spans()[0]


def _round_span(record: RoundRecord) -> Span:
    """The exported span of `record` as `dspark trace-report` reads it (ids fixed for the line)."""
    return Span("spec_decode.round", "ab" * 16, "cd" * 8, None, 10, 20, dict(_sdk_span(record).attributes))


def test_a_probe_round_records_its_priced_loss_through_file_span_and_replay():
    gate = _losing_gate()
    skips = [gate.pre_draft(None) for _ in range(PROBE_FIRST)]
    assert skips == [Reason.RECENT_LOSS] * (PROBE_FIRST - 1) + [None]  # the probe is due
    loss = gate.probe_loss()
    assert loss == pytest.approx((240.0 + 30.0 - 24.0) / 24.0 - gate.survival([0.0])[0], rel=1e-12)
    choice = gate.choose(NEVER, 5)
    # without the probe's floor the rule would cut to 0: a probe verifies one draft
    assert (choice.k, choice.probe, choice.probe_loss) == (1, True, pytest.approx(loss, rel=1e-12))
    assert max(range(6), key=lambda k: choice.values[k]) == 0
    rec = RoundRecord(Reason.COST, 5, 1, 0, gate.cost, confidence_logits=NEVER, choice=choice)
    line = rec.why()
    assert line.startswith(f"submitted 1 of 5 (cost); probe priced {loss:.3g} tokens; lambda ")
    (back,) = parse_rounds(decode_rounds_json(dump_rounds(RoundLog((rec.to_round("w"),))))).rounds
    assert back.probe and back.probe_loss == choice.probe_loss and back.lent_streak is None
    assert redecide(back, gate.config) == 1  # the probe's floor re-decides it
    assert redecide(dataclasses.replace(back, probe_loss=None), gate.config) == 0  # an ordinary round: cut to 0
    span = _round_span(rec)
    assert span.attr("spec_decode.probe_loss") == choice.probe_loss and span.attr("spec_decode.lent_streak") is None
    assert why_lines([span]) == [f"{'ab' * 6} round 7: {line}"]
    # the next round is no probe: nothing recorded of one
    gate.observe(NEVER, 1, 0)
    assert gate.pre_draft(None) is Reason.RECENT_LOSS


def test_a_round_skipped_under_a_lent_streak_says_so(tmp_path, capsys):
    gate = _losing_gate(Streak(since=3, gap=40))
    assert gate.probing.lent and gate.streak() == Streak(3, 40)
    assert gate.pre_draft(None) is Reason.RECENT_LOSS  # the band's streak goes on: no cold first draft
    rec = RoundRecord(Reason.RECENT_LOSS, 0, 0, 0, gate.cost, anchor_margin=2.0, plain_ms=24.0,
                      lent_streak=gate.probing.lent)
    line = rec.why()
    assert line == "submitted 0 of 0 (recent_loss); in a losing streak lent by its band; accepted 0"
    text = dump_rounds(RoundLog((rec.to_round("w"),)))
    assert '"lent_streak": true' in text
    (back,) = parse_rounds(decode_rounds_json(text)).rounds
    assert back.lent_streak is True and not back.probe and back.confidence_logits == ()
    assert why_lines([_round_span(rec)]) == [f"{'ab' * 6} round 7: {line}"]
    # and through `dspark trace-report --rounds` on the span file the SDK's exporter format writes
    done = _sdk_span(rec)
    path = tmp_path / "spans.jsonl"
    path.write_text(done.to_json(indent=None) + "\n")
    assert main(["trace-report", "--rounds", str(path)]) == 0
    trace = f"{done.context.trace_id:032x}"[:12]
    assert capsys.readouterr().out == f"{trace} round 7: {line}\n"
    # a fresh generation's skip is its own streak, not lent; the file omits the key
    own = RoundRecord(Reason.RECENT_LOSS, 0, 0, 0, gate.cost, lent_streak=_losing_gate().probing.lent)
    assert '"lent_streak"' not in dump_rounds(RoundLog((own.to_round("w"),))) and "lent" not in own.why()


def test_a_lent_streak_ends_when_a_round_drafts_on_its_merits():
    gate = Gate(GateConfig(enabled=True), Calibration((0.0,) * 6, (0.0,) * 6, [(8.0,) * 5], Streak(0, 16)))
    assert gate.probing.lent and gate.pre_draft(None) is None  # cold estimates: drafting pays
    choice = gate.choose((8.0,) * 5, 5)
    assert (choice.k, choice.probe, choice.probe_loss) == (5, False, None)
    assert not gate.probing.lent and gate.probing.gap == PROBE_FIRST


def test_an_older_file_without_the_new_keys_still_loads():
    text = '{"format": "dspark-rounds", "version": 1, "metadata": {}, "rounds": [' \
           '{"workload": "w", "confidence_logits": [1.0], "submitted": 1, "accepted": 1, "values": [0.1, 0.2],' \
           ' "survival": [0.9], "rate": 0.003}]}'
    (r,) = parse_rounds(decode_rounds_json(text)).rounds
    assert (r.probe_loss, r.lent_streak, r.probe) == (None, None, False)


@pytest.mark.parametrize("field, value", [("probe_loss", float("inf")), ("probe_loss", True), ("probe_loss", "1"),
                                          ("lent_streak", 1), ("lent_streak", "true")])
def test_bad_probe_and_streak_fields_are_refused_naming_them(field, value):
    with pytest.raises(ValueError, match=f"'{field}'"):
        Round("w", CONF_HIGH, 5, 5, **{field: value})
