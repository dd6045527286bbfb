"""A misbehaving drafter never fails a generation; a restarted backend is used again promptly.

The bad drafter is a scripted `dspark.v1.Drafter` service: a real grpc.aio server on port 0
speaking the real proto, answering commits as the real drafter does and drafts with whatever
the case scripts. Every generation runs under sequential verify, where a drafter failure must
not change a single token, and is compared with the same request under spec off.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import time
from dataclasses import dataclass
from typing import Callable

import grpc
import pytest

from dspark_proto.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from services.app import drafter_engine, start_drafter, start_gateway, start_verifier, verifier_engine
from services.common.server import RunningServer, channel_options, start_server
from services.common.settings import BackendSettings, GatewaySettings
from services.gateway.backends import (MAX_RECONNECT_BACKOFF_MS, DraftReply, InvalidDraftReply, failure_reason,
                                       may_fail_over)
from services.gateway.drafters import DraftCheck, DrafterSupply
from services.gateway.gate import GateConfig
from services.gateway.metrics import GatewayMetrics
from services.verifier.servicer import verifier_identity
from services_fixtures import collect, gen_request, service_loop, tiny_trunk

PROMPT = "The quick brown fox"
MAX_TOKENS = 12
GOOD_TOKEN = 65                # a valid id: the scripted drafter's drafts when a case leaves them alone
# A restarted backend must be used again within this many seconds of listening: the channels
# wait at most MAX_RECONNECT_BACKOFF_MS (+20 % jitter) between connection attempts; the rest
# is slack for a loaded machine. gRPC's default backoff took ~14 s here.
RESTART_BOUND_S = 3.0
DOWN_S = 6.0                   # how long a backend stays down (under load) before it restarts


# ---------------------------------------------------------------------------- the scripted drafter
Script = Callable[[str, drafter_pb2.DrafterRequest, drafter_pb2.DrafterResponse], None]


class ScriptedDrafter(drafter_pb2_grpc.DrafterServicer):
    """A Drafter whose replies a test scripts: `script(op, request, reply)` may change the
    well-formed `reply` (op "commit" or "draft") before it is sent. Counts opened sessions."""

    def __init__(self, identity: common_pb2.ModelIdentity, block_size: int):
        self.identity, self.block_size = identity, block_size
        self.script: Script | None = None
        self.sessions = 0

    async def Info(self, request, context):
        return self.identity

    async def Session(self, request_iterator, context):
        self.sessions += 1
        async for req in request_iterator:
            op = req.WhichOneof("op")
            if op == "commit":
                reply = drafter_pb2.DrafterResponse(
                    committed_through=req.commit.first_position + req.commit.rows.shape[0] - 1)
            else:
                reply = drafter_pb2.DrafterResponse(
                    tokens=[GOOD_TOKEN] * self.block_size, confidence_logits=[2.0] * self.block_size,
                    committed_through=req.draft.seed_position)
            reply.session_tag = req.session_tag
            if self.script is not None:
                self.script(op, req, reply)
            yield reply


def _drafts(tokens=None, conf=None) -> Script:
    """A script replacing every draft reply's tokens and/or confidence logits."""
    def script(op, req, reply):
        if op == "draft":
            if tokens is not None:
                reply.ClearField("tokens")
                reply.tokens.extend(tokens)
            if conf is not None:
                reply.ClearField("confidence_logits")
                reply.confidence_logits.extend(conf)
    return script


def _field(op_name: str, **changes: Callable) -> Script:
    """A script that sets reply fields of `op_name` replies to f(request, reply)."""
    def script(op, req, reply):
        if op == op_name:
            for name, f in changes.items():
                setattr(reply, name, f(req, reply))
    return script


