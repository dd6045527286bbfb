"""gRPC server bootstrap shared by the three services: aio server, health, limits, SIGTERM.

Owns a server's construction, health status and graceful stop; it registers no service of its
own besides health, reads no settings (every limit and deadline arrives as an argument) and
knows nothing of the messages its servicers handle.

`start_server` builds a `grpc.aio.Server` with explicit message-size limits, the OTel server
interceptor, the status mapping of `services.common.errors` (no call ends UNKNOWN), the
stock `grpc.health.v1` Health service (the overall status and the service's own name set to
SERVING), gRPC server reflection (`grpc.reflection.v1` and `v1alpha`, listing the service,
Health and reflection itself, so `grpcurl list` / `describe` work without the .proto files;
`services.common.reflection`) and the keepalive policy of `SERVER_KEEPALIVE_OPTIONS` (client
pings every `MIN_CLIENT_PING_INTERVAL_MS` or more are welcome, calls or none);
`run_until_signal` serves until SIGTERM/SIGINT, then marks the service NOT_SERVING and stops
with a grace period so open generations can finish.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field
from typing import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider

from services.common.errors import StatusInterceptor
from services.common.reflection import enable_reflection
from services.common.settings import DEFAULT_MAX_CONNECTION_AGE_S
from services.common.telemetry import server_interceptors

log = logging.getLogger("dspark.server")

# Largest message either side accepts. A prefill response carries min(n, W) bf16 rows of
# row_width values: W = 128, row_width = 12288 for Flash -> 3 MiB; 64 MiB leaves headroom.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Options for servers and channels: explicit send/receive limits, keepalive for long streams."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
    ]


# Client keepalive pings the servers accept. gRPC's server default (pings at most every 5 min,
# and only during a call) answers the keepalive of common clients with GOAWAY too_many_pings:
# grpc-go and grpc-java ping idle channels every 10 s or more when keepalive is on, grpc-js
# and grpc-core clients as often as configured (a dashboard pinging every second). A ping is
# an 8-byte frame answered by the transport, so the floor only stops floods: a client pinging
# more often than this, without data between, collects a strike per ping and is sent GOAWAY
# too_many_pings after `grpc.http2.max_ping_strikes` (gRPC's 2) strikes in a row.
MIN_CLIENT_PING_INTERVAL_MS = 500
SERVER_KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),  # idle channels may ping too (grpc-js's keepalivePermitWithoutCalls)
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
]


@dataclass
class RunningServer:
    """A started server: `port` is the bound port (useful with port 0). `on_stop`: callables
    run (in order, on a worker thread) once the server has stopped, e.g. a verifier's step loop."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    service_name: str
    on_stop: list[Callable[[], None]] = field(default_factory=list)

    async def not_serving(self) -> None:
        """Report NOT_SERVING (overall and for the service) while still answering calls: the
        service cannot serve any more (a verifier whose TP workers failed), so probes and load
        balancers take it out and an orchestrator restarts it."""
        for name in ("", self.service_name):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Mark NOT_SERVING, then stop accepting and wait up to `grace_s` for open calls; then
        run `on_stop`."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        while self.on_stop:
            await asyncio.to_thread(self.on_stop.pop(0))


# gRPC sets SO_REUSEPORT by default on Linux: a second server on a taken port would then bind
# and silently share its connections. A taken port must be an error instead.
NO_REUSEPORT = ("grpc.so_reuseport", 0)


async def start_server(service_name: str, register: Callable[[grpc.aio.Server], None], port: int = 0,
                       host: str = "127.0.0.1", provider: TracerProvider | None = None,
                       max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                       credentials: grpc.ServerCredentials | None = None,
                       interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                       max_connection_age_s: float = DEFAULT_MAX_CONNECTION_AGE_S) -> RunningServer:
    """Start an aio server on host:port (0 = any free port) with `register(server)` servicers.
    `credentials`: TLS (None = plaintext); `interceptors` run after the OTel one (e.g. auth).
    `max_connection_age_s`: clients are asked to reconnect after this (s; `ServeSettings`).
    `service_name`: the full name of the service `register` adds (e.g. "dspark.v1.Gateway"):
    health reports it and reflection lists it. Its descriptors must be in the default pool,
    which importing its generated `*_pb2` module (as `register` does) ensures.

    Raises:
        RuntimeError: the port could not be bound (named).
    """
    age_ms = int(max_connection_age_s * 1000)
    # StatusInterceptor last, so it is the innermost: whatever a servicer raises becomes a status there
    server = grpc.aio.server(interceptors=server_interceptors(provider) + list(interceptors) + [StatusInterceptor()],
                             options=channel_options(max_message_bytes) + SERVER_KEEPALIVE_OPTIONS
                             + [("grpc.max_connection_age_ms", age_ms), NO_REUSEPORT])
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection((service_name, health.SERVICE_NAME), server)
    addr = f"{host}:{port}"
    try:
        bound = server.add_secure_port(addr, credentials) if credentials else server.add_insecure_port(addr)
    except RuntimeError:  # grpcio raises "Failed to bind ..." (older versions returned 0)
        bound = 0
    if bound == 0:
        raise RuntimeError(f"could not bind {addr} (in use, or not an address of this host)")
    await server.start()
    for name in ("", service_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("%s serving on %s:%d", service_name, host, bound)
    return RunningServer(server, bound, health_servicer, service_name)


async def run_until_signal(running: RunningServer, grace_s: float = 30.0) -> None:
    """Serve until SIGTERM or SIGINT, then shut down gracefully (NOT_SERVING, then stop(grace))."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("%s: signal received, draining for up to %.0f s", running.service_name, grace_s)
    await running.stop(grace_s)
