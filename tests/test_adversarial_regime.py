"""The gateway's paths around its regime (docs/gate.md §14) under forced choices, and the gate
warm start (§6).

Through real in-process services (port 0, real channels, sequential verify, where drafting
never changes a token), with a `ForcedRegime` (the model regime with its choice scripted per
in_flight): a gated generation kept plain beside a neighbour lets its drafter go and, left
alone, wakes it; many concurrent gated generations under a regime that keeps switching,
clients cancelling mid-stream; a full or dead drafter while generations sleep; afterwards no
backend session is left open, nothing is in flight, and every finished generation streamed
plain decode's tokens. Unit level: the model regime fed odd sequences (load jumps, blocks of
any length, the step table coming and going) and the warm bands fed many generations.
"""

from __future__ import annotations

import asyncio
import json
import math

import grpc
import pytest

from dspark_proto.v1 import gateway_pb2
from services.gateway.drafter_link import DrafterLink
from verifier_fixtures import loop_of
from services.gateway.gate import GateConfig
from services.common.budget import StepTimes
from services.gateway.load_regime import ModelRegime
from services.gateway.round_policy import RoundPolicy
from regime_fixtures import ForcedRegime
from services_fixtures import Generation, collect, gen_request, service_loop, start_stack

PROMPTS = ("the regime policy", "a short neighbour", "speculative decoding", "xyz", "a burst drains")
# A choice with every third ask the other one: the regime keeps switching, so rounds go from
# sleeping to waking all the time.
PLAIN_SWITCHING = ("plain", "plain", "draft")
DRAFT_SWITCHING = ("draft", "draft", "plain")


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


def _assert_nothing_open(loop, stack, gw) -> None:
    """No verifier or drafter session left open, and no generation in flight at the gateway."""
    assert not any(loop.run(stack.await_idle()).values())
    assert gw.scheduler.in_flight == 0


async def _first_messages(calls, n: int) -> list[Generation]:
    """Read the first `n` messages of every Generate call (each generation then past its prefill
    and first rounds, all in flight together); one Generation per call."""
    gens = [Generation() for _ in calls]
    for call, g in zip(calls, gens):
        for _ in range(n):
            g.add(await call.read())
    return gens


async def _finish(calls, gens: list[Generation]) -> list[Generation]:
    """Read every call to its end into its Generation."""
    async def rest(call, g):
        while (msg := await call.read()) is not grpc.aio.EOF:
            g.add(msg)
        return g
    return await asyncio.gather(*(rest(c, g) for c, g in zip(calls, gens)))


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


def test_a_plain_regime_lets_the_drafter_go_and_a_lone_generation_wakes_it():
    """Under sequential verify, with a regime that runs 2 in flight plain: a gated generation
    running beside a short plain one runs its rounds plain (reason `regime`) with no drafter
    session; once alone it primes a new drafter session from the verifier's kept rows and
    drafts. Its tokens equal plain decode's, Stats reports the model regime the scheduler
    holds, and no session is left open. A gateway with the regime off reports it off."""
    loop = service_loop()
    stack = start_stack("dspark", gate_config=GateConfig(enabled=True))
    try:
        gw = loop.run(stack.start_gateway("sequential", regime=True))
        try:
            regime = gw.scheduler.regime = ForcedRegime({2: "plain"})
            reference = loop.run(collect(gw.stub, gen_request("the regime policy", max_tokens=32, spec="off")))

            async def beside():
                return await asyncio.gather(collect(gw.stub, gen_request("the regime policy", max_tokens=32,
                                                                         spec="gated")),
                                            collect(gw.stub, gen_request("a short neighbour", max_tokens=6,
                                                                         spec="off")))
            gated, _ = loop.run(beside())
            assert gated.token_ids == reference.token_ids
            assert gated.stats.plain_rounds >= 3 and gated.stats.drafted > 0  # slept, then woke and drafted
            assert not gated.stats.drafter_failed and gated.stats.drafter_failovers == 0
            assert regime.answers["plain"] >= 3 and regime.answers["draft"] == 0  # alone, the model let it draft
            assert gw.scheduler.in_flight == 0
            assert not any(loop.run(stack.await_idle()).values())
            view = loop.run(_stats(gw))["regime"]
            assert view == {"enabled": True, **json.loads(json.dumps(regime.to_dict()))}
            assert view["kind"] == "model" and set(view["in_flight"]) == {"1", "2", "4", "8", "16", "32", "64",
                                                                          "128", "256"}
        finally:
            loop.run(gw.close())
        off = loop.run(stack.start_gateway("sequential", regime=False))
        try:
            assert off.scheduler.regime is None
            assert loop.run(_stats(off))["regime"] == {"enabled": False}
        finally:
            loop.run(off.close())
    finally:
        stack.close()


