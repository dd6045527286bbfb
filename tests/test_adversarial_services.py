"""Adversarial checks of the three services: cancels under load, interrupted cleanup.

Everything runs over real in-process servers on port 0 (`services_fixtures`); the client
cancels with `call.cancel()` as a real client would. The property under attack: whatever
the client does, every backend session a generation opened is freed, and the gateway counts
no drafter failure for a generation the client abandoned.
"""

from __future__ import annotations

import asyncio
import json
import random

import grpc
import pytest

from dspark_proto.v1 import gateway_pb2
from services.gateway.backends import GrpcDrafterSession, GrpcVerifierSession
from services.gateway.drafters import DrafterSupply
from services.gateway.servicer import close_generation
from services.settings import read_settings
from services_fixtures import collect, gen_request, service_loop, start_stack

CONCURRENT = 16        # generations in flight at once (the backends' session limit)
WAVES = 3
IDLE_TIMEOUT_S = 10.0  # sessions must be freed within this after the last call ended


@pytest.fixture(scope="module")
def stack():
    s = start_stack("oracle")
    yield s
    s.close()


async def _cancelled_generation(stub, rng: random.Random, i: int) -> str:
    """One Generate that the client cancels at a random point: before the first message, after
    a random number of messages, or never. Returns how it ended."""
    req = gen_request(f"prompt {i} goes", max_tokens=rng.randint(4, 24), spec=rng.choice(["always", "gated", "off"]))
    call = stub.Generate(req, timeout=60)
    cancel_after_s = rng.choice([0.0, 0.005, 0.02, 0.1, None])
    cancel_at_msg = rng.choice([1, 2, 3, None])

    async def read() -> str:
        n = 0
        async for _ in call:
            n += 1
            if n == cancel_at_msg:
                call.cancel()
                return "cancelled in the stream"
        return "finished"

    reader = asyncio.ensure_future(read())
    if cancel_after_s is not None:
        await asyncio.sleep(cancel_after_s)
        call.cancel()
    try:
        return await reader
    except (asyncio.CancelledError, grpc.aio.AioRpcError) as err:
        code = err.code() if isinstance(err, grpc.aio.AioRpcError) else grpc.StatusCode.CANCELLED
        return code.name


def test_random_client_cancels_under_load_leave_no_backend_session_open(stack):
    rng = random.Random(20)

    async def run():
        gw = await stack.agateway("sequential")
        outcomes = []
        for wave in range(WAVES):
            outcomes += await asyncio.gather(*[_cancelled_generation(gw.stub, rng, wave * CONCURRENT + i)
                                               for i in range(CONCURRENT)])
        idle = await stack.await_idle(IDLE_TIMEOUT_S)
        stats = json.loads((await gw.stub.Stats(gateway_pb2.StatsRequest(), timeout=10)).json)
        after = await collect(gw.stub, gen_request("after the storm", max_tokens=10, spec="always"))
        return outcomes, idle, stats, after

    outcomes, idle, stats, after = service_loop().run(run(), 300)
    assert set(outcomes) <= {"finished", "cancelled in the stream", "CANCELLED"}, outcomes
    assert "CANCELLED" in outcomes or "cancelled in the stream" in outcomes
    assert idle == {"verifier_info": 0, "verifier_engine": 0, "drafter_info": 0, "drafter_engine": 0}
    faults = stats["drafter_failures"]
    assert sum(faults["failures"].values()) == 0 and faults["plain_generations"] == 0, faults
    assert after.stats.accepted > 0 and not after.stats.drafter_failed


class _CancelledWhileClosing:
    """A verifier session whose close is interrupted by a second cancel of the call: it drops
    its stream (as `_Stream.close` does on a cancel) and raises CancelledError."""

    def __init__(self, inner: GrpcVerifierSession):
        self.inner = inner

    async def close(self) -> None:
        self.inner._s.call.cancel()
        raise asyncio.CancelledError


