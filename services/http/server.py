"""Running the HTTP front: a uvicorn server on the caller's asyncio loop, beside the gateway.

Owns the listening socket, the uvicorn server's start and graceful stop, and
`GatewayWithHttp`, which stops the gateway's gRPC server and the HTTP front together. It
never handles a request (`routes` does) and never installs signal handlers: the process's
entry point owns SIGTERM (`services.common.server.run_until_signal`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from dataclasses import dataclass

import uvicorn

from services.common.metrics import RANDOM_TINY_MODEL, served_model_name
from services.common.server import RunningServer
from services.http.gateway_client import GatewayClient
from services.http.middleware import DEFAULT_MAX_BODY_BYTES

log = logging.getLogger("dspark.http")
START_TIMEOUT_S = 10.0


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling (the entry point's handler stops it)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def _bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (0 = any free port), without SO_REUSEPORT, so a
    taken port is an error rather than a shared one.

    Raises:
        RuntimeError: the address could not be bound (named).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"HTTP front: could not bind {host}:{port} ({exc.strerror or exc})") from None
    sock.setblocking(False)
    return sock


@dataclass
class HttpServer:
    """A started HTTP front: `port` is the bound port; `stop(grace_s)` ends it."""

    server: uvicorn.Server
    task: asyncio.Task
    port: int
    client: GatewayClient

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting, let open responses finish for up to `grace_s` s (then cancel them),
        and close the channel to the gateway."""
        self.server.config.timeout_graceful_shutdown = grace_s
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), grace_s + 5.0)
        except asyncio.TimeoutError:
            self.task.cancel()
        finally:
            await self.client.close()


async def serve_http(app, client: GatewayClient, port: int = 0, host: str = "127.0.0.1") -> HttpServer:
    """Serve the ASGI `app` on host:port (0 = any free port) in the running event loop.

    Raises:
        RuntimeError: the port could not be bound, or the server did not start within
            START_TIMEOUT_S s.
    """
    sock = _bind(host, port)
    bound = sock.getsockname()[1]
    config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False)
    server = _Server(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
    while not server.started:
        if task.done() or asyncio.get_running_loop().time() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError(f"HTTP front on {host}:{bound} did not start within {START_TIMEOUT_S:g} s")
        await asyncio.sleep(0.01)
    log.info("HTTP front (OpenAI-compatible) serving on http://%s:%d/v1", host, bound)
    return HttpServer(server, task, bound, client)


@dataclass
class GatewayWithHttp:
    """The gateway's gRPC server and its HTTP front, stopped together (what
    `run_until_signal` stops): the same `port`, `health` and `service_name` as the gateway."""

    grpc: RunningServer
    http: HttpServer

    @property
    def port(self) -> int:
        return self.grpc.port

    @property
    def health(self):
        return self.grpc.health

    @property
    def service_name(self) -> str:
        return self.grpc.service_name

    async def stop(self, grace_s: float = 5.0) -> None:
        """Both stop accepting at once; open HTTP streams finish over gRPC within `grace_s` s."""
        await asyncio.gather(self.http.stop(grace_s), self.grpc.stop(grace_s))


# One name per served model everywhere: the id clients send is the `model` label of the metrics.
RANDOM_MODEL_ID = RANDOM_TINY_MODEL


def model_id(checkpoint: str | None) -> str:
    """The id /v1/models lists and requests name: `served_model_name` (the checkpoint
    folder's name, or RANDOM_MODEL_ID for the built-in random model)."""
    return served_model_name(checkpoint)


def loopback_target(host: str, port: int) -> str:
    """The gRPC target of a server listening on host:port, reached from this process
    (a wildcard address becomes the loopback address of its family)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def start_http_front(gateway: RunningServer, scheduler, checkpoint: str | None, port: int = 0,
                           host: str = "127.0.0.1", token: str = "", generate_timeout_s: float = 600.0,
                           metrics_registry=None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> GatewayWithHttp:
    """Start the OpenAI-compatible HTTP front of the running `gateway` on host:port (0 = any
    free port). scheduler: the gateway's `Scheduler` (the model's limits and tokenizer);
    checkpoint: the served folder (model id, chat template, tokenizer_config.json; None = the
    random model); token: the gateway's bearer token ("" = none), required from HTTP clients
    too and forwarded; generate_timeout_s: deadline of one Generate call (s), which also
    bounds how long a batch's choices queue; metrics_registry: served at /metrics;
    max_body_bytes: request bodies above it get 413 (DSPARK_HTTP_MAX_BODY_BYTES).

    Raises:
        ValueError: a bad chat template or tokenizer_config.json in the checkpoint (file
            named), a bad deadline or body limit.
        RuntimeError: the HTTP port could not be bound.
    """
    from services.gateway.auth import BearerTokenInterceptor
    from services.http.chat import load_chat_template
    from services.http.routes import Front, ModelCard, build_app
    from services.http.tokenizer_api import tokenizer_info

    template = load_chat_template(checkpoint)
    info = tokenizer_info(checkpoint, scheduler.tokenizer)
    client = GatewayClient(loopback_target(host, gateway.port), generate_timeout_s)
    limits = scheduler.limits
    card = ModelCard(model_id(checkpoint), limits.max_seq_len, int(time.time()), limits.vocab_size)
    front = Front(client, card, scheduler.tokenizer, template, BearerTokenInterceptor(token) if token else None)
    try:
        http = await serve_http(build_app(front, metrics_registry, info, max_body_bytes), client, port, host)
    except BaseException:
        await client.close()
        raise
    return GatewayWithHttp(gateway, http)
