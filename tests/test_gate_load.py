"""The verifier's step table and load figures (docs/gate.md §13), what the regime and the step
budget price load with.

Verifier side: the step-time table (per-bucket moving averages, a samples-weighted monotone
fit, profiled then refined online), the committed-token rate with its idle cap, and the
start-up profile over dummy sessions on the real tiny trunk. Gateway side: the table's
interpolation and what one generation has seen of the load (`LoadSeen`, from its replies
only). Service level (in process, port 0, real channels): Info carries the table and rate
(ModelIdentity 29-34), each decode / verify response its step rows and rate (VerifierResponse
40-41), and a gated generation under measured costs streams the tokens of plain decode.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dspark_proto.v1 import common_pb2, verifier_pb2
from services.app import drafter_engine, start_drafter, start_verifier, verifier_engine
from services.common.settings import BackendSettings
from services.gateway.gate import GateConfig
from services.common.alignment import Lockstep
from services.common.budget import StepTimes
from services.gateway.round_policy import LoadSeen
from services.settings import backend_settings, gateway_settings
from services.verifier.batcher import StepLoop, StepRecord
from services.verifier.step_profile import StepProfileSettings, profile_steps, row_targets, split_rows
from services.verifier.step_table import ONLINE, PROFILED, CommitRate, LoadTracker, StepTable
from services_fixtures import ServiceStack, collect, gen_request, service_loop, tiny_draft_module, tiny_trunk

# ---------------------------------------------------------------------------- verifier: the table


def test_step_table_averages_per_bucket_and_fits_a_monotone_table():
    t = StepTable()
    t.add(1, 10.0)
    t.add(1, 20.0)            # same bucket: 10 + 0.1 * (20 - 10)
    t.add(5, 8.0)             # bucket [4, 6): a dip below the 1-row bucket
    t.add(6, 30.0, profiled=True)
    snap = t.snapshot()
    assert snap.rows == (1.0, 5.0, 6.0)
    assert snap.ms == pytest.approx((10.0, 10.0, 30.0))  # 11 (weight 2) and 8 (weight 1) pooled
    assert snap.samples == (2, 1, 1)
    assert snap.source == ONLINE


def test_step_table_source_is_profiled_until_a_live_step_and_bad_values_are_named():
    t = StepTable()
    assert t.snapshot().rows == () and t.snapshot().source == ""
    t.add(3, 4.0, profiled=True)
    assert t.snapshot().source == PROFILED
    t.add(3, 6.0)
    assert t.snapshot().source == ONLINE and t.snapshot().ms == pytest.approx((4.2,))
    with pytest.raises(ValueError, match="rows=0"):
        t.add(0, 1.0)
    with pytest.raises(ValueError, match="ms=nan"):
        t.add(2, float("nan"))


def test_commit_rate_counts_idle_time_up_to_its_cap():
    r = CommitRate(idle_cap_ms=100.0)
    r.add(5, 10.0, end_s=1.0)
    assert r.tokens_per_ms() == pytest.approx(0.5)
    r.add(3, 10.0, end_s=1.030)          # 20 ms idle before it
    assert r.tokens_per_ms() == pytest.approx(7.75 / 39.5)
    r.add(2, 10.0, end_s=2.030)          # 990 ms idle, capped at 100
    assert r.tokens_per_ms() == pytest.approx(9.3625 / 147.525)
    assert r.total == 10


def test_tracker_takes_batch_steps_into_the_table_and_every_step_into_the_rate():
    load = LoadTracker()
    load.record(StepRecord("prefill", 1, 40, 50.0, prefill_rows=40, prefills_done=1, tokens=1))
    load.record(StepRecord("batch", 3, 7, 12.0, tokens=5))
    identity = common_pb2.ModelIdentity()
    load.fill_identity(identity)
    assert list(identity.step_table_rows) == [7.0] and list(identity.step_table_ms) == [12.0]
    assert list(identity.step_table_samples) == [1] and identity.step_table_source == ONLINE
    assert identity.committed_tokens == 6 and identity.committed_tokens_per_ms > 0


def test_row_targets_and_split_rows():
    assert row_targets(2, 6) == [1, 2, 3, 4, 6, 8, 12]
    assert split_rows(7, 2, 6) == [4, 3]
    assert split_rows(1, 2, 6) == [1]
    with pytest.raises(ValueError, match="rows=13"):
        split_rows(13, 2, 6)


def test_profile_times_every_target_over_dummy_sessions_and_closes_them():
    engine = verifier_engine(tiny_trunk(), BackendSettings(max_sessions=4))
    load = LoadTracker()
    loop = StepLoop(engine)
    try:
        steps = profile_steps(loop, load, StepProfileSettings(sessions=2, repeats=2))
    finally:
        loop.close()
    per = min(engine.cfg.dspark_block_size + 1, 8)
    targets = row_targets(2, per)
    assert steps == 2 * len(targets)
    assert engine.num_sessions == 0
    identity = common_pb2.ModelIdentity()
    load.fill_identity(identity)
    assert identity.step_table_source == PROFILED
    assert sum(identity.step_table_samples) == steps
    ms = list(identity.step_table_ms)
    assert ms == sorted(ms) and ms[0] > 0
    assert identity.committed_tokens == 0  # profile steps are not served tokens


def test_the_default_profile_times_a_full_block_step_of_16_generations():
    # the regime prices step(N * (block + 1)) at N generations in flight; a table that ends
    # at a few sessions' rows prices every larger step by extrapolation
    engine = verifier_engine(tiny_trunk(), BackendSettings(max_sessions=32))
    load = LoadTracker()
    loop = StepLoop(engine)
    try:
        profile_steps(loop, load, StepProfileSettings(repeats=1))
    finally:
        loop.close()
    per = min(engine.cfg.dspark_block_size + 1, 8)
    snap = load.table.snapshot()
    assert snap.rows[-1] == 16 * per
    assert set(snap.rows) == set(row_targets(16, per))
    assert engine.num_sessions == 0


def test_profile_sessions_are_forgotten_so_no_step_waits_for_them():
    # rate / lockstep / pingpong await every answered session not yet back: a dummy session
    # the profile closed but the schedule still held stalled every served step by the 1 s cap
    engine = verifier_engine(tiny_trunk(), BackendSettings(max_sessions=4))
    loop = StepLoop(engine)
    loop.schedule.alignment = Lockstep(1.0)
    try:
        # the prefills and the warm-up step answer both dummy sessions whatever the budget
        profile_steps(loop, LoadTracker(), StepProfileSettings(sessions=2, repeats=1, budget_s=0.01))
    finally:
        loop.close()  # the loop thread is gone: the schedule is ours to probe
    loop.schedule.admit(SimpleNamespace(sid=10_000, op="decode"), now=1e6)
    assert loop.schedule.wait_s(1e6, 0.05) == 0.0  # nobody to wait for: the step starts now


# ---------------------------------------------------------------------------- gateway: the table, the load seen
def test_step_times_interpolate_clamp_and_extrapolate():
    t = StepTimes((1.0, 4.0, 8.0), (10.0, 16.0, 40.0))
    assert t.ms_at(0.5) == 10.0 and t.ms_at(2.0) == pytest.approx(12.0)
    assert t.ms_at(8.0) == 40.0 and t.ms_at(10.0) == pytest.approx(52.0)
    assert t.marginal_ms(0.0, 2) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="non-decreasing"):
        StepTimes((1.0, 2.0), (5.0, 4.0))
    with pytest.raises(ValueError, match="strictly increasing"):
        StepTimes((2.0, 2.0), (5.0, 6.0))
    assert StepTimes.from_identity(common_pb2.ModelIdentity()) is None


def test_load_seen_follows_replies_and_ignores_replies_without_a_step():
    seen = LoadSeen()
    seen.observe(0, 1, 5.0)
    assert (seen.other_rows, seen.tokens_per_ms, seen.replies) == (0.0, 0.0, 0)
    seen.observe(9, 1, 0.3)
    seen.observe(3, 3, 0.4)
    assert seen.other_rows == pytest.approx(4.0) and seen.tokens_per_ms == 0.4 and seen.replies == 2
    seen.observe(5, 1, float("nan"))    # a rate that is no number keeps the last one
    assert seen.other_rows == pytest.approx(4.0) and seen.tokens_per_ms == 0.4 and seen.replies == 3


# ---------------------------------------------------------------------------- service level
async def _profiled_stack() -> ServiceStack:
    engine = verifier_engine(tiny_trunk(), BackendSettings(max_sessions=8))
    verifier = await start_verifier(engine, step_profile=StepProfileSettings(sessions=2, repeats=1))
    d_engine = drafter_engine(tiny_draft_module(), settings=BackendSettings(max_sessions=8))
    drafter = await start_drafter(d_engine)
    return ServiceStack(service_loop(), "dspark", engine, d_engine, verifier, drafter, GateConfig(enabled=True), None)


def test_info_and_responses_carry_the_load_and_a_gated_generation_streams_plain_tokens():
    loop = service_loop()
    stack = loop.run(_profiled_stack())
    try:
        async def info():
            return await stack.verifier_stub.Info(common_pb2.InfoRequest(), timeout=10)
        first_info = loop.run(info())
        assert first_info.step_table_source == PROFILED and len(first_info.step_table_rows) >= 3
        assert list(first_info.step_table_ms) == sorted(first_info.step_table_ms)

        async def one_decode():
            call = stack.verifier_stub.Session(timeout=30)
            await call.write(verifier_pb2.VerifierRequest(prefill=verifier_pb2.PrefillRequest(token_ids=[5, 6, 7])))
            first = await call.read()
            await call.write(verifier_pb2.VerifierRequest(
                decode=verifier_pb2.DecodeRequest(token_id=first.next_token, position=3)))
            reply = await call.read()
            await call.done_writing()
            return first, reply
        first, reply = loop.run(one_decode())
        assert first.step_rows == 0                      # a prefill runs in no batch step
        assert reply.step_rows == 1 and reply.committed_tokens_per_ms > 0

        gw = loop.run(stack.start_gateway("sequential", cost_mode="measured"))
        try:
            assert gw.scheduler.load is not None and gw.scheduler.load.table is not None
            req = gen_request("load-aware budget", max_tokens=24, spec="gated")
            gated = loop.run(collect(gw.stub, req))
            plain = loop.run(collect(gw.stub, gen_request("load-aware budget", max_tokens=24, spec="off")))
            assert gated.token_ids == plain.token_ids and len(gated.token_ids) == 24
            samples = gw.scheduler.costs.to_dict("measured")["samples"]
            # rounds alone in their step sample every cost (sequential verify: one row per step)
            assert samples["draft_ms"]["online"] > 0 and samples["plain_ms"]["online"] > 0
            after = loop.run(info())
            assert after.step_table_source == ONLINE and after.committed_tokens >= 48
        finally:
            loop.run(gw.close())
    finally:
        stack.close()


def test_served_processes_profile_and_ignore_the_removed_switches():
    # DSPARK_GATE_LOAD switched load pricing, which was removed: setting it changes nothing
    assert gateway_settings({"DSPARK_GATE_LOAD": "0"}) == gateway_settings({})
    assert backend_settings({}).step_profile is True
    assert backend_settings({"DSPARK_STEP_PROFILE": "0"}).step_profile is True
    with pytest.raises(ValueError, match="budget_s=0"):
        StepProfileSettings(budget_s=0)
