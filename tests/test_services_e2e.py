"""End to end through the three gRPC services (in process, port 0, real channels).

* Output through the gateway equals the in-process scheduler's over the same engines, for
  spec off / always / gated, with the live oracle drafter and the DSpark drafter (random
  weights), with sequential and batched verify.
* With sequential verify, always and gated are token-identical to off; with the oracle
  drafter every verify round accepts its whole block and rounds < tokens.
* 8 concurrent generations equal their solo runs (sequential verify).
* Gateway Stats after generations equal the sum of their final spec_stats.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from services_fixtures import (block_size, collect, dspark_stack, gen_request, oracle_stack, spec_counts,  # noqa: F401
                               tiny_tokenizer)

SPECS = ("off", "always", "gated")
PROMPT = "the quick brown fox"
MAX_TOKENS = 20


@pytest.fixture(params=["oracle", "dspark"])
def stack(request, oracle_stack, dspark_stack):  # noqa: F811
    return oracle_stack if request.param == "oracle" else dspark_stack


@pytest.mark.parametrize("verify_mode", ["sequential", "batched"])
def test_gateway_output_equals_in_process_scheduler(stack, verify_mode):
    for spec in SPECS:
        req = gen_request(PROMPT, max_tokens=MAX_TOKENS, spec=spec)
        remote = stack.generate(req, verify_mode)
        local = stack.local_generate(req, verify_mode)
        assert remote.token_ids == local.token_ids, spec
        assert len(remote.token_ids) == MAX_TOKENS
        assert remote.finish_reason == local.finish_reason == "length"
        assert remote.final.text == local.final.text == tiny_tokenizer().decode(remote.token_ids)
        assert remote.streamed_text == remote.final.text
        assert remote.final.usage.completion_tokens == MAX_TOKENS
        assert remote.final.usage.prompt_tokens == len(PROMPT)
        assert spec_counts(remote.stats) == spec_counts(local.stats), spec
        if spec == "off":
            assert remote.stats.submitted == 0 and remote.stats.plain_rounds == MAX_TOKENS - 1
        else:
            assert remote.stats.drafted > 0 and not remote.stats.drafter_failed
    counts = stack.wait_idle()
    assert counts == dict.fromkeys(counts, 0)


def test_sequential_speculation_is_token_identical_to_off(stack):
    req = dict(max_tokens=MAX_TOKENS)
    off = stack.generate(gen_request("once upon a time", spec="off", **req))
    for spec in ("always", "gated"):
        spec_run = stack.generate(gen_request("once upon a time", spec=spec, **req))
        assert spec_run.token_ids == off.token_ids, spec
        assert spec_run.final.text == off.final.text


@pytest.mark.parametrize("spec", ["always", "gated"])
def test_oracle_rounds_accept_whole_blocks(oracle_stack, spec):  # noqa: F811
    gen = oracle_stack.generate(gen_request(PROMPT, max_tokens=25, spec=spec))
    s = gen.stats
    B = block_size()
    # 1 token from prefill, then 4 rounds of B drafts + bonus fill 25 tokens exactly
    assert len(gen.token_ids) == 25
    assert s.rounds == 4 < len(gen.token_ids)
    assert s.submitted == s.accepted == s.drafted == 4 * B
    assert s.acceptance_rate == 1.0
    assert s.mean_acceptance_length == B + 1
    assert s.plain_rounds == s.truncated_rounds == s.skipped_after_draft == 0
    # streamed message by message: the first anchor alone, then whole blocks of B + 1
    assert [len(c) for c in gen.chunks if c] == [1] + [B + 1] * 4


PROMPTS = ["hello world", "the quick brown fox", "count: 1 2 3", "def f(x):",
           "spec", "stop here", "abc", "once upon a time"]


@pytest.mark.parametrize("drafter", ["oracle", "dspark"])
def test_eight_concurrent_generations_equal_their_solo_runs(drafter, oracle_stack, dspark_stack):  # noqa: F811
    stack = oracle_stack if drafter == "oracle" else dspark_stack
    reqs = [gen_request(p, max_tokens=10 + i, spec=SPECS[i % 3]) for i, p in enumerate(PROMPTS)]
    solo = [stack.generate(r) for r in reqs]

    async def together():
        gw = await stack.agateway("sequential")
        return await asyncio.gather(*(collect(gw.stub, r) for r in reqs))

    concurrent = stack.loop.run(together())
    for r, a, b in zip(reqs, solo, concurrent):
        assert b.token_ids == a.token_ids, r.prompt
        assert len(b.token_ids) == r.max_tokens
        assert b.final.text == a.final.text
        assert spec_counts(b.stats) == spec_counts(a.stats), r.prompt
    counts = stack.wait_idle()
    assert counts == dict.fromkeys(counts, 0)


def test_gateway_stats_equal_sum_of_generation_stats(oracle_stack):  # noqa: F811
    async def run():
        gw = await oracle_stack.start_gateway("sequential")
        try:
            gens = []
            for i, spec in enumerate(("off", "always", "gated", "always")):
                gens.append(await collect(gw.stub, gen_request(PROMPTS[i], max_tokens=9 + i, spec=spec)))
            from dspark_proto.v1 import gateway_pb2
            stats = await gw.stub.Stats(gateway_pb2.StatsRequest(), timeout=10)
            return gens, json.loads(stats.json)
        finally:
            await gw.close()

    gens, stats = oracle_stack.loop.run(run())
    assert stats["generations"] == 4
    assert stats["completion_tokens"] == sum(g.final.usage.completion_tokens for g in gens) == 9 + 10 + 11 + 12
    spec = stats["speculation"]
    for name in ("rounds", "drafted", "submitted", "accepted", "margin_skipped_rounds", "truncated_rounds",
                 "skipped_after_draft", "plain_rounds"):
        assert spec[name] == sum(getattr(g.stats, name) for g in gens), name
    assert spec["accepted"] > 0
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted"] / spec["submitted"])
    assert stats["verify_mode"] == "sequential" and stats["cost_mode"] == "configured"
