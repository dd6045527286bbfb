"""Draft cost per round vs one trunk decode step, and batched drafts: `python -m bench.bench_draft
[--threads N] [--rounds N] [--batch] [--sizes 1,4,16] [--repeats 3]`.

Owns the measurement of the draft's per-round cost (ring commit plus draft) against one trunk
decode; it prints figures and never asserts them (figures of record: bench/README.md).

Tiny config (docs/model.md §13), random weights, quant_sim off, fp32 and bf16. In one process:
trunk decode ms/step (mean over `rounds` steps after a warm-up), and per draft round the
drafter's commit of one row (`write_main_kv`, 3 stages) and the draft itself (3 stages over
5 slots + the 5-step Markov head). Prints each figure and the ratio draft round / decode
step. CPU figures are for comparing runs on one machine (docs/architecture.md §8).

`--batch`: draft throughput (session drafts per second) of N sessions at different positions
(some with a window still filling, most wrapped), drafted one `draft` call each ("per
session") or in one `draft_batch` ("batched"), for each N in `--sizes`. The two arms
alternate inside every repetition (so drift hits both alike); each prints the median over
`--repeats` repetitions and the range.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dsv4.config import tiny_config
from dsv4.dspark import DSparkDraft
from dsv4.init import random_weights
from dsv4.inventory import drafter_params, trunk_params
from dsv4.trunk import Trunk


def bench(dtype: torch.dtype, rounds: int, prompt_len: int = 16) -> dict[str, float]:
    """Mean ms of one trunk decode step, one commit of one row, one draft."""
    cfg = tiny_config(max_seq_len=prompt_len + rounds + 16)
    w = random_weights(cfg, "all", seed=0)
    trunk = Trunk(cfg, dtype=dtype)
    trunk.load_weights({p.name: w[p.name] for p in trunk_params(cfg)})
    draft = DSparkDraft(cfg, dtype=dtype)
    draft.load_weights({p.name: w[p.name] for p in drafter_params(cfg)})
    ids = torch.randint(0, cfg.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0))
    tstate, dstate = trunk.new_state(), draft.new_state()
    out = trunk.prefill(tstate, ids)
    draft.write_main_kv(dstate, out.taps, range(prompt_len - out.taps.shape[0], prompt_len))
    token, t_decode, t_commit, t_draft = int(out.logits.argmax()), 0.0, 0.0, 0.0
    for i, pos in enumerate(range(prompt_len, prompt_len + rounds + 1)):
        t0 = time.perf_counter()
        out = trunk.decode(tstate, token, pos)
        t1 = time.perf_counter()
        draft.write_main_kv(dstate, out.taps, [pos])
        t2 = time.perf_counter()
        draft.draft(dstate, int(out.logits.argmax()), pos)
        t3 = time.perf_counter()
        token = int(out.logits.argmax())
        if i:  # the first round warms up
            t_decode, t_commit, t_draft = t_decode + t1 - t0, t_commit + t2 - t1, t_draft + t3 - t2
    return {"decode_ms": t_decode / rounds * 1e3, "commit_ms": t_commit / rounds * 1e3,
            "draft_ms": t_draft / rounds * 1e3}


def bench_batch(dtype: torch.dtype, sizes: list[int], repeats: int, rounds: int) -> dict[int, dict[str, list[float]]]:
    """Per N in `sizes`: session drafts per second of the "per session" and "batched" arms,
    one figure per repetition (each `rounds` rounds of N drafts, after one warm-up round)."""
    cfg = tiny_config()
    draft = DSparkDraft(cfg, dtype=dtype)
    draft.load_weights(random_weights(cfg, "drafter", seed=0))
    g = torch.Generator().manual_seed(1)
    out: dict[int, dict[str, list[float]]] = {}
    for n in sizes:
        states, seeds = [], []
        for i in range(n):
            length = 3 + (7 * i) % (cfg.max_seq_len - cfg.dspark_block_size - 4)  # spread over the sequence
            st = draft.new_state()
            draft.write_main_kv(st, torch.randn(length, cfg.tap_width, generator=g), range(length))
            states.append(st)
            seeds.append(length - 1)
        anchors = [(5 + 11 * i) % cfg.vocab_size for i in range(n)]
        arms = {"per session": lambda: [draft.draft(s, a, p) for s, a, p in zip(states, anchors, seeds)],
                "batched": lambda: draft.draft_batch(states, anchors, seeds)}
        figures: dict[str, list[float]] = {name: [] for name in arms}
        for fn in arms.values():
            fn()  # warm-up
        for _ in range(repeats):
            for name, fn in arms.items():  # interleaved: both arms in every repetition
                t0 = time.perf_counter()
                for _ in range(rounds):
                    fn()
                figures[name].append(n * rounds / (time.perf_counter() - t0))
        out[n] = figures
    return out


def print_batch(dtype: torch.dtype, sizes: list[int], repeats: int, rounds: int) -> None:
    for n, figures in bench_batch(dtype, sizes, repeats, rounds).items():
        med = {k: statistics.median(v) for k, v in figures.items()}
        cells = "   ".join(f"{k} {med[k]:8.1f} drafts/s [{min(v):.1f}..{max(v):.1f}]" for k, v in figures.items())
        print(f"{str(dtype):15s} N={n:3d}   {cells}   batched / per session = {med['batched'] / med['per session']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--rounds", type=int, default=40, help="timed rounds (default 40)")
    ap.add_argument("--batch", action="store_true", help="batched vs per-session draft throughput instead")
    ap.add_argument("--sizes", default="1,4,16", help="--batch: sessions per batch, comma-separated (default 1,4,16)")
    ap.add_argument("--repeats", type=int, default=3, help="--batch: repetitions of each arm (default 3)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, tiny config, {args.rounds} rounds")
    if args.batch:
        sizes = [int(x) for x in args.sizes.split(",")]
        if args.repeats < 1 or args.rounds < 1 or min(sizes) < 1:
            ap.error(f"--repeats={args.repeats}, --rounds={args.rounds} and --sizes={args.sizes} must be >= 1")
        for dtype in (torch.float32, torch.bfloat16):
            print_batch(dtype, sizes, args.repeats, args.rounds)
        return
    for dtype in (torch.float32, torch.bfloat16):
        r = bench(dtype, args.rounds)
        round_ms = r["commit_ms"] + r["draft_ms"]
        print(f"{str(dtype):15s} trunk decode {r['decode_ms']:7.2f} ms/step   commit 1 row {r['commit_ms']:6.2f} ms   "
              f"draft {r['draft_ms']:7.2f} ms   draft round / decode step = {round_ms / r['decode_ms']:.2f}")


if __name__ == "__main__":
    main()
