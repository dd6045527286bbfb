"""Trunk prefill / decode speed on CPU: `python -m bench.bench_trunk [--threads N] [--no-bf16]`.

Owns the trunk's prefill and decode speed measurement and the larger CPU configuration
(`large_config`) that `bench_verify` and `gpu_check` reuse; it prints figures and never
asserts them (figures of record: bench/README.md).

Prints each configuration in full, then prefill tokens/s and decode ms/token (mean over the
decoded tokens, after one warm-up run) for the docs/model.md §13 tiny config and a larger CPU
config (dim 1024, 8 layers, 16 experts), in fp32 and bf16. Random weights; quant_sim off. CPU
figures are for comparing runs on one machine (docs/architecture.md §8).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dsv4.config import ModelConfig, tiny_config
from dsv4.init import random_weights
from dsv4.trunk import Trunk


def large_config() -> ModelConfig:
    """dim 1024, 8 layers (SWA, CSA r=4, HCA r=16 alternating), 16 experts top-4."""
    return tiny_config(
        vocab_size=8192, dim=1024, n_layers=8, n_heads=8, head_dim=128, rope_head_dim=64,
        q_lora_rank=512, o_groups=4, o_lora_rank=256, window_size=64,
        compress_ratios=[0, 4, 16, 4, 16, 4, 16, 4, 0, 0, 0], original_seq_len=256,
        index_n_heads=4, index_head_dim=128, index_topk=16, n_routed_experts=16,
        n_activated_experts=4, moe_inter_dim=512, n_hash_layers=2, dspark_noise_token_id=8191,
        dspark_target_layer_ids=[5, 6, 7], max_seq_len=1024,
    )


def bench_one(cfg: ModelConfig, dtype: torch.dtype, weights: dict, prompt_len: int, n_decode: int) -> dict:
    """Time one prefill of `prompt_len` tokens and `n_decode` decode steps (after a warm-up)."""
    model = Trunk(cfg, dtype=dtype, quant_sim=False)
    model.load_weights(weights)
    ids = torch.randint(0, cfg.vocab_size, (prompt_len + n_decode,), generator=torch.Generator().manual_seed(0))
    warm = model.new_state()
    model.prefill(warm, ids[:8])
    model.decode(warm, int(ids[8]), 8)
    state = model.new_state()
    t0 = time.perf_counter()
    model.prefill(state, ids[:prompt_len])
    t1 = time.perf_counter()
    for p in range(prompt_len, prompt_len + n_decode):
        model.decode(state, int(ids[p]), p)
    t2 = time.perf_counter()
    return {"prefill_tok_s": prompt_len / (t1 - t0), "decode_ms_per_token": (t2 - t1) / n_decode * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 1 by default: on the shared 2-core machine a second OpenMP thread stalls small ops ~10x
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--no-bf16", action="store_true", help="fp32 only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = [torch.float32] + ([] if args.no_bf16 else [torch.bfloat16])
    cases = [("tiny", tiny_config(), 32, 32), ("large", large_config(), 256, 32)]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    for name, cfg, prompt_len, n_decode in cases:
        print(f"\n== {name}: prompt {prompt_len} tokens, decode {n_decode} tokens")
        print(json.dumps(cfg.to_dict(), sort_keys=True))
        weights = random_weights(cfg, "trunk", seed=0)
        for dtype in dtypes:
            r = bench_one(cfg, dtype, weights, prompt_len, n_decode)
            print(f"{name:6s} {str(dtype):15s} prefill {r['prefill_tok_s']:9.1f} tok/s   "
                  f"decode {r['decode_ms_per_token']:8.2f} ms/token")


if __name__ == "__main__":
    main()
