"""The verifier's step loop over a tensor-parallel trunk (services/verifier/batcher.py driving
services/verifier/tp.py's `TPTrunk.forward_batch`): TP=2 with real gloo worker processes.

  * `TPTrunk.forward_batch` of two decodes and a verify block equals a TP=1 trunk's batch
    (logits within the TP bound of tests/test_tp.py, rel 1e-5), the block rolls back on
    every rank, and bad batches raise ValueError naming the item while the trunk stays usable;
  * four sessions (prompts of 5..17 tokens) run a script of decodes, batched verifies and
    sequential verifies (drafts: the TP=1 greedy chain with one slot corrupted) concurrently
    through the step loop at TP=2, with steps of more than one session; every result equals
    the same script run alone through TP=1's per-session engine calls: tokens, accepted
    counts, positions and rollback bytes exactly, margins within 1e-3 logits, fp32 rows
    within 1e-4 and the bf16 committed tails within one bf16 ulp (1e-2). Fast numerics (exact
    mode is TP=1 only): TP regroups sums (rel 1e-5) and the batch changes GEMM shapes (fast
    mode's batch rounding, tests/test_verifier_steps.py), both far below the chain's margins;
  * service level (in-process servers on port 0, real channels, an oracle drafter over a TP=1
    trunk): four concurrent generations through a TP=2 verifier, whose `start_verifier` runs
    the step loop, give the tokens of the same requests run one by one against a TP=1
    verifier, and Info reports steps of more than one session;
  * a worker killed while it is inside a step of three or more sessions fails every request
    of that step with TPWorkerError naming the dead rank, within the call timeout; later
    requests get "unusable", and closing the loop and the trunk reaps the workers.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
import time

import grpc
import pytest
import torch

from dspark_proto.v1 import common_pb2, gateway_pb2_grpc, verifier_pb2_grpc

from dsv4.batch import BatchItem
from dsv4.config import tiny_config
from model_fixtures import varied_weights
from services import app
from services.common.settings import GatewaySettings
from services.gateway.gate import GateConfig
from services.verifier.batcher import StepLoop, batchable
from services.verifier.engine import VerifierEngine
from verifier_fixtures import StepVerifier
from services.verifier.tp import TPSettings, TPWorkerError, start_tp_trunk
from services_fixtures import collect, gen_request
from tp_faults import worker_faults

CFG = tiny_config(max_seq_len=128)
W = varied_weights(CFG)
N_SESSIONS = 4
ROUNDS = 9
TOL = 1e-5  # TP=2 vs TP=1 logits, rel to the largest (tests/test_tp.py)
TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 30.0


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def ref():
    return start_tp_trunk(CFG, W, 1)


@pytest.fixture(scope="module")
def tp2():
    px = start_tp_trunk(CFG, W, 2, settings=TPSettings(init_timeout_s=60, call_timeout_s=CALL_TIMEOUT_S))
    yield px
    px.close()


# ---------------------------------------------------------------------------- the trunk call
def mixed_batch(model) -> tuple[list, list]:
    """Three prefilled states; one batch of a decode, a 4-token verify block and a decode;
    the block is then rolled back to 2 positions and every state decodes once more alone.
    Returns (logits of every output, next positions)."""
    states = [model.new_state() for _ in range(3)]
    for n, st in enumerate(states):
        model.prefill(st, torch.arange(5 + 4 * n) % CFG.vocab_size)
    outs = model.forward_batch([BatchItem.decode(states[0], 7, 5),
                                BatchItem.block(states[1], torch.tensor([9, 400, 2, 31]), 9),
                                BatchItem.decode(states[2], 300, 13)])
    logits = [outs[0].logits, *outs[1].logits, outs[2].logits]
    model.rollback(states[1], outs[1].undo, keep=2)
    logits += [model.decode(st, 11, st.next_position).logits for st in states]
    return logits, [st.next_position for st in states]


def test_forward_batch_on_every_rank_matches_tp1(tp2, ref):
    assert batchable(tp2)
    got, got_pos = mixed_batch(tp2)
    expected, expected_pos = mixed_batch(ref)
    assert got_pos == expected_pos == [7, 12, 15]
    assert len(got) == len(expected) == 9
    assert max(rel(a, b) for a, b in zip(got, expected)) < TOL
    assert [int(a.argmax()) for a in got] == [int(b.argmax()) for b in expected]


def test_bad_batches_raise_naming_the_item_and_the_trunk_stays_usable(tp2, ref):
    st = tp2.new_state()
    tp2.prefill(st, torch.arange(6))
    with pytest.raises(ValueError, match="at least one BatchItem"):
        tp2.forward_batch([])
    with pytest.raises(ValueError, match="item 1: str is not a BatchItem"):
        tp2.forward_batch([BatchItem.decode(st, 1, 6), "decode"])
    with pytest.raises(ValueError, match="item 0: its state does not belong to this TPTrunk"):
        tp2.forward_batch([BatchItem.decode(ref.new_state(), 1, 0)])
    with pytest.raises(ValueError, match="decode position=9 does not match state.next_position=6"):
        tp2.forward_batch([BatchItem.decode(st, 1, 9)])  # every rank rejects it alike
    [out] = tp2.forward_batch([BatchItem.decode(st, 1, 6)])
    assert out.logits.shape == (CFG.vocab_size,) and st.next_position == 7


# ---------------------------------------------------------------------------- the step loop
def session_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, CFG.vocab_size, (5 + 4 * i,), generator=g).tolist() for i in range(N_SESSIONS)]


def plain_chain(engine: VerifierEngine, prompt: list[int], n: int) -> list[int]:
    """The greedy continuation of `prompt` by plain decode (n + 1 tokens)."""
    sid = engine.open_session()
    try:
        chain = [engine.prefill(sid, prompt).next_token]
        while len(chain) <= n:
            chain.append(engine.decode(sid, chain[-1], len(prompt) + len(chain) - 1).next_token)
        return chain
    finally:
        engine.close_session(sid)


def run_script(engine: VerifierEngine, sid: int, prompt: list[int], chain: list[int], index: int, call) -> list:
    """Prefill, then ROUNDS rounds cycling decode / batched verify (k = 3..5) / sequential verify
    (k = 3), drafts from `chain` with slot (round + index) % (k + 1) corrupted (none when it is
    k). `call(op, *args)` runs one request. Returns every result and the committed tail."""
    out = [call("prefill", sid, prompt)]
    anchor, pos, got = out[0].next_token, len(prompt), 0
    for r in range(ROUNDS):
        kind, k = ("decode", 0) if r % 3 == 0 else ("batched", 3 + r % 3) if r % 3 == 1 else ("sequential", 3)
        if kind == "decode":
            res = call("decode", sid, anchor, pos)
            anchor, pos, got = res.next_token, pos + 1, got + 1
        else:
            drafts = list(chain[got + 1:got + 1 + k])
            bad = (r + index) % (k + 1)
            if bad < len(drafts):
                drafts[bad] = (drafts[bad] + 1) % CFG.vocab_size
            res = call("verify", sid, anchor, drafts, pos, kind)
            anchor, pos, got = res.bonus_token, pos + res.accepted + 1, got + res.accepted + 1
        out.append(res)
    out.append(engine.committed_tail(sid, 0))
    return out


def assert_close_results(a, b, where: str) -> None:
    for name in ("next_token", "bonus_token", "accepted", "positions", "forwarded", "first_position",
                 "rollback_bytes"):
        assert getattr(a, name, None) == getattr(b, name, None), f"{where}: {name}"
    assert abs(a.margin - b.margin) < 1e-3, where
    tol = 1e-4 if a.rows.dtype == torch.float32 else 1e-2  # committed tails are bf16: one ulp of it
    torch.testing.assert_close(a.rows.float(), b.rows.float(), rtol=tol, atol=tol)


def test_concurrent_sessions_through_the_loop_at_tp2_equal_tp1_solo(tp2, ref):
    solo_engine = StepVerifier(VerifierEngine(ref, max_sessions=2))
    prompts = session_prompts()
    chains = [plain_chain(solo_engine, p, 3 * ROUNDS + 6) for p in prompts]
    solo = []
    for i, (p, c) in enumerate(zip(prompts, chains)):
        sid = solo_engine.open_session()
        solo.append(run_script(solo_engine, sid, p, c, i, lambda op, *args: getattr(solo_engine, op)(*args)))
        solo_engine.close_session(sid)

    gc.collect()
    states_before = tp2.worker_stats()[0]["states"]
    engine = VerifierEngine(tp2, max_sessions=N_SESSIONS)
    records = []
    steps = StepLoop(engine, records.append)
    sids = [engine.open_session() for _ in prompts]
    together: list = [None] * N_SESSIONS

    def call(op, *args):
        return steps.submit(getattr(engine, f"admit_{op}")(*args)).result(TIMEOUT_S)

    def one(i):
        together[i] = run_script(engine, sids[i], prompts[i], chains[i], i, call)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(N_SESSIONS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    steps.close()
    for i in range(N_SESSIONS):
        assert together[i] is not None, f"session {i} did not finish"
        for j, (a, b) in enumerate(zip(together[i], solo[i])):
            assert_close_results(a, b, f"session {i} result {j}")
    accepted = {res.accepted for run in solo for res in run[1:-1] if hasattr(res, "accepted")}
    assert accepted >= {0, 1, 2, 3}  # rejections at every slot, and whole blocks accepted
    batch = [r for r in records if r.kind == "batch"]
    # every prompt completed in a prefill step; prompts that arrive together may share one
    assert sum(r.prefills_done for r in records if r.kind == "prefill") == N_SESSIONS
    assert max(r.sessions for r in batch) > 1  # sessions shared TP steps
    assert steps.stats().steps == len(batch) and steps.stats().batch_mean > 1.0
    for sid in sids:
        engine.close_session(sid)
    gc.collect()
    assert tp2.worker_stats()[0]["states"] == states_before  # the workers freed every session's copy


# ---------------------------------------------------------------------------- services
async def generations(verifier_trunk, reqs, together: bool):
    """The token ids of `reqs` through a verifier over `verifier_trunk` (step loop on), an
    oracle drafter over its own TP=1 trunk (corrupting every 3rd slot) and a gateway: run one
    by one, or all at once. Returns (token id lists, Info before, Info after)."""
    verifier = await app.start_verifier(app.verifier_engine(verifier_trunk), tp=getattr(verifier_trunk, "tp", 1))
    drafter = await app.start_drafter(app.drafter_engine(start_tp_trunk(CFG, W, 1), oracle=True, corrupt_every=3))
    gw, _, backends = await app.start_gateway(
        GatewaySettings(verifier_target=f"127.0.0.1:{verifier.port}", drafter_target=f"127.0.0.1:{drafter.port}"),
        GateConfig())
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as ch, \
                grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as vch:
            stub, info = gateway_pb2_grpc.GatewayStub(ch), verifier_pb2_grpc.VerifierStub(vch).Info
            before = await info(common_pb2.InfoRequest(), timeout=5)
            if together:
                gens = await asyncio.gather(*(collect(stub, r) for r in reqs))
            else:
                gens = [await collect(stub, r) for r in reqs]
            after = await info(common_pb2.InfoRequest(), timeout=5)
            return [list(g.token_ids) for g in gens], before, after
    finally:
        for server in (gw, drafter, verifier):
            await server.stop(0)
        await backends.close()


def test_concurrent_generations_at_tp2_equal_tp1_one_by_one(tp2, ref):
    prompts = session_prompts()
    reqs = [gen_request(ids=p, max_tokens=10 + 2 * i, spec=("off", "always", "gated")[i % 3])
            for i, p in enumerate(prompts)]
    expected, _, _ = asyncio.run(generations(ref, reqs, together=False))
    got, before, after = asyncio.run(generations(tp2, reqs, together=True))
    assert got == expected
    assert [len(t) for t in got] == [r.max_tokens for r in reqs]
    assert after.tp == 2 and after.steps > before.steps
    sessions = after.batch_size_mean * after.steps - before.batch_size_mean * before.steps
    assert sessions / (after.steps - before.steps) > 1.0  # the TP verifier's step loop batched the concurrent streams


def test_worker_killed_mid_step_fails_every_request_of_the_step():
    # rank 1 sleeps on its first batch of >= 3 sessions, so rank 0 waits in that step's
    # collectives when the worker is killed
    with worker_faults(stall_batch=(1, 3, 60.0)):
        px = start_tp_trunk(CFG, W, 2, settings=TPSettings(init_timeout_s=60, call_timeout_s=CALL_TIMEOUT_S))
    engine = VerifierEngine(px, max_sessions=4)
    steps = StepLoop(engine)
    try:
        *others, first = [engine.open_session() for _ in range(4)]
        anchors = {sid: steps.submit(engine.admit_prefill(sid, [3 + sid, 5, 7])).result(TIMEOUT_S).next_token
                   for sid in [*others, first]}
        pid = px.worker_pids[0]
        with engine.hold(first):  # the loop takes `first`'s decode alone and waits for its lock
            alone = steps.submit(engine.admit_decode(first, anchors[first], 3))
            deadline = time.monotonic() + TIMEOUT_S
            while not alone.running():  # taken into a step (public Future state)
                assert time.monotonic() < deadline, "the loop never took the first decode"
                time.sleep(0.01)
            step = [steps.submit(engine.admit_decode(sid, anchors[sid], 3)) for sid in others]  # the next step
        threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        assert alone.result(TIMEOUT_S).positions == range(3, 4)  # a step of one session: no stall
        died = rf"TP worker rank 1 \(pid {pid}\) died with exit code -9 during 'forward_batch'"
        for f in step:
            with pytest.raises(TPWorkerError, match=died):
                f.result(TIMEOUT_S)
        assert time.monotonic() - t0 < CALL_TIMEOUT_S  # the dead socket, not the timeout, ended it
        with pytest.raises(TPWorkerError, match="unusable"):
            steps.submit(engine.admit_decode(first, 1, 4)).result(TIMEOUT_S)
    finally:
        steps.close()
        px.close(timeout_s=1.0)
    with pytest.raises(RuntimeError, match="closed"):
        steps.submit(engine.admit_decode(first, 1, 4))
    with pytest.raises(ProcessLookupError):  # close() reaped the worker
        os.kill(pid, 0)


def test_a_dead_worker_turns_the_verifier_server_not_serving():
    """Found by the adversarial pass: a verifier whose TP worker died refused every call but
    kept reporting SERVING, so nothing took it out of rotation or restarted it."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async def go():
        px = start_tp_trunk(CFG, W, 2, settings=TPSettings(init_timeout_s=60, call_timeout_s=CALL_TIMEOUT_S))
        server = await app.start_verifier(VerifierEngine(px, max_sessions=4), tp=2)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        health = health_pb2_grpc.HealthStub(channel)

        async def status(name: str) -> int:
            return (await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)).status
        try:
            assert await status("dspark.v1.Verifier") == health_pb2.HealthCheckResponse.SERVING
            pid = px.worker_pids[0]
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(TPWorkerError, match=rf"rank 1 \(pid {pid}\) died"):
                await asyncio.to_thread(px.new_state)
            deadline = time.monotonic() + 10
            while await status("dspark.v1.Verifier") != health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() < deadline, "the verifier still reports SERVING"
                await asyncio.sleep(0.05)
            assert await status("") == health_pb2.HealthCheckResponse.NOT_SERVING
        finally:
            await channel.close()
            await server.stop(0)
            px.close(timeout_s=1.0)
    asyncio.run(asyncio.wait_for(go(), TIMEOUT_S))
