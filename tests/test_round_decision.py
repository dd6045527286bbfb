"""A round's record carries its length decision's inputs and outputs (survival per position,
lambda, value(k) per k, the step budget's cut): the recorded-rounds file keeps them, `dspark
replay` re-decides from them, and `dspark trace-report --rounds` explains a round in one line."""

from __future__ import annotations

import pytest

from services.analysis.report import why_lines
from services.analysis.traces import Span
from services.gateway.gate import Gate, GateConfig, Reason
from services.gateway.record import RoundRecord
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
