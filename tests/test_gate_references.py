"""Replay reference policies: best fixed k, the calibrated gate in hindsight, the per-round oracle;
the headline fractions and the ECE (docs/gate.md §10)."""

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from services.analysis.calibration import expected_calibration_error
from services.cli import COST_SHAPES
from services.gateway.gate import NUM_BUCKETS, CostModel, GateConfig
from services.analysis.references import (
    HindsightGate,
    best_fixed_k,
    hindsight_rates,
    oracle_lengths,
    replay_fixed_k,
    replay_hindsight,
    replay_oracle,
    replayed_round,
)
from services.analysis.replay import replay_log, report_to_dict
from services.gateway.rounds import Round, RoundLog, load_rounds

DATA = Path(__file__).parent / "data"
HI, LO = 8.0, -2.0  # a confidence logit in the top bucket (5) and one in the bottom bucket (0)
# draft 10 ms, verify 20 + 5·n ms, plain 25 ms: cost(n) = 30 + 5n, a cut after drafting 35 ms.
COST = CostModel(10.0, 20.0, 5.0, 25.0)
MIXED = [Round("w", (HI, HI, HI), 3, 3), Round("w", (HI, LO, HI), 3, 1),
         Round("w", (LO, HI, HI), 3, 0), Round("w", (HI, HI, LO), 3, 2)]


def tok_s(tokens, ms):
    return 1000.0 * tokens / ms


def test_fixed_k_by_hand():
    # k=0: four plain steps. k=1..3: every round costs 30 + 5k ms, accepted min(a, k).
    expected = {0: tok_s(4, 100), 1: tok_s(2 + 2 + 1 + 2, 4 * 35), 2: tok_s(3 + 2 + 1 + 3, 4 * 40),
                3: tok_s(4 + 2 + 1 + 3, 4 * 45)}
    for k, rate in expected.items():
        assert replay_fixed_k(MIXED, COST, k).tok_s == pytest.approx(rate, rel=1e-12)
    k, stats = best_fixed_k(MIXED, COST)
    assert (k, stats.tok_s) == (2, pytest.approx(56.25, rel=1e-12))
    with pytest.raises(ValueError, match="k=-1"):
        replay_fixed_k(MIXED, COST, -1)


@pytest.mark.parametrize("costs", ["seed", "cheap"])
def test_best_fixed_k_is_the_argmax_over_every_k(costs):
    cost = COST_SHAPES[costs]
    for rounds in load_rounds(DATA / "synthetic_rounds.json").workloads().values():
        rates = [replay_fixed_k(rounds, cost, k).tok_s for k in range(6)]
        k, stats = best_fixed_k(rounds, cost)
        assert stats.tok_s == max(rates) and k == rates.index(max(rates))


def test_hindsight_rates_count_censored_positions():
    rates = hindsight_rates(MIXED)
    # top bucket: 3 (round 1) + 1 + 0 + 2 matches, all observed; bottom: 3 misses (rounds 2, 3, 4).
    # Round 2's third position (HI, after a miss) is censored and not counted.
    assert rates.observed[5] == 6 and rates.matched[5] == 6
    assert rates.observed[0] == 3 and rates.matched[0] == 0
    assert rates.rates[5] == 1.0 and rates.rates[0] == 0.0
    assert rates.rates[1:5] == (6 / 9,) * 4  # never observed: the pooled rate


def test_calibrated_gate_in_hindsight_by_hand():
    # True rates 1.0 (top bucket) and 0.0 (bottom): full blocks on HI rounds and a cut to 0
    # after drafting on rounds that open with LO, under any rule that prices a sure miss.
    cost = CostModel(10.0, 60.0, 5.0, 25.0)  # cost(3) = 85 ms, a cut after drafting 35 ms
    rounds = [Round("w", (HI, HI, HI), 3, 3), Round("w", (LO, LO, LO), 3, 0),
              Round("w", (HI, HI, HI), 3, 3), Round("w", (LO, HI, HI), 3, 0)]
    config = GateConfig(draft_ms=10.0, verify_base_ms=60.0, verify_slope_ms=5.0, plain_ms=25.0)
    rates, stats = replay_hindsight(rounds, config)
    assert (rates.rates[5], rates.rates[0]) == (1.0, 0.0)
    assert (stats.tokens, stats.time_ms) == (4 + 1 + 4 + 1, 85 + 35 + 85 + 35)
    assert stats.tok_s == pytest.approx(tok_s(10, 240))
    assert replay_oracle(rounds, cost).tok_s == pytest.approx(tok_s(10, 85 + 25 + 85 + 25))


