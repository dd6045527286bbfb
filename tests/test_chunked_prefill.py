"""Chunked prefill in the verifier's step loop (services/verifier/batcher.py) and the session
limit sized from memory (services/common/limits.py).

On the random tiny model (W = 8, compressor ratios 4 with indexer and 8, max_seq_len 128), a
75-token prompt crosses the ring's wrap and both compressors' block boundaries many times:
  * fed through the loop in chunks of 5, 8 and 16 tokens, alone and while three other
    sessions decode in the same steps, its result (next token, margin, tap rows, positions)
    and the state it leaves (rings, compressed entries and their count, the unfinished
    blocks' rows) equal the one-shot prefill (the whole prompt in one step, `StepVerifier`):
    bitwise in exact numerics, within 1e-4 in fast numerics; ten decodes from either state agree the same way;
  * every step carries at most one chunk, and the decoding sessions run in those steps;
  * a session closed part way through its prompt gets UnknownSessionError and is forwarded
    no further;
  * a bad chunk size is refused naming the value (loop, settings object, environment).
Limits: the memory rule's values, /proc/meminfo parsing on real files, and through real
in-process servers on port 0: a verifier and a drafter sized to two sessions answer the
third with RESOURCE_EXHAUSTED naming the limit; the verifier's Info reports the bytes of one
session, the limit, its rule and the prefill chunk.
"""

from __future__ import annotations

import asyncio
import time
import threading

import grpc
import pytest
import torch

from dspark_proto.v1 import common_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from dsv4.trunk import Trunk
from services.app import drafter_engine, start_drafter, start_verifier, verifier_engine
from verifier_fixtures import StepVerifier
from services.common.limits import (FALLBACK_MAX_SESSIONS, MAX_SESSIONS_CAP, available_memory_bytes,
                                    session_limit)
from services.common.sessions import UnknownSessionError
from services.common.settings import BackendSettings
from services.settings import backend_settings
from services.verifier.batcher import StepLoop
from services.verifier.engine import VerifierEngine
from model_fixtures import tiny_trunk_with
from services_fixtures import service_loop, tiny_draft_module, tiny_trunk

PROMPT_LEN = 75
TIMEOUT_S = 120.0


@pytest.fixture(scope="module", params=["exact", "fast"])
def trunk(request):
    return tiny_trunk_with(request.param)


def prompt(n: int = PROMPT_LEN, seed: int = 11) -> list[int]:
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_close(a: torch.Tensor, b: torch.Tensor, exact: bool, where: str) -> None:
    if exact:
        assert torch.equal(a, b), where
    else:
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-4, atol=1e-4, msg=where)


def live_state(model: Trunk, state) -> list[torch.Tensor]:
    """What a state's future forwards read: rings, entries, and the compressor rows of the
    unfinished blocks (rows a reset left empty and a step left stale are never read)."""
    p, out = state.next_position, []
    for layer, st in zip(model.layers, state.layers):
        out.append(st.ring)
        comps = ((layer.attn.compressor, st.compressor),
                 (layer.attn.indexer.compressor if layer.attn.indexer else None, st.indexer))
        for module, cs in comps:
            if module is None:
                continue
            r = module.ratio
            rows = list(range(r)) if module.overlap and p >= r else []  # the previous block
            rows += [(r if module.overlap else 0) + i for i in range(p % r)]  # the current one
            out += [torch.tensor([cs.n_entries]), cs.cache[: cs.n_entries], cs.kv[rows], cs.score[rows]]
    return out


def continue_decoding(engine: VerifierEngine, sid: int, first: int, n: int = 10) -> list:
    tok, out = first, []
    for i in range(n):
        res = engine.decode(sid, tok, PROMPT_LEN + i)
        out.append(res)
        tok = res.next_token
    return out


def one_shot(engine: VerifierEngine, ids: list[int]):
    sid = engine.open_session()
    res = engine.prefill(sid, ids)
    return sid, res


@pytest.mark.parametrize("chunk", [5, 8, 16])
def test_chunked_prefill_alone_equals_one_shot(trunk, chunk):
    exact = trunk.verify_numerics == "exact"
    engine = StepVerifier(VerifierEngine(trunk, max_sessions=4))
    ids = prompt()
    ref_sid, ref = one_shot(engine, ids)
    records = []
    steps = StepLoop(engine, records.append, prefill_chunk=chunk)
    try:
        sid = engine.open_session()
        got = steps.submit(engine.admit_prefill(sid, ids)).result(TIMEOUT_S)
    finally:
        steps.close()
    assert got.next_token == ref.next_token and got.positions == ref.positions == range(PROMPT_LEN - 8, PROMPT_LEN)
    assert (got.margin == ref.margin) if exact else abs(got.margin - ref.margin) < 1e-3
    assert_close(got.rows, ref.rows, exact, "tap rows")
    for i, (a, b) in enumerate(zip(live_state(trunk, engine._get(sid).state),
                                   live_state(trunk, engine._get(ref_sid).state))):
        assert_close(a, b, exact, f"state tensor {i}")
    assert [r.prefill_rows for r in records] == [min(chunk, PROMPT_LEN - i) for i in range(0, PROMPT_LEN, chunk)]
    assert sum(r.prefills_done for r in records) == 1
    for a, b in zip(continue_decoding(engine, sid, got.next_token), continue_decoding(engine, ref_sid, ref.next_token)):
        assert a.next_token == b.next_token
        assert_close(a.rows, b.rows, exact, "decode after prefill")


