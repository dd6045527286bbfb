"""Transport security (issue #10): mTLS between the gateway and the backends, the gateway's
bearer token, TLS on its client port, the plaintext health port, and the settings' errors.

Certificates are made at test time with `cryptography`: a CA, a server certificate for
127.0.0.1 / localhost, a client certificate, and a client certificate from another CA. Servers
run in process on port 0 over real channels; the CLI and the container health check run as
real subprocesses.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dspark_proto.v1 import common_pb2, drafter_pb2_grpc, gateway_pb2, gateway_pb2_grpc, verifier_pb2_grpc
from services.app import drafter_engine, start_drafter, start_gateway, start_verifier, verifier_engine
from services.common.settings import BackendSettings, GatewaySettings
from services.common.tls import TlsFiles, start_health_server
from services.gateway.backends import BackendError
from services.gateway.gate import GateConfig
from services.settings import gateway_settings, gateway_tls_files, tls_files
from services_fixtures import collect, gen_request, service_loop, tiny_trunk

REPO = Path(__file__).resolve().parents[1]
CALL_S = 5.0          # deadline of one refused or accepted unary call
TOKEN = "s3cret-Token_0123456789"
CLI_TIMEOUT_S = 60


# ---------------------------------------------------------------------------- certificates
def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key, issuer: str, issuer_key, *, ca: bool = False, server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        b = b.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                          content_commitment=False, key_encipherment=False, data_encipherment=False,
                                          key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
    elif server:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                            critical=False)
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    else:
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _pem(cert) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    """PEM files: ca, server (127.0.0.1 / localhost), client, and rogue_client from another CA."""
    d = tmp_path_factory.mktemp("pki")
    ca_key, rogue_ca_key = _key(), _key()
    ca = _cert("dspark test CA", ca_key, "dspark test CA", ca_key, ca=True)
    rogue_ca = _cert("rogue CA", rogue_ca_key, "rogue CA", rogue_ca_key, ca=True)
    files = {"ca.pem": _pem(ca), "rogue-ca.pem": _pem(rogue_ca)}
    for name, issuer, issuer_key, server in (("server", "dspark test CA", ca_key, True),
                                             ("client", "dspark test CA", ca_key, False),
                                             ("rogue-client", "rogue CA", rogue_ca_key, False)):
        key = _key()
        files[f"{name}.pem"] = _pem(_cert(f"dspark {name}", key, issuer, issuer_key, server=server))
        files[f"{name}.key"] = _key_pem(key)
    files["not-pem.pem"] = b"just some bytes\n"
    for name, data in files.items():
        (d / name).write_bytes(data)
    return {name.rsplit(".", 1)[0] + ("_key" if name.endswith(".key") else ""): d / name for name in files}


def server_tls(pki) -> TlsFiles:
    return tls_files({"DSPARK_TLS_CERT": str(pki["server"]), "DSPARK_TLS_KEY": str(pki["server_key"]),
                         "DSPARK_TLS_CA": str(pki["ca"])})


def client_tls(pki, who: str = "client") -> TlsFiles:
    return tls_files({"DSPARK_TLS_CERT": str(pki[who]), "DSPARK_TLS_KEY": str(pki[f"{who}_key"]),
                         "DSPARK_TLS_CA": str(pki["ca"])})


# ---------------------------------------------------------------------------- mTLS at the backends
async def _info(target: str, credentials: grpc.ChannelCredentials | None, stub_class):
    """Info over a fresh channel; returns the identity or the failed call's status code."""
    channel = (grpc.aio.secure_channel(target, credentials) if credentials is not None
               else grpc.aio.insecure_channel(target))
    async with channel:
        try:
            return await stub_class(channel).Info(common_pb2.InfoRequest(), timeout=CALL_S)
        except grpc.aio.AioRpcError as e:
            return e.code()


