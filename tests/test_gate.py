"""Gate: cost model, decision rule on hand-computed cases, buckets, censoring, decay, prior, scope, stats."""

import dataclasses

import numpy as np
import pytest

from services.gateway.gate import (
    BUCKET_EDGES,
    NUM_BUCKETS,
    Calibration,
    CostModel,
    Gate,
    GateConfig,
    LengthChoice,
    bucket_index,
    bucket_label,
    PROBE_FIRST,
)
from services.analysis.references import decide_length, expected_tokens
from services.gateway.record import GateStats, Reason, RoundRecord, RoundStats, drafted_reason

SEED_COST = CostModel()  # draft 196, verify 300 + 109 n, plain 303 (ms)
# One logit inside each bucket, lowest first.
LOGIT_IN_BUCKET = (-2.0, 0.0, 1.0, 2.0, 4.0, 8.0)


def always_k_tok_s(accept_rate: float, k: int = 5) -> float:
    """Reference always-k (docs/architecture.md §12): every round submits k drafts and yields
    accept_rate * k + 1 tokens."""
    return 1000.0 * (accept_rate * k + 1) / SEED_COST.round_ms(k)


@pytest.mark.parametrize(
    ("accept_rate", "seed_tok_s"),
    [(1.0, 5.76), (0.825, 4.92), (0.40, 2.88), (0.175, 1.80)],
)
def test_cost_model_reproduces_seed_always_k_table(accept_rate, seed_tok_s):
    assert round(always_k_tok_s(accept_rate), 2) == seed_tok_s


def test_cost_model_plain_rate_and_full_round_match_seed():
    assert round(1000.0 / SEED_COST.round_ms(0), 2) == 3.30
    assert SEED_COST.round_ms(5) == 1041.0  # 196 + 300 + 5 * 109 (docs/architecture.md §12)
    # docs/architecture.md §12: 7 zero-accept rounds cost 5.2 s more than plain decoding would.
    assert round(7 * (SEED_COST.round_ms(5) - SEED_COST.plain_ms) / 1000, 1) == 5.2


def test_cost_model_counts_drafts_and_skip_after_draft_pays_the_draft():
    assert SEED_COST.verify_ms(1) == 409.0  # n counts drafts: 300 + 109 * 1
    assert SEED_COST.round_ms(1) == 605.0
    assert SEED_COST.skipped_after_draft_ms() == 499.0  # 196 + 303


def test_expected_tokens_hand_computed():
    # p = [0.5, 0.5, 0.5]: 1 + 0.5 + 0.25 + 0.125 = 1.875
    assert expected_tokens([0.5, 0.5, 0.5], 3) == pytest.approx(1.875)
    # p = [0.9, 0.5, 1.0]: n=2 -> 1 + 0.9 + 0.45 = 2.35; n=3 adds 0.45 * 1.0 -> 2.8
    assert expected_tokens([0.9, 0.5, 1.0], 2) == pytest.approx(2.35)
    assert expected_tokens([0.9, 0.5, 1.0], 3) == pytest.approx(2.8)
    assert expected_tokens([0.3], 0) == 1.0  # the plain (or bonus) token only
    with pytest.raises(ValueError, match="n=2"):
        expected_tokens([0.3], 2)


def test_argmax_all_matches_drafts_full_block():
    # p = 1: E(n) = n + 1; rate(5) = 6 / 1041 = 5.76/s beats rate(0) = 1 / 303 = 3.30/s.
    assert decide_length([1.0] * 5, 5, SEED_COST) == 5


def test_argmax_half_matches_cuts_to_zero():
    # The draft is paid either way: value(n) = E[tokens(n)] - (draft + verify(n) or draft + plain)
    # / 303 ms. p = 0.5: E = 1, 1.5, 1.75, ... over 499, 605, 714, ... ms -> values -0.647,
    # -0.497, -0.606, ...: one draft is worth verifying (0.5 tokens for 106 ms more than a plain
    # step). p = 0.3: E = 1, 1.3, 1.39 -> -0.647, -0.697, -0.966, ...: the cut to 0 wins by
    # 2.0 tokens over the full block, beyond the 0.15 * E(5) = 0.21 margin.
    assert decide_length([0.5] * 5, 5, SEED_COST) == 1
    assert decide_length([0.3] * 5, 5, SEED_COST) == 0


