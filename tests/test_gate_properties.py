"""Property tests of the decision rule and the gate (hypothesis).

What is monotone: raising any P(match) never shortens the choice. Raising p_j scales every term
of E[tokens(n)] from position j on, so E'(n)/E(n) is non-decreasing in n: longer lengths gain at
least as much as shorter ones, the argmax (ties to the longer) cannot move down, and the full
block's lead over any truncation can only grow, so a truncation the margin rejected stays
rejected. Raising the margin or the floor never shortens it either. NOT monotone:
raising max_n (the full block it is compared with changes), so that is not tested.
"""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from services.analysis.references import decide_length, round_rate
from services.gateway.gate import NUM_BUCKETS, CostModel, Gate, GateConfig

probs = st.lists(st.floats(0.0, 1.0), min_size=0, max_size=8)
# The whole allowed range: each cost in [0, 1e7] ms, plain_ms >= 1e-3, fixed round cost >= 1e-3.
costs = st.builds(
    CostModel,
    draft_ms=st.floats(0.0, 1e7),
    verify_base_ms=st.floats(1e-3, 1e7),
    verify_slope_ms=st.floats(0.0, 1e7),
    plain_ms=st.floats(1e-3, 1e7),
)
margins = st.floats(1.0, 3.0)
floors = st.integers(0, 10)
logits = st.floats(allow_nan=False, allow_infinity=True)


@st.composite
def case(draw):
    p = draw(probs)
    return p, draw(st.integers(0, len(p))), draw(costs), draw(margins), draw(floors)


@settings(max_examples=300, deadline=None)
@given(case())
def test_length_within_cap_and_floor(args):
    p, max_n, cost, margin, floor = args
    n = decide_length(p, max_n, cost, margin, floor)
    assert isinstance(n, int)
    assert min(floor, max_n) <= n <= max_n


any_float = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, 5e-324, 1e-3, 1e7, 1e306, 10**400])


@settings(max_examples=500, deadline=None)
@given(any_float, any_float, any_float, any_float, probs)
def test_costs_are_rejected_or_give_finite_positive_rates(draft, base, slope, plain, p):
    # Zero, subnormal, huge, NaN and inf costs: either CostModel refuses them or every rate is finite.
    try:
        cost = CostModel(draft, base, slope, plain)
    except ValueError:
        return
    for n in range(len(p) + 1):
        rate = round_rate(cost, p, n)
        assert math.isfinite(rate) and rate > 0
        assert math.isfinite(1000.0 * n / cost.round_ms(n)) and math.isfinite(1000.0 / cost.skipped_after_draft_ms())


@settings(max_examples=300, deadline=None)
@given(case())
def test_rates_are_finite(args):
    p, max_n, cost, _, _ = args
    for n in range(max_n + 1):
        assert math.isfinite(round_rate(cost, p, n)) and round_rate(cost, p, n) > 0


@settings(max_examples=400, deadline=None)
@given(case(), st.data())
def test_raising_match_probabilities_never_shortens(args, data):
    p, max_n, cost, margin, floor = args
    raised = [data.draw(st.floats(x, 1.0)) for x in p]
    assert decide_length(raised, max_n, cost, margin, floor) >= decide_length(p, max_n, cost, margin, floor)


@settings(max_examples=300, deadline=None)
@given(case(), st.floats(0.0, 2.0))
def test_raising_the_margin_never_shortens(args, extra):
    p, max_n, cost, margin, floor = args
    assert decide_length(p, max_n, cost, margin + extra, floor) >= decide_length(p, max_n, cost, margin, floor)


@settings(max_examples=300, deadline=None)
@given(case(), st.integers(0, 5))
def test_raising_the_floor_never_shortens(args, extra):
    p, max_n, cost, margin, floor = args
    assert decide_length(p, max_n, cost, margin, floor + extra) >= decide_length(p, max_n, cost, margin, floor)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8), costs)
def test_certain_matches_never_truncate_when_drafting_pays(p, cost):
    # With p = 1, E(n) = n + 1. If the full block beats plain and each extra draft costs less than
    # the round's fixed part, rate(n) = (n + 1) / (a + s n) rises with n: nothing to truncate.
    n_full = len(p)
    fixed = cost.draft_ms + cost.verify_base_ms
    if fixed >= cost.verify_slope_ms and round_rate(cost, [1.0] * n_full, n_full) >= round_rate(cost, [], 0):
        assert decide_length([1.0] * n_full, n_full, cost) == n_full


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.lists(logits, min_size=0, max_size=6), st.integers(0, 6), st.integers(0, 6)), max_size=30),
    st.integers(0, 4),
    st.floats(0.05, 1.0),
)
def test_gate_stays_in_bounds_and_estimates_stay_probabilities(rounds, probe_every, decay):
    gate = Gate(GateConfig(enabled=True, decay=decay))
    for i, (confidences, cap, accepted) in enumerate(rounds):
        max_n = min(cap, len(confidences))
        probe = probe_every > 0 and i % probe_every == 0
        gate.probing.pending = probe  # as the pre-draft decision sets it on a probe round
        n = gate.choose(confidences, max_n).k
        assert (min(1, max_n) if probe else 0) <= n <= max_n
        gate.observe(confidences, n, min(accepted, n))
        assert all(0.0 < e <= 1.0 and math.isfinite(e) for e in gate.estimates())
    assert len(gate.estimates()) == NUM_BUCKETS
