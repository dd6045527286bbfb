"""The drafter's step loop (services/drafter/steps.py): every session's commits and drafts in
one batched call per step.

Engine level, tiny config (W = 8, B = 5, max_seq_len 64), conformance weights: six sessions
with prompts of 1..16 rows run rounds of "commit the accepted rows, then draft" (1..4 rows a
round, so positions wrap the rings at different rounds). Submitted together, each round's
requests share steps; every session's drafts give the tokens of the same script run alone
through `DrafterEngine`, confidences within 1e-4, and its rings end bitwise equal (commits
are exact). A bad draft fails alone in a step it shares; a request of a session closed
before its step gets UnknownSessionError and nothing of it runs; a second request in flight,
a request after close, and an oracle engine are refused.

Service level (an in-process drafter server on port 0, real channels, float32 rows on the
wire): the same scripts as concurrent Session streams give the drafts of their solo streams;
Info reports steps holding more than one session; a stream cancelled mid-script frees its
session while the others finish unchanged.
"""

from __future__ import annotations

import asyncio
import functools
import time

import grpc
import pytest
import torch

from dspark_proto.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from dsv4.config import tiny_config
from dsv4.dspark import DSparkDraft
from reference_dspark import conformance_weights, synthetic_rows
from services import app
from services.common.sessions import UnknownSessionError
from services.common.tensors import to_proto
from services.drafter.engine import DrafterEngine
from services.drafter.oracle import OracleDrafter, OracleScript
from services.drafter.steps import DraftStepLoop

CFG = tiny_config()
N_SESSIONS = 6
PROMPTS = [1, 4, 7, 9, 12, 16]  # rows committed before the first draft
ROUNDS = 8
TIMEOUT_S = 60.0
CONF_ATOL = 1e-4


@functools.lru_cache(maxsize=None)
def module() -> DSparkDraft:
    m = DSparkDraft(CFG)
    m.load_weights(conformance_weights(CFG, 0))
    return m


def script(i: int) -> list[tuple]:
    """Session i's calls: ("commit", rows, positions) and ("draft", anchor, seed_position)."""
    rows = synthetic_rows(CFG, CFG.max_seq_len, seed=100 + i)
    calls, last = [("commit", rows[:PROMPTS[i]], range(PROMPTS[i]))], PROMPTS[i] - 1
    for r in range(ROUNDS):
        calls.append(("draft", (31 * i + 7 * r) % CFG.vocab_size, last))
        n = 1 + (i + r) % 4  # the accepted drafts plus the bonus row
        calls.append(("commit", rows[last + 1:last + 1 + n], range(last + 1, last + 1 + n)))
        last += n
    calls.append(("draft", 3, last))
    return calls


def solo_runs(engine: DrafterEngine) -> list[tuple[list, list]]:
    """Each script alone through the engine: (draft results, final rings)."""
    out = []
    for i in range(N_SESSIONS):
        sid, drafts = engine.open_session(), []
        for op, a, b in script(i):
            if op == "commit":
                engine.commit(sid, a, b)
            else:
                drafts.append(engine.draft(sid, a, b))
        out.append((drafts, [r.clone() for r in engine.session_state(sid).rings]))
        engine.close_session(sid)
    return out


def assert_drafts_equal(got: list, ref: list, where: str) -> None:
    assert len(got) == len(ref), where
    for j, ((tokens, conf), (ref_tokens, ref_conf)) in enumerate(zip(got, ref)):
        assert tokens == ref_tokens, f"{where} draft {j}"
        torch.testing.assert_close(conf, ref_conf, rtol=0, atol=CONF_ATOL)


def test_concurrent_sessions_through_the_loop_equal_their_solo_runs():
    engine = DrafterEngine(module(), max_sessions=2 * N_SESSIONS)
    solo = solo_runs(engine)
    records = []
    steps = DraftStepLoop(engine, records.append)
    try:
        sids = [engine.open_session() for _ in range(N_SESSIONS)]
        calls = [script(i) for i in range(N_SESSIONS)]
        drafts: list[list] = [[] for _ in range(N_SESSIONS)]
        for k in range(len(calls[0])):  # every session's k-th call submitted together, then awaited
            futures = [(steps.submit_commit if c[k][0] == "commit" else steps.submit_draft)(sid, *c[k][1:])
                       for sid, c in zip(sids, calls)]
            for i, f in enumerate(futures):
                reply = f.result(TIMEOUT_S)
                assert reply.step_ms > 0
                if calls[i][k][0] == "draft":
                    drafts[i].append(reply.value)
        for i, sid in enumerate(sids):
            assert_drafts_equal(drafts[i], solo[i][0], f"session {i}")
            rings = engine.session_state(sid).rings
            assert all(torch.equal(a, b) for a, b in zip(rings, solo[i][1])), f"session {i} rings"
    finally:
        steps.close()
    assert max(r.sessions for r in records) == N_SESSIONS  # a whole round shared one step
    assert sum(r.drafts for r in records) == N_SESSIONS * (ROUNDS + 1)
    stats = steps.stats()
    assert stats.steps == len(records) and stats.batch_max == N_SESSIONS and stats.batch_mean > 1


