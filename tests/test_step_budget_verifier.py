"""The step budget in the verifier's step loop (services/verifier/batcher.py with a
`StepBudget`): a block the budget cuts to its first n drafts gives exactly what a verify of
those n drafts sent whole gives, under every sampling rule, the rejection rule's draft
distributions included (the trimmed q is the first n rows of what was sent).

Random tiny model (exact numerics), fixed prices: a row costs 1 ms and lambda is 0.1 tokens
per ms, so a drafted position pays while its survival is >= 0.1 (hand-computed admissions).
"""

from __future__ import annotations

import torch

from services.common.budget import StepBudget, StepTimes
from services.verifier.batcher import StepLoop
from services.verifier.engine import VerifierEngine
from model_fixtures import tiny_trunk_with

from dsv4.sampling import GREEDY, SamplingParams

TIMEOUT_S = 60.0
PER_ROW = StepTimes((1.0, 100.0), (1.0, 100.0))  # 1 ms a row
RATE = 0.1  # tokens per ms: a position pays while its survival >= 0.1
PROMPT = [5, 17, 33, 2, 8]


def _fields(res) -> tuple:
    return (res.accepted, res.bonus_token, res.margin, res.admitted, res.forwarded, res.rollback_bytes,
            tuple(res.positions), res.rows.tolist(), tuple(res.logprobs))


def _run(steps: StepLoop, engine: VerifierEngine, params: SamplingParams, drafts: list[int],
         q: torch.Tensor | None, survival) -> tuple:
    """Prefill PROMPT with `params`, verify [anchor, *drafts] (batched) with `q` and
    `survival`, then decode the anchor it returns: (the verify's fields, the decode's token)."""
    sid = engine.open_session()
    try:
        first = steps.submit(engine.admit_prefill(sid, PROMPT, params)).result(TIMEOUT_S)
        n = len(PROMPT)
        res = steps.submit(engine.admit_verify(sid, first.next_token, drafts, n, "batched", q, survival)
                           ).result(TIMEOUT_S)
        after = steps.submit(engine.admit_decode(sid, res.bonus_token, res.positions.stop)).result(TIMEOUT_S)
        return _fields(res), after.next_token
    finally:
        engine.close_session(sid)


def _greedy_chain(steps: StepLoop, engine: VerifierEngine, n: int) -> list[int]:
    """The greedy drafts after PROMPT's first anchor x[n]: x[n+1..n+k], k = n, by plain decode."""
    sid = engine.open_session()
    try:
        token = steps.submit(engine.admit_prefill(sid, PROMPT)).result(TIMEOUT_S).next_token
        chain = [token]
        for i in range(n):
            chain.append(steps.submit(engine.admit_decode(sid, chain[-1], len(PROMPT) + i)).result(TIMEOUT_S).next_token)
        return chain[1:]
    finally:
        engine.close_session(sid)


def test_a_cut_block_equals_its_prefix_sent_whole_under_every_rule():
    engine = VerifierEngine(tiny_trunk_with("exact"), max_sessions=4)
    steps = StepLoop(engine, budget=StepBudget(lambda: (PER_ROW, RATE)))
    try:
        chain = _greedy_chain(steps, engine, 4)  # drafts the target accepts: the cut drops real tokens
        accepted = 0
        vocab = engine.cfg.vocab_size
        for rule, temperature in (("coupled", 0.0), ("coupled", 0.9), ("rejection", 0.9)):
            for seed in range(2):
                params = GREEDY if temperature == 0 else SamplingParams(temperature=temperature, seed=seed,
                                                                        rule=rule, logprobs=2)
                g = torch.Generator().manual_seed(seed)
                drafts = chain if seed % 2 == 0 else torch.randint(0, vocab, (4,), generator=g).tolist()
                q = torch.softmax(torch.randn(4, vocab, generator=g), -1) if rule == "rejection" else None
                for survival, admitted in (((0.9, 0.5, 0.05, 0.01), 2), ((0.09, 0.05, 0.01, 0.0), 0)):
                    cut, cut_next = _run(steps, engine, params, drafts, q, survival)
                    whole, whole_next = _run(steps, engine, params, drafts[:admitted],
                                             None if q is None else q[:admitted].clone(), None)
                    assert cut[3] == admitted, (rule, seed, survival, cut[3])
                    assert cut == whole and cut_next == whole_next, (rule, seed, survival)
                    accepted += cut[0]
        assert accepted >= 2  # greedy accepts both admitted drafts of the chain (seed 0)
    finally:
        steps.close()


BAD_SURVIVAL = [
    ([0.9], "survival has 1 entries for 2 drafts"), ([float("nan"), 0.1], "survival[0]=nan"),
    ([float("inf"), 0.1], "survival[0]=inf"), ([0.5, -0.25], "survival[1]=-0.25"), ([1.5, 0.5], "survival[0]=1.5"),
    ([0.25, 0.5], "survival[1]=0.5 > survival[0]=0.25"), ([0.5] * 10**6, "survival has 1000000 entries")]


def test_bad_survival_over_grpc_is_invalid_argument_naming_the_value_and_leaks_no_session():
    """Each bad survival, in either verify mode, on a real in-process verifier: INVALID_ARGUMENT
    naming the value; afterwards no session is left open, and a good one is answered."""
    import asyncio

    import grpc

    from dspark_proto.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
    from services import app
    from services.common.settings import BackendSettings

    def verify(anchor: int, survival: list[float], mode: int):
        return verifier_pb2.VerifierRequest(verify=verifier_pb2.VerifyRequest(
            anchor=anchor, drafts=[1, 2], position=3, mode=mode, survival=survival))

    async def one(stub, survival, mode):
        call = stub.Session(timeout=TIMEOUT_S)
        await call.write(verifier_pb2.VerifierRequest(prefill=verifier_pb2.PrefillRequest(token_ids=[5, 6, 7])))
        anchor = (await call.read()).next_token
        await call.write(verify(anchor, survival, mode))
        try:
            reply = await call.read()
            await call.done_writing()
            await call.read()  # the stream's end: the server closes the session
            return None, reply.admitted
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details()

    async def run():
        engine = app.verifier_engine(app.load_trunk(None, verify_numerics="exact"),
                                     BackendSettings(verify_numerics="exact", max_sessions=4))
        server = await app.start_verifier(engine)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}",
                                                 options=[("grpc.max_send_message_length", 16 << 20)]) as ch:
                stub = verifier_pb2_grpc.VerifierStub(ch)
                out = [await one(stub, s, mode) for s, _ in BAD_SURVIVAL for mode in (1, 2)]
                good = await one(stub, [0.75, 0.5], 2)
                for _ in range(100):  # the server closes each failed stream's session as it ends
                    if (await stub.Info(common_pb2.InfoRequest(), timeout=TIMEOUT_S)).open_sessions == 0:
                        break
                    await asyncio.sleep(0.05)
                return out, good, engine.num_sessions
        finally:
            await server.stop(0)

    out, good, left = asyncio.run(run())
    for (code, details), (survival, named) in zip(out, [b for b in BAD_SURVIVAL for _ in (1, 2)]):
        assert code == grpc.StatusCode.INVALID_ARGUMENT and named in details, (survival[:3], code, details)
    assert good == (None, 2) and left == 0