CFG = tiny_trunk().cfg
B, V, NOISE = CFG.dspark_block_size, CFG.vocab_size, CFG.dspark_noise_token_id
G = [GOOD_TOKEN] * B
BAD_REPLIES = {  # case: (script, the check it must fail)
    "id_at_vocab_size": (_drafts(tokens=[GOOD_TOKEN, V] + G[2:]), "token_range"),
    "id_int32_max": (_drafts(tokens=G[:3] + [2**31 - 1] + G[4:]), "token_range"),
    "id_minus_one": (_drafts(tokens=[-1] + G[1:]), "token_range"),
    "nan_confidence": (_drafts(conf=[1.0, math.nan] + [1.0] * (B - 2)), "confidence_finite"),
    "inf_confidence": (_drafts(conf=[math.inf] * B), "confidence_finite"),
    "fewer_confidences": (_drafts(conf=[1.0, 1.0]), "confidence_count"),
    "more_confidences": (_drafts(conf=[1.0] * (B + 1)), "confidence_count"),
    "more_tokens_than_block": (_drafts(tokens=[GOOD_TOKEN] * 40, conf=[3.0] * 40), "block_size"),
    "draft_of_another_session": (_field("draft", session_tag=lambda q, r: q.session_tag + 1), "session"),
    "commit_of_another_session": (_field("commit", session_tag=lambda q, r: q.session_tag + 1), "session"),
    "draft_of_another_position": (_field("draft", committed_through=lambda q, r: q.draft.seed_position + 1),
                                  "position"),
    "commit_of_another_position": (_field("commit", committed_through=lambda q, r: r.committed_through - 1),
                                   "position"),
}


def shifted_drafts(target: list[int]) -> Script:
    """A script whose drafts are always wrong but look sure: each drafted position gets the
    target's own token at that position plus one (mod vocab), with confidence logit 8.0.
    `target`: the prompt and the spec-off continuation (token ids by position)."""
    def script(op, req, reply):
        if op == "draft":  # the anchor sits at seed_position + 1; draft i predicts the next positions
            first = req.draft.seed_position + 2
            tokens = [(target[q] + 1) % CFG.vocab_size if q < len(target) else 0
                      for q in range(first, first + len(reply.tokens))]
            reply.ClearField("tokens")
            reply.tokens.extend(tokens)
            reply.ClearField("confidence_logits")
            reply.confidence_logits.extend([8.0] * len(tokens))
    return script


def fault_count(metrics: GatewayMetrics, reason: str, check: str = "none") -> float:
    """spec_decode_drafter_faults_total{reason, check} as the Prometheus endpoint would show it."""
    return sum(s.value for fam in metrics.registry.collect() for s in fam.samples
               if s.name == "spec_decode_drafter_faults_total"
               and s.labels.get("reason") == reason and s.labels.get("check") == check)


def failover_count(metrics: GatewayMetrics) -> float:
    return sum(s.value for fam in metrics.registry.collect() for s in fam.samples
               if s.name == "spec_decode_drafter_failovers_total")


@dataclass
class Rig:
    """A verifier, the scripted drafter and a gateway (sequential verify, with metrics)."""

    verifier: RunningServer
    drafter: RunningServer
    scripted: ScriptedDrafter
    gateway: RunningServer
    backends: object
    metrics: GatewayMetrics
    channel: grpc.aio.Channel
    stub: gateway_pb2_grpc.GatewayStub
    off: object = None  # the spec-off Generation of PROMPT (MAX_TOKENS tokens)

    async def stats(self) -> dict:
        return json.loads((await self.stub.Stats(gateway_pb2.StatsRequest(), timeout=10)).json)

    async def close(self) -> None:
        await self.channel.close()
        await self.gateway.stop(0)
        await self.backends.close()
        await self.drafter.stop(0)
        await self.verifier.stop(0)
        self.metrics.close()


async def _start_rig(**settings) -> Rig:
    engine = verifier_engine(tiny_trunk(), BackendSettings())
    verifier = await start_verifier(engine)
    identity = verifier_identity(engine)
    identity.role, identity.confidence_head, identity.drafter_kind = "drafter", True, "scripted"
    scripted = ScriptedDrafter(identity, CFG.dspark_block_size)
    drafter = await start_server("dspark.v1.Drafter",
                                 lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(scripted, s))
    metrics = GatewayMetrics()
    values = dict(verifier_target=f"127.0.0.1:{verifier.port}", drafter_target=f"127.0.0.1:{drafter.port}",
                  verify_mode="sequential", cost_mode="configured", startup_timeout_s=10.0)
    values.update(settings)
    gw, _, backends = await start_gateway(GatewaySettings(**values), GateConfig(), metrics=metrics)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}", options=channel_options())
    return Rig(verifier, drafter, scripted, gw, backends, metrics, channel, gateway_pb2_grpc.GatewayStub(channel))


