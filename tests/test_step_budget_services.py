"""The verifier's step budget through the three services: what a generation commits never
depends on how the steps cut its blocks.

In-process servers on port 0 with real channels, the random tiny model in exact verify
numerics, batched verify, the live oracle drafter corrupting one slot in 3 (drafts both
accepted and rejected). The gateway sends each gated block with its survival estimates
(`step_budget` "full": the step chooses every length; "trim": it may cut the gate's length).
The verifier's budget runs on a fixed, steep price (a step is free up to 12 rows, then 990 ms
a row), so which drafts a step admits depends only on how many sessions share it: 32
generations at once have most of their blocks cut (to nothing, or to a prefix) where each
alone verifies them whole. Every generation, greedy and seeded, must commit the same tokens
together as alone; the drafts judged together must be fewer (the cut happened).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from dspark_proto.v1 import gateway_pb2_grpc
from services import app
from services.common.budget import StepTimes
from services.common.settings import BackendSettings, GatewaySettings
from services.gateway.gate import GateConfig
from services.verifier.step_table import LoadTracker
from services_fixtures import collect, gen_request

TIMEOUT_S = 300.0  # a hang guard only
PROMPTS = ["hello world", "the quick brown fox", "count: 1 2 3", "def f(x):", "spec", "stop here", "abc",
           "once upon a time"]
STEEP = StepTimes((1.0, 12.0, 13.0), (10.0, 10.0, 1000.0))
RATE = 0.01  # tokens per ms: a draft pays while its survival >= 0.01 x the ms its row adds


@pytest.fixture
def steep_prices(monkeypatch):
    """The verifier's step prices fixed at STEEP and RATE (the live ones follow the wall clock,
    which a test must not depend on); counts the steps that priced a budgeted block."""
    calls = []

    def prices(self):
        calls.append(1)
        return STEEP, RATE
    monkeypatch.setattr(LoadTracker, "prices", prices)
    return calls


async def _stack(step_budget: str):
    settings = BackendSettings(verify_numerics="exact", max_sessions=40)
    verifier = await app.start_verifier(app.verifier_engine(app.load_trunk(None, verify_numerics="exact"), settings))
    drafter = await app.start_drafter(app.drafter_engine(app.load_trunk(None), oracle=True, settings=settings,
                                                         corrupt_every=3))
    gw, _, backends = await app.start_gateway(
        GatewaySettings(verifier_target=f"127.0.0.1:{verifier.port}", drafter_target=f"127.0.0.1:{drafter.port}",
                        verify_mode="batched", round_timeout_s=TIMEOUT_S, step_budget=step_budget), GateConfig())
    return (gw, drafter, verifier), backends


def _requests(temperature: float) -> list:
    """32 gated generations: each prompt four times, 6..20 tokens; seeded when sampled."""
    out = []
    for i, prompt in enumerate(PROMPTS):
        for j in range(4):
            req = gen_request(prompt, max_tokens=6 + i + 2 * j, spec="gated", temperature=temperature)
            if temperature > 0:
                req.seed = 1000 + 4 * i + j
            out.append(req)
    return out


@pytest.mark.parametrize("step_budget, temperature", [
    ("full", 0.0), pytest.param("full", 0.8, marks=pytest.mark.slow), pytest.param("trim", 0.0, marks=pytest.mark.slow)])
def test_32_concurrent_generations_cut_by_the_step_budget_equal_their_solo_runs(steep_prices, step_budget,
                                                                               temperature):
    reqs = _requests(temperature)

    async def run():
        servers, backends = await _stack(step_budget)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{servers[0].port}") as ch:
                stub = gateway_pb2_grpc.GatewayStub(ch)
                solo = [await collect(stub, r, TIMEOUT_S) for r in reqs]
                together = await asyncio.gather(*(collect(stub, r, TIMEOUT_S) for r in reqs))
                return solo, together
        finally:
            for server in servers:
                await server.stop(0)
            await backends.close()

    solo, together = asyncio.run(run())
    for r, a, b in zip(reqs, solo, together):
        assert len(a.token_ids) == r.max_tokens, r.prompt
        assert b.token_ids == a.token_ids, (r.prompt, r.max_tokens)
    judged = [sum(g.stats.submitted for g in run) for run in (solo, together)]
    assert sum(g.stats.accepted for g in solo) > 0  # drafts were accepted, not only plain steps
    assert steep_prices and judged[1] < judged[0], f"drafts judged alone, together: {judged}"


def test_a_failing_budget_verifies_blocks_whole_and_a_cold_one_admits_all():
    """The budget only decides how many drafts a step judges: prices that raise leave the step
    verifying the whole block (logged), and without a table every draft is judged."""
    from services.common.budget import StepBudget
    from services.verifier.batcher import StepLoop

    def broken():
        raise ValueError("step table ms=(3.0, 1.0): must be non-decreasing")

    engine = app.verifier_engine(app.load_trunk(None), BackendSettings(max_sessions=2))
    for budget in (StepBudget(broken), StepBudget(lambda: (None, 5.0))):
        with StepLoop(engine, prefill_chunk=64, budget=budget) as steps:
            sid = engine.open_session()
            try:
                anchor = steps.prefill(sid, [5, 6, 7], timeout_s=TIMEOUT_S).next_token
                record = engine.admit_verify(sid, anchor, [1, 2, 3], engine.next_position(sid), "batched",
                                             survival=[0.5, 0.4, 0.1])
                res = steps.submit(record).result(TIMEOUT_S)
                assert res.admitted == 3
            finally:
                engine.close_session(sid)


def _mixed_requests() -> list:
    """16 gated generations, each with what a cut must not change: seeded sampling with
    logprobs (both sampling rules), stop strings, a JSON Schema constraint (sampled and greedy),
    logit bias and penalties."""
    import json

    from structured_schemas import SCHEMAS

    out = []
    for i in range(16):
        prompt = PROMPTS[i % len(PROMPTS)]
        req = gen_request(prompt, max_tokens=10 + i, spec="gated", temperature=0.8 if i % 4 else 0.0)
        req.seed, req.logprobs = 500 + i, 3
        req.sampling_rule = 1 + i % 2 if i % 4 else 0  # coupled, rejection (sampled only)
        if i % 4 == 2:
            req.constraint.json_schema = json.dumps(SCHEMAS[i % 3])
            req.max_tokens, req.ignore_eos = 120, False
        if i % 4 == 3:
            req.logit_bias[7] = 5.0
            req.presence_penalty, req.repetition_penalty = 0.5, 1.2
        out.append(req)
    return out


@pytest.mark.slow
def test_sampled_logprobs_stops_and_constraints_cut_by_the_full_budget_equal_their_solo_runs(steep_prices):
    """As above with DSPARK_STEP_BUDGET=full over `_mixed_requests`: together equals solo in
    tokens, text, finish reason, stop match and every streamed logprob; except under the
    rejection rule, lossless in distribution only (docs/sampling.md), whose cut block samples
    the bonus token from the target where the whole block would have judged a draft: there
    only the outputs' validity is asserted."""
    import json

    reqs = _mixed_requests()

    async def run():
        servers, backends = await _stack("full")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{servers[0].port}") as ch:
                stub = gateway_pb2_grpc.GatewayStub(ch)

                async def one(r):
                    msgs = [m async for m in stub.Generate(r, timeout=TIMEOUT_S)]
                    return msgs
                for r in reqs[1::4]:  # a stop string the generation meets part way: 2 characters of its text
                    text = (await one(r))[-1].text
                    r.stop.append(text[len(text) // 2:len(text) // 2 + 2])
                solo = [await one(r) for r in reqs]
                together = await asyncio.gather(*(one(r) for r in reqs))
                return solo, together
        finally:
            for server in servers:
                await server.stop(0)
            await backends.close()

    def view(msgs):
        final = msgs[-1]
        return ([t for m in msgs for t in m.token_ids], final.text, final.finish_reason, final.matched_stop_str,
                [(lp.token_id, lp.logprob, tuple(lp.top_ids)) for m in msgs for lp in m.logprobs])

    solo, together = asyncio.run(run())
    for r, a, b in zip(reqs, solo, together):
        if r.constraint.json_schema:
            json.loads(a[-1].text), json.loads(b[-1].text)
        if r.sampling_rule == 2:
            continue
        assert view(b) == view(a), (r.prompt, r.max_tokens, r.temperature)
    assert all(a[-1].finish_reason == "stop" and a[-1].matched_stop_str for a in solo[1::4])  # the stops matched
    judged = [sum(run[-1].spec_stats.submitted for run in runs) for runs in (solo, together)]
    assert judged[1] < judged[0], f"drafts judged alone, together: {judged}"
