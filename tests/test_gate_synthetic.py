"""Synthetic rounds: the tilting hits the seed's accept rates, logits stay in their buckets, output is deterministic."""

import pytest

from services.gateway.gate import bucket_index
from services.gateway.rounds import dump_rounds
from services.gateway.synthetic import (
    BUCKET_BOUNDS,
    BUCKET_MATCH_RATES,
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


def test_unreachable_target_is_rejected():
    with pytest.raises(ValueError, match="outside"):
        tilted_weights(0.01)


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
