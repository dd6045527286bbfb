"""The verifier's step loop (services/verifier/batcher.py): every session's pending work in one
forward per step.

Engine level, on the random tiny model (W = 8, compressor ratios 4 and 8, max_seq_len 128):
  * exact numerics: eight sessions (prompts of 3..33 tokens, so their positions wrap the
    ring and cross compressor boundaries at different steps) run a script of decodes,
    batched verifies and sequential verifies whose drafts are the plain greedy chain with
    one slot corrupted, so every accepted count 0..k occurs. Run concurrently through the
    loop, every result (tokens, margins, accepted counts, rows, positions, rollback bytes)
    and every committed tail is bitwise equal to the same script run alone through the
    per-session engine calls;
  * fast numerics: the same, tokens and accepted counts equal, fp32 rows within 1e-4 and the
    bf16 committed tails within one bf16 ulp (1e-2);
  * requests of a session closed before their step get UnknownSessionError and are not
    forwarded; a second request of a session in flight, a request after close, fail.
Service level (in-process servers on port 0, real channels), exact numerics: 8 concurrent
generations with different prompts, lengths and spec modes equal their solo runs, batched
and sequential verify; Info reports batch steps of more than one session; a generation
cancelled mid-stream frees its session while the others finish unchanged.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
import torch

from dspark_proto.v1 import common_pb2, gateway_pb2_grpc, verifier_pb2_grpc
from services import app
from services.common.sessions import UnknownSessionError
from services.common.settings import BackendSettings, GatewaySettings
from services.gateway.gate import GateConfig
from services.verifier.batcher import StepLoop
from services.verifier.engine import VerifierEngine
from verifier_fixtures import StepVerifier
from model_fixtures import tiny_trunk_with
from services_fixtures import collect, gen_request

N_SESSIONS = 8
ROUNDS = 12
TIMEOUT_S = 60.0


@pytest.fixture(scope="module", params=["exact", "fast"])
def trunk(request):
    return tiny_trunk_with(request.param)


def session_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 500, (3 + 4 * i,), generator=g).tolist() for i in range(N_SESSIONS)]


def plain_chain(engine: VerifierEngine, prompt: list[int], n: int) -> list[int]:
    """The greedy continuation x[n0..n0+n] of `prompt` by plain decode."""
    sid = engine.open_session()
    try:
        chain = [engine.prefill(sid, prompt).next_token]
        while len(chain) <= n:
            pos = len(prompt) + len(chain) - 1
            chain.append(engine.decode(sid, chain[-1], pos).next_token)
        return chain
    finally:
        engine.close_session(sid)


def run_script(engine: VerifierEngine, sid: int, prompt: list[int], chain: list[int], index: int, call) -> list:
    """Prefill, then ROUNDS rounds cycling decode / batched verify / sequential verify, drafts
    from `chain` with slot (round + index) % (k + 1) corrupted (none when it is k). `call(op,
    *args)` runs one request and returns its result; returns every result."""
    out = [call("prefill", sid, prompt)]
    anchor, pos, got = out[0].next_token, len(prompt), 0
    for r in range(ROUNDS):
        kind, k = ("decode", 0) if r % 3 == 0 else ("batched", 3 + r % 4) if r % 3 == 1 else ("sequential", 3)
        if kind == "decode":
            res = call("decode", sid, anchor, pos)
            anchor, pos, got = res.next_token, pos + 1, got + 1
        else:
            drafts = list(chain[got + 1:got + 1 + k])
            bad = (r + index) % (k + 1)
            if bad < len(drafts):
                drafts[bad] = (drafts[bad] + 1) % 500
            res = call("verify", sid, anchor, drafts, pos, kind)
            anchor, pos, got = res.bonus_token, pos + res.accepted + 1, got + res.accepted + 1
        out.append(res)
    out.append(engine.committed_tail(sid, 0))
    return out


def solo_call(engine: VerifierEngine):
    return lambda op, *args: getattr(engine, op)(*args)


def loop_call(engine: VerifierEngine, steps: StepLoop):
    return lambda op, *args: steps.submit(getattr(engine, f"admit_{op}")(*args)).result(TIMEOUT_S)


def assert_same(a, b, exact: bool, where: str) -> None:
    for name in ("next_token", "bonus_token", "accepted", "positions", "forwarded", "first_position"):
        assert getattr(a, name, None) == getattr(b, name, None), f"{where}: {name}"
    if exact:
        assert a.margin == b.margin and torch.equal(a.rows, b.rows), where
        assert getattr(a, "rollback_bytes", 0) == getattr(b, "rollback_bytes", 0), where
    else:
        assert abs(a.margin - b.margin) < 1e-3, where
        tol = 1e-4 if a.rows.dtype == torch.float32 else 1e-2  # committed tails are bf16: one ulp of it
        torch.testing.assert_close(a.rows.float(), b.rows.float(), rtol=tol, atol=tol)


def test_concurrent_sessions_through_the_loop_equal_their_solo_runs(trunk, capsys):
    exact = trunk.verify_numerics == "exact"
    engine = StepVerifier(VerifierEngine(trunk, max_sessions=2 * N_SESSIONS))
    prompts = session_prompts()
    chains = [plain_chain(engine, p, 4 * ROUNDS + 8) for p in prompts]
    solo = []
    for i, (p, c) in enumerate(zip(prompts, chains)):
        sid = engine.open_session()
        solo.append(run_script(engine, sid, p, c, i, solo_call(engine)))
        engine.close_session(sid)

    records = []
    steps = StepLoop(engine, records.append)
    together: list = [None] * N_SESSIONS
    sids = [engine.open_session() for _ in prompts]

    def one(i):
        together[i] = run_script(engine, sids[i], prompts[i], chains[i], i, loop_call(engine, steps))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(N_SESSIONS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    steps.close()
    for i in range(N_SESSIONS):
        assert together[i] is not None, f"session {i} did not finish"
        for j, (a, b) in enumerate(zip(solo[i], together[i])):
            assert_same(a, b, exact, f"session {i} result {j}")
    accepted = {res.accepted for run in solo for res in run[1:-1] if hasattr(res, "accepted")}
    assert accepted >= {0, 1, 2, 3}  # rejections at every slot, and whole blocks accepted
    batch = [r for r in records if r.kind == "batch"]
    # every prompt completed in a prefill step; prompts that arrive together may share one
    assert sum(r.prefills_done for r in records if r.kind == "prefill") == N_SESSIONS
    assert max(r.sessions for r in batch) > 1  # sessions did share steps
    assert steps.stats().steps == len(batch)
    with capsys.disabled():
        print(f"\n[report] {trunk.verify_numerics}: {N_SESSIONS} sessions x {ROUNDS} rounds in {len(batch)} batch "
              f"steps, mean {sum(r.sessions for r in batch) / len(batch):.2f} sessions per step")


def test_closed_sessions_are_dropped_and_misuse_is_refused():
    engine = VerifierEngine(tiny_trunk_with("exact"), max_sessions=4)
    records = []
    steps = StepLoop(engine, records.append)
    try:
        a, b = engine.open_session(), engine.open_session()
        for sid in (a, b):
            steps.submit(engine.admit_prefill(sid, [5, 6, 7])).result(TIMEOUT_S)
        work_a = engine.admit_decode(a, 9, 3)
        engine.close_session(a)
        with pytest.raises(UnknownSessionError, match=f"session {a} is not open"):
            steps.submit(work_a).result(TIMEOUT_S)
        assert steps.submit(engine.admit_decode(b, 9, 3)).result(TIMEOUT_S).positions == range(3, 4)
        assert [r.sessions for r in records if r.kind == "batch"] == [1]  # a's decode never ran
        assert engine.num_sessions == 1 and engine.next_position(b) == 4
        with engine.hold(b):  # the loop waits for b's lock: its next decode stays in flight
            first = steps.submit(engine.admit_decode(b, 9, 4))
            with pytest.raises(ValueError, match=f"session {b} already has a request in flight"):
                steps.submit(engine.admit_decode(b, 9, 4))
        first.result(TIMEOUT_S)
    finally:
        steps.close()
    with pytest.raises(RuntimeError, match="closed"):
        steps.submit(engine.admit_decode(b, 9, 5))
    with pytest.raises(ValueError, match="plain Trunk"):
        StepLoop(VerifierEngine(_Proxy(engine.model)))


class _Proxy:
    """A trunk wrapper (what TP and top-k dumps look like to the engine)."""

    def __init__(self, model):
        self.model = model

    def __getattr__(self, name):
        return getattr(self.model, name)


# ---------------------------------------------------------------------------- services
PROMPTS = ["hello world", "the quick brown fox", "count: 1 2 3", "def f(x):",
           "spec", "stop here", "abc", "once upon a time"]
SPECS = ("off", "always", "gated")


async def exact_stack(verify_mode: str):
    """Verifier (exact numerics, step loop), oracle drafter (corrupts every 3rd slot), gateway."""
    settings = BackendSettings(verify_numerics="exact")
    engine = app.verifier_engine(app.load_trunk(None, verify_numerics="exact"), settings)
    verifier = await app.start_verifier(engine)
    oracle = app.drafter_engine(app.load_trunk(None), oracle=True, settings=settings, corrupt_every=3)
    drafter = await app.start_drafter(oracle)
    gw, _, backends = await app.start_gateway(
        GatewaySettings(verifier_target=f"127.0.0.1:{verifier.port}", drafter_target=f"127.0.0.1:{drafter.port}",
                        verify_mode=verify_mode), GateConfig())
    return engine, verifier, drafter, gw, backends


@pytest.mark.parametrize("verify_mode", ["batched", "sequential"])
def test_exact_concurrent_generations_equal_their_solo_runs(verify_mode):
    reqs = [gen_request(p, max_tokens=12 + 3 * i, spec=SPECS[i % 3]) for i, p in enumerate(PROMPTS)]

    async def run():
        engine, verifier, drafter, gw, backends = await exact_stack(verify_mode)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as ch, \
                    grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as vch:
                stub, info = gateway_pb2_grpc.GatewayStub(ch), verifier_pb2_grpc.VerifierStub(vch).Info
                solo = [await collect(stub, r) for r in reqs]
                before = await info(common_pb2.InfoRequest(), timeout=5)
                together = await asyncio.gather(*(collect(stub, r) for r in reqs))
                after = await info(common_pb2.InfoRequest(), timeout=5)
                return solo, together, before, after, engine.num_sessions
        finally:
            for server in (gw, drafter, verifier):
                await server.stop(0)
            await backends.close()

    solo, together, before, after, open_after = asyncio.run(run())
    for r, a, b in zip(reqs, solo, together):
        assert b.token_ids == a.token_ids, r.prompt
        assert len(b.token_ids) == r.max_tokens
    assert before.steps > 0 and 0 < before.batch_size_mean <= 1.0  # solo runs: one session per step
    shared = (after.batch_size_mean * after.steps - before.batch_size_mean * before.steps) / (after.steps - before.steps)
    assert shared > 1.5 and after.step_ms_mean > 0 and after.step_ms_last > 0
    assert open_after == 0


def test_a_cancelled_generation_frees_its_session_and_others_finish():
    reqs = [gen_request(p, max_tokens=40, spec="always") for p in PROMPTS[:4]]

    async def run():
        engine, verifier, drafter, gw, backends = await exact_stack("batched")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as ch:
                stub = gateway_pb2_grpc.GatewayStub(ch)
                solo = [await collect(stub, r) for r in reqs[1:]]
                call = stub.Generate(reqs[0], timeout=TIMEOUT_S)
                others = asyncio.gather(*(collect(stub, r) for r in reqs[1:]))
                await call.read()  # the first chunk: the session is open and stepping
                call.cancel()
                together = await others
                for _ in range(200):
                    if engine.num_sessions == 0:
                        break
                    await asyncio.sleep(0.05)
                return solo, together, engine.num_sessions
        finally:
            for server in (gw, drafter, verifier):
                await server.stop(0)
            await backends.close()

    solo, together, open_after = asyncio.run(run())
    assert [g.token_ids for g in together] == [g.token_ids for g in solo]
    assert open_after == 0
