"""Structured output through the services in exact numerics (docs/structured.md): every
constrained output is valid, and constrained speculative output equals constrained plain
decode token for token, greedy and seeded, with drafters that propose forbidden, grammatical
but rejected, and accepted tokens, and through a drafter stopped mid-generation.

Real servers on port 0 (verifier with DSPARK_VERIFY_NUMERICS=exact, live oracle drafter
corrupting every third slot or the DSpark drafter, gateway). The 200-generation grid is
`slow`; a fast subset runs in CI."""

from __future__ import annotations

import itertools
import json

import jsonschema
import pytest

from services.common.settings import BackendSettings
from services.gateway.gate import GateConfig
from structured_schemas import SCHEMAS
from services.app import drafter_engine, start_verifier, verifier_engine
from services_fixtures import (ServiceStack, collect, dspark_exact, exact_trunk, gen_request,  # noqa: F401 (fixtures)
                               oracle_exact, service_loop, tiny_trunk)

MAX_TOKENS = 200  # every schema bounds its output well inside this (tests/structured_schemas.py)


def schema_request(schema: dict, spec: str, temperature: float = 0.0, seed: int = 7, prompt: str = "json:"):
    req = gen_request(prompt, max_tokens=MAX_TOKENS, spec=spec, ignore_eos=False, temperature=temperature)
    req.constraint.json_schema = json.dumps(schema)
    if temperature > 0:
        req.seed = seed
    return req


def check_valid(gen, schema: dict) -> dict:
    """The final text parses and validates against `schema`, and the generation ended on eos."""
    assert gen.final.finish_reason == "stop" and gen.final.matched_token_id == 1, gen.final
    value = json.loads(gen.final.text)
    jsonschema.validate(value, schema)
    return value


def run_grid(stack: ServiceStack, schemas, temperatures, specs, modes=("batched",)) -> list:
    """For every (schema, temperature, mode): the plain output is valid and every speculative
    spec gives the same tokens. Returns the generations run."""
    n = []
    for (i, schema), t, mode in itertools.product(enumerate(schemas), temperatures, modes):
        plain = stack.generate(schema_request(schema, "off", t, seed=i), mode)
        check_valid(plain, schema)
        n.append(plain)
        for spec in specs:
            spec_gen = stack.generate(schema_request(schema, spec, t, seed=i), mode)
            assert spec_gen.token_ids == plain.token_ids, (i, t, spec, mode, spec_gen.final.text, plain.final.text)
            n.append(spec_gen)
    return n


def test_constrained_speculation_equals_constrained_plain_greedy_and_seeded(oracle_exact):
    """Batched verify in exact numerics. The oracle drafts inside the grammar with every third
    slot corrupted: forbidden drafts (mismatches), grammatical drafts the target rejects, and
    accepted ones."""
    gens = run_grid(oracle_exact, SCHEMAS[2:3], (0.0, 0.7), ("always",))
    stats = [g.final.spec_stats for g in gens[1::2]]
    assert sum(s.accepted for s in stats) > 0 and sum(s.submitted - s.accepted for s in stats) > 0


@pytest.mark.slow
def test_dspark_drafter_sequential_and_gated_equal_plain(dspark_exact):
    assert len(run_grid(dspark_exact, SCHEMAS[3:5], (0.0, 1.0), ("always", "gated"), ("batched", "sequential"))) == 24


def test_regex_choice_and_grammar_constraints_end_in_their_language(oracle_exact):
    cases = [("regex", "[a-z]{2,4}-[0-9]{2}", lambda t: t[-3] == "-" and t[-2:].isdigit()),
             ("grammar", 'root ::= "(" item ("," item)? ")"\nitem ::= [0-9]', lambda t: t[0] == "(" and t[-1] == ")")]
    for kind, spec, check in cases:
        outs = []
        for mode in ("off", "always"):
            req = gen_request("x", max_tokens=MAX_TOKENS, spec=mode, ignore_eos=False)
            setattr(req.constraint, kind, spec)
            outs.append(oracle_exact.generate(req, "batched"))
        assert outs[0].token_ids == outs[1].token_ids and check(outs[0].final.text), outs[0].final.text
    req = gen_request("x", max_tokens=MAX_TOKENS, spec="always", ignore_eos=False)
    req.constraint.choice.choices.extend(["alpha", "beta", "gamma"])
    assert oracle_exact.generate(req, "batched").final.text in ("alpha", "beta", "gamma")