def test_truncation_within_the_win_factor_keeps_full_block():
    # p = [1, 1, 1, 1, 0]: E(4) = E(5) = 5; n=4 saves 109 ms = 0.36 tokens at 1/303 tokens per ms.
    # The margin asks for (margin - 1) * E(5): 0.75 tokens at 1.15 -> full block; 0.25 at 1.05.
    probs = [1.0, 1.0, 1.0, 1.0, 0.0]
    assert decide_length(probs, 5, SEED_COST, win_factor=1.15) == 5
    assert decide_length(probs, 5, SEED_COST, win_factor=1.05) == 4


def test_win_factor_applies_to_zero():
    # One draft, p = 0.3: value(0) = 1 - 499/303 = -0.647, value(1) = 1.3 - 605/303 = -0.697.
    # n=0 is better by 0.050 tokens, short of the margin's 0.15 * E(1) = 0.195, so the draft is
    # verified; with margin 1.0, n=0 is taken.
    assert decide_length([0.3], 1, SEED_COST) == 1
    assert decide_length([0.3], 1, SEED_COST, win_factor=1.0) == 0


def test_floor_bounds_submitted_drafts():
    # The floor a probe sets (1 draft) generalised. p = 0.5 (rates above): floor=1 -> best of n=1..4 is n=1 (2.479/s), 2.479/1.891 = 1.31 > 1.15.
    assert decide_length([0.5] * 5, 5, SEED_COST, floor=1) == 1
    # floor=2 -> n=2 (2.451/s), 2.451/1.891 = 1.30 > 1.15.
    assert decide_length([0.5] * 5, 5, SEED_COST, floor=2) == 2
    # p = 0.2: E(3) = 1.248, E(4) = 1.2496, E(5) = 1.24992 -> 1.516, 1.341, 1.201/s; n=0 excluded.
    assert decide_length([0.2] * 5, 5, SEED_COST, floor=3) == 3
    assert decide_length([0.2] * 5, 5, SEED_COST, floor=0) == 0


def test_floor_above_cap_is_capped():
    # floor = min(floor, max_n): with max_n = 2 the gate submits 2 although p = 0.2.
    assert decide_length([0.2] * 5, 2, SEED_COST, floor=4) == 2


def test_cap_is_respected_and_zero_cap_returns_zero():
    assert decide_length([1.0] * 5, 3, SEED_COST) == 3
    assert decide_length([1.0] * 5, 0, SEED_COST) == 0
    assert decide_length([], 0, SEED_COST, floor=2) == 0
    with pytest.raises(ValueError, match="max_n=6"):
        decide_length([1.0] * 5, 6, SEED_COST)


def test_decide_length_rejects_bad_probability():
    with pytest.raises(ValueError, match="outside"):
        decide_length([1.2, 0.5], 2, SEED_COST)
    with pytest.raises(ValueError, match="outside"):
        decide_length([float("nan"), 0.5], 2, SEED_COST)


@pytest.mark.parametrize(
    ("logit", "bucket"),
    [(-0.5001, 0), (-0.5, 1), (0.4999, 1), (0.5, 2), (1.5, 3), (2.9999, 3), (3.0, 4), (6.0, 5), (float("inf"), 5),
     (float("-inf"), 0)],
)
def test_bucket_edges_lower_inclusive(logit, bucket):
    assert BUCKET_EDGES == (-0.5, 0.5, 1.5, 3.0, 6.0)
    assert bucket_index(logit) == bucket


def test_bucket_labels_and_nan():
    assert [bucket_label(i) for i in range(NUM_BUCKETS)] == [
        "< -0.5", "[-0.5, 0.5)", "[0.5, 1.5)", "[1.5, 3.0)", "[3.0, 6.0)", ">= 6.0"]
    with pytest.raises(ValueError, match="NaN"):
        bucket_index(float("nan"))


def enabled(**kw) -> GateConfig:
    return GateConfig(enabled=True, **kw)


def length_record(gate, logits, choice, accepted=0):
    """The record of a round whose length `gate` chose, as the scheduler makes it."""
    return RoundRecord(drafted_reason(len(logits), choice), len(logits), choice.k, min(accepted, choice.k),
                       gate.cost, confidence_logits=tuple(logits))


def observe(gate, logits, submitted, accepted, stats):
    """gate.observe, with the verified round's record folded into `stats`."""
    gate.observe(logits, submitted, accepted)
    stats.add(length_record(gate, logits, LengthChoice(submitted, submitted), accepted))