@pytest.mark.parametrize("backend", ["verifier", "drafter"])
def test_backend_with_mtls_refuses_clients_without_a_valid_certificate_and_serves_one_with(backend, pki):
    ca = pki["ca"].read_bytes()
    clients = {
        "plaintext": None,
        "tls without a client certificate": grpc.ssl_channel_credentials(ca),
        "client certificate from another CA": client_tls(pki, "rogue-client").channel_credentials(),
        "valid client certificate": client_tls(pki).channel_credentials(),
    }

    async def scenario():
        creds = server_tls(pki).server_credentials()
        if backend == "verifier":
            server = await start_verifier(verifier_engine(tiny_trunk(), BackendSettings()), credentials=creds)
            stub_class = verifier_pb2_grpc.VerifierStub
        else:
            engine = drafter_engine(tiny_trunk(), oracle=True, settings=BackendSettings())
            server = await start_drafter(engine, credentials=creds)
            stub_class = drafter_pb2_grpc.DrafterStub
        try:
            return {what: await _info(f"127.0.0.1:{server.port}", c, stub_class) for what, c in clients.items()}
        finally:
            await server.stop(0)

    results = service_loop().run(scenario())
    for what in ("plaintext", "tls without a client certificate", "client certificate from another CA"):
        assert results[what] == grpc.StatusCode.UNAVAILABLE, (what, results[what])
    assert results["valid client certificate"].role == backend


def test_gateway_with_a_client_certificate_is_served_over_mtls_and_one_without_is_refused(pki):
    trunk = tiny_trunk()

    async def scenario():
        creds = server_tls(pki).server_credentials()
        verifier = await start_verifier(verifier_engine(trunk, BackendSettings()), credentials=creds)
        drafter = await start_drafter(drafter_engine(trunk, oracle=True, settings=BackendSettings()), credentials=creds)
        settings = GatewaySettings(verifier_target=f"127.0.0.1:{verifier.port}",
                                   drafter_target=f"127.0.0.1:{drafter.port}", verify_mode="sequential",
                                   startup_timeout_s=2.0)
        refused = {}
        for what, tls in (("plaintext", None), ("another CA", client_tls(pki, "rogue-client"))):
            try:
                gw, _, backends = await start_gateway(settings, GateConfig(), backend_tls=tls)
            except BackendError as exc:
                refused[what] = exc
            else:
                await gw.stop(0)
                await backends.close()
        gw, _, backends = await start_gateway(settings, GateConfig(), backend_tls=client_tls(pki))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as ch:
                stub = gateway_pb2_grpc.GatewayStub(ch)
                off = await collect(stub, gen_request("secure hello", max_tokens=12, spec="off"))
                spec = await collect(stub, gen_request("secure hello", max_tokens=12, spec="always"))
                return refused, off, spec
        finally:
            await gw.stop(0)
            await backends.close()
            await drafter.stop(0)
            await verifier.stop(0)

    refused, off, spec = service_loop().run(scenario())
    assert set(refused) == {"plaintext", "another CA"}
    assert all(exc.backend == "verifier" for exc in refused.values())
    assert spec.token_ids == off.token_ids and len(off.token_ids) == 12
    assert spec.stats.accepted > 0 and not spec.stats.drafter_failed  # the drafter was reached over mTLS too