def test_a_cancel_while_the_verifier_closes_still_closes_the_drafter_sessions(stack):
    """Closing the verifier's stream raised CancelledError (the client's cancel arriving
    again): the drafter streams must be closed all the same, or their sessions stay open on
    the drafter until the generation deadline."""
    async def run():
        verifier = GrpcVerifierSession(stack.verifier_stub, 10.0, 60.0)
        first = await verifier.prefill([5, 6, 7], None)
        supply = DrafterSupply(lambda: GrpcDrafterSession(stack.drafter_stub, 10.0, 60.0), failovers=1)
        for _ in range(2):
            await supply.open().commit(first.rows, first.first_position, [5, 6, 7], 0, None)
        opened = await stack.aopen_sessions()
        with pytest.raises(asyncio.CancelledError):
            await close_generation(_CancelledWhileClosing(verifier), supply)
        return opened, await stack.await_idle(IDLE_TIMEOUT_S)

    opened, idle = service_loop().run(run(), 60)
    assert (opened["verifier_engine"], opened["drafter_engine"]) == (1, 2)
    assert idle == {"verifier_info": 0, "verifier_engine": 0, "drafter_info": 0, "drafter_engine": 0}


@pytest.mark.parametrize("name, service", [("DSPARK_MAX_SESSIONS", "verifier"), ("DSPARK_MAX_SESSIONS", "drafter"),
                                           ("DSPARK_DRAFTER_FAILOVERS", "gateway")])
def test_a_count_beyond_int32_is_refused_at_start_naming_the_variable(name, service):
    """max_sessions travels as int32 in ModelIdentity: 2**31 used to be accepted here and then
    failed every Info call of the verifier (the gateway could not start against it)."""
    environ = {name: str(2**31), "DSPARK_VERIFIER_TARGET": "127.0.0.1:1"}
    with pytest.raises(ValueError) as err:
        read_settings(environ, service)
    assert str(err.value) == f"{name}='{2**31}': must be an integer >= {0 if 'FAILOVERS' in name else 1} and <= {2**31 - 1}"
    environ[name] = str(2**31 - 1)
    read_settings(environ, service)  # the largest count still accepted


def _with_id(request_id: str) -> gateway_pb2.GenerateRequest:
    req = gen_request("held up", max_tokens=4, spec="off")
    req.request_id = request_id
    return req


def test_a_call_that_ends_during_the_load_refresh_frees_its_session_and_its_id(stack):
    """The first await after a Generate registers its id and opens its verifier stream is the
    load table's refresh (an Info call to the verifier). A deadline or cancel that lands there
    used to skip the cleanup: the verifier kept the session until the generation deadline
    (600 s) and the id answered ALREADY_EXISTS for good. The refresh is held up here (as a
    busy verifier's Info would be) so the deadline lands inside it every time."""
    async def scenario():
        gw = await stack.start_gateway("sequential", cost_mode="measured")
        try:
            real, release = gw.scheduler.load.refresh, asyncio.Event()

            async def slow_refresh():
                await release.wait()
                await real()
            gw.scheduler.load.refresh = slow_refresh
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(gw.stub, _with_id("held-up-1"), 0.5)
            cancelled = gw.stub.Generate(_with_id("held-up-2"), timeout=30)
            reader = asyncio.ensure_future(cancelled.read())
            await asyncio.sleep(0.3)
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader
            await asyncio.sleep(0.5)  # the gateway's side of both calls ends
            opened = await stack.aopen_sessions()
            release.set()
            again = [await collect(gw.stub, _with_id(rid)) for rid in ("held-up-1", "held-up-2")]
            return err.value.code(), opened, again
        finally:
            await gw.close()

    code, opened, again = service_loop().run(scenario())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert opened["verifier_engine"] == opened["verifier_info"] == 0, opened
    assert [len(g.token_ids) for g in again] == [4, 4]  # both ids are free again