def test_cold_gate_drafts_the_full_block():
    gate = Gate(enabled())
    assert gate.estimates() == (1.0,) * NUM_BUCKETS
    for logit in LOGIT_IN_BUCKET:
        assert gate.choose([logit] * 5, 5).k == 5


def test_unobserved_bucket_keeps_the_prior_after_other_buckets_learn():
    gate = Gate(enabled())
    for _ in range(20):
        gate.observe([0.0] * 5, 5, 0)  # bucket 1 misses at position 0
    est = gate.estimates()
    assert est[1] < 0.2
    # Buckets 0 and 2 borrow bucket 1's rate (their neighbour), bounded by the monotone fit:
    # bucket 0 can be no better than bucket 1. Buckets 3..5 have no observed neighbour and
    # keep the optimistic prior.
    assert est[0] <= est[1] and est[2] == est[1]
    assert est[3] == est[4] == est[5] == 1.0
    assert gate.choose([0.0] * 5, 5).k == 0
    assert gate.choose([-3.0] * 5, 5).k == 0  # below a bucket that misses: truncated too
    assert gate.choose([8.0] * 5, 5).k == 5  # never observed, no observed neighbour: not truncated


def test_censoring_records_prefix_and_first_miss_only():
    gate, stats = Gate(enabled(decay=1.0)), RoundStats()
    # buckets 5, 4, 2, 0, 0: accepted 2 of 5 -> bucket 5, 4 matched, bucket 2 missed, rest unknown
    observe(gate, [8.0, 4.0, 1.0, -2.0, -2.0], 5, 2, stats)
    assert stats.gate.bucket_observed == [0, 0, 1, 0, 1, 1]
    assert stats.gate.bucket_matched == [0, 0, 0, 0, 1, 1]
    # all submitted accepted: no miss recorded; the positions after `submitted` are never recorded
    observe(gate, [0.0, 0.0, -2.0, -2.0, -2.0], 2, 2, stats)
    assert stats.gate.bucket_observed == [0, 2, 1, 0, 1, 1]
    assert stats.gate.bucket_matched == [0, 2, 0, 0, 1, 1]
    assert list(gate.calibration().observed) == stats.gate.bucket_observed  # decay 1: the gate's own counts
    # (matched + mu) / (observed + 1), mu the neighbours' pooled rate with one optimistic
    # pseudo-observation: bucket 1 = (2 + (0 + 1)/(1 + 1)) / 3, bucket 2 = (0 + (2 + 1)/(2 + 1))
    # / 2 = 0.5; they violate monotonicity, so the fit pools them into (2.5 + 1) / (3 + 2) = 0.7,
    # and unobserved buckets 0 and 3 are bounded by (and lifted to) the fit around them.
    assert gate.estimates()[:4] == pytest.approx((0.7, 0.7, 0.7, 0.7))


