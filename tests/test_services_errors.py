"""Bad input, session limits and client cancellation through real services (port 0, real channels).

* Each bad Generate request gets INVALID_ARGUMENT with a message naming the value.
* The verifier's session limit answers RESOURCE_EXHAUSTED to the generation that exceeds it;
  a full drafter only degrades a generation to plain decode (same output).
* The verifier and the drafter validate their own inputs when called directly over their
  own stubs (row width, dtype, shape, positions, token ids, a message with no operation),
  and close the session of a stream they reject.
* 50 streams cancelled at seeded random points leave no open session on either backend,
  and the next request succeeds with the same output as before.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
import torch

from dspark_proto.v1 import common_pb2, drafter_pb2, gateway_pb2, verifier_pb2
from services.common.tensors import to_proto
from services_fixtures import (collect, dspark_stack, gen_request, oracle_stack, spec_counts,  # noqa: F401
                               start_stack, tiny_trunk)

INVALID = grpc.StatusCode.INVALID_ARGUMENT
WIDTH = 768  # tap width of the tiny model: 3 target layers x dim 256


def test_tiny_model_dimensions():
    cfg = tiny_trunk().cfg
    assert (cfg.tap_width, cfg.vocab_size, cfg.max_seq_len, cfg.window_size) == (WIDTH, 512, 256, 8)


def expect_error(stack, coro_fn, code: grpc.StatusCode, *needles: str) -> str:
    """Run `coro_fn()` on the stack's loop; it must fail with `code` and a message holding every needle."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        stack.loop.run(coro_fn(), 60)
    err = info.value
    assert err.code() == code, (err.code(), err.details())
    for needle in needles:
        assert needle in err.details(), (needle, err.details())
    return err.details()


def assert_idle(stack) -> None:
    counts = stack.wait_idle()
    assert counts == dict.fromkeys(counts, 0)


async def read_rest(call) -> list:
    """The remaining messages of a server stream already read with `read()` (until EOF)."""
    out = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        out.append(msg)
    return out


# ---------------------------------------------------------------------------- gateway
BAD_REQUESTS = {
    "empty_prompt": (gen_request(""), ["empty prompt"]),
    "token_id_above_vocab": (gen_request(ids=[5, 512, 7]), ["token id 512", "vocab_size=512"]),
    "negative_token_id": (gen_request(ids=[-1, 5]), ["token id -1"]),
    "max_tokens_zero": (gen_request("hi", max_tokens=0), ["max_tokens=0", "> 0"]),
    "max_tokens_negative": (gen_request("hi", max_tokens=-5), ["max_tokens=-5"]),
    "max_tokens_over_limit": (gen_request("h", max_tokens=256), ["max_tokens=256", "max_seq_len=256"]),
    "max_tokens_int32_max": (gen_request("h", max_tokens=2**31 - 1), [f"max_tokens={2**31 - 1}"]),
    "prompt_plus_max_tokens": (gen_request(ids=[5] * 200, max_tokens=57),
                               ["200 tokens", "max_tokens=57", "max_seq_len=256"]),
    "prompt_longer_than_max_seq_len": (gen_request(ids=[5] * 300, max_tokens=1), ["300 tokens"]),
    "temperature": (gen_request("hi", temperature=-0.5), ["temperature=-0.5", ">= 0"]),
    "stop_token_id_out_of_range": (gen_request("hi", stop_token_ids=[600]), ["stop token id 600"]),
    "unknown_spec_mode": (gateway_pb2.GenerateRequest(prompt="hi", max_tokens=4, spec=9), ["spec=9"]),
}


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_bad_generate_request_is_invalid_argument_naming_the_value(oracle_stack, name):  # noqa: F811
    req, needles = BAD_REQUESTS[name]

    async def call():
        gw = await oracle_stack.agateway("sequential")
        return await collect(gw.stub, req, 30)

    expect_error(oracle_stack, call, INVALID, *needles)
    assert_idle(oracle_stack)


def test_prompt_plus_max_tokens_at_the_limit_is_accepted(oracle_stack):  # noqa: F811
    gen = oracle_stack.generate(gen_request(ids=[5] * 250, max_tokens=6, spec="always"))
    assert len(gen.token_ids) == 6 and gen.finish_reason == "length"


