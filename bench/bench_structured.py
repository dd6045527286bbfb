"""Structured output: `python -m bench.bench_structured [options]`.

Owns the measurement of constrained decoding (docs/structured.md). It prints figures and never
asserts them.

1. Cost of the grammar: mask compile ms per schema, and per-step mask ms on the step thread
   after the forward (each session's row masked as the verifier masks it, its token chosen
   and accepted) at 1 and 16 sessions, at vocab 4,096 (the bundled tokenizer) and 129,280
   (V4-Flash's size: the bundled byte-level tokens extended with concatenations of them, a
   stand-in for its tokenizer): "after" with the fills computed beside the forward
   (`GrammarState.prefetch` at admission), "before" with them computed after it; the forward
   is a --forward-ms sleep (a GPU forward holds no GIL while the host waits on it).
2. Acceptance and speed on the bundled model through real services in this process (a
   verifier, two DSpark drafters: one drafting inside the grammar, one blind; a gateway on
   each; ports from --port-base), at T = 0 and T = 0.7: per arm (plain = spec off, masked,
   blind) the acceptance rate, mean acceptance length, tok/s and tok/s / constrained plain,
   the median of --repeats interleaved runs; and jump-forward: plain decode with it off (the
   reference arm) and on ("plain+jf", a gateway that submits forced runs as certain drafts):
   the rounds it saved and the forced tokens it committed, measured.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import grpc
import torch

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


def grammar_costs(vocabs: dict[str, GrammarVocab], steps: int, forward_ms: float) -> None:
    print(f"\n== grammar cost (ms; torch intra-op threads {torch.get_num_threads()}) ==")
    for name, vocab in vocabs.items():
        compile_ms = []
        for schema in SCHEMAS:
            t0 = time.perf_counter()
            GrammarVocab.compile(vocab, make_constraint("json_schema", json.dumps(schema) + " "))  # uncached
            compile_ms.append((time.perf_counter() - t0) * 1e3)
        print(f"{name}: compile per schema median {statistics.median(compile_ms):.1f} ms, "
              f"max {max(compile_ms):.1f} ms over {len(SCHEMAS)} schemas")
        for n in (1, 16):
            before = step_ms(vocab, n, steps, False, forward_ms)
            after = step_ms(vocab, n, steps, True, forward_ms)
            print(f"{name}: {n:>2} sessions: per-step mask {before:.2f} ms after the forward (before), "
                  f"{after:.2f} ms with the fills beside it (after)")


def step_ms(vocab: GrammarVocab, sessions: int, steps: int, prefetch: bool, forward_ms: float) -> float:
    """Median ms a decode step spends on masks after its forward over `sessions` matchers of a
    nested schema: each row masked (`GrammarState.mask`, as `work._allowed`), its argmax
    taken and accepted. prefetch: each session's fill starts at admission, before the
    forward (a `forward_ms` sleep)."""
    compiled = vocab.compile(make_constraint("json_schema", SCHEMAS[14]))
    states = [GrammarState(compiled, vocab.vocab_size, 1) for _ in range(sessions)]
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        logits = torch.randn(sessions, vocab.vocab_size, generator=gen)
        if prefetch:
            for s in states:
                s.prefetch([])
        time.sleep(forward_ms / 1e3)
        t0 = time.perf_counter()
        for i, s in enumerate(states):
            s.accept(int(s.mask(logits[i]).argmax()))
        times.append((time.perf_counter() - t0) * 1e3)
        for i, s in enumerate(states):  # restart finished ones outside the timing
            if s.finished:
                states[i] = GrammarState(compiled, vocab.vocab_size, 1)
    return statistics.median(times)


async def run_arms(args, vocab: GrammarVocab) -> None:
    trunk = load_trunk(args.checkpoint)
    cfg = trunk.cfg
    grammar = lambda: vocab  # noqa: E731
    verifier = await start_verifier(verifier_engine(trunk, vocab=grammar), port=args.port_base + 1)
    module = load_drafter(args.checkpoint)
    drafters = {arm: await start_drafter(drafter_engine(module), port=args.port_base + 2 + i, vocab=grammar,
                                         mask_drafts=arm == "masked") for i, arm in enumerate(("masked", "blind"))}
    gateways, stubs, channels = [], {}, []
    for i, (name, arm, jump) in enumerate((("masked", "masked", True), ("blind", "blind", True),
                                           ("no-jf", "masked", False))):
        gw, _, backends = await start_gateway(GatewaySettings(
            verifier_target=f"127.0.0.1:{verifier.port}", drafter_target=f"127.0.0.1:{drafters[arm].port}",
            verify_mode="batched", cost_mode="configured", startup_timeout_s=30.0, jump_forward=jump), GateConfig(),
            port=args.port_base + 4 + i, checkpoint=args.checkpoint)
        gateways.append((gw, backends))
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}")
        channels.append(ch)
        stubs[name] = gateway_pb2_grpc.GatewayStub(ch)
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
    arms = {"plain": (stubs["no-jf"], gateway_pb2.SPEC_MODE_OFF),
            "plain+jf": (stubs["masked"], gateway_pb2.SPEC_MODE_OFF),
            "masked": (stubs["masked"], gateway_pb2.SPEC_MODE_ALWAYS),
            "blind": (stubs["blind"], gateway_pb2.SPEC_MODE_ALWAYS)}
    stats = {arm: {"tps": [], "acc": 0, "sub": 0, "rounds": 0, "verify_rounds": 0, "tokens": 0, "forced": 0,
                   "forced_rounds": 0} for arm in arms}
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
                s["forced"] += sp.forced_tokens
                s["forced_rounds"] += sp.forced_rounds
        for arm in arms:
            stats[arm]["tps"].append(tokens_by_arm[arm] / secs_by_arm[arm])
    base = statistics.median(stats["plain"]["tps"])
    print(f"\n== T={t:g}: {len(schemas)} schemas x {args.repeats} repeats, batched verify, always k={block} ==")
    print(f"{'arm':<9} {'accept':>7} {'mean len':>9} {'tok/s':>8} {'/ plain':>8} {'rounds':>7} {'forced':>7}")
    for arm, s in stats.items():
        acc = s["acc"] / s["sub"] if s["sub"] else float("nan")
        mean_len = (s["acc"] + s["verify_rounds"]) / s["verify_rounds"] if s["verify_rounds"] else float("nan")
        tps = statistics.median(s["tps"])
        print(f"{arm:<9} {acc:>7.1%} {mean_len:>9.2f} {tps:>8.1f} {tps / base:>8.2f} {s['rounds']:>7} {s['forced']:>7}")
    plain, jf = stats["plain"], stats["plain+jf"]
    print(f"jump-forward (spec off, all repeats): {plain['rounds'] - jf['rounds']} of {plain['rounds']} rounds saved "
          f"({(plain['rounds'] - jf['rounds']) / max(plain['rounds'], 1):.0%}); {jf['forced']} of {jf['tokens']} tokens "
          f"forced, in {jf['forced_rounds']} forced rounds; masked arm: {stats['masked']['forced']} forced tokens")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="assets/dspark-small", help="model folder (default assets/dspark-small)")
    ap.add_argument("--port-base", type=int, default=58000, help="ports port-base+1 .. +6 (verifier, drafters, gateways)")
    ap.add_argument("--schemas", type=int, default=6, help=f"schemas of the acceptance runs (1..{len(SCHEMAS)})")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats (median tok/s)")
    ap.add_argument("--max-tokens", type=int, default=160, help="tokens per generation at most")
    ap.add_argument("--mask-steps", type=int, default=50, help="steps timed per mask-cost cell")
    ap.add_argument("--forward-ms", type=float, default=30.0, help="the forward the mask fills overlap (a sleep, ms)")
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="torch intra-op threads for the mask-cost cells (0: torch's default)")
    ap.add_argument("--skip-arms", action="store_true", help="only the grammar cost figures")
    args = ap.parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    small = checkpoint_vocab(args.checkpoint, 4096, 1)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(Path(args.checkpoint) / "tokenizer.json"))
    tokens = [tok.id_to_token(i) or "" for i in range(tok.get_vocab_size())]
    tokens[0] = tokens[1] = ""
    vocabs = {"vocab 4,096": small, "vocab 129,280": synthetic_vocab(small, tokens, V4_VOCAB)}
    grammar_costs(vocabs, args.mask_steps, args.forward_ms)
    if not args.skip_arms:
        asyncio.run(run_arms(args, small))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