def test_a_bad_draft_fails_alone_and_closed_sessions_are_dropped():
    engine = DrafterEngine(module(), max_sessions=4)
    records = []
    steps = DraftStepLoop(engine, records.append)
    rows = synthetic_rows(CFG, 12, seed=5)
    try:
        a, b, c = (engine.open_session() for _ in range(3))
        for sid in (a, b, c):
            steps.submit_commit(sid, rows[:9], range(9)).result(TIMEOUT_S)
        ref = engine.draft(b, 5, 8)
        with engine.hold(c):  # the loop waits on c, so the next two requests share a step
            first = steps.submit_draft(c, 5, 8)
            while not first.running():  # the loop has taken it and now waits for c's lock
                time.sleep(0.001)
            bad = steps.submit_draft(a, 5, 7)  # 7 is not a's last committed position
            good = steps.submit_draft(b, 5, 8)
            with pytest.raises(ValueError, match=f"session {c} already has a request in flight"):
                steps.submit_draft(c, 5, 8)
        first.result(TIMEOUT_S)
        with pytest.raises(ValueError, match="seed_position=7 is not the last committed position 8"):
            bad.result(TIMEOUT_S)
        assert good.result(TIMEOUT_S).value[0] == ref[0]
        assert records[-1].sessions == 2 and records[-1].drafts == 2
        engine.close_session(a)
        n_steps = len(records)
        with pytest.raises(UnknownSessionError, match=f"session {a} is not open"):
            steps.submit_commit(a, rows[9:10], [9]).result(TIMEOUT_S)
        assert len(records) == n_steps  # its step had nothing left to run
        assert engine.num_sessions == 2
    finally:
        steps.close()
    with pytest.raises(RuntimeError, match="closed"):
        steps.submit_draft(b, 5, 8)
    with pytest.raises(ValueError, match="TP=1 DrafterEngine, got OracleDrafter"):
        DraftStepLoop(OracleDrafter(CFG, OracleScript((1, 2, 3))))


# ---------------------------------------------------------------------------- service
def request(call: tuple, tag: int) -> drafter_pb2.DrafterRequest:
    op, a, b = call
    if op == "commit":
        return drafter_pb2.DrafterRequest(session_tag=tag, commit=drafter_pb2.CommitRequest(
            rows=to_proto(a, "float32"), first_position=b[0]))
    return drafter_pb2.DrafterRequest(session_tag=tag, draft=drafter_pb2.DraftRequest(anchor=a, seed_position=b))


async def stream_script(stub, i: int, stop_after: int | None = None) -> list:
    """Run script(i) on one Session stream; returns its drafts as (tokens, confidence [n])."""
    call, drafts = stub.Session(timeout=TIMEOUT_S), []
    for k, c in enumerate(script(i)):
        if stop_after is not None and k == stop_after:
            call.cancel()
            return drafts
        await call.write(request(c, i + 1))
        reply = await call.read()
        assert reply.session_tag == i + 1
        if c[0] == "draft":
            drafts.append((list(reply.tokens), torch.tensor(list(reply.confidence_logits))))
    await call.done_writing()
    return drafts


def test_concurrent_streams_equal_their_solo_streams_and_a_cancelled_one_is_freed():
    engine = DrafterEngine(module(), max_sessions=2 * N_SESSIONS)

    async def run():
        server = await app.start_drafter(engine)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                stub = drafter_pb2_grpc.DrafterStub(ch)
                solo = [await stream_script(stub, i) for i in range(N_SESSIONS)]
                before = await stub.Info(common_pb2.InfoRequest(), timeout=5)
                cancelled = stream_script(stub, 0, stop_after=5)
                together = await asyncio.gather(cancelled, *(stream_script(stub, i) for i in range(1, N_SESSIONS)))
                after = await stub.Info(common_pb2.InfoRequest(), timeout=5)
                for _ in range(200):
                    if engine.num_sessions == 0:
                        break
                    await asyncio.sleep(0.05)
                return solo, together, before, after, engine.num_sessions
        finally:
            await server.stop(0)

    solo, together, before, after, open_after = asyncio.run(run())
    assert len(together[0]) == 2  # the cancelled stream drafted twice before it went away
    for i in range(1, N_SESSIONS):
        assert_drafts_equal(together[i], solo[i], f"stream {i}")
    assert before.drafter_steps > 0 and before.drafter_batch_size_max == 1  # solo streams: one session a step
    assert before.drafter_step_ms_mean > 0
    shared = after.drafter_steps - before.drafter_steps
    assert after.drafter_batch_size_max > 1 and shared > 0
    assert after.drafter_batch_size_mean * after.drafter_steps > before.drafter_batch_size_mean * before.drafter_steps + shared
    assert open_after == 0