def simulate_stream(true_rates, rounds, seed):
    """Rounds of 5 positions, uniform buckets, matching with the bucket's true rate, censored."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(rounds):
        buckets = rng.integers(0, NUM_BUCKETS, size=5)
        hits = rng.random(5) < np.asarray(true_rates)[buckets]
        accepted = int(np.argmin(hits)) if not hits.all() else 5
        out.append(([LOGIT_IN_BUCKET[b] for b in buckets], accepted))
    return out


def test_censored_estimates_converge_and_counting_unknowns_as_misses_is_biased():
    true_rates = (0.2, 0.65, 0.79, 0.89, 1.0, 1.0)  # reference bucket table (docs/architecture.md §12)
    stream = simulate_stream(true_rates, rounds=6000, seed=7)
    gate = Gate(enabled(decay=1.0))
    naive_matched, naive_observed = np.zeros(NUM_BUCKETS), np.zeros(NUM_BUCKETS)
    for logits, accepted in stream:
        gate.observe(logits, 5, accepted)
        for pos, logit in enumerate(logits):  # the biased rule: every position after a miss is a miss
            naive_observed[bucket_index(logit)] += 1
            naive_matched[bucket_index(logit)] += pos < accepted
    censored_error = np.abs(np.array(gate.estimates()) - true_rates)
    naive_bias = np.array(true_rates) - naive_matched / naive_observed
    assert censored_error.max() < 0.03
    assert naive_bias.min() > 0.05  # every bucket biased down ...
    assert naive_bias[4:].min() > 0.3  # ... the rate-1 buckets most: they sit after earlier misses


def test_decay_follows_a_workload_shift():
    fast, slow = Gate(enabled(decay=0.9)), Gate(enabled(decay=1.0))
    for gate in (fast, slow):
        for _ in range(50):
            gate.observe([1.0], 1, 1)  # bucket 2 always matches
        for _ in range(30):
            gate.observe([1.0], 1, 0)  # then always misses
    # decay 0.9: matched = 9.95 * 0.9^30 = 0.42, observed = 0.42 + 9.58 = 10.0 -> (0.42 + 1) / 11.0
    assert fast.estimates()[2] == pytest.approx(0.129, abs=0.005)
    # decay 1.0: (50 + 1) / (80 + 1)
    assert slow.estimates()[2] == pytest.approx(51 / 81)


def test_decay_is_applied_per_observed_round_only():
    gate = Gate(enabled(decay=0.5))
    gate.observe([1.0], 1, 1)
    gate.choose([1.0] * 5, 5).k
    gate.observe([1.0] * 5, 0, 0)  # nothing submitted: no observation, no decay
    assert gate.calibration().observed[2] == 1.0
    gate.observe([1.0], 1, 0)
    assert gate.calibration().observed[2] == 1.5  # 1 * 0.5 + 1
    assert gate.calibration().matched[2] == 0.5


def test_disabled_gate_submits_max_n_but_keeps_learning():
    gate = Gate(GateConfig(enabled=False))
    for _ in range(10):
        gate.observe([0.0] * 5, 5, 0)
    assert gate.estimates()[1] < 0.2
    choice = gate.choose([0.0] * 5, 4)
    assert choice.k == 4
    stats = RoundStats()
    stats.add(length_record(gate, [0.0] * 5, choice))
    assert stats.gate.truncated == stats.gate.skipped_after_draft == 0


def test_gate_choose_length_rejects_cap_beyond_drafts():
    with pytest.raises(ValueError, match="max_n=3"):
        Gate(enabled()).choose([1.0, 1.0], 3).k
    assert Gate(enabled()).choose([], 0).k == 0


def test_gate_probe_never_returns_zero_after_draft():
    gate = Gate(enabled())
    for _ in range(20):
        gate.observe([-2.0] * 5, 5, 0)
    assert gate.choose([-2.0] * 5, 5).k == 0  # on its merits: cut to 0
    gate.probing.pending = True  # the pre-draft decision let this losing round draft as a probe
    loss = gate.probe_loss()
    choice = gate.choose([-2.0] * 5, 5)
    assert choice.k == 1 and choice.probe and choice.probe_loss == loss
    assert Gate(enabled()).choose([-2.0] * 5, 0).k == 0


@pytest.mark.parametrize(("gate_on", "threshold", "margin", "drafts"), [
    (True, 0.0, 0.1, True),   # threshold 0 disables the pre-draft gate
    (True, 4.0, 3.9, False),
    (True, 4.0, 4.0, True),   # below, not at, the threshold
    (False, 4.0, 3.9, False),  # independent of DSPARK_GATE
    (False, 4.0, None, True),  # margin unknown
])
def test_pre_draft_margin_gate(gate_on, threshold, margin, drafts):
    gate = Gate(GateConfig(enabled=gate_on, margin_threshold=threshold))
    assert gate.pre_draft(margin) is (None if drafts else Reason.ANCHOR_MARGIN)
    stats = run_rounds(Gate(gate.config), [(margin, [8.0] * 5, 5, 5)])
    assert stats.gate.rounds == 1
    assert stats.gate.margin_skipped_rounds == (0 if drafts else 1)


def test_pre_draft_margin_gate_rejects_nan():
    with pytest.raises(ValueError, match="NaN"):
        Gate(GateConfig(margin_threshold=4.0)).pre_draft(float("nan"))


def run_rounds(gate, rounds, stats=None):
    """rounds: (margin, logits, max_n, accepted_if_all_submitted) -> drive one gate like the
    scheduler, folding each round's record into `stats` (a new RoundStats when None); returns it."""
    stats = RoundStats() if stats is None else stats
    for margin, logits, max_n, accepted in rounds:
        skip = gate.pre_draft(margin)
        if skip is not None:
            stats.add(RoundRecord(skip, 0, 0, 0, gate.cost, anchor_margin=margin))
            continue
        choice = gate.choose(logits, max_n)
        gate.observe(logits, choice.k, min(accepted, choice.k))
        stats.add(length_record(gate, logits, choice, accepted))
    return stats