# ---------------------------------------------------------------------------- the bearer token
@pytest.fixture(scope="module")
def token_gateway(pki):
    """Verifier + oracle drafter (plaintext) and a gateway requiring TOKEN with TLS on its client
    port; yields (port, verifier engine)."""
    loop = service_loop()
    engine = verifier_engine(tiny_trunk(), BackendSettings())

    async def start():
        verifier = await start_verifier(engine)
        drafter = await start_drafter(drafter_engine(tiny_trunk(), oracle=True, settings=BackendSettings()))
        settings = GatewaySettings(verifier_target=f"127.0.0.1:{verifier.port}",
                                   drafter_target=f"127.0.0.1:{drafter.port}", verify_mode="sequential",
                                   token=TOKEN)
        public = gateway_tls_files({"DSPARK_GATEWAY_TLS_CERT": str(pki["server"]),
                                       "DSPARK_GATEWAY_TLS_KEY": str(pki["server_key"])})
        gw, _, backends = await start_gateway(settings, GateConfig(), credentials=public.server_credentials())
        return verifier, drafter, gw, backends

    verifier, drafter, gw, backends = loop.run(start())
    yield gw.port, engine

    async def stop():
        await gw.stop(0)
        await backends.close()
        await drafter.stop(0)
        await verifier.stop(0)
    loop.run(stop())


async def _generate(port: int, ca: bytes, metadata):
    async with grpc.aio.secure_channel(f"localhost:{port}", grpc.ssl_channel_credentials(ca)) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        try:
            tokens = []
            async for msg in stub.Generate(gen_request("abc", max_tokens=4), timeout=CALL_S * 6, metadata=metadata):
                tokens += msg.token_ids
            return tokens
        except grpc.aio.AioRpcError as e:
            return e


@pytest.mark.parametrize("metadata, message", [
    (None, "missing bearer token"),
    ((("authorization", "Bearer wrong-token"),), "invalid bearer token"),
    ((("authorization", f"Basic {TOKEN}"),), "invalid bearer token"),
    ((("authorization", f"Bearer {TOKEN}x"),), "invalid bearer token"),
])
def test_call_without_the_bearer_token_gets_unauthenticated_and_opens_no_session(token_gateway, pki, metadata, message):
    port, engine = token_gateway
    err = service_loop().run(_generate(port, pki["ca"].read_bytes(), metadata))
    assert isinstance(err, grpc.aio.AioRpcError)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and message in err.details()
    assert TOKEN not in err.details() and "wrong-token" not in err.details()  # never echoed
    assert engine.num_sessions == 0


def test_call_with_the_bearer_token_is_served_and_health_needs_none(token_gateway, pki):
    port, _ = token_gateway
    ca = pki["ca"].read_bytes()
    tokens = service_loop().run(_generate(port, ca, (("authorization", f"Bearer {TOKEN}"),)))
    assert isinstance(tokens, list) and len(tokens) == 4

    async def stats_and_health():
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        async with grpc.aio.secure_channel(f"localhost:{port}", grpc.ssl_channel_credentials(ca)) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            try:
                await stub.Stats(gateway_pb2.StatsRequest(), timeout=CALL_S)
                stats = "served"
            except grpc.aio.AioRpcError as e:
                stats = e.code()
            health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=CALL_S)
            return stats, health.status
    stats, health = service_loop().run(stats_and_health())
    assert stats == grpc.StatusCode.UNAUTHENTICATED  # every RPC, not only Generate
    assert health == 1  # SERVING, without a token


def _cli(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DSPARK_", "OTEL_", "DEEPSEEK_DSPARK_"))}
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=CLI_TIMEOUT_S, env={**base, **(env or {})}, stdin=subprocess.DEVNULL)


def test_dspark_generate_sends_the_token_from_the_flag_or_the_environment(token_gateway, pki):
    port, _ = token_gateway
    common = ["generate", "abc", "--target", f"localhost:{port}", "--max-tokens", "3", "--ignore-eos",
              "--tls-ca", str(pki["ca"]), "--json"]
    with_flag = _cli(*common, "--token", TOKEN)
    assert with_flag.returncode == 0, with_flag.stderr
    assert '"finished": true' in with_flag.stdout
    with_env = _cli(*common, env={"DSPARK_GATEWAY_TOKEN": TOKEN})
    assert with_env.returncode == 0, with_env.stderr
    without = _cli(*common)
    assert without.returncode == 1 and "UNAUTHENTICATED: missing bearer token" in without.stderr
    bad_ca = _cli(*common[:-3], "--tls-ca", str(pki["ca"]) + ".missing", "--token", TOKEN)
    assert bad_ca.returncode == 2 and "--tls-ca=" in bad_ca.stderr and "cannot read" in bad_ca.stderr


