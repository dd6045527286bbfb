"""Draft cost per round vs one trunk decode step: `python -m bench.bench_draft [--threads N] [--rounds N]`.

Owns the measurement of the draft's per-round cost (ring commit plus draft) against one trunk
decode; it prints figures and never asserts them (figures of record: bench/README.md).

Tiny config (docs/model.md §13), random weights, quant_sim off, fp32 and bf16. In one process:
trunk decode ms/step (mean over `rounds` steps after a warm-up), and per draft round the
drafter's commit of one row (`write_main_kv`, 3 stages) and the draft itself (3 stages over
5 slots + the 5-step Markov head). Prints each figure and the ratio draft round / decode
step. CPU figures are for comparing runs on one machine (docs/architecture.md §8).
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--rounds", type=int, default=40, help="timed rounds (default 40)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, tiny config, {args.rounds} rounds")
    for dtype in (torch.float32, torch.bfloat16):
        r = bench(dtype, args.rounds)
        round_ms = r["commit_ms"] + r["draft_ms"]
        print(f"{str(dtype):15s} trunk decode {r['decode_ms']:7.2f} ms/step   commit 1 row {r['commit_ms']:6.2f} ms   "
              f"draft {r['draft_ms']:7.2f} ms   draft round / decode step = {round_ms / r['decode_ms']:.2f}")


if __name__ == "__main__":
    main()