def test_stats_count_a_scripted_generation():
    gate = Gate(enabled(margin_threshold=2.0))
    for _ in range(12):
        gate.observe([-2.0] * 5, 5, 0)  # teach: bucket 0 always misses at position 0
    stats = run_rounds(gate, [
        (1.0, [8.0] * 5, 5, 5),                       # margin-skipped
        (5.0, [8.0] * 5, 5, 5),                       # full block, all accepted
        (5.0, [8.0, 8.0, -2.0, -2.0, -2.0], 5, 2),    # truncated to 2, both accepted
        (5.0, [-2.0] * 5, 5, 0),                      # skipped after draft
        (5.0, [8.0, 8.0, 8.0], 3, 0),                 # capped at 3, zero accepted
    ])
    s = stats.gate.to_dict()
    assert (s["rounds"], s["margin_skipped_rounds"], s["drafted_rounds"], s["verified_rounds"]) == (5, 1, 4, 3)
    assert (s["drafted"], s["submitted"], s["accepted"]) == (18, 10, 7)
    assert (s["truncated"], s["skipped_after_draft"]) == (1, 1)
    assert (s["zero_accept_rounds"], s["zero_accept_cost_ms"]) == (1, 196 + 300 + 3 * 109 - 303)
    assert s["acceptance_rate"] == pytest.approx(0.7)
    assert s["mean_acceptance_length"] == pytest.approx(10 / 3)
    assert s["buckets"][5] == {"range": ">= 6.0", "observed": 8, "matched": 7, "match_rate": 7 / 8}
    assert s["buckets"][0]["match_rate"] is None


def test_stats_merge_into_process_totals():
    a, b = Gate(GateConfig()), Gate(GateConfig())  # disabled: every round submits max_n
    a_stats = run_rounds(a, [(None, [8.0] * 5, 5, 5)])
    b_stats = run_rounds(b, [(None, [0.0] * 5, 5, 1), (None, [0.0] * 5, 5, 0)])
    total = GateStats()
    total.merge(a_stats.gate)
    total.merge(b_stats.gate)
    assert (total.rounds, total.submitted, total.accepted, total.zero_accept_rounds) == (3, 15, 6, 1)
    assert total.bucket_observed == [0, 3, 0, 0, 0, 5]
    assert total.bucket_matched == [0, 1, 0, 0, 0, 5]


def test_gates_are_independent_per_generation():
    config = enabled()
    one, other = Gate(config), Gate(config)
    for _ in range(20):
        one.observe([0.0] * 5, 5, 0)
    assert other.estimates() == (1.0,) * NUM_BUCKETS
    assert other.choose([0.0] * 5, 5).k == 5
    assert one.choose([0.0] * 5, 5).k == 0


def test_warm_start_from_a_frozen_calibration_snapshot():
    process = GateStats()
    teacher, taught = Gate(enabled()), RoundStats()
    for _ in range(40):
        observe(teacher, [0.0] * 5, 5, 0, taught)
    process.merge(taught.gate)
    snapshot = process.calibration(max_weight=10.0)
    assert snapshot.observed[1] == 10.0 and snapshot.matched[1] == 0.0  # 40 misses scaled to 10
    warm = Gate(enabled(), calibration=snapshot)
    assert warm.estimates()[1] == pytest.approx(1 / 11)
    assert warm.choose([0.0] * 5, 5).k == 0
    warm.observe([0.0] * 5, 5, 5)
    assert snapshot.observed[1] == 10.0  # the snapshot is never written back
    assert Gate(enabled(), calibration=snapshot).estimates()[1] == pytest.approx(1 / 11)


def test_gate_to_dict_reports_estimates_and_weights():
    gate = Gate(enabled(decay=1.0))
    gate.observe([1.0, 1.0], 2, 1)
    buckets = gate.to_dict()["buckets"]
    assert buckets[2]["weight"] == 2.0
    assert buckets[2]["estimate"] == pytest.approx(2 / 3)  # (1 + 1) / (2 + 1), mu = 1 (no neighbours seen)
    assert buckets[3]["estimate"] == pytest.approx(2 / 3)  # mu = 1/2 from bucket 2, lifted to stay monotone
    assert buckets[5]["estimate"] == 1.0