def test_chunked_prefill_interleaved_with_decodes_equals_solo(trunk):
    exact, chunk, n_others, n_decodes = trunk.verify_numerics == "exact", 8, 3, 12
    engine = StepVerifier(VerifierEngine(trunk, max_sessions=2 * (n_others + 1)))
    ids, short = prompt(), [prompt(5 + 3 * i, seed=20 + i) for i in range(n_others)]

    def decode_run(call_prefill, call_decode, sid, p):
        res = [call_prefill(sid, p)]
        for i in range(n_decodes):
            res.append(call_decode(sid, res[-1].next_token, len(p) + i))
        return res

    solo = []
    for p in short:
        sid = engine.open_session()
        solo.append(decode_run(engine.prefill, engine.decode, sid, p))
    ref_sid, ref = one_shot(engine, ids)

    records = []
    steps = StepLoop(engine, records.append, prefill_chunk=chunk)
    loop = {op: (lambda op: lambda *a: steps.submit(getattr(engine, f"admit_{op}")(*a)).result(TIMEOUT_S))(op)
            for op in ("prefill", "decode")}
    sids = [engine.open_session() for _ in short]
    together: list = [None] * n_others
    for i in range(n_others):  # prefilled first, so their decodes overlap the long prompt
        together[i] = [loop["prefill"](sids[i], short[i])]
    started = threading.Event()

    def decodes(i):
        started.wait(TIMEOUT_S)
        for j in range(n_decodes):
            together[i].append(loop["decode"](sids[i], together[i][-1].next_token, len(short[i]) + j))

    threads = [threading.Thread(target=decodes, args=(i,)) for i in range(n_others)]
    for t in threads:
        t.start()
    long_sid = engine.open_session()
    future = steps.submit(engine.admit_prefill(long_sid, ids))
    started.set()
    got = future.result(TIMEOUT_S)
    for t in threads:
        t.join(TIMEOUT_S)
    steps.close()

    assert got.next_token == ref.next_token and got.positions == ref.positions
    assert_close(got.rows, ref.rows, exact, "long prompt rows")
    for a, b in zip(live_state(trunk, engine._get(long_sid).state), live_state(trunk, engine._get(ref_sid).state)):
        assert_close(a, b, exact, "long prompt state")
    for i in range(n_others):
        assert len(together[i]) == n_decodes + 1, f"session {i} did not finish"
        for j, (a, b) in enumerate(zip(solo[i], together[i])):
            assert a.next_token == b.next_token, f"session {i} result {j}"
            assert_close(a.rows, b.rows, exact, f"session {i} result {j}")
    chunked = [r for r in records if r.prefill_rows]
    assert all(r.prefill_rows <= chunk for r in records)
    assert sum(r.prefill_rows for r in records) == PROMPT_LEN + sum(map(len, short))
    assert any(r.sessions > 1 for r in chunked if r.prefill_rows == chunk)  # decodes shared the prompt's steps


def test_a_session_closed_mid_prefill_is_dropped_and_freed():
    engine = VerifierEngine(tiny_trunk_with("exact"), max_sessions=2)
    sid = engine.open_session()
    records = []

    def on_step(record):
        records.append(record)
        if len(records) == 2:  # two chunks in: the stream ends
            engine.close_session(sid)

    steps = StepLoop(engine, on_step, prefill_chunk=8)
    try:
        with pytest.raises(UnknownSessionError, match=f"session {sid} is not open"):
            steps.submit(engine.admit_prefill(sid, prompt())).result(TIMEOUT_S)
        assert [r.prefill_rows for r in records] == [8, 8] and engine.num_sessions == 0
        other = engine.open_session()  # the slot is free; the loop serves the next prompt whole
        res = steps.submit(engine.admit_prefill(other, prompt(10))).result(TIMEOUT_S)
        assert res.positions.stop == 10 and [r.prefill_rows for r in records[2:]] == [8, 2]
    finally:
        steps.close()


@pytest.mark.parametrize("bad", [0, -3, 2.5, "8", True])
def test_a_bad_chunk_size_is_refused_naming_the_value(bad):
    engine = VerifierEngine(tiny_trunk(), max_sessions=1)
    with pytest.raises(ValueError, match="prefill_chunk"):
        StepLoop(engine, prefill_chunk=bad)
    with pytest.raises(ValueError, match=f"prefill_chunk={bad!r}"):
        BackendSettings(prefill_chunk=bad)