@pytest.fixture(scope="module")
def rig():
    loop = service_loop()
    r = loop.run(_start_rig())
    r.off = loop.run(collect(r.stub, gen_request(PROMPT, max_tokens=MAX_TOKENS, spec="off")))
    yield r
    loop.run(r.close())


# ---------------------------------------------------------------------------- bad replies
def test_well_formed_scripted_replies_are_used(rig):
    """The harness itself: well-formed replies are verified, nothing counts as a fault."""
    rig.scripted.script = None
    before = fault_count(rig.metrics, "invalid_reply", "token_range")
    gen = service_loop().run(collect(rig.stub, gen_request(PROMPT, max_tokens=MAX_TOKENS, spec="always")))
    assert gen.token_ids == rig.off.token_ids
    assert gen.stats.submitted > 0 and gen.stats.drafted > 0
    assert not gen.stats.drafter_failed and gen.stats.drafter_failovers == 0
    assert fault_count(rig.metrics, "invalid_reply", "token_range") == before


def test_a_draft_of_the_noise_token_is_valid_since_the_target_may_emit_it(rig):
    """The verifier reserves no id: the random tiny target itself emits its noise id."""
    rig.scripted.script = _drafts(tokens=[NOISE] * B)
    before = fault_count(rig.metrics, "invalid_reply", "reserved_token")
    try:
        gen = service_loop().run(collect(rig.stub, gen_request(PROMPT, max_tokens=MAX_TOKENS, spec="always")))
    finally:
        rig.scripted.script = None
    assert gen.token_ids == rig.off.token_ids
    assert gen.stats.submitted > 0 and not gen.stats.drafter_failed
    assert fault_count(rig.metrics, "invalid_reply", "reserved_token") == before


@pytest.mark.parametrize("case", sorted(BAD_REPLIES))
@pytest.mark.parametrize("spec", ["always", "gated"])
def test_a_bad_drafter_reply_fails_over_then_decodes_plainly_with_the_off_output(rig, case, spec):
    script, check = BAD_REPLIES[case]
    rig.scripted.script = script

    async def run():
        before = (fault_count(rig.metrics, "invalid_reply", check), failover_count(rig.metrics),
                  (await rig.stats())["drafter_failures"])
        gen = await collect(rig.stub, gen_request(PROMPT, max_tokens=MAX_TOKENS, spec=spec))
        after = (fault_count(rig.metrics, "invalid_reply", check), failover_count(rig.metrics),
                 (await rig.stats())["drafter_failures"])
        return gen, before, after

    try:
        gen, before, after = service_loop().run(run())
    finally:
        rig.scripted.script = None
    assert gen.token_ids == rig.off.token_ids and gen.final.text == rig.off.final.text
    assert (gen.finish_reason, gen.final.usage.completion_tokens) == ("length", MAX_TOKENS)
    # The first session and both replacements (DSPARK_DRAFTER_FAILOVERS = 2) got a bad reply:
    # three faults. A replacement whose priming commit is answered badly never takes over.
    failovers = 0 if case.startswith("commit") else 2
    assert gen.stats.drafter_failed and gen.stats.drafter_failovers == failovers
    assert (gen.stats.drafted, gen.stats.submitted) == (0, 0)  # nothing of a bad reply is used
    assert gen.stats.plain_rounds == gen.stats.rounds
    assert after[0] - before[0] == 3
    assert after[1] - before[1] == failovers
    assert after[2]["invalid_reply"][check] - before[2]["invalid_reply"][check] == 3
    assert after[2]["failures"]["invalid_reply"] - before[2]["failures"]["invalid_reply"] == 3
    assert (after[2]["failovers"] - before[2]["failovers"], after[2]["plain_generations"]
            - before[2]["plain_generations"]) == (failovers, 1)


def test_without_failovers_a_bad_reply_means_plain_decode_at_once():
    loop = service_loop()
    r = loop.run(_start_rig(drafter_failovers=0))
    r.scripted.script = BAD_REPLIES["nan_confidence"][0]
    try:
        off = loop.run(collect(r.stub, gen_request(PROMPT, max_tokens=MAX_TOKENS, spec="off")))
        gen = loop.run(collect(r.stub, gen_request(PROMPT, max_tokens=MAX_TOKENS, spec="always")))
        stats = loop.run(r.stats())
        counted = fault_count(r.metrics, "invalid_reply", "confidence_finite")
    finally:
        loop.run(r.close())
    assert gen.token_ids == off.token_ids
    assert gen.stats.drafter_failed and gen.stats.drafter_failovers == 0
    assert r.scripted.sessions == 1
    assert stats["drafter_failures"]["invalid_reply"]["confidence_finite"] == 1
    assert counted == 1


