"""No call ends UNKNOWN: every exception a servicer lets escape becomes a status in one place
(`services.common.errors`), and an unexpected one is INTERNAL with a message that names the
method and the exception's class but none of its internal values."""

from __future__ import annotations

import grpc
import pytest

from dspark_proto.v1 import drafter_pb2, drafter_pb2_grpc, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from services.app import drafter_engine, start_drafter, start_gateway, start_verifier, verifier_engine
from services.common.errors import safe_status, status_for
from services.common.settings import BackendSettings, GatewaySettings
from services.gateway.gate import GateConfig
from services.gateway.metrics import GatewayMetrics
from services_fixtures import collect, gen_request, service_loop, start_stack, tiny_trunk

SECRET = "weights at /secret/path, value 0xfeed"


def _raise(*args, **kwargs):
    raise RuntimeError(SECRET)


def test_status_for_never_answers_unknown():
    unknown = grpc.aio.AioRpcError(grpc.StatusCode.UNKNOWN, grpc.aio.Metadata(), grpc.aio.Metadata(), "boom")
    unavailable = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down")
    assert status_for(unknown) == grpc.StatusCode.INTERNAL
    assert safe_status(unavailable, "/m") == (grpc.StatusCode.UNAVAILABLE, "/m: UNAVAILABLE: down")
    assert safe_status(ValueError("max_n=5 must be in [0, 2]"), "/m") == (
        grpc.StatusCode.INVALID_ARGUMENT, "max_n=5 must be in [0, 2]")
    assert status_for(NotImplementedError()) == grpc.StatusCode.UNIMPLEMENTED
    code, message = safe_status(RuntimeError(SECRET), "/dspark.v1.Verifier/Session")
    assert code == grpc.StatusCode.INTERNAL
    assert message.startswith("internal error in /dspark.v1.Verifier/Session (RuntimeError); see the server log, ref ")
    assert SECRET not in message


def test_an_unexpected_verifier_exception_is_internal_with_a_safe_message():
    engine = verifier_engine(tiny_trunk(), BackendSettings())
    engine.prefill = engine.admit_prefill = _raise  # a fault nothing else can provoke (either path)

    async def scenario():
        server = await start_verifier(engine)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                call = verifier_pb2_grpc.VerifierStub(ch).Session(timeout=30)
                await call.write(verifier_pb2.VerifierRequest(prefill=verifier_pb2.PrefillRequest(token_ids=[5, 6])))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call.read()
                return err.value
        finally:
            await server.stop(0)

    err = service_loop().run(scenario())
    assert err.code() == grpc.StatusCode.INTERNAL
    assert err.details().startswith("internal error in /dspark.v1.Verifier/Session (RuntimeError)"), err.details()
    assert SECRET not in err.details()


def test_an_unexpected_gateway_exception_is_internal_and_a_failing_drafter_is_absorbed():
    v_engine = verifier_engine(tiny_trunk(), BackendSettings())
    d_engine = drafter_engine(tiny_trunk(), oracle=True, settings=BackendSettings())
    d_engine.draft = _raise
    metrics = GatewayMetrics()

    async def scenario():
        verifier, drafter = await start_verifier(v_engine), await start_drafter(d_engine)
        settings = GatewaySettings(verifier_target=f"127.0.0.1:{verifier.port}",
                                   drafter_target=f"127.0.0.1:{drafter.port}", verify_mode="sequential")
        gw, scheduler, backends = await start_gateway(settings, GateConfig(), metrics=metrics)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as ch:
                stub = gateway_pb2_grpc.GatewayStub(ch)
                async with grpc.aio.insecure_channel(f"127.0.0.1:{drafter.port}") as dch:  # the drafter's own answer
                    dcall = drafter_pb2_grpc.DrafterStub(dch).Session(timeout=30)
                    await dcall.write(drafter_pb2.DrafterRequest(
                        draft=drafter_pb2.DraftRequest(anchor=5, seed_position=0)))
                    with pytest.raises(grpc.aio.AioRpcError) as derr:
                        await dcall.read()
                off = await collect(stub, gen_request("abc", max_tokens=10, spec="off"))
                spec = await collect(stub, gen_request("abc", max_tokens=10, spec="always"))
                scheduler.tokenizer.encode = _raise
                with pytest.raises(grpc.aio.AioRpcError) as gerr:
                    await collect(stub, gen_request("abc", max_tokens=4, spec="off"), 30)
                return derr.value, off, spec, gerr.value
        finally:
            await gw.stop(0)
            await backends.close()
            await drafter.stop(0)
            await verifier.stop(0)

    try:
        derr, off, spec, gerr = service_loop().run(scenario())
        errors = sum(s.value for fam in metrics.registry.collect() for s in fam.samples
                     if s.name == "spec_decode_drafter_faults_total" and s.labels.get("reason") == "error")
    finally:
        metrics.close()
    assert derr.code() == grpc.StatusCode.INTERNAL and SECRET not in derr.details()
    assert derr.details().startswith("internal error in /dspark.v1.Drafter/Session (RuntimeError)")
    # the client never sees the drafter's fault: plain decode, the off output
    assert spec.token_ids == off.token_ids and spec.stats.drafter_failed
    assert errors == 1  # INTERNAL is no failover reason: one fault, then plain decode
    assert gerr.code() == grpc.StatusCode.INTERNAL
    assert gerr.details().startswith("internal error in /dspark.v1.Gateway/Generate (RuntimeError)"), gerr.details()
    assert SECRET not in gerr.details()


