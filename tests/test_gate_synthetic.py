"""Synthetic rounds: the tilting hits the reference accept rates (docs/architecture.md §12), logits
stay in their buckets, output is deterministic."""

import pytest

from services.gateway.gate import bucket_index
from services.gateway.rounds import dump_rounds
from services.analysis.synthetic import (
    BUCKET_BOUNDS,
    BUCKET_MATCH_RATES,
    MAX_ROUNDS,
    TARGET_ACCEPT_RATES,
    expected_accept_rate,
    generate,
    main,
    tilted_weights,
)


def test_expected_accept_rate_by_hand():
    # q = 0.5: (0.5 + 0.25 + 0.125 + 0.0625 + 0.03125) / 5 = 0.19375
    assert expected_accept_rate(0.5) == pytest.approx(0.19375)
    assert expected_accept_rate(1.0) == 1.0


@pytest.mark.parametrize("workload", list(TARGET_ACCEPT_RATES))
def test_tilted_weights_hit_the_seed_accept_rate(workload):
    weights = tilted_weights(TARGET_ACCEPT_RATES[workload])
    assert sum(weights) == pytest.approx(1.0)
    match_prob = sum(w * r for w, r in zip(weights, BUCKET_MATCH_RATES))
    assert expected_accept_rate(match_prob) == pytest.approx(TARGET_ACCEPT_RATES[workload], abs=1e-9)


def test_repeat_uses_only_the_rate_one_buckets():
    assert tilted_weights(1.0) == pytest.approx((0, 0, 0, 0, 14 / 50, 36 / 50))


def test_harder_workloads_shift_weight_to_low_confidence():
    low = [tilted_weights(TARGET_ACCEPT_RATES[w])[0] for w in ("code", "prose", "math")]
    assert low == sorted(low)


REACHABLE = "must be in [0.049985, 0.999828] or exactly 1.0"


@pytest.mark.parametrize("target", [0.01, 0.9999, 1.5, float("inf"), float("nan"), -1.0, True, "0.5"])
def test_unreachable_target_is_rejected_with_the_reachable_range(target):
    with pytest.raises(ValueError) as info:
        tilted_weights(target)
    assert str(info.value) == f"target accept rate {target!r} unreachable: {REACHABLE}"


def test_the_stated_range_edges_are_reachable():
    for target in (0.049985, 0.999828):
        match_prob = sum(w * r for w, r in zip(tilted_weights(target), BUCKET_MATCH_RATES))
        assert expected_accept_rate(match_prob) == pytest.approx(target, abs=1e-9)


@pytest.mark.parametrize(("args", "message"), [
    ((0.5, 0), "block_size=0"),
    ((0.5, 2.0), "block_size=2.0"),
    ((1.5,), "match_prob=1.5"),
    ((float("nan"),), "match_prob=nan"),
])
def test_expected_accept_rate_validates(args, message):
    with pytest.raises(ValueError, match=message):
        expected_accept_rate(*args)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"seed": -1}, "seed=-1"),
    ({"seed": 2**128}, "seed=340282366920938463463374607431768211456"),
    ({"seed": 1.0}, "seed=1.0"),
    ({"rounds_per_workload": 0}, "rounds_per_workload=0"),
    ({"rounds_per_workload": -5}, "rounds_per_workload=-5"),
    ({"rounds_per_workload": MAX_ROUNDS + 1}, f"rounds_per_workload={MAX_ROUNDS + 1}"),
])
def test_generate_validates_seed_and_rounds(kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(**kwargs)


def test_rounds_follow_the_procedure():
    log = generate(seed=3, rounds_per_workload=50)
    assert [len(rs) for rs in log.workloads().values()] == [50, 50, 50, 50]
    for r in log.rounds:
        assert r.submitted == len(r.confidence_logits) == 5
        assert all(BUCKET_BOUNDS[0][0] <= c < BUCKET_BOUNDS[-1][1] for c in r.confidence_logits)
        assert all(round(c, 4) == c for c in r.confidence_logits)
    repeat = log.workloads()["repeat"]
    assert all(r.accepted == 5 and min(map(bucket_index, r.confidence_logits)) >= 4 for r in repeat)


def test_same_seed_same_bytes_other_seed_other_bytes():
    first = dump_rounds(generate(seed=11, rounds_per_workload=20))
    assert dump_rounds(generate(seed=11, rounds_per_workload=20)) == first
    assert dump_rounds(generate(seed=12, rounds_per_workload=20)) != first


def test_entry_point_writes_the_file(tmp_path, capsys):
    out = tmp_path / "rounds.json"
    assert main(["--out", str(out), "--seed", "5", "--rounds", "10"]) == 0
    assert out.read_text() == dump_rounds(generate(seed=5, rounds_per_workload=10))
    assert "code: realised" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "message"), [
    (["--seed", "-1"], "--seed='-1' must be an integer in [0, 2**128)"),
    (["--seed", "٣"], "--seed='٣' must be an integer in [0, 2**128)"),
    (["--rounds", "-5"], "--rounds='-5' must be an integer in [1, 100000]"),
    (["--rounds", "0"], "--rounds='0' must be an integer in [1, 100000]"),
])
def test_entry_point_rejects_bad_flags_without_writing(tmp_path, capsys, args, message):
    out = tmp_path / "rounds.json"
    assert main(["--out", str(out), *args]) == 2
    assert capsys.readouterr().err == f"synthetic: error: {message}\n"
    assert not out.exists()


@pytest.mark.parametrize("where", ["missing/dir/x.json", ".", ""])
def test_entry_point_reports_an_unwritable_out_path(tmp_path, capsys, monkeypatch, where):
    monkeypatch.chdir(tmp_path)
    assert main(["--out", where, "--rounds", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("synthetic: error: ") and err.count("\n") == 1
    assert (f"--out {where!r}" if where else "--out is an empty path") in err