def test_verifier_session_limit_is_resource_exhausted():
    stack = start_stack("oracle", verifier_max_sessions=1)
    try:
        async def run():
            gw = await stack.agateway("sequential")
            first = gw.stub.Generate(gen_request("hello world", max_tokens=80, spec="off"), timeout=60)
            msg = await first.read()  # the first generation holds the only verifier session now
            assert list(msg.token_ids) and not msg.finished
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(gw.stub, gen_request("abc", max_tokens=4, spec="always"), 30)
            rest = await read_rest(first)
            return info.value, rest
        err, rest = stack.loop.run(run())
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "session limit reached: 1 sessions open" in err.details()
        assert rest[-1].finished and rest[-1].usage.completion_tokens == 80  # the first one was unaffected
        assert_idle(stack)
        assert len(stack.generate(gen_request("abc", max_tokens=4)).token_ids) == 4  # the slot is free again
    finally:
        stack.close()


def test_full_drafter_keeps_the_generation_on_plain_rounds_with_the_same_output():
    stack = start_stack("oracle", drafter_max_sessions=1)
    try:
        async def run():
            gw = await stack.agateway("sequential")
            first = gw.stub.Generate(gen_request("hello world", max_tokens=40, spec="always"), timeout=60)
            msg = await first.read()
            assert not msg.finished
            second = await collect(gw.stub, gen_request("abc", max_tokens=12, spec="always"), 60)
            rest = await read_rest(first)
            return second, rest
        second, rest = stack.loop.run(run())
        off = stack.generate(gen_request("abc", max_tokens=12, spec="off"))
        assert second.token_ids == off.token_ids
        # A full drafter is asked again later (tests/test_drafter_full.py), never given up on;
        # its refusals leave the generation on plain rounds with plain decode's tokens.
        assert not second.stats.drafter_failed and second.stats.plain_rounds >= 1
        assert rest[-1].finished and not rest[-1].spec_stats.drafter_failed
        assert_idle(stack)
    finally:
        stack.close()


# ---------------------------------------------------------------------------- backends over their stubs
async def session_error(method, requests):
    """Send `requests` on one Session stream; all but the last must be answered; the last must fail.

    Returns the AioRpcError (raises AssertionError when the last request was answered)."""
    call = method(timeout=30)
    try:
        for req in requests[:-1]:
            await call.write(req)
            reply = await call.read()
            assert reply is not grpc.aio.EOF
        await call.write(requests[-1])
        reply = await call.read()
        raise AssertionError(f"the backend answered an invalid request: {reply}")
    except grpc.aio.AioRpcError as err:
        return err
    finally:
        call.cancel()


def v_prefill(ids):
    return verifier_pb2.VerifierRequest(prefill=verifier_pb2.PrefillRequest(token_ids=ids))


def v_decode(token, position):
    return verifier_pb2.VerifierRequest(decode=verifier_pb2.DecodeRequest(token_id=token, position=position))


def v_verify(anchor, drafts, position, mode=verifier_pb2.VERIFY_MODE_SEQUENTIAL):
    return verifier_pb2.VerifierRequest(verify=verifier_pb2.VerifyRequest(
        anchor=anchor, drafts=drafts, position=position, mode=mode))


