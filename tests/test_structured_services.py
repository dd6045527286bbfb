"""Structured output through the services in exact numerics (docs/structured.md): every
constrained output is valid, and constrained speculative output equals constrained plain
decode token for token, greedy and seeded, with drafters that propose forbidden, grammatical
but rejected, and accepted tokens, and through a drafter stopped mid-generation.

Real servers on port 0 (verifier with DSPARK_VERIFY_NUMERICS=exact, live oracle drafter
corrupting every third slot or the DSpark drafter, gateway). The 200-generation grid is
`slow`; a fast subset runs in CI."""

from __future__ import annotations

import functools
import itertools
import json

import jsonschema
import pytest

from services.app import (drafter_engine, load_trunk, start_drafter, start_verifier, verifier_engine)
from services.common.settings import BackendSettings
from services.gateway.gate import GateConfig
from structured_schemas import SCHEMAS
from services_fixtures import ServiceStack, gen_request, service_loop, tiny_draft_module, tiny_trunk

MAX_TOKENS = 200  # every schema bounds its output well inside this (tests/structured_schemas.py)


@functools.lru_cache(maxsize=None)
def exact_trunk():
    return load_trunk(None, verify_numerics="exact")


async def _astack(drafter: str) -> ServiceStack:
    v_engine = verifier_engine(exact_trunk(), BackendSettings(verify_numerics="exact"))
    verifier = await start_verifier(v_engine)
    d_engine = (drafter_engine(tiny_trunk(), oracle=True, corrupt_every=3) if drafter == "oracle"
                else drafter_engine(tiny_draft_module()))
    d_server = await start_drafter(d_engine)
    return ServiceStack(service_loop(), drafter, v_engine, d_engine, verifier, d_server, GateConfig(), None)


@pytest.fixture(scope="module")
def oracle_exact():
    stack = service_loop().run(_astack("oracle"), 60)
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def dspark_exact():
    stack = service_loop().run(_astack("dspark"), 60)
    yield stack
    stack.close()


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


@pytest.mark.slow
def test_validity_and_exactness_grid_over_twenty_schemas(oracle_exact, dspark_exact):
    """>= 200 generations: 21 schemas x T in {0, 0.7, 1.0} x {off, always, gated}, batched
    (oracle drafter), plus sequential under the DSpark drafter for the first 8 schemas."""
    n = len(run_grid(oracle_exact, SCHEMAS, (0.0, 0.7, 1.0), ("always", "gated")))
    n += len(run_grid(dspark_exact, SCHEMAS[:8], (0.0, 0.7), ("always",), ("sequential",)))
    assert n >= 200, n
