"""Peak host memory of a TP verifier's start-up from a checkpoint folder: every rank's peak
RSS while it loads its shard (docs/deployment.md "GPU pods"; the figure is in bench/README.md).

    python -m bench.bench_tp_load --folder /tmp/tpload --write     # once: a random checkpoint
    python -m bench.bench_tp_load --folder /tmp/tpload --tp 2      # a fresh process per run

The checkpoint is `dsv4.random_checkpoint`'s (fp8 weights, fp4 experts) at a config chosen
so the decoded trunk dwarfs the interpreter: dim 1024, 16 experts of 1024, vocab 8192. One
run loads it with `start_tp_trunk(None, folder, tp)` on the CPU (gloo), then prints the
decoded fp32 trunk size, rank 0's peak RSS (this process) and the largest worker's (its
children, reaped at close). Run the write in its own process: its peak would mask rank 0's.
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

import torch

from dsv4.config import tiny_config
from dsv4.random_checkpoint import write_random_checkpoint

CFG = tiny_config(dim=1024, moe_inter_dim=1024, n_routed_experts=16, vocab_size=8192, q_lora_rank=256,
                  n_heads=8, o_groups=4, o_lora_rank=256, index_n_heads=4, max_seq_len=256,
                  dspark_noise_token_id=8191)
MIB = 2 ** 20


def decoded_bytes() -> int:
    """Bytes of the decoded fp32 trunk (what `load_trunk_weights` holds), from meta modules."""
    from dsv4.trunk import Trunk
    return sum(t.numel() * 4 for t in Trunk(CFG, device="meta").state_dict().values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", type=Path, required=True)
    ap.add_argument("--write", action="store_true", help="write the random checkpoint and exit")
    ap.add_argument("--tp", type=int, default=2)
    args = ap.parse_args()
    if args.write:
        print(f"wrote {write_random_checkpoint(args.folder, CFG, seed=0) / MIB:.0f} MiB to {args.folder}")
        return
    from services.verifier.tp import start_tp_trunk
    start = time.perf_counter()
    trunk = start_tp_trunk(None, args.folder, args.tp)
    load_s = time.perf_counter() - start
    if args.tp > 1:
        trunk.close()
    rank0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(f"tp={args.tp}  decoded trunk {decoded_bytes() / MIB:.0f} MiB  load {load_s:.1f} s  "
          f"peak RSS: rank 0 {rank0:.0f} MiB, largest worker {workers:.0f} MiB  (torch {torch.__version__})")


if __name__ == "__main__":
    main()