# ---------------------------------------------------------------------------- generations that cannot draft
@pytest.mark.parametrize("max_tokens", [1, 2])
def test_a_generation_that_cannot_draft_opens_no_drafter_session(rig, max_tokens):
    rig.scripted.script = None
    before = rig.scripted.sessions
    gen = service_loop().run(collect(rig.stub, gen_request(PROMPT, max_tokens=max_tokens, spec="always")))
    assert gen.token_ids == rig.off.token_ids[:max_tokens]
    assert rig.scripted.sessions == before
    assert not gen.stats.drafter_failed and gen.stats.rounds == max_tokens - 1


def test_a_one_token_request_with_the_drafter_down_reports_no_drafter_failure():
    hole = socket.socket()  # bound, never listening: connections to it are refused
    hole.bind(("127.0.0.1", 0))

    async def scenario():
        verifier = await start_verifier(verifier_engine(tiny_trunk(), BackendSettings()))
        settings = GatewaySettings(verifier_target=f"127.0.0.1:{verifier.port}",
                                   drafter_target=f"127.0.0.1:{hole.getsockname()[1]}", verify_mode="sequential",
                                   startup_timeout_s=1.0)
        gw, _, backends = await start_gateway(settings, GateConfig())
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as ch:
                stub = gateway_pb2_grpc.GatewayStub(ch)
                return (await collect(stub, gen_request(PROMPT, max_tokens=1, spec="always")),
                        await collect(stub, gen_request(PROMPT, max_tokens=6, spec="always")))
        finally:
            await gw.stop(0)
            await backends.close()
            await verifier.stop(0)

    try:
        one, six = service_loop().run(scenario())
    finally:
        hole.close()
    assert len(one.token_ids) == 1 and not one.stats.drafter_failed
    assert six.stats.drafter_failed  # a generation that drafts does notice the dead drafter


# ---------------------------------------------------------------------------- restarts
async def _load_while_down(stub, req: gateway_pb2.GenerateRequest) -> list:
    """Generate every 0.2 s for DOWN_S seconds, as clients under load would, so the gateway's
    channel keeps trying the dead backend and its reconnect backoff grows. Returns each
    outcome: the Generation, or the AioRpcError the call ended with."""
    outcomes, deadline = [], time.monotonic() + DOWN_S
    while time.monotonic() < deadline:
        try:
            outcomes.append(await collect(stub, req, 30))
        except grpc.aio.AioRpcError as err:
            outcomes.append(err)
        await asyncio.sleep(0.2)
    return outcomes


async def _first_speculating(stub, started: float) -> tuple[float, gateway_pb2.SpecStats]:
    """Generate until one generation speculates; (seconds from `started` to that generation's
    start, its stats). Gives up after 10 * RESTART_BOUND_S."""
    while True:
        t = time.monotonic()
        gen = await collect(stub, gen_request(PROMPT, max_tokens=8, spec="always"), 30)
        if gen.stats.submitted > 0 and not gen.stats.drafter_failed:
            return t - started, gen.stats
        if t - started > 10 * RESTART_BOUND_S:
            raise AssertionError(f"no speculating generation within {10 * RESTART_BOUND_S:g} s of the restart")
        await asyncio.sleep(0.05)


