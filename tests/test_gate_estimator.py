"""The gate's estimator, cost accounting and pre-draft decision (docs/gate.md §2–§6).

Covers: convergence of the bucket estimates to a known match curve under censoring (and the
old estimator's failure of the same test), the causal ECE helper, a cut to 0 charged draft +
decode, the learned pre-draft threshold setting, and a drafter that is always wrong served
through the real services (a scripted gRPC drafter, the real verifier and gateway).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from services.analysis.calibration import causal_ece
from services.gateway.estimator import BucketEstimator, pool_adjacent_violators
from services.gateway.gate import (BUCKET_EDGES, NUM_BUCKETS, PROBE_FIRST, CostModel, Gate, GateConfig,
                                   LengthChoice)
from services.analysis.references import decide_length
from services.gateway.record import Reason, RoundRecord, RoundStats
from services.gateway.rounds import Round, load_rounds
from services.gateway.scheduler import MAX_DEFERRED_ROWS
from services.settings import gate_config

SEED_COST = CostModel(196.0, 300.0, 109.0, 303.0)
LOGIT_IN_BUCKET = (-2.0, 0.0, 1.0, 2.0, 4.0, 8.0)
# A known monotone match curve, and a workload whose low buckets are rare (as in every measured
# table): the case where a prior that does not decay dominates.
TRUE_CURVE = np.array([0.15, 0.35, 0.55, 0.70, 0.85, 0.95])
BUCKET_FREQ = np.array([0.03, 0.05, 0.12, 0.20, 0.25, 0.35])
TOLERANCE = 0.05  # |time-averaged estimate - true rate| per bucket, after warm-up


class OldEstimator:
    """Test-only reference of the replaced estimator: per-round decayed counts (decay 0.9 on
    every verified round, all buckets) plus one undecayed pseudo-observation of mean 1.0."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay, self.m, self.o = decay, np.zeros(NUM_BUCKETS), np.zeros(NUM_BUCKETS)

    def estimates(self) -> tuple[float, ...]:
        return tuple((self.m + 1.0) / (self.o + 1.0))

    def observe(self, logits, submitted: int, accepted: int) -> None:
        if submitted == 0:
            return
        self.m *= self.decay
        self.o *= self.decay
        for pos, c in enumerate(logits[: min(accepted + 1, submitted)]):
            b = int(np.searchsorted(BUCKET_EDGES, c, side="right"))
            self.o[b] += 1.0
            self.m[b] += pos < accepted