def test_hindsight_gate_keeps_its_rates_and_learns_nothing():
    rates = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)
    gate = HindsightGate(GateConfig(), rates)
    gate.observe((HI, HI, HI), 3, 0)
    gate.choose((LO, LO), 2)
    assert gate.estimates() == rates
    with pytest.raises(ValueError, match="need 6 buckets"):
        HindsightGate(GateConfig(), (0.5,))
    with pytest.raises(ValueError, match=r"rates\[2\]=1.5"):
        HindsightGate(GateConfig(), (0.5, 0.5, 1.5, 0.5, 0.5, 0.5))


def test_oracle_by_hand_drops_rounds_below_the_best_rate():
    # cost(n) = 50 + 5n ms, plain 25 ms. The a=2 round beats plain on its own (3 tokens / 60 ms,
    # 50 tok/s against 40), but gains 2 tokens for 35 ms more, below the best total rate: the
    # oracle takes it as a plain step: (4 + 4 + 1) tokens / (65 + 65 + 25) ms.
    cost = CostModel(30.0, 20.0, 5.0, 25.0)
    rounds = [Round("w", (HI,) * 3, 3, 3), Round("w", (HI,) * 3, 3, 3), Round("w", (HI,) * 3, 3, 2)]
    assert oracle_lengths(rounds, cost) == [3, 3, None]
    assert replay_oracle(rounds, cost).tok_s == pytest.approx(tok_s(9, 155), rel=1e-12)
    assert tok_s(9, 155) > tok_s(11, 190)  # taking every round that beats plain is worse


def brute_force_best(rounds, cost):
    """Best total tok/s over every subset of rounds drafted with k = accepted (the rest plain)."""
    best = 0.0
    for choice in itertools.product([False, True], repeat=len(rounds)):
        recs = [replayed_round(r, r.accepted if c and r.accepted and r.confidence_logits else None, cost)
                for r, c in zip(rounds, choice)]
        best = max(best, tok_s(sum(x.committed for x in recs), sum(x.modelled_ms for x in recs)))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_oracle_equals_brute_force_on_random_rounds(seed):
    rng = np.random.default_rng(seed)
    rounds = []
    for _ in range(int(rng.integers(1, 11))):
        submitted = int(rng.integers(0, 6))
        rounds.append(Round("w", (HI,) * 5, submitted, int(rng.integers(0, submitted + 1))))
    cost = CostModel(*rng.uniform(1.0, 300.0, size=4))
    assert replay_oracle(rounds, cost).tok_s == pytest.approx(brute_force_best(rounds, cost), rel=1e-12)


@pytest.mark.parametrize("name", ["synthetic_rounds.json", "bundled_rounds.json"])
@pytest.mark.parametrize("costs", ["seed", "cheap"])
def test_oracle_never_submits_a_miss_and_bounds_every_policy(name, costs):
    cost = COST_SHAPES[costs]
    config = GateConfig(**{k: getattr(cost, k) for k in ("draft_ms", "verify_base_ms", "verify_slope_ms", "plain_ms")})
    report = replay_log(load_rounds(DATA / name), config)
    for w, rounds in zip(report.workloads, load_rounds(DATA / name).workloads().values()):
        for rec, n in zip(rounds, oracle_lengths(rounds, cost)):
            assert n is None or replayed_round(rec, n, cost).accepted == n >= 1
        oracle = w.references.results["oracle"].tok_s
        others = [r.tok_s for r in w.results.values()] + [r.tok_s for r in w.references.results.values()]
        assert oracle == max(others), w.name