def test_a_restarted_drafter_is_used_again_within_the_reconnect_bound():
    engine = drafter_engine(tiny_trunk(), oracle=True, settings=BackendSettings())

    async def scenario():
        verifier = await start_verifier(verifier_engine(tiny_trunk(), BackendSettings()))
        drafter = await start_drafter(engine)
        port = drafter.port
        settings = GatewaySettings(verifier_target=f"127.0.0.1:{verifier.port}", drafter_target=f"127.0.0.1:{port}",
                                   verify_mode="sequential", startup_timeout_s=10.0)
        gw, _, backends = await start_gateway(settings, GateConfig())
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as ch:
                stub = gateway_pb2_grpc.GatewayStub(ch)
                req = gen_request(PROMPT, max_tokens=8, spec="always")
                before = await collect(stub, req)
                await drafter.stop(0)
                down = await _load_while_down(stub, req)
                drafter = await start_drafter(engine, port=port)
                waited, stats = await _first_speculating(stub, time.monotonic())
                return before, down, waited, stats
        finally:
            await gw.stop(0)
            await backends.close()
            await drafter.stop(0)
            await verifier.stop(0)

    before, down, waited, stats = service_loop().run(scenario())
    assert before.stats.accepted > 0 and not before.stats.drafter_failed
    assert down and all(g.stats.drafter_failed and g.token_ids == before.token_ids for g in down)
    assert stats.accepted > 0
    assert waited <= RESTART_BOUND_S, f"speculation resumed {waited:.2f} s after the restart"
    assert MAX_RECONNECT_BACKOFF_MS * 1.2 / 1000 < RESTART_BOUND_S


def test_a_restarted_verifier_serves_new_generations_within_the_reconnect_bound():
    async def scenario():
        verifier = await start_verifier(verifier_engine(tiny_trunk(), BackendSettings()))
        port = verifier.port
        settings = GatewaySettings(verifier_target=f"127.0.0.1:{port}", drafter_target="",
                                   verify_mode="sequential", startup_timeout_s=10.0)
        gw, _, backends = await start_gateway(settings, GateConfig())
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as ch:
                stub = gateway_pb2_grpc.GatewayStub(ch)
                req = gen_request(PROMPT, max_tokens=6, spec="off")
                before = await collect(stub, req)
                await verifier.stop(0)
                down = await _load_while_down(stub, req)
                verifier = await start_verifier(verifier_engine(tiny_trunk(), BackendSettings()), port=port)
                started = time.monotonic()
                while True:
                    t = time.monotonic()
                    try:
                        after = await collect(stub, req, 30)
                        return before, down, after, t - started
                    except grpc.aio.AioRpcError as err:
                        if err.code() != grpc.StatusCode.UNAVAILABLE or t - started > 10 * RESTART_BOUND_S:
                            raise
                    await asyncio.sleep(0.05)
        finally:
            await gw.stop(0)
            await backends.close()
            await verifier.stop(0)

    before, down, after, waited = service_loop().run(scenario())
    assert down and all(e.code() == grpc.StatusCode.UNAVAILABLE and e.details().startswith("verifier:")
                        for e in down)
    assert after.token_ids == before.token_ids
    assert waited <= RESTART_BOUND_S, f"the verifier was used again {waited:.2f} s after the restart"


# ---------------------------------------------------------------------------- the checks and the budget
def test_draft_check_names_the_rule_and_the_value():
    check = DraftCheck(vocab_size=512, block_size=5, reserved_ids={7})
    check(DraftReply([1, 2, 3], [0.5, -1.0, 2.0], 0.0))
    check(DraftReply([], None, 0.0))
    cases = [(DraftReply([1, 512], None, 0.0), "token_range", "token id 512 at index 1 outside [0, vocab_size=512)"),
             (DraftReply([1, 7], None, 0.0), "reserved_token", "token id 7 at index 1 is reserved"),
             (DraftReply([1] * 6, None, 0.0), "block_size", "6 tokens, block_size is 5"),
             (DraftReply([1, 2], [0.1], 0.0), "confidence_count", "1 confidence logits for 2 tokens"),
             (DraftReply([1, 2], [0.1, -math.inf], 0.0), "confidence_finite", "confidence logit -inf at index 1")]
    for reply, rule, needle in cases:
        with pytest.raises(InvalidDraftReply) as err:
            check(reply)
        assert err.value.check == rule and needle in str(err.value), (rule, str(err.value))
        assert failure_reason(err.value) == "invalid_reply" and may_fail_over(err.value)


def test_drafter_supply_hands_out_the_first_session_and_the_failover_budget():
    opened = []
    supply = DrafterSupply(lambda: opened.append(len(opened)) or len(opened), failovers=2)
    assert [supply.open() for _ in range(4)] == [1, 2, 3, None]
    assert DrafterSupply.of("only").open() == "only"
    with pytest.raises(ValueError, match="failovers=-1"):
        DrafterSupply(lambda: None, failovers=-1)
