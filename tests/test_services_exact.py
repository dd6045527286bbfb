"""DSPARK_VERIFY_NUMERICS=exact through the services: batched speculative output equals plain."""

from __future__ import annotations

import asyncio

import pytest

from services import app
from services.common.settings import BackendSettings, GatewaySettings
from services.gateway.gate import GateConfig
from services.settings import backend_settings
from services_fixtures import collect, gen_request


def test_verify_numerics_setting_is_parsed_and_checked():
    assert backend_settings({"DSPARK_VERIFY_NUMERICS": "exact"}).verify_numerics == "exact"
    assert backend_settings({}).verify_numerics == "fast"
    with pytest.raises(ValueError, match="DSPARK_VERIFY_NUMERICS='bitwise'"):
        backend_settings({"DSPARK_VERIFY_NUMERICS": "bitwise"})
    with pytest.raises(ValueError, match="needs --tp 1"):
        app.load_trunk(None, tp=2, verify_numerics="exact")


def test_exact_batched_speculation_equals_plain_through_the_services():
    async def run():
        settings = BackendSettings(verify_numerics="exact")
        trunk = app.load_trunk(None, verify_numerics="exact")
        verifier = await app.start_verifier(app.verifier_engine(trunk, settings))
        oracle = app.drafter_engine(app.load_trunk(None), oracle=True, settings=settings, corrupt_every=3)
        drafter = await app.start_drafter(oracle)
        gw, _, backends = await app.start_gateway(
            GatewaySettings(verifier_target=f"127.0.0.1:{verifier.port}",
                            drafter_target=f"127.0.0.1:{drafter.port}", verify_mode="batched"), GateConfig())
        import grpc
        from dspark_proto.v1 import gateway_pb2_grpc
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as ch:
                stub = gateway_pb2_grpc.GatewayStub(ch)
                out = {}
                for spec in ("off", "always", "gated"):
                    out[spec] = await collect(stub, gen_request("exact please", max_tokens=30, spec=spec))
                return out
        finally:
            await gw.stop(0)
            await drafter.stop(0)
            await verifier.stop(0)
            await backends.close()

    out = asyncio.run(run())
    assert out["always"].token_ids == out["off"].token_ids
    assert out["gated"].token_ids == out["off"].token_ids
    assert out["always"].stats.accepted > 0 and out["always"].stats.rounds < 30