def known_curve_rounds(n: int, seed: int) -> list[Round]:
    """n rounds of 5 drafts: buckets drawn with BUCKET_FREQ, each position matching with its
    bucket's TRUE_CURVE rate; accepted = the first miss (censored), all 5 submitted."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        buckets = rng.choice(NUM_BUCKETS, size=5, p=BUCKET_FREQ)
        hits = rng.random(5) < TRUE_CURVE[buckets]
        accepted = 5 if hits.all() else int(np.argmin(hits))
        out.append(Round("known", tuple(LOGIT_IN_BUCKET[b] for b in buckets), 5, accepted))
    return out


def time_averaged_estimates(estimator, rounds: list[Round], warm_up: int) -> np.ndarray:
    """Mean over rounds (after `warm_up`) of the estimates held before each round is observed."""
    held = []
    for i, r in enumerate(rounds):
        if i >= warm_up:
            held.append(estimator.estimates())
        estimator.observe(r.confidence_logits, r.submitted, r.accepted)
    return np.mean(held, axis=0)


def test_estimator_converges_to_a_known_curve_under_censoring_and_the_old_one_does_not():
    rounds = known_curve_rounds(4000, seed=11)
    new = time_averaged_estimates(Gate(GateConfig(enabled=True)), rounds, warm_up=500)
    old = time_averaged_estimates(OldEstimator(), rounds, warm_up=500)
    assert np.abs(new - TRUE_CURVE).max() < TOLERANCE, new
    # The old prior of weight 1 and mean 1.0 never decays while the counts do every round, so the
    # rare low buckets stay near the prior: biased up far beyond the tolerance.
    assert np.abs(old - TRUE_CURVE).max() > 2 * TOLERANCE, old
    assert (old[:2] - TRUE_CURVE[:2]).min() > 0.15
    # Without forgetting, the new estimator's final estimates converge too.
    still = Gate(GateConfig(enabled=True, decay=1.0))
    for r in rounds:
        still.observe(r.confidence_logits, r.submitted, r.accepted)
    assert np.abs(np.array(still.estimates()) - TRUE_CURVE).max() < 0.03


def test_causal_ece_is_small_for_the_new_estimator_and_large_for_the_old():
    rounds = known_curve_rounds(2000, seed=5)
    new_ece, rows = causal_ece(rounds, Gate(GateConfig(enabled=True)))
    old_ece, _ = causal_ece(rounds, OldEstimator())
    assert new_ece < 0.05 < old_ece
    assert sum(r["observed"] for r in rows) == sum(min(r.accepted + 1, r.submitted) for r in rounds)
    assert causal_ece([], Gate(GateConfig())) == (None, causal_ece([], Gate(GateConfig()))[1])


def test_estimates_are_monotone_and_cold_is_optimistic():
    est = BucketEstimator(NUM_BUCKETS, 0.9, 1.0)
    assert est.estimates() == (1.0,) * NUM_BUCKETS  # a cold gate drafts the full block
    est.observe([5, 5, 5], 0)  # the top bucket misses at position 0
    est.observe([1, 1], 2)  # a low bucket matches twice
    values = est.estimates()
    assert list(values) == sorted(values)
    assert pool_adjacent_violators([0.5, 0.3, 0.9], [1.0, 1.0, 2.0]) == pytest.approx([0.4, 0.4, 0.9])
    with pytest.raises(ValueError, match="weight"):
        pool_adjacent_violators([0.1], [0.0])


def test_a_skip_is_charged_draft_plus_decode():
    # The record prices a round cut to 0 after drafting at draft + plain ...
    cut = RoundRecord(Reason.COST, 5, 0, 0, SEED_COST, confidence_logits=(0.0,) * 5)
    assert cut.modelled_ms == 196.0 + 303.0 == SEED_COST.drafted_round_ms(0)
    assert SEED_COST.drafted_round_ms(2) == 196.0 + 300.0 + 2 * 109.0
    # ... and so does the decision: at p = 0.5, one verified draft yields 0.5 more tokens for
    # 106 ms more than the plain step (value -0.497 against -0.647 tokens at 1/303 tokens/ms).
    # Pricing k = 0 at the plain step alone (the draft forgotten) would cut it to 0.
    assert decide_length([0.5] * 5, 5, SEED_COST) == 1
    plain_only = [1.0 / 303.0] + [(1 + sum(0.5 ** i for i in range(1, k + 1))) / SEED_COST.round_ms(k)
                                  for k in range(1, 6)]
    assert int(np.argmax(plain_only)) == 0


def test_decide_length_rate_is_the_long_run_exchange_rate():
    # lambda is what a ms is worth in tokens: at the plain rate one draft at p = 0.5 pays; at a
    # long-run rate of twice that, 106 ms cost 0.70 tokens and the cut to 0 wins.
    assert decide_length([0.5] * 5, 5, SEED_COST, rate=1 / 303) == 1
    assert decide_length([0.5] * 5, 5, SEED_COST, rate=2 / 303) == 0
    with pytest.raises(ValueError, match="rate"):
        decide_length([0.5] * 5, 5, SEED_COST, rate=0.0)


def test_margin_threshold_auto_is_refused_naming_it():
    # the learned per-margin-bin threshold was deleted: no measurement supported it (issue #38)
    with pytest.raises(ValueError, match="DSPARK_GATE_MARGIN_THRESHOLD='auto'"):
        gate_config({"DSPARK_GATE_MARGIN_THRESHOLD": "auto"})


def test_suspended_gate_drafts_only_on_probe_rounds():
    gate, stats = Gate(GateConfig(enabled=True)), RoundStats()
    conf = [8.0] * 5
    drafted = []
    for i in range(200):
        skip = gate.pre_draft(None)
        if skip is not None:
            assert skip is Reason.RECENT_LOSS  # no margin known, no threshold: the recent rounds lost
            stats.add(RoundRecord(skip, 0, 0, 0, gate.cost))
            continue
        drafted.append(i)
        choice = gate.choose(conf, 5)
        gate.observe(conf, choice.k, 0)
        stats.add(RoundRecord(Reason.FULL if not choice.cut else Reason.COST, 5, choice.k, 0, gate.cost,
                              confidence_logits=tuple(conf)))
    # Round 0 (cold) drafts; then probes at doubling gaps from PROBE_FIRST up to PROBE_PERIOD.
    assert drafted[:3] == [0, PROBE_FIRST, 3 * PROBE_FIRST]
    assert all(b - a == 2 * PROBE_FIRST for a, b in zip(drafted[2:], drafted[3:]))
    assert stats.accepted == 0 and stats.margin_skipped_rounds == 200 - len(drafted)


# ---------------------------------------------------------------------------- through the services
WRONG_PROMPT_IDS = tuple(range(7, 19))
WRONG_MAX_TOKENS = 64


def test_a_drafter_that_is_always_wrong_stops_drafting_through_the_services():
    """A scripted drafter answers every draft with the target's own next tokens shifted by one
    id (plausible, confident (logit 8.0), always wrong): acceptance is exactly 0. The gated
    generation must keep the spec-off output, draft in the cold first round, and afterwards
    only on probe rounds: at most one drafted round per PROBE_FIRST rounds. A round kept from
    drafting holds its rows back from the drafter (they go with the next draft, or once
    MAX_DEFERRED_ROWS pile up), so it does not pay a drafter round trip either. (The wall-clock
    ratio against plain decode is measured by bench/bench_gate.py.)"""
    from services_fixtures import collect, gen_request, service_loop
    from test_drafter_faults import _start_rig, shifted_drafts

    loop = service_loop()
    rig = loop.run(_start_rig())
    try:
        off = loop.run(collect(rig.stub, gen_request(ids=WRONG_PROMPT_IDS, max_tokens=WRONG_MAX_TOKENS, spec="off")))
        target = [*WRONG_PROMPT_IDS, *off.token_ids]

        shifted, commits = shifted_drafts(target), []

        def counted(op, req, reply):
            commits.extend([req] if op == "commit" else [])
            shifted(op, req, reply)

        rig.scripted.script = counted
        gated = loop.run(collect(rig.stub, gen_request(ids=WRONG_PROMPT_IDS, max_tokens=WRONG_MAX_TOKENS,
                                                       spec="gated")))
    finally:
        rig.scripted.script = None
        loop.run(rig.close())
    s = gated.stats
    assert gated.token_ids == off.token_ids
    assert s.accepted == 0 and s.submitted > 0
    drafted_rounds = s.rounds - s.margin_skipped_rounds
    assert drafted_rounds >= 1  # the cold gate explores
    assert drafted_rounds - 1 <= math.ceil((s.rounds - 1) / PROBE_FIRST)
    # the prompt's commit, at most a flush and a commit per drafted round, and the bounded flushes
    assert len(commits) <= 1 + 2 * drafted_rounds + math.ceil(s.rounds / MAX_DEFERRED_ROWS) < s.rounds
