"""Structured output's validity and exactness grid (docs/structured.md §8) on the tiny model in
exact numerics: every generation ends on eos with JSON that validates against its schema, and
equals constrained plain decode (jump-forward off, speculation off, one stream), across
temperatures, off / always / gated, 1 and 16 concurrent streams, gRPC and HTTP (the `openai`
client, streaming and not) and a drafter killed mid-generation (`bench.bench_structured_grid`).

Real servers on port 0: a verifier (DSPARK_VERIFY_NUMERICS=exact), a live oracle drafter
drafting inside the grammar (every third slot corrupted: forbidden, rejected and accepted
drafts), two gateways (reference, and jump-forward on), an HTTP front. The full grid (>= 200
generations over 21 schemas) is `slow`; a small one runs in CI."""

from __future__ import annotations

import openai
import pytest

from bench.bench_structured_grid import GridTargets, run_grid, start_grid_gateway, summary
from services.app import drafter_engine, start_drafter, start_verifier, verifier_engine
from services.common.settings import BackendSettings
from services.http.server import start_http_front
from services_fixtures import exact_trunk, service_loop, tiny_trunk
from structured_schemas import SCHEMAS


async def _start():
    verifier = await start_verifier(verifier_engine(exact_trunk(), BackendSettings(verify_numerics="exact")))
    drafter = await start_drafter(drafter_engine(tiny_trunk(), oracle=True, corrupt_every=3))
    _, _, plain, close_plain = await start_grid_gateway(verifier.port, drafter.port, jump_forward=False)
    gw, sched, main, close_main = await start_grid_gateway(verifier.port, drafter.port)
    front = await start_http_front(gw, sched, None, 0, generate_timeout_s=120.0)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{front.http.port}/v1", api_key="unused",
                                max_retries=0, timeout=120.0)
    model = (await client.models.list()).data[0].id

    async def killable():
        victim = await start_drafter(drafter_engine(tiny_trunk(), oracle=True))
        _, _, stub, close = await start_grid_gateway(verifier.port, victim.port)

        async def close_both():
            await close()
            await victim.stop(0)
        return stub, lambda: victim.stop(0), close_both

    async def close_all():
        await client.close()
        await front.http.stop(1.0)
        await close_main()
        await close_plain()
        await drafter.stop(0)
        await verifier.stop(0)
    return GridTargets(plain, main, client, model, killable), close_all


@pytest.fixture(scope="module")
def targets():
    grid, close = service_loop().run(_start(), 60)
    yield grid
    service_loop().run(close(), 30)


def test_small_grid_is_valid_and_exact(targets):
    """Two schemas at T = 0.7: always one stream and two at once, a drafter killed after three
    tokens (HTTP streaming and not: the slow grid, and tests/test_structured_http.py)."""
    rows = service_loop().run(run_grid(targets, [1, 2], (0.7,), specs=("always",), streams=2, http_temps=(),
                                       kills=1), 120)
    assert len(rows) == 7 and {r.part for r in rows} == {"plain", "grpc x1", "grpc x2", "drafter killed"}
    assert all(r.valid and r.exact and not r.why for r in rows), summary(rows)


@pytest.mark.slow
def test_full_grid_over_twenty_one_schemas_is_valid_and_exact(targets):
    rows = service_loop().run(run_grid(targets, list(range(len(SCHEMAS))), (0.0, 0.7, 1.0), kills=3,
                                       log=print), 3600)
    print(summary(rows))
    assert len(rows) >= 200 and len({r.schema for r in rows}) >= 20
    assert all(r.valid and r.exact and not r.why for r in rows), summary(rows)
