"""Sampling through the three services (real servers on port 0, real channels, the tiny model).

What a request gets must not depend on whether, or how, it was speculated: under the coupled
rule with exact verifier numerics, a (prompt, parameters, seed) gives one token sequence with
speculation off, always-k, gated, an oracle drafter, a drafter killed mid-generation and 16
concurrent streams; logprobs with speculation on equal those with it off, bitwise. Both rules
reproduce per seed; a request without a seed gets one drawn and returned; bad values are
INVALID_ARGUMENT naming the field.

The full grid (20 prompts x 3 seeds x T in {0.7, 1.0}) is marked slow; CI runs a subset of
the same code.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import grpc
import pytest

from dspark_proto.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services import app
from services.common.server import RunningServer, channel_options
from services.common.settings import BackendSettings, GatewaySettings
from services.gateway.gate import GateConfig
from services_fixtures import SPEC, Generation, collect, service_loop, tiny_draft_module

PROMPTS = tuple(f"{w} {i}" for i, w in enumerate(
    ["def f(x):", "the cat", "1 + 1 =", "import os", "hello", "for i in", "class A:", "# note", "x = [",
     "while True", "print(", "a b c", "return", "if x >", "lambda", "0 1 2", "yield", "try:", "with open", "SELECT"]))
SEEDS = (11, 2024, 987654321)
TEMPERATURES = (0.7, 1.0)
MAX_TOKENS = 12
RULES = {None: common_pb2.SAMPLING_RULE_DEFAULT, "coupled": common_pb2.SAMPLING_RULE_COUPLED,
         "rejection": common_pb2.SAMPLING_RULE_REJECTION}


def sampled(prompt: str, spec: str = "always", *, temperature: float = 1.0, seed: int | None = 7,
            top_p: float = 0.9, rule: str | None = None, logprobs: int = 0,
            max_tokens: int = MAX_TOKENS) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, spec=SPEC[spec], ignore_eos=True,
                                      temperature=temperature, top_p=top_p, logprobs=logprobs,
                                      sampling_rule=RULES[rule])
    if seed is not None:
        req.seed = seed
    return req


@dataclass
class SamplingStack:
    """An exact-numerics verifier, a DSpark drafter and a live oracle drafter, and a gateway
    over each drafter (batched verify, pinned gate costs)."""

    servers: list[RunningServer] = field(default_factory=list)
    closers: list = field(default_factory=list)
    stubs: dict[str, gateway_pb2_grpc.GatewayStub] = field(default_factory=dict)
    verifier_target: str = ""
    backend: BackendSettings = field(default_factory=lambda: BackendSettings(verify_numerics="exact"))

    async def gateway(self, name: str, drafter_target: str, **overrides) -> gateway_pb2_grpc.GatewayStub:
        settings = GatewaySettings(verifier_target=self.verifier_target, drafter_target=drafter_target,
                                   verify_mode="batched", **overrides)
        server, _, backends = await app.start_gateway(settings, GateConfig())
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=channel_options())
        self.servers.append(server)
        self.closers += [channel.close, backends.close]
        self.stubs[name] = gateway_pb2_grpc.GatewayStub(channel)
        return self.stubs[name]

    async def dspark_drafter(self) -> RunningServer:
        server = await app.start_drafter(app.drafter_engine(tiny_draft_module(), settings=self.backend))
        self.servers.append(server)
        return server

    async def close(self) -> None:
        for close in self.closers:
            await close()
        for server in reversed(self.servers):
            await server.stop(0)


async def _start() -> SamplingStack:
    stack = SamplingStack()
    trunk = app.load_trunk(None, verify_numerics="exact")
    verifier = await app.start_verifier(app.verifier_engine(trunk, stack.backend))
    stack.servers.append(verifier)
    stack.verifier_target = f"127.0.0.1:{verifier.port}"
    dspark = await stack.dspark_drafter()
    oracle = await app.start_drafter(app.drafter_engine(app.load_trunk(None), oracle=True, settings=stack.backend))
    stack.servers.append(oracle)
    await stack.gateway("dspark", f"127.0.0.1:{dspark.port}")
    await stack.gateway("oracle", f"127.0.0.1:{oracle.port}")
    await stack.gateway("rejection", f"127.0.0.1:{dspark.port}", sampling_rule="rejection")
    return stack


@pytest.fixture(scope="module")
def stack():
    loop = service_loop()
    s = loop.run(_start(), 120)
    yield s
    loop.run(s.close(), 60)


def run(coro, timeout_s: float = 300):
    return service_loop().run(coro, timeout_s)


async def _killed_drafter_run(stack: SamplingStack, req: gateway_pb2.GenerateRequest) -> Generation:
    """`req` through a gateway whose own DSpark drafter is stopped after the first streamed message."""
    drafter = await stack.dspark_drafter()
    stub = await stack.gateway(f"killed-{drafter.port}", f"127.0.0.1:{drafter.port}", drafter_failovers=1)
    gen = Generation()
    async for msg in stub.Generate(req, timeout=60):
        gen.add(msg)
        if len(gen.chunks) == 1:
            await drafter.stop(0)
    return gen


async def _outputs(stack: SamplingStack, prompt: str, seed: int, temperature: float) -> dict[str, list[int]]:
    """One (prompt, seed, T) through every path but concurrency: the token ids of each."""
    def req(spec: str) -> gateway_pb2.GenerateRequest:
        return sampled(prompt, spec, temperature=temperature, seed=seed)
    dspark, oracle = stack.stubs["dspark"], stack.stubs["oracle"]
    out = {"off": await collect(dspark, req("off")), "always": await collect(dspark, req("always")),
           "gated": await collect(dspark, req("gated")), "oracle": await collect(oracle, req("always")),
           "killed": await _killed_drafter_run(stack, req("always"))}
    assert out["oracle"].stats.accepted > 0  # the oracle proposes the target's own keyed choice
    return {name: g.token_ids for name, g in out.items()}


def _check_grid(stack: SamplingStack, prompts, seeds, temperatures) -> None:
    cases = [(p, s, t) for p in prompts for s in seeds for t in temperatures]
    plain = {}
    for prompt, seed, t in cases:
        out = run(_outputs(stack, prompt, seed, t))
        assert len(out["off"]) == MAX_TOKENS
        for name, ids in out.items():
            assert ids == out["off"], (prompt, seed, t, name)
        plain[prompt, seed, t] = out["off"]

    streams = [cases[i % len(cases)] for i in range(16)]  # 16 at once (a case may repeat)

    async def concurrent():
        reqs = [sampled(p, "always", temperature=t, seed=s) for p, s, t in streams]
        return await asyncio.gather(*(collect(stack.stubs["dspark"], r) for r in reqs))
    together = run(concurrent())
    assert [g.token_ids for g in together] == [plain[c] for c in streams]


def test_coupled_output_is_one_sequence_whatever_the_speculation(stack):
    """CI subset of the grid below: 2 prompts x 2 seeds x both temperatures."""
    _check_grid(stack, PROMPTS[:2], SEEDS[:2], TEMPERATURES)


@pytest.mark.slow
def test_coupled_output_is_one_sequence_whatever_the_speculation_full_grid(stack):
    """20 prompts x 3 seeds x T in {0.7, 1.0}, top-p 0.9, exact numerics."""
    _check_grid(stack, PROMPTS, SEEDS, TEMPERATURES)


@pytest.mark.parametrize("rule", ["coupled", "rejection"])
def test_same_seed_twice_gives_the_same_output(stack, rule):
    stub = stack.stubs["rejection" if rule == "rejection" else "dspark"]
    a = run(collect(stub, sampled("the cat 1", rule=rule, seed=5, max_tokens=16)))
    b = run(collect(stub, sampled("the cat 1", rule=rule, seed=5, max_tokens=16)))
    other = run(collect(stub, sampled("the cat 1", rule=rule, seed=6, max_tokens=16)))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 16
    assert a.final.seed == 5
    assert other.token_ids != a.token_ids  # the seed matters (16 tokens at T=1 from 512)
    assert a.stats.submitted > 0  # speculation ran


def test_rejection_rule_is_chosen_per_request_and_by_setting(stack):
    """A request that leaves the rule unset on the gateway set to rejection, and one asking
    for rejection on the gateway left at coupled, sample with the same rule: they agree."""
    by_setting = run(collect(stack.stubs["rejection"], sampled("hello 4", seed=9)))
    asked = run(collect(stack.stubs["dspark"], sampled("hello 4", seed=9, rule="rejection")))
    coupled = run(collect(stack.stubs["rejection"], sampled("hello 4", seed=9, rule="coupled")))
    default = run(collect(stack.stubs["dspark"], sampled("hello 4", seed=9)))
    assert asked.token_ids == by_setting.token_ids
    assert coupled.token_ids == default.token_ids != asked.token_ids


@pytest.mark.parametrize("rule", ["coupled", "rejection"])
def test_a_drawn_seed_is_returned_and_reproduces_the_output(stack, rule):
    stub = stack.stubs["dspark"]
    first = run(collect(stub, sampled("import os 3", rule=rule, seed=None, max_tokens=16)))
    seed = first.final.seed
    assert seed > 0  # drawn from 2**63 values
    again = run(collect(stub, sampled("import os 3", rule=rule, seed=seed, max_tokens=16)))
    assert again.token_ids == first.token_ids and again.final.seed == seed
    other = run(collect(stub, sampled("import os 3", rule=rule, seed=None, max_tokens=16)))
    assert other.final.seed != seed


def test_logprobs_with_speculation_equal_those_without_bitwise(stack):
    async def both():
        stub = stack.stubs["oracle"]
        off = [m async for m in stub.Generate(sampled("x = [ 8", "off", logprobs=5, seed=3), timeout=60)]
        on = [m async for m in stub.Generate(sampled("x = [ 8", "always", logprobs=5, seed=3), timeout=60)]
        return off, on
    off, on = run(both())
    records = {name: [lp for m in msgs for lp in m.logprobs] for name, msgs in (("off", off), ("on", on))}
    tokens = {name: [t for m in msgs for t in m.token_ids] for name, msgs in (("off", off), ("on", on))}
    assert tokens["on"] == tokens["off"] and len(records["off"]) == MAX_TOKENS
    assert [r.token_id for r in records["off"]] == tokens["off"]  # one record per streamed token
    assert records["on"] == records["off"]  # protobuf equality: every float bitwise
    assert sum(m.spec_stats.accepted for m in on) > 0
    for r in records["off"]:
        assert len(r.top_ids) == 5 and list(r.top_logprobs) == sorted(r.top_logprobs, reverse=True)
        assert r.logprob <= 0 and r.logprob <= r.top_logprobs[0]
        # raw logprobs, before temperature and top-p: the top-5 mass of a 512-token model is < 1
        assert sum(math.exp(v) for v in r.top_logprobs) < 1


def test_greedy_requests_are_unchanged_and_ignore_the_seed(stack):
    stub = stack.stubs["dspark"]
    plain = run(collect(stub, gateway_pb2.GenerateRequest(prompt="def f(x): 0", max_tokens=MAX_TOKENS,
                                                          spec=SPEC["off"], ignore_eos=True)))
    seeded = run(collect(stub, sampled("def f(x): 0", "always", temperature=0.0, seed=99)))
    assert seeded.token_ids == plain.token_ids
    assert plain.final.seed == 0 and seeded.final.seed == 99


@pytest.mark.parametrize("fields, words", [
    ({"temperature": math.nan}, "temperature=nan"),
    ({"temperature": -0.5}, "temperature=-0.5"),
    ({"top_p": 1.5}, "top_p=1.5"),
    ({"top_p": -0.1}, "top_p=-0.1"),
    ({"top_k": -1}, "top_k=-1"),
    ({"min_p": 2.0}, "min_p=2"),
    ({"min_p": -0.25}, "min_p=-0.25"),
    ({"logprobs": 21}, "logprobs=21"),
    ({"logprobs": -1}, "logprobs=-1"),
    ({"seed": 2 ** 63}, f"seed={2 ** 63}"),
    ({"sampling_rule": 7}, "sampling_rule=7"),
])
def test_bad_sampling_values_are_invalid_argument_naming_the_field(stack, fields, words):
    req = gateway_pb2.GenerateRequest(prompt="hi", max_tokens=4, **({"temperature": 1.0} | fields))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(collect(stack.stubs["dspark"], req))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in err.value.details(), err.value.details()
