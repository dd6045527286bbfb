"""Structured output: `python -m bench.bench_structured [options]`.

Owns the measurement of constrained decoding (docs/structured.md). It prints figures and never
asserts them.

1. Cost of the grammar: mask compile ms per schema, and per-step mask ms (fill every
   session's bitmask, apply it to a [N, V] logits batch, advance each matcher) at 1 and 16
   sessions, at vocab 4,096 (the bundled tokenizer) and 129,280 (V4-Flash's size: the bundled
   byte-level tokens extended with concatenations of them, a stand-in for its tokenizer).
2. Acceptance and speed on the bundled model through real services in this process (a
   verifier, two DSpark drafters: one drafting inside the grammar, one blind; a gateway on
   each; ports from --port-base), at T = 0 and T = 0.7: per arm (plain = spec off, masked,
   blind) the acceptance rate, mean acceptance length, tok/s and tok/s / constrained plain,
   the median of --repeats interleaved runs; and jump-forward's saved rounds: for each plain
   output, the rounds its forced runs (tokens the grammar leaves alone allowed) would save
   if committed as guaranteed drafts, B per verify.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import grpc
import torch
import xgrammar as xgr

from dspark_proto.v1 import gateway_pb2, gateway_pb2_grpc
from services.app import (drafter_engine, load_drafter, load_trunk, start_drafter, start_gateway, start_verifier,
                          verifier_engine)
from services.common.constraint import GrammarVocab, checkpoint_vocab, make_constraint
from services.common.settings import GatewaySettings
from services.gateway.gate import GateConfig
from services.common.grammar import GrammarState

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from structured_schemas import SCHEMAS  # noqa: E402

V4_VOCAB = 129_280


def synthetic_vocab(base: GrammarVocab, tokens: list[str], size: int) -> GrammarVocab:
    """`size` byte-level tokens: the bundled ones, then pairs of them (unique), eos 1."""
    out, seen = list(tokens), set(tokens)
    plain = [t for t in tokens if t]
    for a, b in itertools.product(plain, plain):
        if len(out) >= size:
            break
        if a + b not in seen:
            seen.add(a + b)
            out.append(a + b)
    return GrammarVocab(out, size, 1, byte_level=True)


def grammar_costs(vocabs: dict[str, GrammarVocab], steps: int) -> None:
    print("\n== grammar cost (ms) ==")
    for name, vocab in vocabs.items():
        compile_ms = []
        for schema in SCHEMAS:
            t0 = time.perf_counter()
            GrammarVocab.compile(vocab, make_constraint("json_schema", json.dumps(schema) + " "))  # uncached
            compile_ms.append((time.perf_counter() - t0) * 1e3)
        print(f"{name}: compile per schema median {statistics.median(compile_ms):.1f} ms, "
              f"max {max(compile_ms):.1f} ms over {len(SCHEMAS)} schemas")
        for n in (1, 16):
            print(f"{name}: {n:>2} sessions: per-step mask {step_ms(vocab, n, steps):.2f} ms")


def step_ms(vocab: GrammarVocab, sessions: int, steps: int) -> float:
    """Median ms of one step over `sessions` matchers: fill each bitmask, apply all to logits, advance."""
    compiled = vocab.compile(make_constraint("json_schema", SCHEMAS[14]))
    states = [GrammarState(compiled, vocab.vocab_size, 1) for _ in range(sessions)]
    bitmask = xgr.allocate_token_bitmask(sessions, vocab.vocab_size)
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        logits = torch.randn(sessions, vocab.vocab_size, generator=gen)
        t0 = time.perf_counter()
        for i, s in enumerate(states):
            bitmask[i] = s._fill().bitmask[0]
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab.vocab_size)
        for i, s in enumerate(states):
            t = int(logits[i].argmax())
            s.accept(t)
        times.append((time.perf_counter() - t0) * 1e3)
        for i, s in enumerate(states):  # restart finished ones outside the timing
            if s.finished:
                states[i] = GrammarState(compiled, vocab.vocab_size, 1)
    return statistics.median(times)


def saved_rounds(vocab: GrammarVocab, schema: dict, tokens: list[int], block: int) -> tuple[int, int]:
    """(forced tokens, rounds jump-forward saves) over one plain constrained output."""
    state = GrammarState(vocab.compile(make_constraint("json_schema", schema)), vocab.vocab_size, 1)
    forced = saved = i = 0
    while i < len(tokens):
        run = state.forced_run(len(tokens))
        m = 0
        while m < len(run) and i + m < len(tokens) and tokens[i + m] == run[m]:
            m += 1
        if m:
            forced += m
            saved += (m + 1) - math.ceil((m + 1) / (block + 1))
        for t in tokens[i:i + m + 1]:
            state.accept(t)
        i += m + 1
    return forced, saved


async def run_arms(args, vocab: GrammarVocab) -> None:
    trunk = load_trunk(args.checkpoint)
    cfg = trunk.cfg
    grammar = lambda: vocab  # noqa: E731
    verifier = await start_verifier(verifier_engine(trunk, vocab=grammar), port=args.port_base + 1)
    module = load_drafter(args.checkpoint)
    drafters = {arm: await start_drafter(drafter_engine(module), port=args.port_base + 2 + i, vocab=grammar,
                                         mask_drafts=arm == "masked") for i, arm in enumerate(("masked", "blind"))}
    gateways, stubs, channels = [], {}, []
    for i, arm in enumerate(("masked", "blind")):
        gw, _, backends = await start_gateway(GatewaySettings(
            verifier_target=f"127.0.0.1:{verifier.port}", drafter_target=f"127.0.0.1:{drafters[arm].port}",
            verify_mode="batched", cost_mode="configured", startup_timeout_s=30.0), GateConfig(),
            port=args.port_base + 4 + i, checkpoint=args.checkpoint)
        gateways.append((gw, backends))
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}")
        channels.append(ch)
        stubs[arm] = gateway_pb2_grpc.GatewayStub(ch)
    try:
        for t in (0.0, 0.7):
            await one_temperature(args, stubs, vocab, t, cfg.dspark_block_size)
    finally:
        for ch in channels:
            await ch.close()
        for gw, backends in gateways:
            await gw.stop(0)
            await backends.close()
        for d in drafters.values():
            await d.stop(0)
        await verifier.stop(0)


async def generate(stub, schema: dict, spec: int, t: float, seed: int, max_tokens: int):
    req = gateway_pb2.GenerateRequest(prompt="Reply in JSON: ", max_tokens=max_tokens, spec=spec, temperature=t)
    req.constraint.json_schema = json.dumps(schema)
    if t > 0:
        req.seed = seed
    tokens, final, t0 = [], None, time.perf_counter()
    async for msg in stub.Generate(req, timeout=600):
        tokens += msg.token_ids
        if msg.finished:
            final = msg
    return tokens, final, time.perf_counter() - t0


async def one_temperature(args, stubs, vocab, t: float, block: int) -> None:
    arms = {"plain": (stubs["masked"], gateway_pb2.SPEC_MODE_OFF),
            "masked": (stubs["masked"], gateway_pb2.SPEC_MODE_ALWAYS),
            "blind": (stubs["blind"], gateway_pb2.SPEC_MODE_ALWAYS)}
    stats = {arm: {"tps": [], "acc": 0, "sub": 0, "rounds": 0, "verify_rounds": 0, "tokens": 0} for arm in arms}
    forced = saved = plain_rounds = 0
    schemas = SCHEMAS[:args.schemas]
    for rep in range(args.repeats):
        tokens_by_arm = {arm: 0 for arm in arms}
        secs_by_arm = {arm: 0.0 for arm in arms}
        for i, schema in enumerate(schemas):
            for arm, (stub, spec) in arms.items():  # interleaved: every arm once per schema, in turn
                tokens, final, secs = await generate(stub, schema, spec, t, 100 * rep + i, args.max_tokens)
                tokens_by_arm[arm] += len(tokens)
                secs_by_arm[arm] += secs
                s, sp = stats[arm], final.spec_stats
                s["acc"] += sp.accepted
                s["sub"] += sp.submitted
                s["rounds"] += sp.rounds
                s["verify_rounds"] += sp.rounds - sp.plain_rounds
                s["tokens"] += len(tokens)
                if arm == "plain" and rep == 0:
                    f, sv = saved_rounds(vocab, schema, tokens, block)
                    forced, saved, plain_rounds = forced + f, saved + sv, plain_rounds + sp.rounds
        for arm in arms:
            stats[arm]["tps"].append(tokens_by_arm[arm] / secs_by_arm[arm])
    base = statistics.median(stats["plain"]["tps"])
    print(f"\n== T={t:g}: {len(schemas)} schemas x {args.repeats} repeats, batched verify, always k={block} ==")
    print(f"{'arm':<8} {'accept':>7} {'mean len':>9} {'tok/s':>8} {'/ plain':>8}")
    for arm, s in stats.items():
        acc = s["acc"] / s["sub"] if s["sub"] else float("nan")
        mean_len = (s["acc"] + s["verify_rounds"]) / s["verify_rounds"] if s["verify_rounds"] else float("nan")
        tps = statistics.median(s["tps"])
        print(f"{arm:<8} {acc:>7.1%} {mean_len:>9.2f} {tps:>8.1f} {tps / base:>8.2f}")
    print(f"jump-forward (plain outputs, repeat 1): {forced} forced tokens; {saved} of {plain_rounds} plain rounds "
          f"saved ({saved / max(plain_rounds, 1):.0%})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="assets/dspark-small", help="model folder (default assets/dspark-small)")
    ap.add_argument("--port-base", type=int, default=58000, help="ports port-base+1 .. +5 (verifier, drafters, gateways)")
    ap.add_argument("--schemas", type=int, default=6, help=f"schemas of the acceptance runs (1..{len(SCHEMAS)})")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats (median tok/s)")
    ap.add_argument("--max-tokens", type=int, default=160, help="tokens per generation at most")
    ap.add_argument("--mask-steps", type=int, default=50, help="steps timed per mask-cost cell")
    ap.add_argument("--skip-arms", action="store_true", help="only the grammar cost figures")
    args = ap.parse_args(argv)
    small = checkpoint_vocab(args.checkpoint, 4096, 1)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(Path(args.checkpoint) / "tokenizer.json"))
    tokens = [tok.id_to_token(i) or "" for i in range(tok.get_vocab_size())]
    tokens[0] = tokens[1] = ""
    vocabs = {"vocab 4,096": small, "vocab 129,280": synthetic_vocab(small, tokens, V4_VOCAB)}
    grammar_costs(vocabs, args.mask_steps)
    if not args.skip_arms:
        asyncio.run(run_arms(args, small))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
