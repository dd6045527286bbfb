"""Transport security from PEM files: mTLS between the gateway and the backends, optional TLS
on the gateway's client port. Plaintext stays the default: with no variable set, nothing changes.

| variable | read by | meaning |
|---|---|---|
| DSPARK_TLS_CERT | all | this process's certificate chain (PEM): a backend's server, the gateway's client cert |
| DSPARK_TLS_KEY | all | the private key of DSPARK_TLS_CERT (PEM, unencrypted) |
| DSPARK_TLS_CA | all | CA certificates (PEM) that must have signed the other side's certificate |
| DSPARK_TLS_SERVER_NAME | gateway | name the backends' certificates must carry, if not the target's host |
| DSPARK_GATEWAY_TLS_CERT, _KEY | gateway | server certificate and key of the client port (no client certs) |

The three DSPARK_TLS_* files come together or not at all: a backend with them requires a
client certificate on every call (health checks too, except on the plaintext health port of
`start_health_server`), and a gateway with them presents
its certificate and checks the backends'. The two DSPARK_GATEWAY_TLS_* files also come as a pair.
Files are read once at start; every problem (a missing or unreadable file, not PEM, a key
that does not match its certificate) stops the service with a message naming the variable
and the path.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass, field
from typing import Mapping

import grpc

_PEM = b"-----BEGIN "


@dataclass(frozen=True)
class TlsFiles:
    """Contents of a certificate chain, its key and (for mTLS) the trusted CA certificates."""

    cert: bytes
    key: bytes = field(repr=False)
    ca: bytes | None = None
    server_name: str | None = None

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server side: present `cert`; with `ca`, require and verify a client certificate (mTLS)."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=self.ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client side: verify the server against `ca` and present `cert` (mTLS)."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def channel_options(self) -> list[tuple[str, str]]:
        """`grpc.ssl_target_name_override` when the certificates carry another name than the target's host."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def _read(environ: Mapping[str, str], name: str) -> bytes | None:
    path = environ.get(name, "")
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 20)
    except OSError as exc:
        raise ValueError(f"{name}={path!r}: cannot read: {exc.strerror or exc}") from None
    if _PEM not in data:
        raise ValueError(f"{name}={path!r}: not a PEM file (no '-----BEGIN' line)")
    return data


def _no_password() -> str:
    raise ValueError("the key is encrypted: gRPC needs an unencrypted PEM key")


def _check_pair(environ: Mapping[str, str], cert_var: str, key_var: str, ca_var: str | None = None) -> None:
    """Load the files into an `ssl` context, so a key that does not match its certificate, or a
    CA file without a certificate, is reported here and not as a failed bind or handshake."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(environ[cert_var], environ[key_var], password=_no_password)
    except (ssl.SSLError, ValueError) as exc:
        raise ValueError(f"{cert_var}={environ[cert_var]!r} and {key_var}={environ[key_var]!r}: "
                         f"not a certificate chain with its private key ({exc})") from None
    if ca_var is not None:
        try:
            ctx.load_verify_locations(cafile=environ[ca_var])
        except (ssl.SSLError, ValueError) as exc:
            raise ValueError(f"{ca_var}={environ[ca_var]!r}: no CA certificate in it ({exc})") from None


def tls_from_env(environ: Mapping[str, str] = os.environ) -> TlsFiles | None:
    """mTLS files of a backend (server) or of the gateway (client); None when none is set (plaintext).

    Raises:
        ValueError: only some of DSPARK_TLS_CERT / _KEY / _CA set, or a file that is unreadable,
            not PEM, or a key that does not match its certificate (variable and path named).
    """
    names = ("DSPARK_TLS_CERT", "DSPARK_TLS_KEY", "DSPARK_TLS_CA")
    given = [n for n in names if environ.get(n)]
    if not given:
        return None
    if len(given) != len(names):
        missing = [n for n in names if n not in given]
        raise ValueError(f"{', '.join(given)} set without {', '.join(missing)}: mTLS needs all three "
                         f"(certificate, key, CA), plaintext none")
    cert, key, ca = (_read(environ, n) for n in names)
    _check_pair(environ, *names)
    return TlsFiles(cert, key, ca, environ.get("DSPARK_TLS_SERVER_NAME") or None)


def gateway_tls_from_env(environ: Mapping[str, str] = os.environ) -> TlsFiles | None:
    """Server-side TLS of the gateway's client port; None when not configured (plaintext).

    Raises:
        ValueError: only one of DSPARK_GATEWAY_TLS_CERT / _KEY set, or a bad file (named).
    """
    names = ("DSPARK_GATEWAY_TLS_CERT", "DSPARK_GATEWAY_TLS_KEY")
    given = [n for n in names if environ.get(n)]
    if not given:
        return None
    if len(given) == 1:
        raise ValueError(f"{given[0]} set without {[n for n in names if n != given[0]][0]}: TLS needs both")
    cert, key = (_read(environ, n) for n in names)
    _check_pair(environ, *names)
    return TlsFiles(cert, key)


async def start_health_server(health_servicer, port: int, host: str = "127.0.0.1") -> tuple[grpc.aio.Server, int]:
    """A plaintext server with only `grpc.health.v1.Health` (the service's own servicer, so a
    drain's NOT_SERVING shows there too): Kubernetes `grpc:` probes cannot present a client
    certificate to an mTLS port. It serves no other method, so it exposes nothing but status.
    Returns the started server and its bound port (port 0 = any free port).

    Raises:
        RuntimeError: the port could not be bound (named).
    """
    from grpc_health.v1 import health_pb2_grpc

    from services.common.server import NO_REUSEPORT

    server = grpc.aio.server(options=[NO_REUSEPORT])
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"could not bind the health port {host}:{port}")
    await server.start()
    return server, bound