@pytest.mark.parametrize("raw", ["0", "-1", "abc", "1.5", "", "2000000"])
def test_a_bad_prefill_chunk_variable_is_refused_naming_it(raw):
    with pytest.raises(ValueError, match=f"DSPARK_PREFILL_CHUNK={raw!r}"):
        backend_settings({"DSPARK_PREFILL_CHUNK": raw})
    assert backend_settings({"DSPARK_PREFILL_CHUNK": "32"}).prefill_chunk == 32
    assert backend_settings({}).prefill_chunk == 64 and backend_settings({}).max_sessions is None


# ---------------------------------------------------------------------------- limits
def test_the_memory_rule():
    gib = 2**30
    lim = session_limit(100 * 2**20, available_bytes=20 * gib)  # 0.5 * 20 GiB / 100 MiB = 102
    assert lim.limit == 102 and lim.per_session_bytes == 100 * 2**20 and lim.rule.startswith("memory: 0.5 x 20.0 GiB")
    assert session_limit(2**20, available_bytes=20 * gib).limit == MAX_SESSIONS_CAP
    assert session_limit(2**20, configured=7, available_bytes=20 * gib).rule == "DSPARK_MAX_SESSIONS=7"
    assert session_limit(2**20).limit == FALLBACK_MAX_SESSIONS
    with pytest.raises(ValueError, match="holds no session of 4096 bytes"):
        session_limit(4096, available_bytes=4096)
    with pytest.raises(ValueError, match="per_session_bytes=0"):
        session_limit(0)


def test_available_memory_is_read_from_meminfo(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24576000 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\n")
    assert available_memory_bytes(f) == 20000000 * 1024
    f.write_text("MemTotal:       24576000 kB\n")
    assert available_memory_bytes(f) is None
    assert available_memory_bytes(tmp_path / "absent") is None


def test_sessions_beyond_the_memory_sized_limit_are_resource_exhausted():
    probe = verifier_engine(tiny_trunk(), BackendSettings())
    per = probe.per_session_bytes()
    model = tiny_trunk()
    assert per == model.state_bytes(model.new_state()) + model.cfg.window_size * model.cfg.tap_width * 2
    v_engine = verifier_engine(tiny_trunk(), BackendSettings(), available_bytes=5 * per)  # 0.5 x 5 -> 2
    rings = drafter_engine(tiny_draft_module(), settings=BackendSettings())
    d_per = rings.session_bytes(rings.open_session())
    d_engine = drafter_engine(tiny_draft_module(), settings=BackendSettings(), available_bytes=5 * d_per)
    assert v_engine.max_sessions == d_engine.max_sessions == 2 and v_engine.limit_rule.startswith("memory: 0.5 x ")

    async def third_session(stub, engine, first=None):
        """Hold two sessions open (sending `first` on each when given), then open a third."""
        calls = [stub.Session(timeout=30) for _ in range(2)]
        for call in calls:
            if first is not None:
                await call.write(first)
                assert (await call.read()).next_position == 3
        deadline = time.monotonic() + 30.0  # a loaded machine can take seconds to open them
        while engine.num_sessions < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert engine.num_sessions == 2, "the first two sessions did not open"
        third = stub.Session(timeout=30)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await third.read()
        for call in calls:
            call.cancel()
        return err.value

    async def scenario():
        verifier, drafter = await start_verifier(v_engine, prefill_chunk=16), await start_drafter(d_engine)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as ch:
                stub = verifier_pb2_grpc.VerifierStub(ch)
                info = await stub.Info(common_pb2.InfoRequest(), timeout=10)
                v_err = await third_session(stub, v_engine, verifier_pb2.VerifierRequest(
                    prefill=verifier_pb2.PrefillRequest(token_ids=[5, 6, 7])))
                deadline = time.monotonic() + 30.0  # a step's stats land just after its replies
                while (after := await stub.Info(common_pb2.InfoRequest(), timeout=10)).prefill_steps < 2 \
                        and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{drafter.port}") as ch:
                d_err = await third_session(drafter_pb2_grpc.DrafterStub(ch), d_engine)
            return info, v_err, after, d_err
        finally:
            await verifier.stop(0)
            await drafter.stop(0)

    info, v_err, after, d_err = service_loop().run(scenario())
    assert info.session_state_bytes == per and info.max_sessions == 2 and info.prefill_chunk == 16
    assert info.max_sessions_rule == v_engine.limit_rule
    assert after.prefill_steps >= 2  # the two sessions' prompts ran as prompt-chunk steps
    for err in (v_err, d_err):
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "session limit reached: 2 sessions open (max_sessions=2)" in err.details(), err.details()


def test_the_step_loop_thread_runs_with_the_configured_torch_threads(trunk):
    """A thread other than the main one starts with torch's default team (one worker per core),
    which made every served forward about twice as slow on the 2-core box
    (services.common.threads); the loop pins the count it is given on its own thread."""
    engine = VerifierEngine(trunk, max_sessions=2)
    for threads in (1, 2):
        seen = []
        steps = StepLoop(engine, lambda record: seen.append(torch.get_num_threads()), torch_threads=threads)
        try:
            sid = engine.open_session()
            steps.submit(engine.admit_prefill(sid, prompt(6))).result(TIMEOUT_S)
        finally:
            steps.close()
            engine.close_session(sid)
        assert seen == [threads]
