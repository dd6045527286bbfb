"""Round-record JSON: round trip, optional fields, and validation errors naming round index and field."""

import json
import os

import pytest

from services.gateway.rounds import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_FILE_BYTES,
    Round,
    RoundLog,
    dump_rounds,
    load_rounds,
    parse_rounds,
)


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


def write(tmp_path, text, name="rounds.json"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def good_text(**top):
    return json.dumps(document(GOOD, **top))


@pytest.mark.parametrize("version", [True, 1.0, "1"])
def test_version_must_be_the_integer_one(version):
    with pytest.raises(ValueError, match=f"'version'={version!r}"):
        parse_rounds(document(GOOD, version=version))


@pytest.mark.parametrize(("text", "key"), [
    ('{"format": "dspark-rounds", "version": 1, "version": 1, "rounds": []}', "'version'"),
    (good_text().replace('"accepted": 1', '"accepted": 1, "accepted": 0'), "'accepted'"),
    (good_text().replace('"source": "test"', '"source": "a", "source": "b"'), "'source'"),
])
def test_duplicate_keys_are_rejected_naming_key_and_file(tmp_path, text, key):
    with pytest.raises(ValueError, match=f"rounds.json: .*duplicate key {key}"):
        load_rounds(write(tmp_path, text))


@pytest.mark.parametrize("workload", [" ", "\t\n", "overall", "Overall", " OVERALL "])
def test_blank_and_reserved_workloads_are_rejected(workload):
    with pytest.raises(ValueError, match="round 0: field 'workload'="):
        parse_rounds(document({**GOOD, "workload": workload}))


@pytest.mark.parametrize(("literal", "message"), [
    ("NaN", "non-finite number NaN"),
    ("-Infinity", "non-finite number -Infinity"),
    ("1e400", "number '1e400' is out of float range"),
])
def test_non_finite_numbers_are_rejected_anywhere(tmp_path, literal, message):
    in_metadata = good_text().replace('"test"', literal)
    in_round = good_text().replace("2.5", literal)
    for text in (in_metadata, in_round):
        with pytest.raises(ValueError, match=f"rounds.json: .*{message}"):
            load_rounds(write(tmp_path, text))


@pytest.mark.parametrize(("metadata", "message"), [
    ({"x": float("nan")}, "'metadata.x'=nan must be a finite number"),
    ({"x": [1.0, float("inf")]}, "'metadata.x\\[1\\]'=inf"),
    ({1: "one"}, "non-string key 1"),
    ({"x": {(1, 2): 3}}, "non-string key \\(1, 2\\)"),
    ({"x": {1, 2}}, "has a set"),
])
def test_metadata_that_would_not_round_trip_is_rejected(metadata, message):
    with pytest.raises(ValueError, match=message):
        parse_rounds(document(GOOD, metadata=metadata))
    with pytest.raises(ValueError, match=message):
        RoundLog((), metadata)


def test_metadata_nesting_is_bounded():
    deep = []
    for _ in range(150):
        deep = [deep]
    with pytest.raises(ValueError, match="nests deeper than 100 levels"):
        RoundLog((), {"deep": deep})


def test_metadata_round_trips_exactly(tmp_path):
    log = RoundLog((Round("code", (1.0,), 1, 1),), {"a": [1, 2.5, None, True, "x"], "b": {"c": -0.0}})
    assert load_rounds(write(tmp_path, dump_rounds(log))) == log


@pytest.mark.parametrize("field_name", ["confidence_logits", "draft_ms", "anchor_margin"])
def test_huge_integers_in_a_round_name_the_field(tmp_path, field_name):
    huge = "1" * 400
    text = good_text().replace('"submitted": 3', f'"submitted": 3, "{field_name}": {huge}')
    if field_name == "confidence_logits":
        text = good_text().replace("2.5", huge)
    with pytest.raises(ValueError, match=f"rounds.json: round 0: field '{field_name}'.*\\(400 digits\\) must be"):
        load_rounds(write(tmp_path, text))


def test_integer_literal_past_4300_digits_names_the_file(tmp_path):
    with pytest.raises(ValueError, match="rounds.json: .*integer literal of 5000 digits"):
        load_rounds(write(tmp_path, good_text().replace("2.5", "1" * 5000)))


def test_deeply_nested_json_names_the_file(tmp_path):
    with pytest.raises(ValueError, match="rounds.json: .*nested too deeply"):
        load_rounds(write(tmp_path, "[" * 200_000))


def test_non_utf8_file_names_the_file(tmp_path):
    path = tmp_path / "latin1.json"
    path.write_bytes(good_text().replace("test", "caf\u00e9").encode("latin-1"))
    with pytest.raises(ValueError, match="latin1.json: not UTF-8 text"):
        load_rounds(path)


def test_empty_path_is_rejected():
    with pytest.raises(ValueError, match="path is empty"):
        load_rounds("")


def test_directory_and_device_are_refused_without_reading(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path}: is a directory"):
        load_rounds(tmp_path)
    if os.path.exists("/dev/zero"):
        with pytest.raises(ValueError, match="/dev/zero: is not a regular file"):
            load_rounds("/dev/zero")


def test_file_over_the_size_limit_is_refused_naming_file_and_size(tmp_path):
    path = tmp_path / "big.json"
    with open(path, "wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)  # sparse: no disk used, never read
    with pytest.raises(ValueError, match=f"big.json: {MAX_FILE_BYTES + 1} bytes exceeds the {MAX_FILE_BYTES} byte"):
        load_rounds(path)


def test_missing_file_raises_oserror_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.json"):
        load_rounds(tmp_path / "missing.json")


def test_empty_round_list_round_trips():
    assert parse_rounds(document()).rounds == ()
