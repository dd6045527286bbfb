"""A full drafter is a passing condition: the generation decodes plainly, then drafts again.

A drafter at its session limit refuses a new session with RESOURCE_EXHAUSTED. The gateway
counts that as reason "full" (not "error"), decodes plainly, and asks for a session again after
FULL_RETRY_FIRST rounds, then at doubling gaps (services/gateway/drafter_link.py). Everything
here runs through real in-process servers on port 0: a verifier, the live oracle drafter
limited to one session, and a gateway under sequential verify, where speculation never
changes a token.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from dspark_proto.v1 import gateway_pb2
from services.gateway.backends import BackendError, failure_reason, may_fail_over
from services.gateway.drafter_link import FULL_RETRY_FIRST, FULL_RETRY_MAX
from services.gateway.drafters import FAILURE_REASONS, DrafterSupply
from services_fixtures import gen_request, start_stack


@pytest.fixture(scope="module")
def one_slot_stack():
    """Verifier + oracle drafter that holds at most one session."""
    stack = start_stack("oracle", drafter_max_sessions=1)
    yield stack
    stack.close()


def test_resource_exhausted_is_full_and_retried_later_not_failed_over():
    exc = BackendError("drafter", "session limit reached", grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert failure_reason(exc) == "full" and "full" in FAILURE_REASONS
    assert not may_fail_over(exc)  # a full drafter is asked again after a wait, not at once
    internal = BackendError("drafter", "boom", grpc.StatusCode.INTERNAL)
    assert failure_reason(internal) == "error" and not may_fail_over(internal)


def test_retries_do_not_spend_the_failover_budget():
    opened = []
    supply = DrafterSupply(lambda: opened.append(object()) or opened[-1], failovers=1)
    assert supply.open() is not None            # the first session
    assert supply.retry() is not None and supply.retry() is not None  # two capacity retries
    assert supply.open() is not None            # the one failover is still there
    assert supply.open() is None                # and then the budget is spent
    assert len(opened) == 4
    assert DrafterSupply.of(object()).retry() is None  # a caller-owned session cannot be re-opened


class SlotHolder:
    """A raw drafter `Session` stream that takes the drafter's only slot until `release()`."""

    def __init__(self, stack):
        self.stack, self._done = stack, asyncio.Event()

    async def _requests(self):
        await self._done.wait()
        return
        yield  # an async generator that sends nothing, then half-closes

    async def take(self) -> None:
        self.call = self.stack.drafter_stub.Session(self._requests(), timeout=60)
        counts = {}
        for _ in range(600):  # the server opens the session when the stream starts
            counts = await self.stack.aopen_sessions()
            if counts["drafter_engine"] == 1:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"the slot holder never got its session: {counts}")

    async def release(self) -> None:
        self._done.set()
        async for _ in self.call:  # the stream ends once the server closed the session
            pass


async def _stats(gw) -> dict:
    return json.loads((await gw.stub.Stats(gateway_pb2.StatsRequest(), timeout=10)).json)["drafter_failures"]


async def _full_then_free(stack, release_after: int | None, max_tokens: int):
    """B runs while a holder takes the drafter's only slot; the holder lets go after B's
    `release_after`-th streamed token (None: only after B ends). Returns B's tokens, its
    SpecStats and the gateway's drafter failure counts before and after."""
    gw = await stack.agateway("sequential")
    before = await _stats(gw)
    holder = SlotHolder(stack)
    await holder.take()
    tokens, final = [], None
    try:
        async for msg in gw.stub.Generate(gen_request(ids=[9, 10, 11, 12], max_tokens=max_tokens, spec="always"),
                                          timeout=60):
            tokens += list(msg.token_ids)
            if release_after is not None and len(tokens) >= release_after and not holder._done.is_set():
                await holder.release()
            if msg.finished:
                final = msg
    finally:
        if not holder._done.is_set():
            await holder.release()
    return tokens, final.spec_stats, before, await _stats(gw)


def test_a_full_drafter_is_asked_again_and_speculation_resumes(one_slot_stack):
    tokens, stats, before, after = one_slot_stack.loop.run(_full_then_free(one_slot_stack, 2, 64), 120)
    plain = one_slot_stack.generate(gen_request(ids=[9, 10, 11, 12], max_tokens=64, spec="off"))
    assert tokens == plain.token_ids  # sequential verify: speculation never changes a token
    assert after["failures"]["full"] - before["failures"]["full"] >= 1
    assert after["failures"]["error"] == before["failures"]["error"]
    assert after["plain_generations"] == before["plain_generations"]  # never given up on
    # B decoded plainly while refused (at least the rounds before its first ask) ...
    assert stats.plain_rounds >= FULL_RETRY_FIRST - 1
    # ... and drafted again once the slot was free: the oracle's drafts are all accepted.
    assert stats.drafted >= 1 and stats.accepted >= 1
    counts = one_slot_stack.wait_idle()
    assert not any(counts.values()), counts


def test_a_drafter_that_stays_full_is_asked_at_doubling_gaps(one_slot_stack):
    # B's prompt commit is refused; then it asks after FULL_RETRY_FIRST plain rounds and
    # after gaps doubling up to FULL_RETRY_MAX, each ask refused while the holder stays.
    _, stats, before, after = one_slot_stack.loop.run(_full_then_free(one_slot_stack, None, 40), 120)
    asks, gap, at = 1, FULL_RETRY_FIRST, FULL_RETRY_FIRST
    while at <= stats.plain_rounds:
        asks, gap = asks + 1, min(FULL_RETRY_MAX, 2 * gap)
        at += gap
    assert stats.drafted == 0 and stats.plain_rounds == stats.rounds
    assert after["failures"]["full"] - before["failures"]["full"] == asks, (after, before, stats.rounds)
    counts = one_slot_stack.wait_idle()
    assert not any(counts.values()), counts