def test_many_concurrent_gated_generations_with_cancels_leave_nothing_open(dspark):
    """28 gated generations (and 4 plain ones) at once under a regime that is plain at 2-4
    and from 17 in flight, drafting at 5-16, each with every third ask the other choice:
    rounds switch between sleeping and waking all the time. Every third client cancels after
    a few messages. The others stream plain decode's tokens; then no session is open
    anywhere, no generation is in flight, and Stats still answers with what the regime
    learned."""
    loop = service_loop()
    gw = loop.run(dspark.start_gateway("sequential", regime=True))
    try:
        regime = gw.scheduler.regime = ForcedRegime({2: PLAIN_SWITCHING, 5: DRAFT_SWITCHING,
                                                     17: PLAIN_SWITCHING})
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
        assert gw.scheduler.in_flight == 0
        assert regime.answers["plain"] > 0 and regime.answers["draft"] > 0
        view = loop.run(_stats(gw))
        assert view["regime"]["enabled"] is True and view["regime"]["kind"] == "model"
        assert view["regime"]["blocks"] == regime.blocks > 0  # full blocks drafted while the regime let them
        assert view["drafter_failures"]["plain_generations"] == 0
    finally:
        loop.run(gw.close())


def test_a_generation_arriving_where_the_regime_is_plain_opens_no_drafter_session(dspark):
    """A gated generation that joins one already in flight, at a concurrency (2) the
    regime runs plain, runs all its rounds plain beside it and must never open a drafter
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
                      regime=ForcedRegime({2: "plain"}, limits.block_size))
    opened = []

    def factory():
        opened.append(LocalDrafterSession(dspark.drafter_engine))
        return opened[-1]

    async def run():
        tok = tiny_tokenizer()
        first = sched.generate(sched.params("a long neighbour", tok.encode("a long neighbour"), 64, "off"),
                               LocalVerifierSession(loop_of(dspark.verifier_engine)))
        await first.__anext__()  # in flight, paused at its first token
        supply = DrafterSupply(factory, 2)
        verifier = LocalVerifierSession(loop_of(dspark.verifier_engine))
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


def test_a_full_drafter_while_generations_sleep_and_wake_keeps_plain_tokens_and_leaks_nothing():
    """A drafter with 2 slots and 10 gated generations whose regime (plain at 2 and from 9 in
    flight, drafting at 3-8) switches every few asks: wakes are refused (RESOURCE_EXHAUSTED,
    reason "full"), the refused generations decode
    plainly and ask again later, never give up (no drafter_failed), stream plain decode's
    tokens, and every session closes."""
    loop = service_loop()
    stack = start_stack("dspark", gate_config=GateConfig(enabled=True), drafter_max_sessions=2)
    try:
        gw = loop.run(stack.start_gateway("sequential", regime=True))
        try:
            regime = gw.scheduler.regime = ForcedRegime({2: PLAIN_SWITCHING, 3: DRAFT_SWITCHING,
                                                         9: PLAIN_SWITCHING})
            refs = _references(loop, gw, PROMPTS, 40)

            async def run():
                return await asyncio.gather(*(collect(gw.stub, gen_request(PROMPTS[i % len(PROMPTS)], max_tokens=40,
                                                                         spec="gated"))
                                              for i in range(10)))
            gens = loop.run(run(), 300)
            for i, g in enumerate(gens):
                assert g.token_ids == refs[PROMPTS[i % len(PROMPTS)]], i
                assert not g.stats.drafter_failed and g.stats.drafter_failovers == 0, i
            assert regime.answers["plain"] > 0 and regime.answers["draft"] > 0
            view = loop.run(_stats(gw))["drafter_failures"]
            assert view["failures"]["full"] > 0
            assert view["plain_generations"] == 0 and view["failovers"] == 0
            assert sum(view["failures"].values()) == view["failures"]["full"]
            _assert_nothing_open(loop, stack, gw)
        finally:
            loop.run(gw.close())
    finally:
        stack.close()


def test_a_drafter_that_dies_while_generations_sleep_leaves_them_on_plain_decode():
    """The drafter stops while gated generations sleep (the regime runs 2-4 in flight plain);
    when it turns to drafting at 3-4 they wake, the
    priming fails (dead), the failover budget is spent on sessions that fail too, and each
    goes on with plain decode: plain decode's tokens, drafter_failed, Stats counting one
    plain generation each, and no verifier session left open."""
    loop = service_loop()
    stack = start_stack("dspark", gate_config=GateConfig(enabled=True))
    try:
        gw = loop.run(stack.start_gateway("sequential", regime=True, drafter_failovers=1, round_timeout_s=5.0))
        try:
            regime = gw.scheduler.regime = ForcedRegime({2: "plain"})
            refs = _references(loop, gw, PROMPTS[:3], 48)

            async def run():
                calls = [gw.stub.Generate(gen_request(p, max_tokens=48, spec="gated"), timeout=60) for p in PROMPTS[:3]]
                gens = await _first_messages(calls, 3)  # all three in flight, rounds plain
                await stack.drafter.stop(0)
                regime.script = {2: "plain", 3: "draft"}  # now drafting pays at 3 in flight: they wake
                return await _finish(calls, gens)
            gens = loop.run(run(), 300)
            for p, g in zip(PROMPTS[:3], gens):
                assert g.token_ids == refs[p]
                assert g.stats.drafter_failed
            view = loop.run(_stats(gw))["drafter_failures"]
            assert view["plain_generations"] == 3 and view["failovers"] == 0
            assert view["failures"]["dead"] + view["failures"]["timeout"] + view["failures"]["error"] == 6
            assert gw.scheduler.in_flight == 0
            async def engines_idle():  # the stopped drafter answers no Info: ask the engines
                for _ in range(300):
                    if stack.verifier_engine.num_sessions == 0 and stack.drafter_engine.num_sessions == 0:
                        return True
                    await asyncio.sleep(0.05)
                return False
            assert loop.run(engines_idle())
        finally:
            loop.run(gw.close())
    finally:
        loop.run(stack.verifier.stop(0))


def test_a_forced_regime_answers_its_script_per_range_and_the_model_below_it():
    """The helper the service tests force regimes with: ranges from each key up, a tuple cycled
    one answer per ask, the model below the lowest key (alone it drafts), rows held and
    tokens left ignored, the model's length rule kept, a bad answer refused."""
    regime = ForcedRegime({2: "plain", 5: ("draft", "draft", "plain"), 17: "plain"}, 5)
    assert [regime.may_draft(n) for n in (1, 2, 4, 16, 16, 16, 16, 17, 300)] == [
        True, False, False, True, True, False, True, False, False]
    assert regime.may_draft(8, held_rows=10**6, tokens_left=1) is True  # the 5th ask of 5-16: "draft"
    assert regime.answers == {"plain": 5, "draft": 4} and regime.decides_length(2) and not regime.decides_length(1)
    regime.script = {2: "draft"}
    assert regime.may_draft(300) is True
    with pytest.raises(ValueError, match="'gate'"):
        ForcedRegime({2: "gate"}, 5)


