"""The HTTP front's gRPC client of the gateway: one channel, Generate and health, with deadlines.

Owns the channel to the gateway's own port, the per-call deadline and the forwarded bearer
token. It never builds requests or responses (the request models and `responses` do).
"""

from __future__ import annotations

from typing import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dspark_proto.v1 import gateway_pb2, gateway_pb2_grpc
from services.common.server import channel_options
from services.common.settings import check_seconds
from services.http.errors import from_rpc_error

HEALTH_TIMEOUT_S = 5.0


class GatewayClient:
    """Calls the gateway at `target` (host:port, plaintext) with these deadlines (s):
    `generate_timeout_s` for one whole Generate stream, `health_timeout_s` for a health check.

    Raises:
        ValueError: a deadline not in (0, 1e8] s (named).
    """

    def __init__(self, target: str, generate_timeout_s: float, health_timeout_s: float = HEALTH_TIMEOUT_S):
        check_seconds("generate_timeout_s", generate_timeout_s)
        check_seconds("health_timeout_s", health_timeout_s)
        self.target = target
        self.generate_timeout_s, self.health_timeout_s = generate_timeout_s, health_timeout_s
        self.channel = grpc.aio.insecure_channel(target, options=channel_options())
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def generate(self, request: gateway_pb2.GenerateRequest,
                       authorization: str | None) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """The Generate stream of `request`; `authorization`: the client's header value, sent
        on as gRPC metadata (None: none). The call is cancelled when the iteration stops early
        (a client that went away), so the gateway closes the generation's backend sessions.

        Raises:
            ApiError: the call failed (its gRPC status mapped by `errors.from_rpc_error`).
        """
        metadata = (("authorization", authorization),) if authorization else None
        call = self.stub.Generate(request, timeout=self.generate_timeout_s, metadata=metadata)
        try:
            async for message in call:
                yield message
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        finally:
            call.cancel()  # a no-op once the call has ended

    async def serving(self) -> bool:
        """Whether the gateway's gRPC health service reports SERVING within the health deadline."""
        try:
            reply = await self.health.Check(health_pb2.HealthCheckRequest(service="dspark.v1.Gateway"),
                                            timeout=self.health_timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        await self.channel.close()