P = v_prefill([5, 6, 7])  # a valid prefill: next position 3
VERIFIER_CASES = {
    "no_op": ([verifier_pb2.VerifierRequest()], ["no operation"]),
    "empty_prefill": ([v_prefill([])], ["empty prompt"]),
    "prefill_id_out_of_range": ([v_prefill([5, 512])], ["token id 512"]),
    "prefill_too_long": ([v_prefill([5] * 300)], ["prompt length 300", "max_seq_len=256"]),
    "second_prefill": ([P, P], ["already prefilled"]),
    "decode_before_prefill": ([v_decode(5, 0)], ["prefill first"]),
    "decode_wrong_position": ([P, v_decode(5, 7)], ["position=7", "next position 3"]),
    "decode_negative_position": ([P, v_decode(5, -1)], ["position=-1"]),
    "decode_id_out_of_range": ([P, v_decode(512, 3)], ["token id 512"]),
    "verify_wrong_position": ([P, v_verify(5, [6, 7], 9)], ["position=9", "next position 3"]),
    "verify_draft_out_of_range": ([P, v_verify(5, [6, 700], 3)], ["token id 700"]),
    "verify_negative_anchor": ([P, v_verify(-3, [6], 3)], ["token id -3"]),
    "verify_past_max_seq_len": ([v_prefill([5] * 253), v_verify(5, [6, 7, 8], 253)],
                                ["position 253", "max_seq_len=256"]),
    "verify_unknown_mode": ([P, v_verify(5, [6], 3, mode=9)], ["mode=9"]),
}


@pytest.mark.parametrize("name", VERIFIER_CASES)
def test_verifier_rejects_bad_stream_messages_naming_the_value(oracle_stack, name):  # noqa: F811
    requests, needles = VERIFIER_CASES[name]
    expect_error(oracle_stack, lambda: _raise(session_error(oracle_stack.verifier_stub.Session, requests)),
                 INVALID, *needles)
    assert_idle(oracle_stack)


async def _raise(err_coro):
    raise await err_coro


def rows_tensor(n: int, width: int = WIDTH, dtype: str = "bfloat16") -> common_pb2.Tensor:
    return to_proto(torch.randn(n, width), dtype)


def d_commit(rows, first=0, token_ids=(), token_first=0):
    return drafter_pb2.DrafterRequest(commit=drafter_pb2.CommitRequest(
        rows=rows, first_position=first, token_ids=list(token_ids), token_first_position=token_first))


def d_draft(anchor, seed):
    return drafter_pb2.DrafterRequest(draft=drafter_pb2.DraftRequest(anchor=anchor, seed_position=seed))


C = d_commit(rows_tensor(3), 0, [5, 6, 7], 0)  # a valid first commit: positions 0..2
DRAFTER_CASES = {
    "no_op": ([drafter_pb2.DrafterRequest()], ["no operation"]),
    "row_width": ([d_commit(rows_tensor(2, 100))], ["[2, 100]", "row_width=768"]),
    "rows_1d": ([d_commit(common_pb2.Tensor(data=bytes(2 * WIDTH), dtype="bfloat16", shape=[WIDTH]))],
                ["[768]", "row_width=768"]),
    "rows_dtype_unknown": ([d_commit(common_pb2.Tensor(data=bytes(2 * WIDTH), dtype="float16", shape=[1, WIDTH]))],
                           ["'float16'"]),
    "rows_dtype_int": ([d_commit(common_pb2.Tensor(data=bytes(8 * WIDTH), dtype="int64", shape=[1, WIDTH]))],
                       ["int64"]),
    "rows_bytes_short": ([d_commit(common_pb2.Tensor(data=bytes(2 * WIDTH), dtype="bfloat16", shape=[2, WIDTH]))],
                         [f"needs {4 * WIDTH} bytes", f"got {2 * WIDTH}"]),
    "rows_negative_dim": ([d_commit(common_pb2.Tensor(dtype="bfloat16", shape=[-1, WIDTH]))], ["negative"]),
    "negative_first_position": ([d_commit(rows_tensor(1), -1)], ["first_position=-1"]),
    "commit_gap": ([C, d_commit(rows_tensor(1), 7, [9], 3)], ["7"]),
    "draft_before_commit": ([d_draft(5, 0)], ["nothing committed"]),
    "draft_wrong_seed": ([C, d_draft(5, 6)], ["seed_position=6", "2"]),
    "draft_anchor_out_of_range": ([C, d_draft(512, 2)], ["512"]),
}
ORACLE_ONLY = {
    "oracle_token_id_out_of_range": ([d_commit(rows_tensor(2), 0, [5, 999], 0)], ["token id 999"]),
    "oracle_tokens_do_not_continue": ([C, d_commit(rows_tensor(1), 3, [9], 5)], ["token_first_position=5"]),
}
DSPARK_ONLY = {
    "dspark_nan_rows": ([d_commit(to_proto(torch.full((1, WIDTH), float("nan"))))], ["NaN"]),
    "dspark_first_write_not_at_zero": ([d_commit(rows_tensor(2), 4)], ["position 4", "window_size=8"]),
}


