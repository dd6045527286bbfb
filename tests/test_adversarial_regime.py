"""Adversarial checks of the regime policy (docs/gate.md §14) and the gate warm start (§6).

Through real in-process services (port 0, real channels, sequential verify, where drafting
never changes a token): many concurrent gated generations under a policy that switches
regime every window, clients cancelling mid-stream, a full or dead drafter while generations
sleep; afterwards no backend session is left open, nothing is in flight, and every finished
generation streamed plain decode's tokens. Unit level: the policy fed odd sequences (load
jumps, time going backwards, idle while settling) and the warm bands fed many generations.
"""

from __future__ import annotations

import asyncio
import json
import math

import grpc
import pytest

from dspark_proto.v1 import gateway_pb2
from services.gateway.gate import GateConfig
from services.gateway.regime import REGIMES, RegimeConfig, RegimePolicy
from services_fixtures import Generation, collect, gen_request, service_loop, start_stack

PROMPTS = ("the regime policy", "a short neighbour", "speculative decoding", "xyz", "windows close")


def _forced(bucket_choice: dict[int, str], **config) -> RegimePolicy:
    """A policy whose evidence in each listed bucket says `bucket_choice[bucket]` by a mile
    (decay 1: new windows cannot move it); probes every 2nd window keep regimes switching."""
    cfg = dict(window_ms=5.0, decay=1.0, margin=0.05, probe_min=2, probe_max=2)
    cfg.update(config)
    policy = RegimePolicy(RegimeConfig(**cfg))
    for bucket, choice in bucket_choice.items():
        fast, slow = (choice, REGIMES[1 - REGIMES.index(choice)])
        policy.buckets[bucket].rates[fast].add(10**9, 1.0, 1.0)
        policy.buckets[bucket].rates[slow].add(1, 10.0**9, 1.0)
        policy.buckets[bucket].chosen = choice
    return policy


async def _partial(stub, req, cancel_after: int) -> list[int]:
    """Stream `req`, cancel the call after `cancel_after` messages; the tokens seen."""
    call = stub.Generate(req, timeout=60)
    tokens: list[int] = []
    n = 0
    async for msg in call:
        tokens.extend(msg.token_ids)
        n += 1
        if n >= cancel_after:
            call.cancel()
            break
    return tokens


async def _stats(gw) -> dict:
    return json.loads((await gw.stub.Stats(gateway_pb2.StatsRequest(), timeout=10)).json)


@pytest.fixture(scope="module")
def dspark():
    stack = start_stack("dspark", gate_config=GateConfig(enabled=True), drafter_max_sessions=64,
                        verifier_max_sessions=64)
    yield stack
    stack.close()


def _references(loop, gw, prompts, max_tokens) -> dict[str, list[int]]:
    async def run():
        gens = await asyncio.gather(*(collect(gw.stub, gen_request(p, max_tokens=max_tokens, spec="off"))
                                      for p in prompts))
        return {p: g.token_ids for p, g in zip(prompts, gens)}
    return loop.run(run())


def test_many_concurrent_gated_generations_with_cancels_leave_nothing_open(dspark):
    """28 gated generations (and 4 plain ones) at once under a policy that is plain at 17-32
    and 3-4 in flight, gate at 9-16 and 5-8, probing every second window of 5 ms: rounds
    switch between sleeping and waking all the time. Every third client cancels after a few
    messages. The others stream plain decode's tokens; then no session is open anywhere, no
    generation is in flight, and Stats still answers."""
    loop = service_loop()
    gw = loop.run(dspark.start_gateway("sequential", regime=True))
    try:
        gw.scheduler.regime = _forced({5: "plain", 4: "gate", 3: "gate", 2: "plain", 1: "plain"})
        refs = _references(loop, gw, PROMPTS, 40)

        async def run():
            jobs = []
            for i in range(32):
                prompt = PROMPTS[i % len(PROMPTS)]
                spec = "off" if i % 8 == 7 else "gated"
                req = gen_request(prompt, max_tokens=40 - (i % 5) * 6, spec=spec)
                jobs.append(_partial(gw.stub, req, 1 + i % 7) if i % 3 == 0 else collect(gw.stub, req))
            return await asyncio.gather(*jobs, return_exceptions=True)
        results = loop.run(run(), 300)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, errors[:3]
        for i, r in enumerate(results):
            want = refs[PROMPTS[i % len(PROMPTS)]][:40 - (i % 5) * 6]
            if isinstance(r, Generation):
                assert r.token_ids == want, i
                assert not r.stats.drafter_failed, i
            else:
                assert r == want[:len(r)], i
        assert not any(loop.run(dspark.await_idle()).values())
        assert gw.scheduler.in_flight == 0 and gw.scheduler.occupancy.inside == 0
        view = loop.run(_stats(gw))
        assert view["regime"]["enabled"] is True and view["regime"]["window"] is None
        assert view["drafter_failures"]["plain_generations"] == 0
    finally:
        loop.run(gw.close())


def test_a_generation_arriving_into_a_plain_window_opens_no_drafter_session(dspark):
    """A gated generation that joins one already in flight, at a concurrency (2) whose
    regime is plain, runs all its rounds plain beside it and must never open a drafter
    session: the regime is asked at the concurrency the generation itself makes, not the
    one before it arrived (else every arrival takes a drafter slot during its prefill)."""
    from services.gateway.backends import LocalDrafterSession, LocalVerifierSession
    from services.gateway.drafters import DrafterSupply
    from services.gateway.scheduler import FinalEvent, ModelLimits, Scheduler
    from services_fixtures import tiny_tokenizer
    loop = service_loop()
    cfg = dspark.verifier_engine.cfg
    limits = ModelLimits(cfg.vocab_size, cfg.max_seq_len, cfg.eos_token_id, cfg.dspark_block_size, True)
    sched = Scheduler(limits, tiny_tokenizer(), GateConfig(enabled=True), "sequential", "configured",
                      regime=_forced({1: "plain"}, window_ms=60_000.0, probe_min=64, probe_max=64))
    opened = []

    def factory():
        opened.append(LocalDrafterSession(dspark.drafter_engine))
        return opened[-1]

    async def run():
        tok = tiny_tokenizer()
        first = sched.generate(sched.params("a long neighbour", tok.encode("a long neighbour"), 64, "off"),
                               LocalVerifierSession(dspark.verifier_engine))
        await first.__anext__()  # in flight, paused at its first token
        supply = DrafterSupply(factory, 2)
        verifier = LocalVerifierSession(dspark.verifier_engine)
        events = []
        try:
            async for ev in sched.generate(sched.params("joins it", tok.encode("joins it"), 12, "gated"),
                                           verifier, supply):
                events.append(ev)
        finally:
            await verifier.close()
            await supply.close()
            await first.aclose()
        return events
    events = loop.run(run())
    final = events[-1]
    assert isinstance(final, FinalEvent) and final.counters.plain_rounds > 0 and final.counters.drafted == 0
    assert opened == [], f"{len(opened)} drafter session(s) opened by a generation that never drafted"
    assert sched.in_flight == 0