def test_jump_forward_commits_forced_runs_and_output_equals_plain_decode(oracle_exact):
    """Jump-forward on (the stack's gateway) against a gateway that never submits forced runs
    (true plain decode): the same tokens, greedy (spec off and always), seeded (off) and
    seeded with logits controls beside the grammar (repetition penalty, a logit bias), in
    fewer rounds off; every forced token was accepted (the verifier's grammar forces it too)."""
    async def plain_gateway():
        return await oracle_exact.start_gateway("batched", jump_forward=False)

    def request(spec: str, t: float, controls: bool):
        req = schema_request(SCHEMAS[0], spec, t, seed=3)
        if controls:
            req.repetition_penalty = 1.5
            req.logit_bias[ord("a") + 2] = 4.0
        return req

    gw = service_loop().run(plain_gateway())
    try:
        for t, controls in ((0.0, False), (0.7, False), (0.7, True)):
            plain = service_loop().run(collect(gw.stub, request("off", t, controls)), 120)
            check_valid(plain, SCHEMAS[0])
            assert plain.final.spec_stats.forced_rounds == 0
            for spec in ("off", "always") if t == 0 else ("off",):
                jumped = oracle_exact.generate(request(spec, t, controls), "batched")
                assert jumped.token_ids == plain.token_ids, (t, controls, spec)
                st = jumped.final.spec_stats
                if spec == "off":
                    assert st.forced_rounds > 0 and st.forced_tokens >= st.forced_rounds
                    assert st.rounds == plain.final.spec_stats.rounds - st.forced_tokens
                    assert st.submitted == 0  # forced tokens are not drafts: acceptance figures stay the drafter's
    finally:
        service_loop().run(gw.close())


@pytest.mark.slow
def test_validity_and_exactness_grid_over_twenty_schemas(oracle_exact, dspark_exact):
    """>= 200 generations: 21 schemas x T in {0, 0.7, 1.0} x {off, always, gated}, batched
    (oracle drafter), plus sequential under the DSpark drafter for the first 8 schemas."""
    n = len(run_grid(oracle_exact, SCHEMAS, (0.0, 0.7, 1.0), ("always", "gated")))
    n += len(run_grid(dspark_exact, SCHEMAS[:8], (0.0, 0.7), ("always",), ("sequential",)))
    assert n >= 200, n


# ---------------------------------------------------------------------------- scripted and failing drafters
from dspark_proto.v1 import drafter_pb2_grpc, gateway_pb2_grpc  # noqa: E402
from services.app import start_gateway  # noqa: E402
from services.common.constraint import byte_vocab, make_constraint  # noqa: E402
from services.common.server import start_server  # noqa: E402
from services.common.settings import GatewaySettings  # noqa: E402
from services.drafter.servicer import DrafterServicer  # noqa: E402
from services.common.grammar import GrammarState  # noqa: E402
from services.verifier.servicer import verifier_identity  # noqa: E402
from test_drafter_faults import ScriptedDrafter  # noqa: E402

CHOICE_SCHEMA = SCHEMAS[14]  # nested object with an enum: forced keys and free strings


def grammatical_detours(target: list[int], schema: dict, prompt_len: int, vocab_size: int, block: int):
    """A drafter script whose every block is: the target's own token at the first drafted
    position, then a token the grammar allows there that is NOT the target's (rejected), then
    tokens the grammar allows after that detour. `target`: prompt + plain constrained output.
    Returns (script, commits seen)."""
    compiled = byte_vocab(vocab_size, 1).compile(make_constraint("json_schema", schema))
    commits = []

    def script(op, req, reply):
        if op == "commit":
            commits.append(req.commit)
            return
        first = req.draft.seed_position + 2  # position of the first draft
        state = GrammarState(compiled, vocab_size, 1)
        for t in target[prompt_len:first]:
            state.accept(t)
        tokens = []
        for j in range(block):
            q = first + j
            allowed = state.allowed().nonzero().flatten().tolist()
            want = target[q] if q < len(target) else 1
            pick = want if j == 0 else next((a for a in allowed if a != want), want)
            tokens.append(pick)
            state.accept(pick)
            if pick == 1:
                break
        reply.ClearField("tokens")
        reply.tokens.extend(tokens)
        reply.ClearField("confidence_logits")
        reply.confidence_logits.extend([4.0] * len(tokens))
    return script, commits