NAN = float("nan")


def snapshot(gate):
    """Everything a failed call must leave unchanged: the decayed counts (the gate keeps no others)."""
    return gate.calibration()


def taught_gate(gate_on=True):
    gate = Gate(GateConfig(enabled=gate_on, decay=0.5))
    gate.observe([1.0, 2.0, 8.0], 3, 1)
    return gate


@pytest.mark.parametrize(("confidences", "submitted", "accepted", "message"), [
    ([1.0] * 3, 1.5, 1, "submitted=1.5"),
    ([1.0] * 3, 2, 1.0, "accepted=1.0"),
    ([1.0] * 3, True, 0, "submitted=True"),
    ([1.0] * 3, "2", 1, "submitted='2'"),
    ([1.0] * 3, 2, None, "accepted=None"),
    ([1.0] * 3, 3, 4, "accepted=4"),
    ([1.0, NAN, 1.0], 3, 2, "NaN"),
    ([1.0, 1.0, NAN], 1, 0, "NaN"),  # every drafted position is checked, recorded or not
    ([1.0, "x"], 2, 1, "confidence logit \\[1\\]='x'"),
    ("abc", 1, 0, "sequence of numbers"),
    (5.0, 1, 0, "sequence of numbers"),
])
def test_observe_validates_everything_before_changing_state(confidences, submitted, accepted, message):
    gate = taught_gate()
    before = snapshot(gate)
    with pytest.raises(ValueError, match=message):
        gate.observe(confidences, submitted, accepted)
    assert snapshot(gate) == before


def test_observe_accepts_numpy_counts_and_stores_plain_ints():
    gate, stats = Gate(enabled(decay=1.0)), RoundStats()
    observe(gate, np.array([8.0, 8.0]), np.int64(2), np.int32(1), stats)
    assert (stats.gate.submitted, stats.gate.accepted) == (2, 1)
    assert type(stats.gate.submitted) is int and type(stats.gate.accepted) is int
    assert stats.gate.bucket_observed[5] == 2


@pytest.mark.parametrize("gate_on", [True, False])
@pytest.mark.parametrize(("confidences", "max_n", "message"), [
    ([1.0, NAN, 1.0], 3, "NaN"),
    ([1.0, NAN, 1.0], 1, "NaN"),  # NaN beyond the cap still raises
    ([1.0] * 3, 2.5, "max_n=2.5"),
    ([1.0] * 3, True, "max_n=True"),
    ([1.0] * 3, None, "max_n=None"),
    ([1.0] * 3, "2", "max_n='2'"),
    ([1.0] * 3, -1, "max_n=-1"),
    ([1.0] * 3, 4, "max_n=4"),
])
def test_choose_length_validates_before_counting_whether_enabled_or_not(gate_on, confidences, max_n, message):
    gate = taught_gate(gate_on)
    before = snapshot(gate)
    with pytest.raises(ValueError, match=message):
        gate.choose(confidences, max_n).k
    assert snapshot(gate) == before


@pytest.mark.parametrize("gate_on", [True, False])
def test_nan_confidence_raises_through_choose_length_and_observe(gate_on):
    gate = Gate(GateConfig(enabled=gate_on))
    with pytest.raises(ValueError, match="confidence logit \\[0\\] is NaN"):
        gate.choose([NAN, 1.0], 2).k
    with pytest.raises(ValueError, match="confidence logit \\[0\\] is NaN"):
        gate.observe([NAN, 1.0], 2, 1)
    assert gate.calibration() == Gate(GateConfig(enabled=gate_on)).calibration()


def test_choose_length_accepts_numpy_cap_and_huge_integer_logits():
    gate, stats = Gate(enabled()), RoundStats()
    choice = gate.choose([10**400, -(10**400)], np.int64(2))
    assert choice.k == 2  # huge ints bucket as +-inf
    stats.add(length_record(gate, [10**400, -(10**400)], choice))
    assert stats.gate.drafted_rounds == 1


