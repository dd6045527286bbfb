"""Draft-data generation speed: one sequence at a time against `Trunk.forward_batch` groups.

Owns the measurement behind training/rebuild.sh's draft-data stage time; it writes no data
files and asserts nothing (figures of record: bench/README.md, "Draft data").

    python -m bench.bench_draft_data --checkpoint assets/dspark-small --data runs/trunk-v3/data

The prompts are those of the recipe (`training.draft_data.sample_prompt` on the train split's
tokenized streams: `--prompt-min`..`--prompt-max` tokens, half of them at a document start,
the default domain mix), each continued by `--new` greedy tokens. Arms, in this order, on one
trunk per numerics: `continue_greedy` one sequence at a time (fast numerics: today's recipe;
exact numerics) over the first `--sequential` prompts, then `continue_greedy_batch` in
groups of each of `--batches` rows (exact numerics) over all `--sequences` prompts. Prints
sequences/s per arm and its ratio to one-at-a-time fast generation, and whether the exact
batched sequences equal the exact one-at-a-time ones bitwise (ids, taps, top-K).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from training.draft_data import (DEFAULT_MIX, continue_greedy, continue_greedy_batch, document_starts, load_trunk,
                                 sample_prompt)

FIELDS = ("ids", "taps", "top_ix", "top_lp")


def sample(data: Path, n: int, prompt_min: int, prompt_max: int, doc_start: float) -> list[torch.Tensor]:
    """The first n train-split prompts [P] int64 of the recipe (seed 0)."""
    from training.train_trunk import load_streams

    streams = load_streams(data, "train")
    starts = document_starts(streams)
    return [sample_prompt(streams, DEFAULT_MIX, 0, "train", i, prompt_min, prompt_max, doc_start, starts)[1]
            for i in range(n)]


def timed(fn) -> tuple[list, float]:
    """(fn(), its wall seconds)."""
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description="Draft-data generation: sequences/s one at a time vs batched.")
    ap.add_argument("--checkpoint", type=Path, default=Path("assets/dspark-small"))
    ap.add_argument("--data", type=Path, default=Path("runs/trunk/data"), help="tokenized streams (train_trunk)")
    ap.add_argument("--sequences", type=int, default=64, help="prompts of the batched arms")
    ap.add_argument("--sequential", type=int, default=16, help="prompts of the one-at-a-time arms (the first ones)")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[16, 32, 64])
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--prompt-min", type=int, default=4)
    ap.add_argument("--prompt-max", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if not 1 <= args.sequential <= args.sequences:
        ap.error(f"--sequential {args.sequential} must lie in 1..--sequences {args.sequences}")
    torch.set_num_threads(args.threads)
    prompts = sample(args.data, args.sequences, args.prompt_min, args.prompt_max, 0.5)
    trunks = {m: load_trunk(args.checkpoint, m) for m in ("fast", "exact")}
    rows, reference = [], {}
    for mode, trunk in trunks.items():
        seqs, s = timed(lambda: [continue_greedy(trunk, p, args.new, args.topk) for p in prompts[:args.sequential]])
        rows.append((f"one at a time, {mode}", len(seqs) / s))
        reference[mode] = seqs
    equal = True
    for b in args.batches:
        seqs, s = timed(lambda: [q for i in range(0, len(prompts), b) for q in
                                 continue_greedy_batch(trunks["exact"], prompts[i:i + b], args.new, args.topk)])
        rows.append((f"batched {b} rows, exact", len(seqs) / s))
        equal &= all(torch.equal(x[f], y[f]) for x, y in zip(seqs, reference["exact"]) for f in FIELDS)
    base = rows[0][1]
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.new} new tokens per sequence")
    for name, rate in rows:
        print(f"{name:28s} {rate:7.3f} seq/s  {rate * args.new:7.1f} tok/s  x{rate / base:5.2f}")
    print(f"exact batched == exact one at a time (first {args.sequential}, bitwise): {equal}")


if __name__ == "__main__":
    main()
