"""Cost of exact verify numerics on CPU: `python -m bench.bench_exact [--config tiny|large] [options]`.

Owns the measurement of what exact verify numerics cost against fast ones, per call and per
workload, and whether each mode's tokens equal its plain chain; it prints figures and never
asserts them (figures of record: bench/README.md).

One process run, one set of random weights, two trunks: "fast" (the default numerics) and
"exact" (`Trunk(verify_numerics="exact")`: 8-row tiles, fixed key lists and chunks, routed
experts per route; see dsv4.trunk.Trunk). Printed:

1. Per call: plain decode ms (fast = the fastest plain decode, one unpadded row; exact) and
   batched verify ms for k = 1..5 (fast, exact), with exact/fast ratios. Medians.
2. Per workload (repeat, code, prose, math as in docs/architecture.md §8; byte-tokenised prompts):
   completion tok/s of plain decode (fast, exact), always-k speculative decoding with batched
   verify (fast, exact) and gated exact speculative decoding; verify rounds, accepted drafts
   and whether the tokens equal the plain chain of the same numerics. Ratios: exact plain /
   fast plain, exact always-k / fast always-k (the price of exactness on a batched verify),
   and the speedups of exact always-k and exact gated over fast plain decode.

Drafts come from an oracle: the plain chain of the same numerics with slot j of a draft at
position p corrupted ((token + 1) % V) when (p + j) % corrupt_every == corrupt_every - 1
(the live oracle drafter's schedule), because the random model's DSpark drafts are rarely
accepted. The oracle costs nothing here, so "speedup" is the verify amortisation alone; the
"incl. draft" columns add, per drafted round, the reference setup's draft cost relative to plain
decode (196 / 303 ms, docs/architecture.md §12) times the measured fast plain ms per token. The
gate is services.gateway.gate with costs measured in this run (verify line fitted to the exact
batched verify ms). CPU figures are ratios for this machine only (docs/architecture.md §8).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.bench_trunk import large_config
from dsv4.config import tiny_config
from dsv4.init import random_weights
from dsv4.trunk import Trunk
from services.gateway.gate import Gate, GateConfig
from services.gateway.tokenizer import ByteTokenizer
from services.verifier.batcher import StepVerifier
from services.verifier.engine import VerifierEngine

WORKLOADS = {  # as bench/bench_services.py
    "repeat": "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15",
    "code": "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "prose": "The old lighthouse keeper walked slowly along the shore, watching",
    "math": "Solve for x: 3x + 7 = 22. Subtract 7 from both sides: 3x =",
}
REFERENCE_DRAFT_OVER_PLAIN = 196.0 / 303.0  # docs/architecture.md §12: draft 196 ms, plain decode 303 ms


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    return statistics.median(fn() for _ in range(repeats))


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


# ---------------------------------------------------------------- per-call costs
def call_costs(engines: dict, prompt: list[int], repeats: int) -> dict:
    """{numerics: {"decode": ms, k: batched verify ms}} on a fresh session after `prompt`."""
    out = {}
    for name, engine in engines.items():
        chain = plain_chain(engine, prompt, 6)

        def once(k: int) -> float:
            sid = engine.open_session()
            engine.prefill(sid, prompt)
            if k == 0:
                ms = timed(lambda: engine.decode(sid, chain[0], len(prompt)))
            else:
                ms = timed(lambda: engine.verify(sid, chain[0], chain[1:k + 1], len(prompt), "batched"))
            engine.close_session(sid)
            return ms

        out[name] = {"decode": median_ms(lambda: once(0), repeats),
                     **{k: median_ms(lambda k=k: once(k), repeats) for k in range(1, 6)}}
    return out


# ---------------------------------------------------------------- generation
def plain_chain(engine: VerifierEngine, prompt: list[int], n_tokens: int) -> list[int]:
    sid = engine.open_session()
    tokens, pos = [engine.prefill(sid, prompt).next_token], len(prompt)
    while len(tokens) < n_tokens:
        tokens.append(engine.decode(sid, tokens[-1], pos).next_token)
        pos += 1
    engine.close_session(sid)
    return tokens


def speculate(engine: VerifierEngine, prompt: list[int], chain: list[int], n_tokens: int, corrupt_every: int,
              gate: Gate | None) -> tuple[list[int], int, int]:
    """Speculative generation with batched verify and oracle drafts -> (tokens, drafted rounds, accepted)."""
    cfg = engine.cfg
    sid = engine.open_session()
    out, pos = [engine.prefill(sid, prompt).next_token], len(prompt)
    rounds = accepted = 0
    while len(out) < n_tokens:
        drafts, conf = [], []
        for j, tok in enumerate(chain[len(out):len(out) + cfg.dspark_block_size]):
            bad = corrupt_every > 0 and (pos + 1 + j) % corrupt_every == corrupt_every - 1
            drafts.append((tok + 1) % cfg.vocab_size if bad else tok)
            conf.append(-2.0 if bad else 6.5)  # the live oracle drafter's confidence logits
        rounds += 1
        k = gate.choose(conf, len(drafts)).k if gate else len(drafts)
        if k == 0:
            out.append(engine.decode(sid, out[-1], pos).next_token)
            pos += 1
            continue
        res = engine.verify(sid, out[-1], drafts[:k], pos, "batched")
        if gate:
            gate.observe(conf, k, res.accepted)
        out += drafts[:res.accepted] + [res.bonus_token]
        pos += res.accepted + 1
        accepted += res.accepted
    engine.close_session(sid)
    return out[:n_tokens], rounds, accepted


def fit_line(points: dict[int, float]) -> tuple[float, float]:
    """Least-squares (base, slope) of ms over k."""
    ks, ms = list(points), list(points.values())
    mk, mm = statistics.fmean(ks), statistics.fmean(ms)
    slope = sum((k - mk) * (m - mm) for k, m in zip(ks, ms)) / sum((k - mk) ** 2 for k in ks)
    return mm - slope * mk, slope


def run_workload(engines: dict, prompt: list[int], args, gate_cfg: GateConfig, plain_ms: float) -> dict:
    """Medians over args.repeats interleaved runs of each variant: tok/s, rounds, accepted, same."""
    n = args.tokens
    chains = {name: plain_chain(e, prompt, n) for name, e in engines.items()}
    variants = {
        "plain fast": lambda: (plain_chain(engines["fast"], prompt, n), 0, 0),
        "plain exact": lambda: (plain_chain(engines["exact"], prompt, n), 0, 0),
        "always fast": lambda: speculate(engines["fast"], prompt, chains["fast"], n, args.corrupt_every, None),
        "always exact": lambda: speculate(engines["exact"], prompt, chains["exact"], n, args.corrupt_every, None),
        "gated exact": lambda: speculate(engines["exact"], prompt, chains["exact"], n, args.corrupt_every,
                                         Gate(gate_cfg)),
    }
    walls: dict[str, list[float]] = {v: [] for v in variants}
    info = {}
    for _ in range(args.repeats):  # interleaved, so every variant sees the same machine load
        for v, fn in variants.items():
            t0 = time.perf_counter()
            toks, rounds, acc = fn()
            walls[v].append(time.perf_counter() - t0)
            info[v] = (rounds, acc, toks == chains["fast" if v.endswith("fast") else "exact"])
    draft_s = REFERENCE_DRAFT_OVER_PLAIN * plain_ms / 1e3
    res = {}
    for v in variants:
        wall = statistics.median(walls[v])
        rounds, acc, same = info[v]
        res[v] = {"tok_s": n / wall, "tok_s_draft": n / (wall + rounds * draft_s), "rounds": rounds,
                  "accepted": acc, "same": same}
    return res


# ---------------------------------------------------------------- report
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=("tiny", "large"), default="tiny")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--tokens", type=int, default=48, help="completion tokens per generation")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--corrupt-every", type=int, default=7, help="oracle corruption period (0 = never)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = tiny_config(max_seq_len=256) if args.config == "tiny" else large_config()
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    weights = random_weights(cfg, "trunk", seed=0)
    engines = {}
    for numerics in ("fast", "exact"):
        model = Trunk(cfg, dtype=dtype, verify_numerics=numerics)
        model.load_weights(weights)
        engines[numerics] = StepVerifier(VerifierEngine(model))
    tok = ByteTokenizer(cfg.vocab_size)
    prompts = {name: tok.encode(text) for name, text in WORKLOADS.items()}

    print(f"config {args.config}: dim {cfg.dim}, {cfg.n_layers} layers, W {cfg.window_size}, experts "
          f"{cfg.n_routed_experts} top-{cfg.n_activated_experts}; {args.dtype}, {args.threads} thread(s); "
          f"{args.tokens} tokens per generation, medians of {args.repeats}; oracle corrupt_every {args.corrupt_every}")
    costs = call_costs(engines, prompts["prose"], max(args.repeats, 5))
    print("\nper call (ms)      decode " + " ".join(f"{'verify k=' + str(k):>10}" for k in range(1, 6)))
    for name in ("fast", "exact"):
        print(f"{name:<17} {costs[name]['decode']:7.1f} " + " ".join(f"{costs[name][k]:10.1f}" for k in range(1, 6)))
    print(f"{'exact / fast':<17} {costs['exact']['decode'] / costs['fast']['decode']:6.2f}x "
          + " ".join(f"{costs['exact'][k] / costs['fast'][k]:9.2f}x" for k in range(1, 6)))

    base, slope = fit_line({k: costs["exact"][k] for k in range(1, 6)})
    plain_ms = costs["fast"]["decode"]
    gate_cfg = GateConfig(enabled=True, draft_ms=REFERENCE_DRAFT_OVER_PLAIN * plain_ms, verify_base_ms=max(base, 1e-3),
                          verify_slope_ms=max(slope, 1e-3), plain_ms=costs["exact"]["decode"])
    print(f"gate costs (ms): draft {gate_cfg.draft_ms:.1f}, verify {gate_cfg.verify_base_ms:.1f} + "
          f"{gate_cfg.verify_slope_ms:.1f} k, plain {gate_cfg.plain_ms:.1f}")

    head = (f"\n{'workload':<8} {'plain fast':>10} {'plain exact':>11} {'always fast':>11} {'always exact':>12} "
            f"{'gated exact':>11} | {'exact/fast plain':>16} {'exact/fast always':>17} {'always exact/plain fast':>23} "
            f"{'gated exact/plain fast':>22} | {'incl. draft: always':>19} {'gated':>6} | rounds (accepted) always "
            f"exact / gated exact; same as plain: fast always, exact always, exact gated")
    print(head + "\n" + "-" * 200)
    for name, prompt in prompts.items():
        r = run_workload(engines, prompt, args, gate_cfg, plain_ms)
        pf = r["plain fast"]["tok_s"]
        print(f"{name:<8} {pf:10.1f} {r['plain exact']['tok_s']:11.1f} {r['always fast']['tok_s']:11.1f} "
              f"{r['always exact']['tok_s']:12.1f} {r['gated exact']['tok_s']:11.1f} | "
              f"{r['plain exact']['tok_s'] / pf:15.2f}x "
              f"{r['always exact']['tok_s'] / r['always fast']['tok_s']:16.2f}x "
              f"{r['always exact']['tok_s'] / pf:22.2f}x {r['gated exact']['tok_s'] / pf:21.2f}x | "
              f"{r['always exact']['tok_s_draft'] / pf:18.2f}x {r['gated exact']['tok_s_draft'] / pf:5.2f}x | "
              f"{r['always exact']['rounds']} ({r['always exact']['accepted']}) / {r['gated exact']['rounds']} "
              f"({r['gated exact']['accepted']}); {r['always fast']['same']}, {r['always exact']['same']}, "
              f"{r['gated exact']['same']}")
    print("tok/s: completion tokens per second of wall time (prefill included). Ratios > 1: faster.")


if __name__ == "__main__":
    main()