@pytest.mark.parametrize("margin", [NAN, "4", [4.0]])
def test_pre_draft_rejects_bad_margin_without_counting(margin):
    gate, stats = Gate(GateConfig(margin_threshold=4.0)), RoundStats()
    with pytest.raises(ValueError, match="anchor margin"):
        run_rounds(gate, [(margin, [8.0] * 5, 5, 5)], stats)
    assert stats.gate.rounds == 0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"win_factor": NAN}, "win_factor=nan"),
    ({"win_factor": float("inf")}, "win_factor=inf"),
    ({"win_factor": 0.99}, "win_factor=0.99"),
    ({"floor": 1.5}, "floor=1.5"),
    ({"floor": NAN}, "floor=nan"),
    ({"floor": True}, "floor=True"),
    ({"floor": -1}, "floor=-1"),
])
def test_decide_length_rejects_bad_margin_and_floor(kwargs, message):
    with pytest.raises(ValueError, match=message):
        decide_length([0.5] * 5, 5, SEED_COST, **kwargs)


@pytest.mark.parametrize("max_n", [2.5, True, None, "2"])
def test_decide_length_rejects_non_integer_cap(max_n):
    with pytest.raises(ValueError, match=f"max_n={max_n!r} must be an integer"):
        decide_length([0.5] * 5, max_n, SEED_COST)


def test_decide_length_accepts_numpy_arguments():
    assert decide_length(np.full(5, 0.5), np.int64(5), SEED_COST, np.float64(1.15), np.int64(1)) == 1


@pytest.mark.parametrize(("probs", "n", "message"), [
    ([0.5, NAN], 2, "\\[1\\]=nan outside"),
    ([0.5, True], 2, "\\[1\\]=True outside"),
    ([0.5], 1.0, "n=1.0"),
    ([0.5], -1, "n=-1"),
])
def test_expected_tokens_validates(probs, n, message):
    with pytest.raises(ValueError, match=message):
        expected_tokens(probs, n)


@pytest.mark.parametrize(("field", "value", "rule"), [
    ("plain_ms", 0.0, "in \\[0.001, 1e\\+07\\]"),
    ("plain_ms", 5e-324, "in \\[0.001, 1e\\+07\\]"),
    ("draft_ms", -1.0, "in \\[0, 1e\\+07\\]"),
    ("verify_slope_ms", NAN, "finite number"),
    ("verify_base_ms", float("inf"), "finite number"),
    ("draft_ms", 1e306, "in \\[0, 1e\\+07\\]"),
    ("draft_ms", 10**400, "finite number"),
    ("plain_ms", "303", "finite number"),
])
def test_cost_model_rejects_costs_naming_the_field(field, value, rule):
    with pytest.raises(ValueError, match=f"^{field}=.* must be (a )?{rule}"):
        dataclasses.replace(SEED_COST, **{field: value})


def test_cost_model_needs_a_positive_round_cost():
    with pytest.raises(ValueError, match="draft_ms \\+ verify_base_ms \\+ verify_slope_ms = 0"):
        CostModel(0.0, 0.0, 0.0, 303.0)
    with pytest.raises(ValueError, match="n=1.5"):
        SEED_COST.round_ms(1.5)


@pytest.mark.parametrize("max_weight", [NAN, float("inf"), 0.0, -1.0, "10", True])
def test_calibration_rejects_bad_max_weight(max_weight):
    with pytest.raises(ValueError, match="max_weight="):
        GateStats().calibration(max_weight=max_weight)


def test_calibration_snapshot_rejects_nan_counts():
    with pytest.raises(ValueError, match="bucket 2"):
        Calibration((0.0,) * 6, (0.0, 0.0, NAN, 0.0, 0.0, 0.0))


def test_a_bucket_cut_to_zero_is_probed_after_probe_first_rounds():
    # Five verified rounds that all miss at position 0 drive the bucket's estimate low enough
    # that the gate cuts the next rounds to 0. Cut rounds verify nothing, so nothing changes the
    # estimate; the PROBE_FIRST-th round without a verified draft submits one, so a workload
    # that turned good is found again (later probes come at doubling gaps, at most PROBE_PERIOD).
    gate, stats = Gate(GateConfig(enabled=True, decay=0.9)), RoundStats()
    conf = [2.0] * 5  # one bucket for every position
    for _ in range(5):
        observe(gate, conf, 5, 0, stats)
    cuts = 0
    while (choice := gate.choose(conf, 5)).k == 0:
        stats.add(length_record(gate, conf, choice))  # a cut round is over: nothing to verify
        cuts += 1
        assert cuts < 100, gate.estimates()
    assert cuts == PROBE_FIRST - 1 and choice.k >= 1
    assert stats.gate.skipped_after_draft == cuts
    assert stats.gate.verified_rounds == 5  # the cuts observed nothing