async def _close(gateway, backends, *servers) -> None:
    """Stop a gateway, its backend channels, then `servers` in order."""
    await gateway.stop(0)
    await backends.close()
    for server in servers:
        await server.stop(0)


def test_grammatical_then_rejected_drafts_never_advance_the_matcher():
    """A scripted drafter proposes, every round, one accepted token then grammatical tokens the
    target rejects: the output equals constrained plain decode (batched verify, exact numerics),
    and the priming commit carried the constraint."""
    async def run():
        engine = verifier_engine(exact_trunk(), BackendSettings(verify_numerics="exact"))
        verifier = await start_verifier(engine)
        identity = verifier_identity(engine)
        identity.role, identity.confidence_head, identity.drafter_kind = "drafter", True, "scripted"
        cfg = engine.cfg
        scripted = ScriptedDrafter(identity, cfg.dspark_block_size)
        drafter = await start_server("dspark.v1.Drafter",
                                     lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(scripted, s))
        gw, _, backends = await start_gateway(GatewaySettings(
            verifier_target=f"127.0.0.1:{verifier.port}", drafter_target=f"127.0.0.1:{drafter.port}",
            verify_mode="batched", cost_mode="configured", startup_timeout_s=10.0), GateConfig())
        try:
            import grpc
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as ch:
                stub = gateway_pb2_grpc.GatewayStub(ch)
                plain = await collect(stub, schema_request(CHOICE_SCHEMA, "off"))
                prompt = list(b"json:")
                target = [b + 2 for b in prompt] + plain.token_ids
                scripted.script, commits = grammatical_detours(target, CHOICE_SCHEMA, len(prompt), cfg.vocab_size,
                                                               cfg.dspark_block_size)
                spec = await collect(stub, schema_request(CHOICE_SCHEMA, "always"))
                return plain, spec, commits
        finally:
            await _close(gw, backends, drafter, verifier)

    plain, spec, commits = service_loop().run(run(), 300)
    check_valid(plain, CHOICE_SCHEMA)
    assert spec.token_ids == plain.token_ids
    st = spec.final.spec_stats
    assert st.accepted > 0 and st.submitted - st.accepted >= st.rounds - st.plain_rounds - 1  # a detour a round
    assert commits[0].HasField("constraint") and commits[0].constraint_first_position == len(b"json:")
    assert all(not c.HasField("constraint") for c in commits[1:])


class FailingOnce(DrafterServicer):
    """A real drafter (live oracle) whose `fail_at`-th draft reply, once, names another session:
    the gateway drops the session as failed and fails over to a new one, primed again with the
    constraint and every committed token."""

    fail_at = 3

    async def _handle(self, sid, request, received):
        response = await super()._handle(sid, request, received)
        if request.WhichOneof("op") == "draft":
            self.drafts = getattr(self, "drafts", 0) + 1
            if self.drafts == self.fail_at:
                response.session_tag += 1
        return response


def test_a_drafter_failing_mid_generation_re_primes_its_matcher_and_output_equals_plain(oracle_exact):
    async def run():
        servicer = FailingOnce(drafter_engine(tiny_trunk(), oracle=True))
        drafter = await start_server("dspark.v1.Drafter",
                                     lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, s))
        gw, _, backends = await start_gateway(GatewaySettings(
            verifier_target=oracle_exact.verifier_target, drafter_target=f"127.0.0.1:{drafter.port}",
            verify_mode="batched", cost_mode="configured", startup_timeout_s=10.0), GateConfig())
        try:
            import grpc
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as ch:
                stub = gateway_pb2_grpc.GatewayStub(ch)
                plain = await collect(stub, schema_request(SCHEMAS[2], "off"))
                before = servicer.controls is not None
                spec = await collect(stub, schema_request(SCHEMAS[2], "always"))
                return plain, spec, before
        finally:
            await _close(gw, backends, drafter)

    plain, spec, masking = service_loop().run(run(), 300)
    assert masking and spec.token_ids == plain.token_ids
    st = spec.final.spec_stats
    assert st.drafter_failovers == 1 and not st.drafter_failed
    # an uncorrupted oracle inside the grammar proposes exactly the target's tokens: after the
    # failover its re-primed matcher keeps every draft accepted
    assert st.accepted == st.submitted > 0