# ---------------------------------------------------------------------------- the health port
def test_plaintext_health_port_beside_an_mtls_port_serves_only_health_and_shows_the_drain(pki):
    async def scenario():
        server = await start_verifier(verifier_engine(tiny_trunk(), BackendSettings()),
                                      credentials=server_tls(pki).server_credentials())
        health, port = await start_health_server(server.health, 0)
        try:
            check = lambda: subprocess.run(  # noqa: E731 - the container's health check, as compose runs it
                [sys.executable, str(REPO / "deploy" / "healthcheck.py"), f"127.0.0.1:{port}", "dspark.v1.Verifier"],
                capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
            import asyncio
            serving = await asyncio.to_thread(check)
            info = await _info(f"127.0.0.1:{port}", None, verifier_pb2_grpc.VerifierStub)
            await server.health.enter_graceful_shutdown()  # what SIGTERM does first
            draining = await asyncio.to_thread(check)
            return serving, info, draining
        finally:
            await health.stop(0)
            await server.stop(0)

    serving, info, draining = service_loop().run(scenario())
    assert serving.returncode == 0, serving.stderr
    assert info == grpc.StatusCode.UNIMPLEMENTED  # the model's service is not on the plaintext port
    assert draining.returncode == 1 and "NOT_SERVING" in draining.stderr


# ---------------------------------------------------------------------------- settings
def test_tls_settings_errors_name_the_variable_and_the_file(pki):
    with pytest.raises(ValueError, match="DSPARK_TLS_CERT set without DSPARK_TLS_KEY, DSPARK_TLS_CA"):
        tls_files({"DSPARK_TLS_CERT": str(pki["server"])})
    env = {"DSPARK_TLS_CERT": str(pki["server"]), "DSPARK_TLS_KEY": str(pki["server_key"]),
           "DSPARK_TLS_CA": str(pki["not-pem"])}
    with pytest.raises(ValueError, match=f"DSPARK_TLS_CA='{pki['not-pem']}': not a PEM file"):
        tls_files(env)
    with pytest.raises(ValueError, match="DSPARK_TLS_KEY=.*cannot read"):
        tls_files({**env, "DSPARK_TLS_CA": str(pki["ca"]), "DSPARK_TLS_KEY": str(pki["server_key"]) + ".gone"})
    with pytest.raises(ValueError, match="not a certificate chain with its private key"):
        tls_files({**env, "DSPARK_TLS_CA": str(pki["ca"]), "DSPARK_TLS_KEY": str(pki["client_key"])})
    with pytest.raises(ValueError, match="DSPARK_GATEWAY_TLS_KEY set without DSPARK_GATEWAY_TLS_CERT"):
        gateway_tls_files({"DSPARK_GATEWAY_TLS_KEY": str(pki["server_key"])})
    assert tls_files({}) is None and gateway_tls_files({}) is None  # plaintext by default
    with pytest.raises(ValueError, match=r"DSPARK_GATEWAY_TOKEN: must be printable ASCII .*\(value not shown\)"):
        gateway_settings({"DSPARK_GATEWAY_TOKEN": "two words"})
    assert "token" not in repr(GatewaySettings(token=TOKEN)) and TOKEN not in repr(GatewaySettings(token=TOKEN))


def test_dspark_serve_with_incomplete_tls_settings_exits_2_before_loading_a_model(pki):
    out = _cli("serve", "verifier", "--port", "0", env={"DSPARK_TLS_CERT": str(pki["server"])})
    assert out.returncode == 2
    assert "dspark serve verifier: DSPARK_TLS_CERT set without DSPARK_TLS_KEY, DSPARK_TLS_CA" in out.stderr
