"""The model regime (services/gateway/load_regime.py, docs/gate.md §14): its throughput model on a
hand-computed table, what it learns, the wake price, bad input, the simulator running it, and
real in-process services deciding with it."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from dspark_proto.v1 import gateway_pb2
from services.common.budget import StepTimes
from services.gateway.decision import CostModel
from services.gateway.gate import GateConfig
from services.gateway.load_regime import PRIOR_BLOCKS, REVISIT, SURVIVAL_DECAY, ModelRegime
from services_fixtures import collect, gen_request, service_loop, start_stack

# A step of 1 row takes 10 ms, 8 rows 12 ms, 16 rows 20 ms, 48 rows 60 ms (linear between).
TABLE = StepTimes((1.0, 8.0, 16.0, 48.0), (10.0, 12.0, 20.0, 60.0))
# One stream: plain 11 ms (1 ms beyond the step), draft 3 ms, commit 1 ms.
COST = CostModel(draft_ms=3.0, verify_base_ms=10.0, verify_slope_ms=1.0, plain_ms=11.0, commit_ms=1.0)


def regime(table: StepTimes | None = TABLE) -> ModelRegime:
    return ModelRegime(5, lambda: table, lambda: COST)


def test_goodput_on_a_hand_computed_table():
    """n = 2, cold (every draft accepted), no leg measured (draft + commit = 4 ms):
    plain = 2 / (step(2) + 1) = 2 / (10 + 2/7 + 1); draft = 2 * 6 / (step(12) + 1 + 4) = 12 / 21."""
    g = regime().goodput(2)
    assert g.plain == pytest.approx(2 / (10 + 2 / 7 + 1))
    assert g.draft == pytest.approx(12 / 21)
    assert g.leg_ms == 4.0 and g.drafts


def test_outcomes_and_legs_are_learned():
    """A full block whose first draft was rejected moves every position towards 0 by
    1 / (PRIOR_BLOCKS * decay + 1); a leg measured at 3 in flight prices 3-8 in flight
    (nearest lower bucket), not 2; a block cut short is not pooled, its leg still is."""
    r = regime()
    r.observe(3, (0.0,) * 5, 40.0)
    share = 1 / (PRIOR_BLOCKS * SURVIVAL_DECAY + 1)
    assert r.survival == pytest.approx([1 - share] * 5) and r.blocks == 1
    assert r.goodput(4).leg_ms == 40.0 and r.goodput(8).leg_ms == 40.0 and r.goodput(2).leg_ms == 4.0
    r.observe(3, (1.0, 1.0), 60.0)  # a block of 2: its leg counts (decayed), its outcome does not
    assert r.blocks == 1 and r.goodput(4).leg_ms == pytest.approx(0.9 * 40 + 0.1 * 60)


def test_plain_where_rows_are_dear_and_alone_always_the_gate():
    """After 30 blocks that never accepted a draft, drafting cannot pay at 16 in flight:
    plain = 16 / 21; draft = 16 * (1 + ~0.5) / (step(96) + 5) is far less. Alone it still
    drafts (the gate decides), and without a table it never blocks."""
    r = regime()
    for _ in range(30):
        r.observe(16, (0.0,) * 5, 4.0)
    assert not r.may_draft(16) and not r.goodput(16).drafts
    assert r.may_draft(1) and not r.decides_length(1) and r.decides_length(16)
    cold = regime(table=None)
    assert cold.may_draft(16) and cold.goodput(16) is None and not cold.decides_length(16)


def test_waking_is_priced_by_the_tokens_left():
    """Cold at 2 in flight drafting saves 1 / plain - 1 / draft ms per token per generation
    in flight; 500 rows held back cost commit_ms x 500 = 500 ms to re-prime: worth it over
    1000 tokens left, not over 5."""
    r = regime()
    g = r.goodput(2)
    per_token = g.in_flight * (1 / g.plain - 1 / g.draft)
    assert 1000 * per_token > 500 > 5 * per_token
    assert r.may_draft(2, held_rows=500, tokens_left=1000)
    assert not r.may_draft(2, held_rows=500, tokens_left=5)
    assert r.may_draft(2, held_rows=0, tokens_left=5)


def test_a_plain_regime_revisits_drafting():
    """Plain decode verifies no block, so nothing the regime measures would ever bring it back
    to drafting once a poor stretch pulled the pooled survival under break-even (the whole
    gateway then stayed plain at that load for good). Each round the model keeps plain ages the
    survival towards the prior by REVISIT / in-flight: at 4 in flight a survival of 0 comes
    back to drafting after a computable number of plain rounds, and no sooner."""
    r = regime()
    r.survival, r.weight = [0.0] * 5, 50.0
    assert not r.goodput(4).drafts
    r.observe_plain(4)
    assert r.survival == pytest.approx([REVISIT / 4] * 5)
    # draft(4) = 4 (1 + 5 s) / (step(24) + 1 + 4) against plain(4) = 4 / (step(4) + 1)
    s_even = ((TABLE.ms_at(24) + 5) / (TABLE.ms_at(4) + 1) - 1) / 5
    rounds = math.ceil(math.log(1 - s_even) / math.log(1 - REVISIT / 4))
    r.survival = [0.0] * 5
    for _ in range(rounds - 1):
        r.observe_plain(4)
    assert not r.goodput(4).drafts
    r.observe_plain(4)
    assert r.goodput(4).drafts and r.weight == 50.0  # the evidence's weight is untouched


def test_the_simulated_gateway_comes_back_to_drafting_after_a_poor_stretch(monkeypatch):
    """Bundled prose rounds on the `cpu` shape, 2 streams of 4 generations each: k5 is about
    1.8x plain, but a stretch of rejected blocks pulls the pooled survival under break-even.
    Revisiting, gated reaches 0.91x k5; without it (REVISIT = 0, the broken variant) the
    gateway stays plain for good, about 0.58x k5."""
    from services.gateway import load_regime
    from services.gateway.rounds import load_rounds
    from services.simulate.engine import RunConfig
    from services.simulate.models import load_model
    from services.simulate.run import Load, arm_registry, parse_lengths, simulate_grid, workloads

    groups = workloads([load_rounds("tests/data/bundled_rounds.json")], "prose")
    arms = arm_registry(5)

    def cell(names):
        out = simulate_grid(load_model("cpu"), RunConfig(alignment="gather"), [arms[a] for a in names],
                            [Load(streams=2, per_stream=4)], groups, parse_lengths("64", "p"),
                            parse_lengths("256", "o"), 0)
        return out["cells"]["2"]
    served = cell(("k5", "gated"))
    assert served["gated"]["aggregate_tok_s"] >= 0.85 * served["k5"]["aggregate_tok_s"]
    monkeypatch.setattr(load_regime, "REVISIT", 0.0)
    stuck = cell(("gated",))["gated"]
    assert stuck["aggregate_tok_s"] < 0.7 * served["k5"]["aggregate_tok_s"] and stuck["plain_round_share"] > 0.8


def test_only_rounds_the_model_keeps_plain_age_the_survival():
    """A round kept plain by the wake price (the model says draft), decided by the gate alone,
    or ended before the regime was asked (no room: a stale decision) ages nothing; a round the
    model keeps plain does."""
    from services.gateway.gate import Gate, Reason
    from services.gateway.round_policy import RoundPolicy

    r = regime()
    r.survival = [0.0] * 5
    policy = RoundPolicy("gated", Gate(GateConfig(enabled=True)), r, None, 4096, 100)
    assert not policy.regime_drafts(16, pos=10, emitted=3)
    policy.observe(None, 0, 0, 16, 1, 0.1, reason=Reason.REGIME)
    assert r.survival == pytest.approx([REVISIT / 16] * 5)
    policy.observe(None, 0, 0, 16, 1, 0.1, reason=Reason.NO_ROOM)  # the next round never asked the regime
    assert r.survival == pytest.approx([REVISIT / 16] * 5)
    r.survival = [1.0] * 5
    assert not policy.regime_drafts(2, pos=10_000, emitted=99)  # draft wins; waking 10,000 rows does not
    policy.observe(None, 0, 0, 2, 1, 0.1, reason=Reason.REGIME)
    assert policy.regime_drafts(1)  # alone: the gate decides
    policy.observe(None, 0, 0, 1, 1, 0.1, reason=Reason.ANCHOR_MARGIN)
    assert r.survival == [1.0] * 5


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="block=0"):
        ModelRegime(0, lambda: TABLE, lambda: COST)
    r = regime()
    with pytest.raises(ValueError, match=r"survival=\[1.5"):
        r.observe(2, (1.5, 0, 0, 0, 0), None)
    with pytest.raises(ValueError, match="leg_ms=-1"):
        r.observe(2, (1.0,) * 5, -1.0)
    with pytest.raises(ValueError, match="leg_ms=nan"):
        r.observe(2, (1.0,) * 5, float("nan"))
    assert r.blocks == 0  # a refused observation changed nothing it checks first
    for bad in (-1, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match="in_flight="):
            r.observe_plain(bad)
    assert r.survival == [1.0] * 5


def test_stats_view():
    view = regime().to_dict()
    assert view["kind"] == "model" and view["survival"] == [1.0] * 5 and view["blocks"] == 0
    assert view["in_flight"]["2"]["drafts"] is True and set(view["in_flight"]) >= {"1", "2", "256"}


def test_the_simulator_runs_it_and_never_loses_to_plain_where_rows_are_dear():
    """`dspark simulate`'s gated arm is the model regime: on the cpu shape at 64 streams every
    fixed k is under plain and the regime runs plain (its throughput within 2 % of plain's);
    at 2 streams it drafts the full block, as fast as k5."""
    from services.gateway.rounds import load_rounds
    from services.simulate.engine import RunConfig
    from services.simulate.models import load_model
    from services.simulate.run import Load, arm_registry, parse_lengths, simulate_grid, workloads

    groups = workloads([load_rounds("tests/data/bundled_rounds.json")], None)
    arms = arm_registry(5)
    out = simulate_grid(load_model("cpu"), RunConfig(), [arms[a] for a in ("plain", "k5", "gated")],
                        [Load(streams=2), Load(streams=64)], groups, parse_lengths("64", "p"),
                        parse_lengths("256", "o"), 0)
    r2, r64 = out["ratios"]["2"], out["ratios"]["64"]
    assert r64["k5"] < 0.9 and r64["gated"] >= 0.98
    assert r2["k5"] > 1.5 and r2["gated"] == pytest.approx(r2["k5"], rel=0.02)
    assert out["cells"]["64"]["gated"]["plain_round_share"] > 0.9


def test_served_gateway_runs_plain_where_the_model_says_so_and_stays_exact():
    """Real in-process services, sequential verify: with a step table on which rows are dear
    (plain wins at 2 in flight whatever is accepted), two concurrent gated generations run
    plain (reason `regime`) and stream plain decode's tokens; with a flat table they draft
    the full block without asking their gate. Stats reports the model."""
    loop = service_loop()
    stack = start_stack("dspark", gate_config=GateConfig(enabled=True))
    dear = StepTimes((1.0, 2.0, 64.0), (1.0, 2.0, 1e5))
    flat = StepTimes((1.0, 64.0), (10.0, 10.0))
    prompts = ("the model regime", "a short neighbour")
    try:
        gw = loop.run(stack.start_gateway("sequential", regime=True))
        try:
            reference = [loop.run(collect(gw.stub, gen_request(p, max_tokens=24, spec="off"))) for p in prompts]

            async def both():
                return await asyncio.gather(*(collect(gw.stub, gen_request(p, max_tokens=24, spec="gated"))
                                              for p in prompts))
            for table, drafts in ((dear, False), (flat, True)):
                gw.scheduler.regime = ModelRegime(5, lambda t=table: t, lambda: COST)
                runs = loop.run(both())
                assert [r.token_ids for r in runs] == [r.token_ids for r in reference]
                if drafts:
                    assert all(r.stats.drafted > 0 for r in runs)
                else:
                    assert all(r.stats.plain_rounds > 0 for r in runs)
                    assert sum(r.stats.drafted for r in runs) <= 2 * 5  # at most a round alone at the end

            async def stats_json():
                return (await gw.stub.Stats(gateway_pb2.StatsRequest(), timeout=10)).json
            view = json.loads(loop.run(stats_json()))["regime"]
            assert view["enabled"] is True and view["kind"] == "model" and view["blocks"] > 0
            assert not any(loop.run(stack.await_idle()).values())
        finally:
            loop.run(gw.close())
    finally:
        stack.close()


def test_a_regime_decided_round_explains_itself():
    """A gated round the regime decided carries (in flight, plain, draft) in its record, and its
    one-line explanation (`dspark trace-report --rounds`) names them; alone, the gate decides
    and the round carries none."""
    from services.gateway.gate import Gate, Reason
    from services.gateway.record import RoundRecord
    from services.gateway.round_policy import RoundPolicy

    r = regime()
    for _ in range(30):
        r.observe(16, (0.0,) * 5, 4.0)
    policy = RoundPolicy("gated", Gate(GateConfig(enabled=True)), r, None, 4096, 100)
    assert not policy.regime_drafts(16, pos=10, emitted=3)
    n, plain, draft = policy.regime_inputs()
    assert n == 16 and plain == pytest.approx(16 / 21) and draft < plain
    line = RoundRecord(Reason.REGIME, 0, 0, 0, COST, regime=policy.regime_inputs()).why()
    assert f"regime at 16 in flight: draft {draft:.4g} vs plain {plain:.4g} tok/ms" in line
    assert policy.regime_drafts(1, pos=11, emitted=4) and policy.regime_inputs() is None