def _raw(channel: grpc.aio.Channel, method: str, streaming: bool):
    """A call of `method` that sends bytes as they are, so the test can send what no stub would."""
    as_is = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    return channel.stream_stream(method, **as_is) if streaming else channel.unary_stream(method, **as_is)


def test_a_request_that_does_not_parse_is_invalid_argument_and_frees_the_session():
    bad_utf8 = b"\x0a\x02\xff\xfe\x18\x04"  # GenerateRequest.prompt = b"\xff\xfe", max_tokens = 4
    corrupt = b"\x0a\x09abc"  # a 9-byte string field with 3 bytes left
    stack = start_stack("oracle")

    async def scenario():
        gw, errors = await stack.agateway(), []
        for raw in (bad_utf8, corrupt):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in _raw(gw.channel, "/dspark.v1.Gateway/Generate", False)(raw, timeout=30):
                    pass
            errors.append(err.value)
        good = await collect(gw.stub, gen_request("abc", max_tokens=3, spec="off"))
        async with grpc.aio.insecure_channel(stack.verifier_target) as ch:
            call = _raw(ch, "/dspark.v1.Verifier/Session", True)(timeout=30)
            await call.write(verifier_pb2.VerifierRequest(
                prefill=verifier_pb2.PrefillRequest(token_ids=[5, 6])).SerializeToString())
            first = await call.read()  # answered before the bad request arrives
            await call.write(b"\x0a\x02\x0a\x02\xff\xfe")  # trace.traceparent = b"\xff\xfe"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            errors.append(err.value)
        return errors, good, first, await stack.aopen_sessions()

    try:
        errors, good, first, opened = stack.loop.run(scenario())
    finally:
        stack.close()
    assert [e.code() for e in errors] == [grpc.StatusCode.INVALID_ARGUMENT] * 3
    assert errors[0].details() == ("/dspark.v1.Gateway/Generate: the request does not parse: Error parsing message"
                                   " with type 'dspark.v1.GenerateRequest': String field had bad UTF-8")
    assert "Wire format was corrupt" in errors[1].details()
    assert errors[2].details().startswith("/dspark.v1.Verifier/Session: the request does not parse:")
    assert len(good.token_ids) == 3 and verifier_pb2.VerifierResponse.FromString(first).next_position == 2
    assert opened["verifier_engine"] == opened["verifier_info"] == 0  # the refused stream's session is freed


def test_the_pure_python_runtimes_unicode_error_is_a_parse_failure_too():
    """protobuf's pure-Python runtime (PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python) reports
    bad UTF-8 in a string field as UnicodeDecodeError, not DecodeError."""
    from services.common.errors import UndecodableRequestError, _parsed, _tolerant

    parse = _tolerant(lambda data: data.decode("utf-8"), "/dspark.v1.Gateway/Abort")
    assert parse(b"ok") == "ok"
    with pytest.raises(UndecodableRequestError, match=r"^/dspark.v1.Gateway/Abort: the request does not parse: "
                                                      r"'utf-8' codec can't decode byte 0xff"):
        _parsed(parse(b"\xff"), streaming_in=False)