def test_report_json_carries_references_headline_and_ece():
    report = replay_log(load_rounds(DATA / "synthetic_rounds.json"), GateConfig(), costs="seed")
    doc = json.loads(json.dumps(report_to_dict(report), allow_nan=False))
    assert doc["costs"] == "seed"
    prose = next(w for w in doc["workloads"] if w["workload"] == "prose")
    gated, always = prose["policies"]["gated"]["tok_s"], prose["policies"]["always-k"]["tok_s"]
    calibrated, oracle = (prose["references"][p]["tok_s"] for p in ("calibrated-hindsight", "oracle"))
    assert prose["headline"] == pytest.approx({"calibrated_gain": calibrated / always - 1,
                                               "of_calibrated_gain": (gated - always) / (calibrated - always),
                                               "of_oracle_gap": (gated - always) / (oracle - always)})
    assert prose["references"]["best-fixed-k"]["k"] == 0
    assert len(prose["references"]["calibrated-hindsight"]["bucket_rates"]) == NUM_BUCKETS
    buckets = prose["calibration"]["buckets"]
    assert sum(b["observed"] for b in buckets) == sum(
        min(r.accepted + 1, r.submitted) for r in load_rounds(DATA / "synthetic_rounds.json").workloads()["prose"])
    assert prose["calibration"]["ece"] == pytest.approx(sum(
        b["observed"] / sum(c["observed"] for c in buckets) * abs(b["mean_estimate"] - b["realised"])
        for b in buckets if b["observed"]))
    repeat = doc["workloads"][0]
    assert repeat["headline"]["of_calibrated_gain"] is None  # no room: calibrated = always-k
    assert doc["overall"]["references"]["best-fixed-k"]["k"] is None  # workloads differ (5 and 0)


def test_references_can_be_left_out():
    log = RoundLog(tuple(MIXED))
    report = replay_log(log, GateConfig(), references=False)
    assert report.workloads[0].references is None
    assert report_to_dict(report)["workloads"][0]["headline"] is None


def test_ece_by_hand_and_its_errors():
    # realised 1/4 and 9/10; estimates 0.5 and 0.9: (4 * 0.25 + 10 * 0) / 14.
    assert expected_calibration_error([0.5, 0.9], [1, 9], [4, 10]) == pytest.approx(1 / 14)
    assert expected_calibration_error([None, 0.2], [0, 1], [0, 5]) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="one entry per bucket"):
        expected_calibration_error([0.5], [1, 2], [3, 4])
    with pytest.raises(ValueError, match="zero observations"):
        expected_calibration_error([0.5], [0], [0])
    with pytest.raises(ValueError, match="bucket 0: estimate=1.5"):
        expected_calibration_error([1.5], [1], [2])
    with pytest.raises(ValueError, match="matched=3 <= observed=2"):
        expected_calibration_error([0.5], [3], [2])


def test_gate_shapes_names_each_missed_aim_and_sums_the_shortfall():
    from bench.gate_shapes import misses, shape_rows

    row = {"file": "f", "shape": "seed", "workload": "math", "vs_plain": 0.9, "vs_always": 1.2, "headline": 0.5,
           "warm_vs_plain": 1.1, "warm_vs_always": 1.0, "warm_headline": None}
    lines, short = misses([row])
    assert lines == ["f                seed  math    cold: x plain 0.9000, headline 50%"]
    assert short == pytest.approx(0.1 + 0.3)
    # a workload label from a rounds file cannot put an escape sequence on the terminal
    lines, _ = misses([{**row, "workload": "m\x1b[2Jx"}])
    assert lines == ["f                seed  m\\x1b[2Jxcold: x plain 0.9000, headline 50%"]
    lines, _ = misses([{**row, "vs_plain": 0.99999}])  # a miss never prints as the 1.0000 it misses
    assert lines == ["f                seed  math    cold: x plain 0.9999, headline 50%"]
    rows = shape_rows("synthetic:3", "cheap")  # drawn in memory, labelled by its seed
    assert [(r["file"], r["workload"]) for r in rows] == [("synthetic:3", w) for w in ("repeat", "code", "prose", "math")]
    for bad in ("synthetic:x", "synthetic:\u0663", "synthetic:" + "9" * 40):
        with pytest.raises(ValueError, match="the seed must be a non-negative integer"):
            shape_rows(bad, "cheap")
