"""Start-up checks of `dspark serve` and `dspark up`: ports free before anything binds, and
whether a started gateway serves yet.

This module owns those two questions only. A taken port is found here, before a model
loads and before gRPC tries to bind (gRPC's own failure prints a raw `add_port.cc` log line
to stderr first), so the command can end with one line naming the port and what wanted it.
It reads no environment.
"""

from __future__ import annotations

import socket
from typing import Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check_ports_free(host: str, ports: Mapping[str, int | None]) -> None:
    """Raise ValueError naming the first port of `ports` ({what: port}; None and 0 skipped)
    that another process holds on `host`, or that two entries share.

    The probe binds with SO_REUSEADDR like gRPC's servers, so a port in TIME_WAIT is free;
    it cannot reserve the port (a process may still take it before the service binds).
    Raises:
        ValueError: "the <what> port <host>:<port> is in use" or "... also the <other> port"; a host
            that does not resolve (named).
    """
    seen: dict[int, str] = {}
    for what, port in ports.items():
        if not port:
            continue
        if port in seen:
            raise ValueError(f"the {what} port {port} is also the {seen[port]} port: give each its own")
        seen[port] = what
        try:
            family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
        except socket.gaierror as exc:
            raise ValueError(f"--host={host!r}: {exc.strerror}") from None
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(addr)
            except OSError as exc:
                raise ValueError(f"the {what} port {host}:{port} is in use ({exc.strerror or exc}): "
                                 "another process holds it") from None


def is_serving(channel: grpc.Channel, service: str, timeout_s: float = 1.0) -> bool:
    """Whether the server behind `channel` reports `service` SERVING on grpc.health.v1 within
    `timeout_s` seconds (False on any RPC error: not up yet, refused, deadline)."""
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                          timeout=timeout_s)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