def test_the_model_regime_survives_odd_sequences():
    """Load jumping between 0 and 300 in flight, blocks of every length (empty, cut short,
    longer than the block), legs of 0 ms and none, rows held and tokens left out of range,
    and the step table coming and going: no error, every survival a probability, every rate
    and leg finite, the view plain JSON; after the table goes, every gated round drafts."""
    tables = [StepTimes((1.0, 8.0, 64.0), (5.0, 9.0, 400.0)), None]
    regime = ModelRegime(5, lambda: tables[0], GateConfig().cost_model)
    for i in range(3000):
        in_flight = (0, 1, 300, 2, 17, 3, 9, 5)[i % 8] if i % 50 < 25 else i % 64
        if i % 97 == 0:
            tables.reverse()  # the verifier's Info lost its table, then reported one again
        regime.observe(in_flight, tuple(float(j < i % 4) for j in range(i % 7)), None if i % 5 == 0 else (i % 3) * 7.0)
        assert regime.may_draft(in_flight, held_rows=(i % 11) * 100 - 300, tokens_left=i % 13 - 4) in (True, False)
        assert regime.decides_length(in_flight) == (in_flight > 1 and tables[0] is not None)
    assert all(0.0 <= s <= 1.0 for s in regime.survival) and regime.blocks > 0
    tables[0] = StepTimes((1.0, 8.0, 64.0), (5.0, 9.0, 400.0))
    view = json.loads(json.dumps(regime.to_dict()))
    assert all(math.isfinite(ms) and ms >= 0 for ms in view["leg_ms"].values())
    for rates in view["in_flight"].values():
        assert all(math.isfinite(rates[k]) and rates[k] > 0 for k in ("plain_tok_per_ms", "draft_tok_per_ms"))
    tables[0] = None
    assert regime.to_dict()["in_flight"] == {} and all(regime.may_draft(n, 10**6, 1) for n in (2, 64, 300))


