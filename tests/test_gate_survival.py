"""The survival estimate the gate prices a block with (docs/gate.md §4, services/gateway/survival.py).

Covers: censoring and the hazard / survival arithmetic on a hand-computed 3-round example; a
dependent acceptance process (a position after an accepted one accepts more often) that the
conditional estimate recovers and the pooled per-bucket rate and the product of marginals
get measurably wrong; monotonicity in confidence and in the position; the length rule priced
by the survival curve; the settings' and functions' errors.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from services.analysis.references import decide_length, expected_tokens, survival_of
from services.gateway.decision import CostModel, length_decision
from services.gateway.gate import BUCKET_EDGES, NUM_BUCKETS, Calibration, Gate, GateConfig
from services.analysis.references import HindsightGate, hindsight_hazards
from services.gateway.rounds import Round
from services.gateway.survival import GREEDY_BAND, SurvivalEstimator, survival_from_hazards

SEED_COST = CostModel(196.0, 300.0, 109.0, 303.0)
HIGH, MID = 4.0, 1.0  # confidence logits in buckets 4 ([3, 6)) and 2 ([0.5, 1.5))


def _hand_gate(classes: int = 2) -> Gate:
    """Three verified rounds through a gate without forgetting (decay 1)."""
    gate = Gate(GateConfig(decay=1.0, position_classes=classes))
    gate.observe([HIGH] * 5, 5, 5)                    # positions 0..4 observed, all accepted
    gate.observe([HIGH, MID, HIGH, HIGH, HIGH], 3, 1)  # 0 accepted, 1 missed; 2 is past the miss, 3-4 past submitted
    gate.observe([MID, HIGH, HIGH, HIGH, HIGH], 2, 2)  # 0 and 1 accepted; 2-4 past submitted, never compared
    return gate


def test_censoring_counts_only_positions_that_were_compared():
    table = _hand_gate().survival_estimator.band(GREEDY_BAND)
    # class 0 (position 0): bucket 4 accepted 2 of 2, bucket 2 accepted 1 of 1
    assert (table.matched[0][4], table.observed[0][4], table.matched[0][2], table.observed[0][2]) == (2, 2, 1, 1)
    # class 1 (positions 1+): bucket 4 accepted 5 of 5 (4 in round 1, 1 in round 3), bucket 2 missed 1 of 1
    assert (table.matched[1][4], table.observed[1][4], table.matched[1][2], table.observed[1][2]) == (5, 5, 0, 1)
    assert sum(map(sum, table.observed)) == 9  # 5 + 2 + 2 positions compared, none past a miss or submitted
    assert (table.pooled.matched[4], table.pooled.observed[4], table.pooled.matched[2], table.pooled.observed[2]) \
        == (7, 7, 1, 2)


def test_hazards_and_survival_by_hand():
    gate = _hand_gate()
    # Pooled (w0 = 1): bucket 2 (1 + 1) / (2 + 1) = 2/3, bucket 4 (7 + 1) / (7 + 1) = 1, bucket 3 from its
    # neighbours (1 + 7 + 1) / (2 + 7 + 1) = 0.9; buckets 0-1 are held to bucket 2's 2/3 by the monotone fit.
    assert gate.estimates() == pytest.approx((2 / 3, 2 / 3, 2 / 3, 0.9, 1.0, 1.0))
    h0, h1 = gate.hazards()
    # Cells (w1 = 3 pseudo-observations of the pooled rate): class 0 bucket 2 (1 + 3 * 2/3) / (1 + 3) = 0.75;
    # class 1 bucket 2 (0 + 2) / (1 + 3) = 0.5, below buckets 0-1 (2/3, weight 3 each): pooled by the
    # monotone fit to (2 + 2 + 2) / 10 = 0.6.
    assert h0 == pytest.approx((2 / 3, 2 / 3, 0.75, 0.9, 1.0, 1.0))
    assert h1 == pytest.approx((0.6, 0.6, 0.6, 0.9, 1.0, 1.0))
    s = gate.survival([MID, HIGH, MID])
    assert s == pytest.approx((0.75, 0.75, 0.45))
    # One class is the pooled per-bucket rate at every position: the product of those rates.
    assert _hand_gate(classes=1).survival([MID, HIGH, MID]) == pytest.approx((2 / 3, 2 / 3, 4 / 9))
    assert _hand_gate(classes=1).hazards() == (gate.estimates(),)


def _dependent_rounds(n: int, seed: int = 7) -> list[tuple[list[float], int]]:
    """Blocks of 3 drafts at one confidence: position 0 is accepted with 0.5; a later position
    with 0.9 when every earlier one was accepted and 0.1 otherwise (the verifier never sees that
    case, but it makes each position's marginal P(match) 0.5, 0.5 and 0.5)."""
    rng = np.random.default_rng(seed)
    rounds = []
    for _ in range(n):
        u = rng.random(3)
        matches, alive = [], True
        for j in range(3):
            p = 0.5 if j == 0 else (0.9 if alive else 0.1)
            matches.append(bool(u[j] < p))
            alive = alive and matches[-1]
        rounds.append(([HIGH] * 3, matches.index(False) if False in matches else 3))
    return rounds


def test_conditional_estimate_recovers_a_dependent_process_where_products_err():
    truth = (0.5, 0.45, 0.405)
    conditional, pooled = Gate(GateConfig(decay=1.0)), Gate(GateConfig(decay=1.0, position_classes=1))
    for conf, accepted in _dependent_rounds(4000):
        conditional.observe(conf, 3, accepted)
        pooled.observe(conf, 3, accepted)
    got = conditional.survival([HIGH] * 3)
    assert np.abs(np.array(got) - truth).max() < 0.03
    # The pooled rate mixes position 0's 0.5 with the later 0.9s: (0.5 + 0.45 + 0.405) / 1.95 = 0.695.
    flat = pooled.survival([HIGH] * 3)
    assert flat[0] - truth[0] > 0.15 and truth[2] - flat[2] > 0.04
    # The product of the true marginals (0.5 each) misses the dependence the other way.
    marginals = survival_of([0.5, 0.5, 0.5])
    assert truth[1] - marginals[1] > 0.15 and truth[2] - marginals[2] > 0.25
    # Priced: E[tokens(3)] = 1 + sum S = 2.355; the marginals say 1.875, the pooled rate about 2.52.
    assert 1 + sum(got) == pytest.approx(2.355, abs=0.05)
    assert expected_tokens([0.5] * 3, 3) == pytest.approx(1.875)


def test_survival_is_monotone_in_position_and_confidence_whatever_was_observed():
    rng = random.Random(3)
    for _ in range(100):
        gate = Gate(GateConfig(decay=rng.choice([0.8, 0.9, 1.0])))
        for _ in range(rng.randrange(20)):
            conf = [rng.uniform(-2, 8) for _ in range(5)]
            submitted = rng.randrange(1, 6)
            gate.observe(conf, submitted, rng.randrange(submitted + 1))
        for row in gate.hazards():
            assert all(0.0 <= a <= b <= 1.0 for a, b in zip(row, row[1:]))
        conf = [rng.uniform(-2, 8) for _ in range(5)]
        s = gate.survival(conf)
        assert all(0.0 <= b <= a <= 1.0 for a, b in zip((1.0, *s), s))
        raised = gate.survival([c + 3.0 for c in conf])  # every position more confident
        assert all(r >= x - 1e-12 for r, x in zip(raised, s))


def test_a_cold_gate_survives_everywhere_and_warm_start_lends_pooled_counts():
    assert Gate(GateConfig()).survival([-3.0, 0.0, 9.0]) == (1.0, 1.0, 1.0)
    warm = Gate(GateConfig(), Calibration((0.0,) * NUM_BUCKETS, (0.0, 0.0, 0.0, 0.0, 10.0, 0.0)))
    # Bucket 4 lent 0 of 10: pooled (0 + 1 * 1.0) / (10 + 1) = 1/11, and every cell starts at the pooled rate.
    assert warm.survival([HIGH, HIGH]) == pytest.approx((1 / 11, 1 / 121))


def test_the_gate_prices_its_block_by_the_survival():
    gate = Gate(GateConfig(enabled=True, decay=1.0, win_factor=1.0))
    for conf, accepted in _dependent_rounds(400):
        gate.observe(conf, 3, accepted)
    s = gate.survival([HIGH] * 3)
    assert gate.choose([HIGH] * 3, 3).k == length_decision(s, 3, gate.cost, 1.0, 0, gate.rate())[0]
    # Hand case under the seed costs at the plain rate: S = (0.5, 0.45, 0.405) drafts the whole block
    # (each position adds S_j - 109 / 303 > 0); the marginals 0.5 each stop after one draft.
    assert length_decision((0.5, 0.45, 0.405), 3, SEED_COST, 1.0)[0] == 3
    assert decide_length([0.5, 0.5, 0.5], 3, SEED_COST, 1.0) == 1


def test_hindsight_gate_takes_the_true_hazards_per_class():
    rounds = [Round("w", (HIGH,) * 3, 3, a) for _, a in _dependent_rounds(2000)]
    hazards = hindsight_hazards(rounds, 3)
    assert hazards[0][4] == pytest.approx(0.5, abs=0.03) and hazards[1][4] == pytest.approx(0.9, abs=0.03)
    gate = HindsightGate(GateConfig(), [0.7] * NUM_BUCKETS, hazards)
    assert gate.survival([HIGH] * 2) == pytest.approx(survival_from_hazards(hazards, [4, 4]))
    assert HindsightGate(GateConfig(), [0.7] * NUM_BUCKETS).survival([HIGH] * 2) == pytest.approx((0.7, 0.49))
    with pytest.raises(ValueError, match=r"hazards\[1\]"):
        HindsightGate(GateConfig(), [0.7] * NUM_BUCKETS, [[0.5] * NUM_BUCKETS, [2.0] * NUM_BUCKETS])


@pytest.mark.parametrize("value", [0, 17, 2.5, True, "3", None])
def test_position_classes_outside_1_to_16_are_refused(value):
    with pytest.raises(ValueError, match="position_classes="):
        GateConfig(position_classes=value)


def test_bad_inputs_raise_naming_the_value():
    with pytest.raises(ValueError, match=r"survival\[1\]=0.6"):
        length_decision([0.5, 0.6], 2, SEED_COST)[0]  # rises: not a survival curve
    with pytest.raises(ValueError, match=r"survival\[0\]=nan"):
        length_decision([float("nan")], 1, SEED_COST)[0]
    with pytest.raises(ValueError, match="NaN"):
        Gate(GateConfig()).survival([1.0, float("nan")])
    with pytest.raises(ValueError, match="position classes=0"):
        SurvivalEstimator(BUCKET_EDGES, 0, 0.9, 1.0)


def test_bands_keep_separate_counts():
    est = SurvivalEstimator(BUCKET_EDGES, 3, 1.0, 1.0)
    est.observe([HIGH, HIGH], 1, band="coupled:T(0.5,1]:unfiltered")
    assert est.survival([HIGH, HIGH], GREEDY_BAND) == (1.0, 1.0)  # the greedy band saw nothing
    assert est.buckets([-0.5, 0.5, 6.0, HIGH]) == [1, 2, 5, 4]  # lower edge inclusive, as the gate's buckets
    hot = est.survival([HIGH, HIGH], "coupled:T(0.5,1]:unfiltered")
    assert hot[0] < 1.0 and hot[1] < hot[0]


def test_a_budgeted_verify_carries_the_gates_survival():
    from services.gateway.round_policy import RoundPolicy

    gate = Gate(GateConfig(decay=1.0))
    for conf, accepted in _dependent_rounds(400):
        gate.observe(conf, 3, accepted)
    conf = [HIGH, HIGH, MID, HIGH]
    trim = RoundPolicy("gated", gate, None, None, 64, 32, budget="trim")
    assert trim.survival(conf, 3) == gate.survival(conf[:3])  # the curve the length choice priced
    assert trim.survival(conf, 3)[0] == pytest.approx(0.5, abs=0.06)  # not the pooled rate's 0.70
    assert RoundPolicy("gated", gate, None, None, 64, 32).survival(conf, 3) is None  # budget off
