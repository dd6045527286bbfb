"""Concurrency correctness through the three services: 32 generations at once equal their solo runs.

In-process servers on port 0 with real channels, on the random tiny model (fixed seed) with
exact verify numerics, batched verify and the live oracle drafter corrupting one slot in 3
positions (so every accepted count occurs). The 32 generations mix spec modes (off, always
with the full block, always with a fixed k through `max_draft_tokens`, gated) and lengths
(5..18 tokens). While they run, four more are stopped early, two by a client cancel and two
by `Gateway.Abort`: the 32 must still equal their solo runs token for token, every backend
session must close (verifier and drafter `Info.open_sessions` back to 0), and in exact mode
every spec mode of one prompt must give plain decode's tokens. A second test checks the
`max_draft_tokens` field itself: a fixed k caps every round's submitted drafts, and a value
outside [0, block size] is refused naming it.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from dspark_proto.v1 import common_pb2, drafter_pb2_grpc, gateway_pb2, gateway_pb2_grpc, verifier_pb2_grpc
from services import app
from services.common.settings import BackendSettings, GatewaySettings
from services.gateway.gate import GateConfig
from services_fixtures import collect, gen_request

# Deadline of every RPC here (s): a hang guard only, wide enough for a loaded 2-core machine.
TIMEOUT_S = 300.0
IDLE_WAIT_S = 15.0      # how long the backends may take to close cancelled sessions (s)
PROMPTS = ["hello world", "the quick brown fox", "count: 1 2 3", "def f(x):",
           "spec", "stop here", "abc", "once upon a time"]
# (spec, max_draft_tokens): the four variants every prompt runs in
VARIANTS = (("off", 0), ("always", 0), ("always", 2), ("gated", 0))
N_STREAMS = len(PROMPTS) * len(VARIANTS)  # 32
N_STOPPED = 4


async def start_exact_stack(max_sessions: int):
    """Verifier (exact numerics, step loop), oracle drafter, gateway; returns (servers, backends)."""
    settings = BackendSettings(verify_numerics="exact", max_sessions=max_sessions)
    engine = app.verifier_engine(app.load_trunk(None, verify_numerics="exact"), settings)
    verifier = await app.start_verifier(engine)
    oracle = app.drafter_engine(app.load_trunk(None), oracle=True, settings=settings, corrupt_every=3)
    drafter = await app.start_drafter(oracle)
    gw, _, backends = await app.start_gateway(
        GatewaySettings(verifier_target=f"127.0.0.1:{verifier.port}", drafter_target=f"127.0.0.1:{drafter.port}",
                        verify_mode="batched", cost_mode="configured", round_timeout_s=TIMEOUT_S), GateConfig())
    return (gw, drafter, verifier), backends


def requests() -> list[gateway_pb2.GenerateRequest]:
    """The 32 generations: prompt i runs its j-th variant for 5 + i + 2 j tokens (5..18)."""
    out = []
    for i, prompt in enumerate(PROMPTS):
        for j, (spec, k) in enumerate(VARIANTS):
            req = gen_request(prompt, max_tokens=5 + i + 2 * j, spec=spec)
            req.max_draft_tokens = k
            out.append(req)
    return out


async def stopped_early(stub, index: int) -> str:
    """A long generation stopped after its first message: even indices by a client cancel, odd
    ones by Gateway.Abort. Returns how it ended ("cancelled" or the final finish_reason)."""
    req = gen_request(PROMPTS[index], max_tokens=40, spec="always")
    req.request_id = f"stopped-{index}"
    call = stub.Generate(req, timeout=TIMEOUT_S)
    await call.read()  # the first chunk: its sessions are open and stepping
    if index % 2 == 0:
        call.cancel()
        return "cancelled"
    found = await stub.Abort(gateway_pb2.AbortRequest(request_id=req.request_id), timeout=TIMEOUT_S)
    assert found.found, req.request_id
    last = None
    while (msg := await call.read()) is not grpc.aio.EOF:  # read() only: a call cannot mix read and iteration
        last = msg
    return last.finish_reason


async def open_sessions(stubs) -> list[int]:
    return [(await info(common_pb2.InfoRequest(), timeout=5)).open_sessions for info in stubs]


async def await_idle(stubs) -> list[int]:
    """Poll the backends' open_sessions until all are 0 or IDLE_WAIT_S passes; the last counts."""
    deadline = time.monotonic() + IDLE_WAIT_S
    while True:
        counts = await open_sessions(stubs)
        if not any(counts) or time.monotonic() > deadline:
            return counts
        await asyncio.sleep(0.05)


