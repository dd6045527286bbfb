"""Measured gate costs: the cost table, the start-up profile, pinned variables and their sources.

The services run in process on port 0 with real channels (`tests.services_fixtures`); timings
are never compared with thresholds, only the structure and the orderings the code guarantees
(one verify entry per k, positive times, a non-decreasing table, which source wins).
"""

from __future__ import annotations

import json
import socket

import numpy as np
import pytest

from dspark_proto.v1 import gateway_pb2
from services.gateway.backends import LocalDrafterSession, LocalVerifierSession
from verifier_fixtures import loop_of
from services.common.monotone import non_decreasing
from services.gateway.costs import DEFAULT, ONLINE, PROFILED, CostTracker, verify_line
from services.gateway.gate import CostModel
from services.gateway.profile import CostProfile, ProfileError, ProfileSettings, positions_needed, profile_sessions
from services.settings import gate_config, gateway_settings
from services.app import drafter_engine, verifier_engine
from tests.services_fixtures import block_size, collect, gen_request, service_loop, start_stack, tiny_trunk
from training.demo import interleaved_order, ratio_summary

COST_VARS = {"DSPARK_GATE_DRAFT_MS": "7.5", "DSPARK_GATE_PLAIN_MS": "11"}


# ---------------------------------------------------------------------------- CostModel
def test_cost_model_reads_its_verify_table_and_the_line_beyond_it():
    cost = CostModel(10.0, 20.0, 5.0, 30.0, commit_ms=2.0, verify_table=(21.0, 22.0, 40.0))
    assert [cost.verify_ms(n) for n in range(0, 5)] == [20.0, 21.0, 22.0, 40.0, 40.0]
    assert cost.round_ms(2) == 10.0 + 22.0 + 2.0  # draft + verify(2) + commit
    assert cost.round_ms(0) == 30.0
    assert cost.skipped_after_draft_ms() == 10.0 + 30.0 + 2.0


def test_cost_model_keeps_its_positional_constructor_and_defaults():
    cost = CostModel(196, 300, 109, 303)
    assert (cost.commit_ms, cost.verify_table) == (0.0, None)
    assert cost.round_ms(3) == 196 + 300 + 3 * 109
    assert CostModel(1, 2, 3, 4, source="profiled") == CostModel(1, 2, 3, 4)  # the source is a description


