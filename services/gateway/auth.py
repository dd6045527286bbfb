"""Bearer-token check of the gateway's client calls (`DSPARK_GATEWAY_TOKEN`).

This module owns one gRPC server interceptor and its constant-time token comparison. It must
not read the environment (the entry point hands it the token), echo what a client sent, or
protect the backends (mTLS does).

With a token configured, every call except the `grpc.health.v1.Health` service (probes carry
no token) must send the metadata `authorization: Bearer <token>`; any other call ends with
UNAUTHENTICATED before the servicer runs. The comparison is constant-time (SHA-256 of both
sides through `hmac.compare_digest`, so neither the content nor the length of the expected
token leaks through timing); messages never echo what the client sent. The token protects
the gateway only: the backends are protected by mTLS (`services/common/tls.py`), and nothing
from the client's metadata is forwarded to them.

Tenants: a call belongs to the tenant of the bearer token it presents (`tenant_of`), whether
or not a token is required; the gateway scopes request ids per tenant, so `Abort` reaches only
the caller's own generations and an id another token uses is simply not found.
"""

from __future__ import annotations

import hashlib
import hmac

import grpc

EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)
MISSING = "missing bearer token: send the metadata 'authorization: Bearer <token>'"
INVALID = "invalid bearer token"


def _digest(value: str | bytes) -> bytes:
    return hashlib.sha256(value.encode() if isinstance(value, str) else value).digest()


def tenant_of(metadata) -> str:
    """The tenant of a call whose metadata is `metadata` (key, value pairs): the SHA-256 (hex)
    of the bearer token its `authorization` carries, "" when it carries none. The token itself
    is never kept."""
    values = [v for k, v in (metadata or ()) if k.lower() == "authorization"]
    if not values:
        return ""
    value = values[0].decode("latin-1") if isinstance(values[0], bytes) else values[0]
    scheme, _, token = value.partition(" ")
    return _digest(token.strip() if scheme.lower() == "bearer" else value).hex()


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Reject calls without the configured bearer token (see the module docstring).

    Raises:
        ValueError: an empty token (an empty token would make the check meaningless).
    """

    def __init__(self, token: str):
        if not token:
            raise ValueError("bearer token is empty: leave DSPARK_GATEWAY_TOKEN unset to require none")
        self._expected = _digest(token)

    def check(self, metadata) -> str | None:
        """None when `metadata` (key, value pairs) carries the token, else the reason to refuse."""
        values = [v for k, v in (metadata or ()) if k.lower() == "authorization"]
        if not values:
            return MISSING
        scheme, _, token = (values[0].decode("latin-1") if isinstance(values[0], bytes) else values[0]).partition(" ")
        # compare even when the scheme is wrong, so every refusal takes the same time
        ok = hmac.compare_digest(_digest(token.strip()), self._expected)
        return None if ok and scheme.lower() == "bearer" and len(values) == 1 else INVALID

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(EXEMPT_PREFIXES):
            return handler
        reason = self.check(handler_call_details.invocation_metadata)
        return handler if reason is None else _refusal(handler, reason)


def _refusal(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with UNAUTHENTICATED."""
    code = grpc.StatusCode.UNAUTHENTICATED

    async def unary(request, context):
        await context.abort(code, reason)

    async def streaming(request, context):
        await context.abort(code, reason)
        yield  # never reached: makes this an async generator, as a streaming response handler must be

    kinds = {(False, False): (grpc.unary_unary_rpc_method_handler, unary),
             (False, True): (grpc.unary_stream_rpc_method_handler, streaming),
             (True, False): (grpc.stream_unary_rpc_method_handler, unary),
             (True, True): (grpc.stream_stream_rpc_method_handler, streaming)}
    make, behaviour = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(behaviour, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
