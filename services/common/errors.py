"""The one place where a servicer exception becomes a gRPC status (all three services).

Owns the mapping from an exception to a status code and message; it never decides whether a
request is valid (the engines do) and imports nothing from the gateway, verifier or drafter
packages. `status_for` maps an exception to a code: client faults are never INTERNAL, and no
path yields UNKNOWN (gRPC's answer to an exception nobody mapped, which leaks the exception's
class and message to the client). `StatusInterceptor`, installed last (innermost) on every
server by `services.common.server.start_server`, applies it to whatever a servicer raises:
ValueError and the like keep their message, which names the value; anything unexpected
becomes INTERNAL with a message that names only the method, the exception's class and a
reference to the full traceback in the server's log (docs/architecture.md §6).
"""

from __future__ import annotations

import inspect
import logging
import secrets

import grpc
from grpc._cython import cygrpc  # ExecuteBatchError: a send on a call that has ended
from google.protobuf.message import DecodeError

from services.common.sessions import SessionLimitError, UnknownSessionError

log = logging.getLogger("dspark.server")


def status_for(exc: BaseException) -> grpc.StatusCode:
    """RESOURCE_EXHAUSTED for a session limit, NOT_FOUND for an unknown session,
    INVALID_ARGUMENT for ValueError/TypeError, UNIMPLEMENTED for NotImplementedError, the
    call's own code for a failed outgoing call (INTERNAL instead of UNKNOWN), INTERNAL otherwise."""
    if isinstance(exc, SessionLimitError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, UnknownSessionError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, (ValueError, TypeError)):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED
    if isinstance(exc, grpc.aio.AioRpcError) and exc.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.OK):
        return exc.code()
    return grpc.StatusCode.INTERNAL


def message_for(exc: BaseException) -> str:
    """The exception's message without KeyError's quoting."""
    return str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)


def safe_status(exc: Exception, method: str) -> tuple[grpc.StatusCode, str]:
    """(code, message) for an exception a servicer of `method` let escape.

    A mapped exception (see `status_for`) keeps its own message; an INTERNAL one is logged
    here with its traceback under a random reference, and the client gets only the method,
    the exception's class and that reference (internal values never leave the server).
    """
    code = status_for(exc)
    if code != grpc.StatusCode.INTERNAL:
        if isinstance(exc, grpc.aio.AioRpcError):
            return code, f"{method}: {code.name}: {exc.details()}"
        return code, message_for(exc)
    ref = secrets.token_hex(4)
    log.error("internal error in %s (ref %s)", method, ref, exc_info=exc)
    return code, f"internal error in {method} ({type(exc).__name__}); see the server log, ref {ref}"


class UndecodableRequestError(ValueError):
    """A request whose bytes are not a valid message of the method's request type (corrupt wire
    format, or a string field holding bytes that are not UTF-8): a client fault, so
    INVALID_ARGUMENT naming the method, the type and the parser's reason."""


class _Undecodable:
    """What the guarded deserializer hands on in place of a message it could not parse, so the
    handler (not grpcio, which would answer UNKNOWN or INTERNAL) ends the call."""

    def __init__(self, error: UndecodableRequestError) -> None:
        self.error = error


class StatusInterceptor(grpc.aio.ServerInterceptor):
    """Wrap every handler so an exception escaping it ends the call with `safe_status`, and a
    request that does not parse ends it INVALID_ARGUMENT (`UndecodableRequestError`).
    Aborts the servicer made itself (`context.abort`) and cancellations pass through as they are."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return _guarded(handler, handler_call_details.method)


def _guarded(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` whose escaping exceptions become statuses."""
    streaming_in, streaming_out = handler.request_streaming, handler.response_streaming
    behaviour = {(False, False): handler.unary_unary, (False, True): handler.unary_stream,
                 (True, False): handler.stream_unary, (True, True): handler.stream_stream}[(streaming_in,
                                                                                            streaming_out)]

    async def abort(context, exc: Exception):
        if isinstance(exc, cygrpc.ExecuteBatchError):
            # The peer had gone (a cancel or an expired deadline) when the handler tried to send
            # its status: grpcio then fails that send (ExecuteBatchError), and no status can
            # reach anyone. Not a server fault, so no "internal error" and no second abort.
            log.info("%s: the call had already ended when its status was sent (%s)", method, type(exc).__name__)
            return
        code, message = safe_status(exc, method)
        await context.abort(code, message)

    async def unary(request, context):
        try:
            result = behaviour(_parsed(request, streaming_in), context)
            return await result if inspect.isawaitable(result) else result
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort(context, exc)

    async def streaming(request, context):
        try:
            result = behaviour(_parsed(request, streaming_in), context)
            if hasattr(result, "__aiter__"):
                async for response in result:
                    yield response
            elif inspect.isawaitable(result):  # a handler that writes through context.write
                await result
            else:
                for response in result:
                    yield response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort(context, exc)

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return kinds[(streaming_in, streaming_out)](streaming if streaming_out else unary,
                                               request_deserializer=_tolerant(handler.request_deserializer, method),
                                               response_serializer=handler.response_serializer)


def _tolerant(deserializer, method: str):
    """`deserializer` (bytes -> message), returning an `_Undecodable` instead of raising
    DecodeError (or UnicodeDecodeError, from protobuf's pure-Python runtime): grpcio would end such a call UNKNOWN (unary request) or let the error escape
    the handler's request loop (streamed requests)."""
    if deserializer is None:
        return None

    def parse(data: bytes):
        try:
            return deserializer(data)
        except (DecodeError, UnicodeDecodeError) as exc:  # the pure-Python runtime raises the latter
            return _Undecodable(UndecodableRequestError(f"{method}: the request does not parse: {exc}"))
    return parse


def _parsed(request, streaming_in: bool):
    """The request (or, for streamed requests, an async iterator of them) with every
    `_Undecodable` raised as its UndecodableRequestError; a streamed session then ends there,
    its earlier requests answered."""
    if not streaming_in:
        if isinstance(request, _Undecodable):
            raise request.error
        return request

    async def messages():
        async for message in request:
            if isinstance(message, _Undecodable):
                raise message.error
            yield message
    return messages()
