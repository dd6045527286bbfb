"""Service settings read once from the environment into frozen dataclasses (CLI flags override).

| variable | default | meaning |
|---|---|---|
| DSPARK_VERIFIER_TARGET | 127.0.0.1:50051 | gateway -> verifier address(es) |
| DSPARK_DRAFTER_TARGET | 127.0.0.1:50052 | gateway -> drafter address(es); empty = no drafter |
| DSPARK_VERIFY_MODE | batched | verify path: sequential or batched |
| DSPARK_GATE_COSTS | configured | gate costs: configured (DEEPSEEK_DSPARK_GATE_*_MS) or measured |
| DSPARK_ROUND_TIMEOUT_S | 30 | gateway: deadline for one backend reply (s) |
| DSPARK_GENERATION_TIMEOUT_S | 600 | gateway: deadline of one generation's backend streams (s) |
| DSPARK_MAX_SESSIONS | 16 | verifier / drafter: concurrent sessions (streams) |
| DSPARK_STARTUP_TIMEOUT_S | 10 | gateway: deadline for the backends' Info at start (s) |
| DSPARK_DRAFTER_FAILOVERS | 2 | gateway: drafter re-primes per generation after a failure (0 = plain at once) |
| DSPARK_GATEWAY_TOKEN | unset | gateway: bearer token required from clients (`authorization: Bearer ...`) |
| DSPARK_HEALTH_PORT | unset | `dspark serve`: plaintext port with only grpc.health.v1 (probes) |
| DSPARK_DRAIN_TIMEOUT_S | 30 | `dspark serve`: on SIGTERM, how long open streams may finish (s) |
| DSPARK_MAX_CONNECTION_AGE_S | 300 | servers: clients reconnect (and re-resolve) after this (s) |

A target is any gRPC target (`host:port`, `ipv4:a:p,b:p`, `dns:///name:port`) or a comma-separated
list of IP `address:port`s, which becomes an `ipv4:` / `ipv6:` target (one channel, round_robin).
TLS files: `services/common/tls.py`.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from typing import Mapping

from services.gateway.costs import COST_MODES
from services.gateway.scheduler import VERIFY_MODES


# Longest accepted timeout (s), ~3 years: a gRPC deadline past ~7e9 s overflows and every
# call then fails at once with DEADLINE_EXCEEDED.
MAX_TIMEOUT_S = 1e8
# grpc.max_connection_age_ms is a C int: at most 2^31 - 1 ms (~24.8 days), at least 1 ms.
MAX_CONNECTION_AGE_S = (2**31 - 1) / 1000


def _float(environ: Mapping[str, str], name: str, default: float, low: float = 0.0,
           high: float = MAX_TIMEOUT_S) -> float:
    """Seconds in (low, high] from `name`; `default` when unset. Raises ValueError naming the
    variable and value otherwise (empty, not a number, NaN, out of range)."""
    raw = environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: not a number") from None
    if not low < value <= high:
        raise ValueError(f"{name}={raw!r}: must be a number > {low:g} and <= {high:.10g}")
    return value


def _int(environ: Mapping[str, str], name: str, default: int, low: int = 1) -> int:
    raw = environ.get(name)
    if raw is None:
        return default
    if not raw.strip().isascii() or not raw.strip().isdigit() or int(raw) < low:
        raise ValueError(f"{name}={raw!r}: must be an integer >= {low}")
    return int(raw)


_SCHEMES = ("ipv4:", "ipv6:", "dns:", "unix:", "unix-abstract:", "vsock:", "xds:")


def backend_target(value: str, name: str = "target") -> str:
    """A gRPC target; a comma-separated list of IP `address:port`s (no scheme) becomes one
    `ipv4:` or `ipv6:` target over all of them (the gateway's channels balance round_robin).

    Raises:
        ValueError: naming `name` and the value: empty, a port outside 1..65535, a list entry
            that is not an IP address:port, or a list mixing IPv4 and IPv6.
    """
    value = value.strip()
    if not value:
        raise ValueError(f"{name}='': empty (a host:port or a gRPC target such as dns:///name:port)")
    if "," not in value or value.startswith(_SCHEMES):
        host, sep, port = value.rpartition(":")
        if sep and port.isascii() and port.isdigit() and not 0 < int(port) < 65536 \
                and not value.startswith(("unix:", "unix-abstract:")):
            raise ValueError(f"{name}={value!r}: port {port} is not in 1..65535")
        return value
    families = set()
    for entry in (e.strip() for e in value.split(",")):
        host, sep, port = entry.rpartition(":")
        bracketed = host.startswith("[") and host.endswith("]")
        host = host[1:-1] if bracketed else host
        try:
            version = ipaddress.ip_address(host).version
            port_ok = bool(sep) and port.isascii() and port.isdigit() and 0 < int(port) < 65536
            if not port_ok or (version == 6) != bracketed:
                raise ValueError
            families.add(version)
        except ValueError:
            raise ValueError(f"{name}={value!r}: list entry {entry!r} is not an IP address:port "
                             f"([v6]:port for IPv6; name several hosts with a dns:/// target)") from None
    if len(families) > 1:
        raise ValueError(f"{name}={value!r}: mixes IPv4 and IPv6 addresses")
    entries = ",".join(e.strip() for e in value.split(","))
    return f"ipv{families.pop()}:{entries}"


def _token(environ: Mapping[str, str], name: str) -> str:
    raw = environ.get(name, "")
    if raw and not (raw.isascii() and raw.isprintable() and " " not in raw):
        raise ValueError(f"{name}: must be printable ASCII without spaces (value not shown)")
    return raw


def _choice(environ: Mapping[str, str], name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = environ.get(name, default)
    if raw not in choices:
        raise ValueError(f"{name}={raw!r}: must be one of {choices}")
    return raw


@dataclass(frozen=True)
class GatewaySettings:
    verifier_target: str = "127.0.0.1:50051"
    drafter_target: str = "127.0.0.1:50052"
    verify_mode: str = "batched"
    cost_mode: str = "configured"
    round_timeout_s: float = 30.0
    generation_timeout_s: float = 600.0
    startup_timeout_s: float = 10.0
    drafter_failovers: int = 2
    token: str = field(default="", repr=False)  # DSPARK_GATEWAY_TOKEN; "" = no token required

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "GatewaySettings":
        """Raises ValueError naming the variable and value when one is invalid (the token's value is never shown)."""
        drafter = environ.get("DSPARK_DRAFTER_TARGET", cls.drafter_target)
        return cls(
            verifier_target=backend_target(environ.get("DSPARK_VERIFIER_TARGET", cls.verifier_target),
                                           "DSPARK_VERIFIER_TARGET"),
            drafter_target=backend_target(drafter, "DSPARK_DRAFTER_TARGET") if drafter.strip() else "",
            verify_mode=_choice(environ, "DSPARK_VERIFY_MODE", cls.verify_mode, VERIFY_MODES),
            cost_mode=_choice(environ, "DSPARK_GATE_COSTS", cls.cost_mode, COST_MODES),
            round_timeout_s=_float(environ, "DSPARK_ROUND_TIMEOUT_S", cls.round_timeout_s),
            generation_timeout_s=_float(environ, "DSPARK_GENERATION_TIMEOUT_S", cls.generation_timeout_s),
            startup_timeout_s=_float(environ, "DSPARK_STARTUP_TIMEOUT_S", cls.startup_timeout_s),
            drafter_failovers=_int(environ, "DSPARK_DRAFTER_FAILOVERS", cls.drafter_failovers, low=0),
            token=_token(environ, "DSPARK_GATEWAY_TOKEN"),
        )


@dataclass(frozen=True)
class ServeSettings:
    """Process settings of `dspark serve` (every service).

    health_port: DSPARK_HEALTH_PORT, a plaintext port serving only grpc.health.v1 (Kubernetes
        `grpc:` probes cannot present a client certificate); None = no such port.
    drain_timeout_s: DSPARK_DRAIN_TIMEOUT_S, how long SIGTERM lets open streams finish (30 s).
    max_connection_age_s: DSPARK_MAX_CONNECTION_AGE_S, after which a server asks a client to
        reconnect (open streams are not cut), so a `dns:///` client re-resolves and sees new
        replicas (300 s).
    """

    health_port: int | None = None
    drain_timeout_s: float = 30.0
    max_connection_age_s: float = 300.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "ServeSettings":
        """Raises ValueError naming the variable and value when one is invalid."""
        port = _int(environ, "DSPARK_HEALTH_PORT", 0, low=0) if environ.get("DSPARK_HEALTH_PORT") else None
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"DSPARK_HEALTH_PORT={environ['DSPARK_HEALTH_PORT']!r}: must be a port in 1..65535")
        return cls(health_port=port,
                   drain_timeout_s=_float(environ, "DSPARK_DRAIN_TIMEOUT_S", cls.drain_timeout_s),
                   max_connection_age_s=_float(environ, "DSPARK_MAX_CONNECTION_AGE_S", cls.max_connection_age_s,
                                               low=0.0, high=MAX_CONNECTION_AGE_S))


@dataclass(frozen=True)
class BackendSettings:
    max_sessions: int = 16
    verify_mode: str = "batched"
    verify_numerics: str = "fast"  # "exact": the verifier's batched verify is bitwise equal to decode

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "BackendSettings":
        """Raises ValueError naming the variable and value when one is invalid."""
        return cls(max_sessions=_int(environ, "DSPARK_MAX_SESSIONS", cls.max_sessions),
                   verify_mode=_choice(environ, "DSPARK_VERIFY_MODE", cls.verify_mode, VERIFY_MODES),
                   verify_numerics=_choice(environ, "DSPARK_VERIFY_NUMERICS", cls.verify_numerics,
                                           ("fast", "exact")))