@pytest.mark.parametrize("drafter,name", [(d, n) for d in ("oracle", "dspark") for n in DRAFTER_CASES]
                         + [("oracle", n) for n in ORACLE_ONLY] + [("dspark", n) for n in DSPARK_ONLY])
def test_drafter_rejects_bad_stream_messages_naming_the_value(oracle_stack, dspark_stack, drafter, name):  # noqa: F811
    stack = oracle_stack if drafter == "oracle" else dspark_stack
    requests, needles = {**DRAFTER_CASES, **ORACLE_ONLY, **DSPARK_ONLY}[name]
    expect_error(stack, lambda: _raise(session_error(stack.drafter_stub.Session, requests)), INVALID, *needles)
    assert_idle(stack)


def test_backends_answer_valid_direct_streams(oracle_stack):  # noqa: F811
    """The direct-stream helpers above build valid messages: a clean exchange is answered."""
    async def run():
        call = oracle_stack.verifier_stub.Session(timeout=30)
        await call.write(P)
        first = await call.read()
        await call.write(v_decode(first.next_token, 3))
        second = await call.read()
        call.cancel()
        d = oracle_stack.drafter_stub.Session(timeout=30)
        await d.write(C)
        committed = await d.read()
        await d.write(d_draft(first.next_token, 2))
        drafted = await d.read()
        d.cancel()
        return first, second, committed, drafted
    first, second, committed, drafted = oracle_stack.loop.run(run())
    assert (first.first_position, first.next_position, second.first_position) == (0, 3, 3)
    assert list(first.rows.shape) == [3, WIDTH] and first.rows.dtype == "bfloat16"
    assert committed.committed_through == 2
    assert len(drafted.tokens) == 5 and drafted.tokens[0] == second.next_token
    assert_idle(oracle_stack)


# ---------------------------------------------------------------------------- cancellation
def test_cancelled_streams_leave_no_open_session_and_the_next_request_succeeds(oracle_stack):  # noqa: F811
    stack = oracle_stack
    prompts = ["hello world", "abc", "the quick brown fox", "spec"]
    specs = ("off", "always", "gated")
    rng = random.Random(6)
    # (prompt, spec, verify mode, messages to read before cancelling, extra delay in s)
    plan = [(rng.choice(prompts), rng.choice(specs), rng.choice(("sequential", "batched")),
             rng.randrange(0, 3), rng.choice((0.0, 0.0, 0.003, 0.02, 0.08))) for _ in range(50)]
    check = gen_request("count: 1 2 3", max_tokens=12, spec="always")
    before = stack.generate(check)
    open_at_cancel: list[tuple[int, int]] = []  # (verifier, drafter) sessions open just before each cancel

    async def one(prompt, spec, mode, after, delay):
        gw = await stack.agateway(mode)
        call = gw.stub.Generate(gen_request(prompt, max_tokens=40, spec=spec), timeout=60)
        for _ in range(after):
            msg = await call.read()
            assert msg is not grpc.aio.EOF and not msg.finished
        await asyncio.sleep(delay)
        open_at_cancel.append((stack.verifier_engine.num_sessions, stack.drafter_engine.num_sessions))
        call.cancel()
        return await call.code()

    async def run():
        codes = []
        for i in range(0, len(plan), 5):  # five at a time
            codes += await asyncio.gather(*(one(*p) for p in plan[i:i + 5]))
        return codes

    codes = stack.loop.run(run(), 300)
    assert codes == [grpc.StatusCode.CANCELLED] * 50
    # the cancels hit live sessions on both backends (not only streams that had not started)
    assert sum(v > 0 for v, _ in open_at_cancel) >= 25 and sum(d > 0 for _, d in open_at_cancel) >= 10
    assert_idle(stack)
    after = stack.generate(check)
    assert after.token_ids == before.token_ids
    assert spec_counts(after.stats) == spec_counts(before.stats)
