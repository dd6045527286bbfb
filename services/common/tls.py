"""Transport security from PEM files: mTLS between the gateway and the backends, optional TLS
on the gateway's client port. Plaintext is the default.

This module reads and checks the files (`load_tls`) and turns them into gRPC credentials
(`TlsFiles`); which variables name the files, and which must come together, is decided by
`services.settings`, the only reader of the environment. A backend with mTLS files requires a
client certificate on every call (health checks too, except on the plaintext health port of
`start_health_server`), and a gateway with them presents its certificate and checks the
backends'. The gateway's client port may have its own certificate and key (no client
certificates there). Files are read once at start; every problem (a missing or unreadable
file, not PEM, a key that does not match its certificate) stops the service with a message
naming the setting and the path.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field

import grpc

_PEM = b"-----BEGIN "


@dataclass(frozen=True)
class PemFile:
    """A PEM file and the setting that named it (`name`, e.g. a variable or a flag), for errors."""

    name: str
    path: str


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


def _read(name: str, path: str) -> bytes:
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


def _check_pair(cert: PemFile, key: PemFile, ca: PemFile | None) -> None:
    """Load the files into an `ssl` context, so a key that does not match its certificate, or a
    CA file without a certificate, is reported here and not as a failed bind or handshake."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cert.path, key.path, password=_no_password)
    except (ssl.SSLError, ValueError) as exc:
        raise ValueError(f"{cert.name}={cert.path!r} and {key.name}={key.path!r}: "
                         f"not a certificate chain with its private key ({exc})") from None
    if ca is not None:
        try:
            ctx.load_verify_locations(cafile=ca.path)
        except (ssl.SSLError, ValueError) as exc:
            raise ValueError(f"{ca.name}={ca.path!r}: no CA certificate in it ({exc})") from None


def load_tls(cert: PemFile, key: PemFile, ca: PemFile | None = None, server_name: str | None = None) -> TlsFiles:
    """Read and check a certificate chain, its key and (for mTLS) the trusted CA certificates.

    Each file is read once, at most 1 MiB. `server_name` is the name the peer's certificate
    must carry when it is not the target's host (client side only).
    Raises:
        ValueError: a file that is unreadable or not PEM, an encrypted key, a key that does not
            match its certificate, or a CA file without a certificate (setting and path named).
    """
    data = [_read(f.name, f.path) for f in (cert, key) + ((ca,) if ca is not None else ())]
    _check_pair(cert, key, ca)
    return TlsFiles(data[0], data[1], data[2] if ca is not None else None, server_name or None)


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