@pytest.mark.parametrize("kwargs, message", [
    ({"verify_table": ()}, r"verify_table=\(\) must be a non-empty sequence"),
    ({"verify_table": (1.0, -2.0)}, r"verify_table\[1\]=-2.0 must be in \[0, 1e\+07\]"),
    ({"verify_table": "12"}, "verify_table='12' must be a non-empty sequence"),
    ({"commit_ms": float("nan")}, "commit_ms=nan must be a finite number"),
])
def test_cost_model_rejects_a_bad_table_or_commit_naming_it(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CostModel(1.0, 2.0, 3.0, 4.0, **kwargs)


# ---------------------------------------------------------------------------- the table
def test_non_decreasing_pools_adjacent_violators_by_weight():
    out = non_decreasing(np.array([1.0, 3.0, 2.0, 4.0, 0.0]), np.array([1.0, 1.0, 3.0, 1.0, 1.0]))
    # (3, w1) and (2, w3) pool to 2.25 (w4); (4, w1) and (0, w1) pool to 2.0 (w2), below 2.25, so
    # the four pool to (2.25 * 4 + 2.0 * 2) / 6
    assert out.tolist() == pytest.approx([1.0] + [13 / 6] * 4)


def test_verify_line_holds_a_pinned_base_or_slope():
    table = (12.0, 14.0, 16.0)
    assert verify_line(table) == pytest.approx((10.0, 2.0))
    assert verify_line(table, slope=1.0) == pytest.approx((12.0, 1.0))
    assert verify_line(table, base=0.0)[1] == pytest.approx((12 + 28 + 48) / 14)
    assert verify_line((5.0,)) == (5.0, 0.0)


def _profile(verify=(20.0, 21.0, 19.0, 30.0), draft=8.0, plain=15.0, commit=2.0) -> CostProfile:
    return CostProfile(tuple(verify), draft, plain, commit, repeats=3)


def test_tracker_uses_the_profile_as_a_non_decreasing_table_with_sources():
    costs = CostTracker(CostModel())
    costs.seed(_profile())
    model = costs.model("measured")
    assert model.verify_table == pytest.approx((20.0, 20.0, 20.0, 30.0))  # the dip at k = 3 is pooled away
    assert (model.draft_ms, model.plain_ms, model.commit_ms) == (8.0, 15.0, 2.0)
    values, sources = costs.in_force("measured")
    assert set(sources.values()) == {PROFILED}
    costs.add_draft(10.0)
    assert costs.in_force("measured")[1]["draft_ms"] == ONLINE
    assert costs.model("measured").draft_ms == pytest.approx(0.9 * 8.0 + 0.1 * 10.0)
    # configured mode ignores every measurement
    assert costs.model("configured") == CostModel()
    assert set(costs.in_force("configured")[1].values()) == {DEFAULT, "not used"}


def test_tracker_builds_a_model_once_per_sample():
    """The regime asks for the model every round: with no new sample it is the same object,
    and every kind of sample (seed, draft, plain, commit, verify) rebuilds it with that sample."""
    costs = CostTracker(CostModel())
    cold = costs.model("measured")
    assert costs.model("measured") is cold and costs.model("configured") is not cold
    costs.seed(_profile())
    seeded = costs.model("measured")
    assert seeded is not cold and seeded.draft_ms == 8.0 and costs.model("measured") is seeded
    for add, field, ms in ((costs.add_draft, "draft_ms", 10.0), (costs.add_plain, "plain_ms", 25.0),
                           (costs.add_commit, "commit_ms", 4.0)):
        before = getattr(costs.model("measured"), field)
        add(ms)
        assert getattr(costs.model("measured"), field) == pytest.approx(0.9 * before + 0.1 * ms)
    last = costs.model("measured")
    costs.add_verify(4, 50.0)
    assert costs.model("measured").verify_table[3] > last.verify_table[3]
    with pytest.raises(ValueError, match="'bogus'"):
        costs.model("bogus")


def test_tracker_fills_unmeasured_ks_from_live_rounds_only_after_enough_samples():
    costs = CostTracker(CostModel())
    costs.add_draft(5.0)
    costs.add_plain(9.0)
    for k, ms in ((1, 11.0), (1, 11.0), (4, 17.0), (4, 17.0)):
        costs.add_verify(k, ms)
    assert costs.measured() is None  # MIN_SAMPLES verify rounds not reached: configured costs
    costs.add_verify(4, 17.0)
    table = costs.model("measured").verify_table
    assert len(table) == 4 and table[0] == pytest.approx(11.0) and table[3] == pytest.approx(17.0)
    assert table == pytest.approx((11.0, 13.0, 15.0, 17.0))  # ks 2, 3 from the line through 1 and 4


def test_pinned_fields_win_and_a_pinned_verify_field_drops_the_table():
    configured = CostModel(7.5, 40.0, 3.0, 11.0)
    costs = CostTracker(configured, {"draft_ms": "DSPARK_GATE_DRAFT_MS",
                                     "verify_slope_ms": "DSPARK_GATE_VERIFY_SLOPE_MS"})
    costs.seed(_profile(verify=(12.0, 14.0, 16.0, 18.0)))
    model = costs.model("measured")
    assert model.draft_ms == 7.5 and model.verify_slope_ms == 3.0 and model.verify_table is None
    assert model.verify_base_ms == pytest.approx(15.0 - 3.0 * 2.5)  # mean(table - 3k)
    assert (model.plain_ms, model.commit_ms) == (15.0, 2.0)
    sources = costs.in_force("measured")[1]
    assert sources["draft_ms"] == "configured by DSPARK_GATE_DRAFT_MS"
    assert sources["verify_slope_ms"] == "configured by DSPARK_GATE_VERIFY_SLOPE_MS"
    assert sources["verify_base_ms"] == sources["plain_ms"] == PROFILED
    with pytest.raises(ValueError, match=r"pinned cost fields \['win_factor'\]"):
        CostTracker(configured, {"win_factor": "DSPARK_GATE_MARGIN"})


# ---------------------------------------------------------------------------- settings
def test_measured_is_the_served_default_and_set_cost_variables_are_pinned():
    assert gateway_settings({}).cost_mode == "measured"
    assert gateway_settings({}).pinned_costs == ()
    assert gateway_settings({"DSPARK_GATE_COSTS": "configured"}).cost_mode == "configured"
    assert gateway_settings(COST_VARS).pinned_costs == ("draft_ms", "plain_ms")
    with pytest.raises(ValueError, match="DSPARK_GATE_COSTS='fitted'"):
        gateway_settings({"DSPARK_GATE_COSTS": "fitted"})


# ---------------------------------------------------------------------------- the profile
def _local_profile(max_seq_len: int, settings: ProfileSettings = ProfileSettings()) -> CostProfile:
    trunk = tiny_trunk()
    v_engine, d_engine = verifier_engine(trunk), drafter_engine(trunk, oracle=True)
    verifier, drafter = LocalVerifierSession(loop_of(v_engine)), LocalDrafterSession(d_engine)

    async def run():
        try:
            return await profile_sessions(verifier, drafter, list(range(2, 18)), block_size(), max_seq_len, settings)
        finally:
            await verifier.close()
            await drafter.close()
    return service_loop().run(run())


def test_profile_on_local_sessions_times_every_k():
    profile = _local_profile(tiny_trunk().cfg.max_seq_len, ProfileSettings(repeats=2))
    assert len(profile.verify_ms) == block_size() and profile.repeats == 2
    assert min(profile.verify_ms) > 0 and profile.draft_ms > 0 and profile.plain_ms > 0 and profile.commit_ms > 0


def test_profile_refuses_a_sequence_too_short_naming_the_positions():
    need = positions_needed(16, block_size(), 3)
    with pytest.raises(ProfileError, match=f"needs {need} positions; max_seq_len={need}"):
        _local_profile(need)


def _stats(gw) -> dict:
    async def get():
        return json.loads((await gw.stub.Stats(gateway_pb2.StatsRequest(), timeout=10)).json)
    return service_loop().run(get())


def test_startup_profile_gives_one_verify_entry_per_k_and_closes_its_sessions():
    stack = start_stack("dspark")
    try:
        gw = stack.loop.run(stack.start_gateway("batched", cost_mode="measured"))
        try:
            costs = _stats(gw)["costs"]
            profile, values = costs["profile"], costs["in_force"]
            assert costs["profile_error"] is None
            assert len(profile["verify_ms"]) == block_size() and profile["repeats"] == 3
            assert min(profile["verify_ms"]) > 0 and profile["draft_ms"] > 0 and profile["commit_ms"] > 0
            assert set(profile["rpc_overhead_ms"]) == {"draft", "verify", "decode"}
            table = values["verify_table"]
            assert len(table) == block_size() and table == sorted(table)  # non-decreasing in k
            assert set(costs["sources"].values()) == {PROFILED}
            assert stack.wait_idle() == {"verifier_info": 0, "verifier_engine": 0, "drafter_info": 0,
                                         "drafter_engine": 0}
            gen = stack.loop.run(collect(gw.stub, gen_request("profiled costs", max_tokens=12, spec="gated")))
            assert len(gen.token_ids) == 12
            after = _stats(gw)["costs"]
            assert after["sources"]["commit_ms"] == ONLINE and after["samples"]["commit_ms"]["online"] > 0
        finally:
            stack.loop.run(gw.close())
    finally:
        stack.close()


def test_explicit_cost_variables_override_the_measured_costs():
    stack = start_stack("oracle", gate_config=gate_config(COST_VARS))
    try:
        pinned = gateway_settings(COST_VARS).pinned_costs
        gw = stack.loop.run(stack.start_gateway("batched", cost_mode="measured", pinned_costs=pinned))
        try:
            costs = _stats(gw)["costs"]
            assert costs["profile"] is not None
            assert costs["in_force"]["draft_ms"] == 7.5 and costs["in_force"]["plain_ms"] == 11.0
            assert costs["sources"]["draft_ms"] == "configured by DSPARK_GATE_DRAFT_MS"
            assert costs["sources"]["plain_ms"] == "configured by DSPARK_GATE_PLAIN_MS"
            assert costs["sources"]["verify_table"] == costs["sources"]["commit_ms"] == PROFILED
            stack.loop.run(collect(gw.stub, gen_request("pinned costs", max_tokens=12, spec="gated")))
            model = gw.scheduler.costs.model("measured")  # live rounds refine only the unpinned costs
            assert (model.draft_ms, model.plain_ms) == (7.5, 11.0)
            assert model.verify_table == pytest.approx(tuple(_stats(gw)["costs"]["in_force"]["verify_table"]))
        finally:
            stack.loop.run(gw.close())
    finally:
        stack.close()


def test_a_failed_profile_keeps_the_configured_costs_and_the_gateway_serves():
    with socket.socket() as s:  # a port nothing listens on: the drafter is down
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    stack = start_stack("none")
    try:
        gw = stack.loop.run(stack.start_gateway("batched", cost_mode="measured", drafter_target=dead,
                                                startup_timeout_s=1.0))
        try:
            costs = _stats(gw)["costs"]
            assert costs["profile"] is None and costs["profile_error"]
            assert gw.scheduler.costs.model("measured") == CostModel()  # GateConfig()'s configured costs
            assert set(costs["sources"].values()) == {DEFAULT, "not used"}
            gen = stack.loop.run(collect(gw.stub, gen_request("still serving", max_tokens=8, spec="gated")))
            assert len(gen.token_ids) == 8 and gen.finish_reason == "length"
        finally:
            stack.loop.run(gw.close())
    finally:
        stack.close()


# ---------------------------------------------------------------------------- the demo's statistics
def test_interleaved_order_rotates_every_mode_through_every_slot():
    orders = [interleaved_order(("gated", "off", "always"), r) for r in range(3)]
    assert orders == [["gated", "off", "always"], ["off", "always", "gated"], ["always", "gated", "off"]]
    assert all(sorted(o[slot] for o in orders) == ["always", "gated", "off"] for slot in range(3))


def test_ratio_summary_pairs_repetitions_and_reports_the_median_and_range():
    tok_s = {"off": [10.0, 20.0, 10.0], "always": [15.0, 20.0, 30.0], "gated": [12.0, 10.0, 11.0]}
    out = ratio_summary(tok_s)
    assert (out["always"].median, out["always"].low, out["always"].high) == (1.5, 1.0, 3.0)
    assert (out["gated"].median, out["gated"].low, out["gated"].high) == (1.1, 0.5, 1.2)
    assert out["off"].median == out["off"].low == out["off"].high == 1.0 and out["off"].repeats == 3
    with pytest.raises(ValueError, match="mode 'gated' has 2 repetitions, 'off' has 3"):
        ratio_summary({"off": [1.0, 1.0, 1.0], "gated": [1.0, 1.0]})
    with pytest.raises(ValueError, match="baseline 'off' tok/s=\\[0.0\\]"):
        ratio_summary({"off": [0.0]})