def test_warm_bands_stay_bounded_over_many_generations_and_threads():
    """100 000 finished generations merged from 8 threads: the lent weight per bucket stays
    at most max_weight and finite, generations that verified nothing are left out."""
    import threading
    from services.gateway.record import GateStats, Reason, RoundRecord
    from services.gateway.warm import GREEDY_BAND, WarmBands, WarmStart
    cost = GateConfig().cost_model()
    drafted = GateStats()
    drafted.add(RoundRecord(Reason.FULL, 3, 3, 2, cost, confidence_logits=(8.0, 2.0, -3.0)))
    bands = WarmBands(WarmStart(max_weight=7.0))

    def merge():
        for i in range(12_500):
            bands.add(GREEDY_BAND, drafted if i % 2 else GateStats(), [(8.0, 2.0, -3.0)])
    threads = [threading.Thread(target=merge) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    view = bands.to_dict()["bands"][GREEDY_BAND]
    assert view["generations"] == 50_000 and view["verified_rounds"] == 50_000
    cal = bands.calibration(GREEDY_BAND)
    assert all(math.isfinite(o) and 0 <= m <= o <= 7.0 for m, o in zip(cal.matched, cal.observed))
    assert max(view["lent_observed"]) == pytest.approx(7.0)


def test_a_generation_backed_off_from_a_full_drafter_opens_no_session_in_a_plain_round(monkeypatch):
    """A drafter with 2 slots and 6 gated generations started while the regime drafts: 4 are
    refused (full) and back off. The regime then turns plain: a backed-off generation may reopen a
    session only in a round whose regime decision let it draft, never in a plain round (open a
    session, prime it, let it go); all 6 stream plain decode's tokens and nothing stays open.

    Each reopening is attributed to its own round's decision, not to the moment the test
    turns the regime: a round decided while it drafted may still be waiting on its reopen
    when the switch lands, and that reopening is legitimate."""
    loop = service_loop()
    stack = start_stack("dspark", gate_config=GateConfig(enabled=True), drafter_max_sessions=2)
    decided: dict[object, bool] = {}  # generation task -> its current round's regime decision
    reopened: list[bool | None] = []  # per reopened session: the decision of its round (None: none made)
    retry_full = DrafterLink.retry_full

    async def attributed_retry(link):
        before = link.session
        ok = await retry_full(link)
        if link.session is not None and link.session is not before:
            reopened.append(decided.get(asyncio.current_task()))
        return ok
    monkeypatch.setattr(DrafterLink, "retry_full", attributed_retry)
    observe = RoundPolicy.observe

    def finishing(policy, *args, **kwargs):
        decided.pop(asyncio.current_task(), None)  # the round's reply is in: the round is over
        return observe(policy, *args, **kwargs)
    monkeypatch.setattr(RoundPolicy, "observe", finishing)
    try:
        gw = loop.run(stack.start_gateway("sequential", regime=True))
        try:
            refs = _references(loop, gw, PROMPTS, 60)
            regime = ForcedRegime({2: "draft"})
            may_draft = regime.may_draft

            def deciding(*args):
                decided[asyncio.current_task()] = answer = may_draft(*args)
                return answer
            regime.may_draft = deciding
            gw.scheduler.regime = regime

            async def run():
                reqs = [gen_request(PROMPTS[i % len(PROMPTS)], max_tokens=60, spec="gated") for i in range(6)]
                calls = [gw.stub.Generate(r, timeout=120) for r in reqs]
                gens = await _first_messages(calls, 2)  # every generation past its first round, drafting
                regime.script = {2: "plain"}
                return await _finish(calls, gens)
            gens = loop.run(run(), 300)
            for i, g in enumerate(gens):
                assert g.token_ids == refs[PROMPTS[i % len(PROMPTS)]], i
            assert loop.run(_stats(gw))["drafter_failures"]["failures"]["full"] >= 1
            assert regime.answers["plain"] > 0  # rounds asked after the turn, and ran plain
            assert all(d is True for d in reopened), reopened
            _assert_nothing_open(loop, stack, gw)
        finally:
            loop.run(gw.close())
    finally:
        stack.close()