def test_32_concurrent_generations_equal_their_solo_runs_and_stopped_ones_free_their_sessions():
    reqs = requests()
    assert len(reqs) == N_STREAMS == 32

    async def run():
        servers, backends = await start_exact_stack(max_sessions=N_STREAMS + N_STOPPED)
        gw, drafter, verifier = servers
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as ch, \
                    grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as vch, \
                    grpc.aio.insecure_channel(f"127.0.0.1:{drafter.port}") as dch:
                stub = gateway_pb2_grpc.GatewayStub(ch)
                infos = [verifier_pb2_grpc.VerifierStub(vch).Info, drafter_pb2_grpc.DrafterStub(dch).Info]
                solo = [await collect(stub, r, TIMEOUT_S) for r in reqs]
                together, stops = await asyncio.gather(
                    asyncio.gather(*(collect(stub, r, TIMEOUT_S) for r in reqs)),
                    asyncio.gather(*(stopped_early(stub, i) for i in range(N_STOPPED))))
                return solo, together, stops, await await_idle(infos)
        finally:
            for server in servers:
                await server.stop(0)
            await backends.close()

    solo, together, stops, idle = asyncio.run(run())
    assert stops == ["cancelled", "abort", "cancelled", "abort"]
    assert idle == [0, 0], f"open sessions (verifier, drafter) after the run: {idle}"
    for r, a, b in zip(reqs, solo, together):
        where = f"{r.prompt!r} spec={r.spec} k={r.max_draft_tokens}"
        assert len(a.token_ids) == r.max_tokens, where
        assert b.token_ids == a.token_ids, where
        assert b.finish_reason == "length", where
    for i in range(len(PROMPTS)):  # exact numerics: every spec mode gives plain decode's tokens
        runs = [g.token_ids for g in solo[i * len(VARIANTS):(i + 1) * len(VARIANTS)]]
        longest = max(runs, key=len)
        for run_ in runs:
            assert run_ == longest[:len(run_)], PROMPTS[i]
    speculative = [g.stats for r, g in zip(reqs, solo) if r.spec != gateway_pb2.SPEC_MODE_OFF]
    assert sum(s.accepted for s in speculative) > 0  # the oracle's drafts were used, not only plain steps


def test_max_draft_tokens_fixes_k_and_is_validated():
    async def run():
        servers, backends = await start_exact_stack(max_sessions=4)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{servers[0].port}") as ch:
                stub = gateway_pb2_grpc.GatewayStub(ch)
                out = {}
                for k in (1, 3, 0):
                    req = gen_request("count: 1 2 3", max_tokens=30, spec="always")
                    req.max_draft_tokens = k
                    out[k] = await collect(stub, req, TIMEOUT_S)
                bad = gen_request("abc", max_tokens=8, spec="always")
                bad.max_draft_tokens = 6
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await collect(stub, bad, TIMEOUT_S)
                return out, err.value
        finally:
            for server in servers:
                await server.stop(0)
            await backends.close()

    out, err = asyncio.run(run())
    block = app.random_tiny_config().dspark_block_size
    assert block == 5
    for k, gen in out.items():
        s, cap = gen.stats, k or block
        verify_rounds = s.rounds - s.plain_rounds
        assert 0 < s.submitted <= cap * verify_rounds, (k, s)
        assert gen.token_ids == out[0].token_ids  # exact numerics: k never changes the tokens
    assert out[1].stats.submitted == out[1].stats.rounds - out[1].stats.plain_rounds  # k = 1: one per round
    assert out[3].stats.submitted > out[1].stats.submitted
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_draft_tokens=6" in err.details() and "block_size=5" in err.details()
