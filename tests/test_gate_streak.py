"""A losing streak across generations (docs/gate.md §5b, §6): probes priced by the scoring rule,
a band's streak continued by its next generation, and through real engines a drafter that is
never accepted: a generation continuing the band's streak opens no drafter session, one that
skips past MAX_DEFERRED_ROWS lets its session go, and every gated generation streams plain
decode's tokens.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from services.gateway.gate import (DEAR_PROBE_TOKENS, PROBE_FIRST, PROBE_LOSS_SHARE, PROBE_PERIOD, Calibration, Gate,
                                   GateConfig, Streak)
from services.gateway.record import GateStats, Reason, RoundRecord
from services.gateway.warm import GREEDY_BAND, LOSING_GENERATIONS, WarmBands, WarmStart
from services_fixtures import collect, gen_request, service_loop, start_stack

# A drafter whose draft costs ten plain steps (the live oracle on the 2-core box is about five).
DEAR = GateConfig(enabled=True, draft_ms=240.0, verify_base_ms=20.0, verify_slope_ms=10.0, plain_ms=24.0)
# The reference costs but a draft of 1400 ms: a probe of one draft costs (1400 + 409 - 303) / 303
# = 4.97 tokens less S_0, more than DEAR_PROBE_TOKENS: a dear probe, so a losing streak is lent.
PRICEY = GateConfig(draft_ms=1400.0)
LOSING = Calibration((0.0,) * 6, (0.0, 10.0, 0.0, 0.0, 0.0, 0.0), [(0.0,) * 5] * 4)  # bucket 1 never matched


def _probe_rounds(gate: Gate, rounds: int) -> list[int]:
    """Run `rounds` rounds of a drafter that is never accepted; the rounds (0-based) that drafted."""
    drafted = []
    for i in range(rounds):
        if gate.pre_draft(None) is None:
            drafted.append(i)
            k = gate.choose([0.0] * 5, 5).k
            gate.observe([0.0] * 5, k, 0)
    return drafted


# ---------------------------------------------------------------------------- priced probes
def test_a_dear_probe_is_priced_by_the_scoring_rule():
    gate = Gate(DEAR, LOSING)
    lam, s0 = 1 / 24.0, gate.survival([0.0])[0]  # a probe is priced at the plain rate
    loss = lam * (240.0 + 30.0 - 24.0) - s0  # value(plain) - value(probe of one draft), tokens
    assert gate.probe_loss() == pytest.approx(loss, rel=1e-12)
    assert gate.probe_gap() == math.ceil(gate.probe_loss() / PROBE_LOSS_SHARE) > 10 * PROBE_PERIOD
    gate.probing.wake_ms = 120.0  # a measured re-prime is reported with the streak, not priced
    assert gate.probe_loss() == pytest.approx(loss, rel=1e-12) and gate.probes_dear()
    cheap = Gate(GateConfig(enabled=True, draft_ms=4.0, verify_base_ms=20.0, verify_slope_ms=5.0, plain_ms=24.0),
                 LOSING)
    assert cheap.probe_gap() == 2 * PROBE_FIRST == PROBE_PERIOD  # ~0.2 token a probe: doubling as before
    # losing, but a cheap drafter's streak is not lent to the band's next generations: its cold start
    # costs less than a good workload suspended behind a losing one; a dear drafter's is
    assert cheap.losing() and not cheap.probes_dear() and cheap.streak() is None
    assert gate.losing() and gate.streak() == Streak(0, PROBE_FIRST, 120.0)
    seed = Gate(GateConfig(enabled=True), LOSING)  # the reference costs: (605 - 303) / 303 - 0.09 tokens
    assert seed.losing() and seed.probe_loss() < DEAR_PROBE_TOKENS and seed.streak() is None
    assert seed.probe_gap() == PROBE_PERIOD  # a cheap probe: the doubling schedule, as before
    assert Gate(dataclasses.replace(PRICEY, enabled=True), LOSING).streak() is not None


def test_a_losing_streak_spends_at_most_the_loss_share_on_probes():
    gate = Gate(DEAR, LOSING)
    drafted = _probe_rounds(gate, 4000)
    gaps = [b - a for a, b in zip(drafted, drafted[1:])]
    # the first probe PROBE_FIRST rounds in, then every gap the priced one (the old rule: 32, 32, ...);
    # it moves by a few rounds as the estimate of the first draft decays further
    assert drafted[0] == PROBE_FIRST - 1 and len(gaps) == 3 and max(gaps) - min(gaps) <= 4
    loss_per_probe = (240.0 + 30.0 - 24.0) / 24.0 - gate.survival([0.0])[0]  # tokens
    assert PROBE_LOSS_SHARE * 0.99 <= loss_per_probe / min(gaps) <= PROBE_LOSS_SHARE * 1.01


# ---------------------------------------------------------------------------- the band's streak
def test_a_gate_continues_the_streak_it_is_lent():
    gate = Gate(dataclasses.replace(PRICEY, enabled=True),
                Calibration(LOSING.matched, LOSING.observed, LOSING.recent, Streak(since=30, gap=64)))
    assert gate.losing()
    decisions = [gate.pre_draft(None) for _ in range(34)]
    assert decisions == [Reason.RECENT_LOSS] * 33 + [None]  # the probe is due 64 rounds after the last one
    loss = (1400.0 + 409.0 - 303.0) / 303.0 - gate.survival([0.0])[0]  # 4.88 tokens a probe
    assert gate.probe_gap() == math.ceil(loss / PROBE_LOSS_SHARE) == 488  # at most 1 % of the gap
    assert gate.choose([0.0] * 5, 5).k == 1 and gate.streak().gap == 488


@pytest.mark.parametrize("field, value, message", [
    ("since", -1, "streak since=-1 must be an integer >= 0"),
    ("gap", 0, "streak gap=0 must be an integer >= 1"),
    ("gap", 2.0, "streak gap=2.0 must be an integer"),
    ("wake_ms", float("nan"), "streak wake_ms=nan must be a finite number >= 0"),
    ("wake_ms", True, "streak wake_ms=True"),
])
def test_streak_refuses_bad_values_naming_them(field, value, message):
    with pytest.raises(ValueError, match=message):
        Streak(**{field: value})
    with pytest.raises(ValueError, match="calibration streak=\\(3, 16\\) must be a Streak"):
        Calibration((0.0,) * 6, (0.0,) * 6, (), (3, 16))


def _stats(verified: bool) -> GateStats:
    out, cost = GateStats(), GateConfig().cost_model()
    out.add(RoundRecord(Reason.COST, 5, 1 if verified else 0, 0, cost, confidence_logits=(0.0,) * 5))
    return out


def test_a_band_lends_its_streak_after_losing_generations_in_a_row():
    bands, streak = WarmBands(WarmStart()), Streak(40, 32, 12.5)
    for _ in range(LOSING_GENERATIONS - 1):
        bands.add(GREEDY_BAND, _stats(True), [(0.0,) * 5], streak)
    assert LOSING_GENERATIONS == 4 and bands.calibration(GREEDY_BAND).streak is None  # could be the workloads
    bands.add(GREEDY_BAND, _stats(False), [], Streak(70, 32))  # verified nothing, woke nothing: still counts
    lent = bands.calibration(GREEDY_BAND)
    assert lent.streak == Streak(70, 32, 12.5) and lent.recent == ((0.0,) * 5,) * 3  # the last re-prime measured
    bands.add(GREEDY_BAND, GateStats(), [], None)  # spec off: its gate was never asked, the band is unchanged
    assert bands.calibration(GREEDY_BAND).streak == Streak(70, 32, 12.5)
    assert bands.to_dict()["bands"]["greedy"]["streak"] == {"since": 70, "gap": 32, "wake_ms": 0.0}
    bands.add(GREEDY_BAND, _stats(True), [(0.0,) * 5], None)  # a generation that did not end losing
    assert bands.calibration(GREEDY_BAND).streak is None and bands.calibration(GREEDY_BAND).recent == ()


# ---------------------------------------------------------------------------- real services
@pytest.fixture(scope="module")
def never():
    """Verifier + live oracle drafter corrupting every slot (no draft is ever accepted), priced
    with PRICEY costs (a probe costs about 3 tokens): real servers on port 0."""
    stack = start_stack("oracle", corrupt_every=1, gate_config=PRICEY)
    yield stack
    stack.close()


def test_a_never_accepted_drafter_is_let_go_and_later_generations_start_without_it(never, monkeypatch):
    opened, fed = [], []  # drafter sessions opened and committed tokens fed, counted at the real engine
    engine = never.drafter_engine
    real_open, real_observe = engine.open_session, engine.observe_tokens
    monkeypatch.setattr(engine, "open_session", lambda: opened.append(1) or real_open())
    monkeypatch.setattr(engine, "observe_tokens", lambda sid, first, ids: fed.append(len(ids)) or real_observe(
        sid, first, ids))
    loop, recorded, rounds = service_loop(), [], []  # every round's line; the gated generations' lines
    gw = loop.run(never.start_gateway("sequential", recorder=recorded, warm_start=True))
    try:
        plan, runs = (("one", 180), ("two", 40), ("three", 40), ("four", 40), ("five", 8)), []
        for prompt, n in plan:
            before = len(opened), sum(fed), len(recorded)
            gated = loop.run(collect(gw.stub, gen_request(prompt, max_tokens=n, spec="gated")))
            runs.append((len(opened) - before[0], sum(fed) - before[1]))
            rounds.append(recorded[before[2]:])
            plain = loop.run(collect(gw.stub, gen_request(prompt, max_tokens=n, spec="off")))
            assert gated.token_ids == plain.token_ids and len(gated.token_ids) == n  # plain decode's tokens
        band = gw.scheduler.stats.warm.to_dict()["bands"]["greedy"]
    finally:
        loop.run(gw.close())
    # The first drafts its first round (cold) and probes at round 17; the next probe is ~480 rounds
    # away (the priced gap), so at round 49, MAX_DEFERRED_ROWS rows held, it lets its session go:
    # the drafter is fed the prompt and 17 rounds' tokens, not 180. The next three start as the
    # first. The fifth continues their streak (LOSING_GENERATIONS losing generations in a row)
    # and drafts nothing in 8 tokens: it never opens a session, the drafter sees nothing.
    assert [o for o, _ in runs] == [1, 1, 1, 1, 0]
    assert runs[0][1] < 40 and runs[4][1] == 0
    assert band["losing_generations"] == 5 and band["streak"]["gap"] > 10 * PROBE_PERIOD  # the priced gap, ~480
    assert band["wake_ms"] == 0.0  # no generation woke a drafter it let go: no probe came after the sleep
    # The recorded rounds say why: the first generation's one probe (round 17) with its priced
    # loss, over DEAR_PROBE_TOKENS; the fifth's skips, each in the streak its band lent it.
    probes = [r for r in rounds[0] if r.probe]
    assert len(probes) == 1 and probes[0].submitted >= 1 and probes[0].probe_loss > DEAR_PROBE_TOKENS
    assert not any(r.lent_streak for gen in rounds[:4] for r in gen)
    # (its last round has one token left, no room to draft: the gate was not asked, nothing lent)
    assert [r.lent_streak for r in rounds[4]] == [True] * 6 + [None]
    assert not any(r.confidence_logits or r.probe for r in rounds[4])
