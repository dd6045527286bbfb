"""Verify cost on CPU: `python -m bench.bench_verify [--config tiny|large] [--repeats N]`.

Owns the measurement of sequential and batched verify against plain decode, of rollback bytes
and of the 100 %-acceptance ceiling; it prints figures and never asserts them (figures of
record: bench/README.md).

For k = 1..5 drafts, in one process run: plain decode ms per token, sequential verify ms per
call and batched verify ms per call (perfect drafts, so every position is forwarded and
accepted), rollback bytes copied per batched round (all drafts rejected: the worst case),
and the 100%-acceptance ceiling in tokens per ms relative to plain decode:
ceiling(k) = (k + 1) / verify_ms(k) / (1 / decode_ms). Medians over `repeats` calls after a
warm-up. CPU figures are ratios for this machine only (docs/architecture.md §8).
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
from services.verifier.batcher import StepVerifier
from services.verifier.engine import VerifierEngine


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(cfg_name: str, repeats: int) -> None:
    cfg = tiny_config(max_seq_len=256) if cfg_name == "tiny" else large_config()
    model = Trunk(cfg)
    model.load_weights(random_weights(cfg, "trunk", seed=0))
    engine = StepVerifier(VerifierEngine(model))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (24,), generator=gen)

    sid = engine.open_session()
    first = engine.prefill(sid, prompt)
    chain, pos = [first.next_token], len(prompt)
    for _ in range(8):
        chain.append(engine.decode(sid, chain[-1], pos).next_token)
        pos += 1
    engine.close_session(sid)

    def fresh():
        s = engine.open_session()
        engine.prefill(s, prompt)
        return s

    def decode_once():
        s = fresh()
        t0 = time.perf_counter()
        engine.decode(s, chain[0], len(prompt))
        engine.close_session(s)
        return (time.perf_counter() - t0) * 1e3

    decode_ms = statistics.median(decode_once() for _ in range(repeats))
    print(f"config {cfg_name}: dim {cfg.dim}, {cfg.n_layers} layers, ratios {cfg.compress_ratios[:cfg.n_layers]}, "
          f"W {cfg.window_size}, experts {cfg.n_routed_experts} top-{cfg.n_activated_experts}; fp32, 1 thread")
    print(f"plain decode: {decode_ms:.2f} ms/token")
    print(f"{'k':>2} {'sequential ms':>14} {'batched ms':>11} {'batched/plain':>14} "
          f"{'ceiling seq':>12} {'ceiling batched':>16} {'rollback B':>11}")
    for k in range(1, 6):
        timings = {}
        for mode in ("sequential", "batched"):
            def once(mode=mode):
                s = fresh()
                t0 = time.perf_counter()
                engine.verify(s, chain[0], chain[1:k + 1], len(prompt), mode)
                engine.close_session(s)
                return (time.perf_counter() - t0) * 1e3
            timings[mode] = statistics.median(once() for _ in range(repeats))
        s = fresh()
        wrong = [(t + 1) % cfg.vocab_size for t in chain[1:k + 1]]
        copied = engine.verify(s, chain[0], wrong, len(prompt), "batched").rollback_bytes
        engine.close_session(s)
        ceil = {m: (k + 1) / timings[m] * decode_ms for m in timings}
        print(f"{k:>2} {timings['sequential']:>14.2f} {timings['batched']:>11.2f} "
              f"{timings['batched'] / decode_ms:>14.2f} {ceil['sequential']:>11.2f}x {ceil['batched']:>15.2f}x "
              f"{copied:>11,}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=("tiny", "large", "both"), default="both")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for name in (("tiny", "large") if args.config == "both" else (args.config,)):
        run(name, args.repeats)


if __name__ == "__main__":
    main()
