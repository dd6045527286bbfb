"""`StatusInterceptor` on a call whose client is gone: a real grpc.aio server on port 0."""

from __future__ import annotations

import asyncio
import logging

import grpc

from services.common.errors import StatusInterceptor
from services_fixtures import service_loop


def test_a_failure_after_the_client_left_is_not_logged_as_an_internal_error(caplog):
    """The handler fails after the client's deadline passed (it was inside work the
    cancellation could not interrupt, like a backend reply racing the deadline): no status can
    reach the client, so the interceptor must neither log an "internal error" nor abort twice
    (grpcio logged "Abort already called!")."""
    failed = asyncio.Event()

    async def handler(requests, context):
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:  # the deadline: finish the uninterruptible part, then fail
            pass
        failed.set()  # the backend's refusal, passed on as the servicers do: on a call already gone
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the backend refused while the client was leaving")
        yield b""  # unreachable: makes this an async generator (a streaming handler)

    async def scenario():
        server = grpc.aio.server(interceptors=[StatusInterceptor()])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "t.T", {"S": grpc.stream_stream_rpc_method_handler(handler)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.stream_stream("/t.T/S")(iter([b"x"]), timeout=0.2)
                try:
                    async for _ in call:
                        pass
                except grpc.aio.AioRpcError as e:
                    code = e.code()
            await asyncio.wait_for(failed.wait(), 5)
            await asyncio.sleep(0.1)
            return code
        finally:
            await server.stop(0)

    with caplog.at_level(logging.INFO):
        code = service_loop().run(scenario())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert failed.is_set()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []
    assert any("had already ended" in r.getMessage() for r in caplog.records if r.name == "dspark.server")
