"""Round-record JSON: round trip, optional fields, and validation errors naming round index and field."""

import json

import pytest

from services.gateway.rounds import FORMAT_NAME, FORMAT_VERSION, Round, RoundLog, dump_rounds, load_rounds, parse_rounds


def document(*rounds, **top):
    header = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "metadata": {"source": "test"}}
    return {**header, "rounds": list(rounds), **top}


GOOD = {"workload": "code", "confidence_logits": [2.5, 0.25, -1.0], "submitted": 3, "accepted": 1}


def test_round_trip_keeps_every_field(tmp_path):
    log = RoundLog(
        (
            Round("code", (2.5, 0.25, -1.0), 3, 1, anchor_margin=7.5, draft_ms=190.0, verify_ms=620.5, plain_ms=301.0),
            Round("math", (0.0, 1.0), 1, 0),
            Round("prose", (), 0, 0, anchor_margin=0.5),  # margin-skipped: nothing drafted
        ),
        {"source": "unit", "block_size": 5},
    )
    path = tmp_path / "rounds.json"
    path.write_text(dump_rounds(log))
    assert load_rounds(path) == log
    assert json.loads(path.read_text())["rounds"][1] == {
        "workload": "math", "confidence_logits": [0.0, 1.0], "submitted": 1, "accepted": 0}


def test_optional_fields_may_be_null_or_absent():
    log = parse_rounds(document({**GOOD, "anchor_margin": None, "verify_ms": None}, GOOD))
    assert log.rounds[0] == log.rounds[1]
    assert log.rounds[0].anchor_margin is None


def test_workloads_group_in_order_of_first_appearance():
    rounds = [{**GOOD, "workload": w} for w in ("b", "a", "b")]
    groups = parse_rounds(document(*rounds)).workloads()
    assert list(groups) == ["b", "a"]
    assert len(groups["b"]) == 2


@pytest.mark.parametrize(("change", "field"), [
    ({"accepted": 4}, "'accepted'=4"),
    ({"submitted": 4, "accepted": 0}, "'submitted'=4"),
    ({"submitted": -1}, "'submitted'=-1"),
    ({"accepted": True}, "'accepted'=True"),
    ({"accepted": 1.0}, "'accepted'=1.0"),
    ({"confidence_logits": [1.0, "x", 2.0]}, "'confidence_logits'[1]='x'"),
    ({"confidence_logits": [1.0, float("nan"), 2.0]}, "'confidence_logits'[1]=nan"),
    ({"confidence_logits": 3.0}, "'confidence_logits' must be a list"),
    ({"workload": ""}, "'workload'=''"),
    ({"anchor_margin": -0.1}, "'anchor_margin'=-0.1"),
    ({"draft_ms": "fast"}, "'draft_ms'='fast'"),
    ({"extra": 1}, "unknown field(s) ['extra']"),
])
def test_invalid_round_names_index_and_field(change, field):
    with pytest.raises(ValueError) as info:
        parse_rounds(document(GOOD, GOOD, {**GOOD, **change}))
    assert str(info.value).startswith("round 2: ")
    assert field in str(info.value)


def test_missing_field_is_named():
    bad = {k: v for k, v in GOOD.items() if k != "submitted"}
    with pytest.raises(ValueError, match="round 0: missing field 'submitted'"):
        parse_rounds(document(bad))


@pytest.mark.parametrize(("doc", "message"), [
    ([], "top level must be an object"),
    (document(format="other"), "'format'='other'"),
    (document(version=2), "'version'=2"),
    (document(rounds={}), "'rounds' must be a list"),
    (document(metadata=[]), "'metadata' must be an object"),
    (document(GOOD, note="x"), "unknown top-level key"),
])
def test_invalid_top_level_is_named(doc, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_rounds(doc)


def test_load_names_the_file_on_bad_json(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json: not JSON"):
        load_rounds(path)
    path.write_text(json.dumps(document({**GOOD, "accepted": 9})))
    with pytest.raises(ValueError, match="broken.json: round 0: field 'accepted'=9"):
        load_rounds(path)
