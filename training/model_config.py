"""The bundled small model's configuration, its exported size, and its draft/decode cost ratio.

Owns the bundled geometry (`bundled_config`); it never trains or exports, and its cost
measurement only prints (figures of record: bench/README.md).

`bundled_config()` is a DeepSeek-V4 trunk + 3-stage DSpark module small enough to train on
one CPU core in under an hour, and shaped like the real 0731 model (docs/model.md §1.3):

| layer | ratio | attention | MoE gate |
|---|---|---|---|
| 0, 1 | 0 | sliding window only (SWA) | hash (tid2eid) |
| 2 | 4 | overlapped compressor + indexer (CSA) | hash |
| 3, 5, 7 | 16 | plain compressor, attends every entry (HCA) | scored |
| 4, 6, 8 | 4 | CSA | scored |
| DSpark stages 9..11 | 0 | DSpark attention over the target rows | scored |

Every fp8-stored linear has in_features % 128 == 0 and head_dim - rope_head_dim = 64, so the
quantisation simulation could be switched on (docs/model.md §13 "why these values"); the model is
trained with it off (fp32 training, see `training.forward`). The vocabulary matches
`training.tokenizer` (bos 0, eos 1, DSpark noise token vocab_size - 1).

`python -m training.model_config` prints the stored checkpoint size and measures, with random
weights, one trunk decode step (`Trunk.decode`) against one DSpark draft round
(`DSparkDraft.draft`) in one process (CPU figures are ratios, docs/architecture.md §8).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from dsv4.config import ModelConfig
from dsv4.inventory import Param, drafter_params, trunk_params

VOCAB_SIZE = 4096
NOISE_TOKEN_ID = VOCAB_SIZE - 1  # reserved by training.tokenizer, never produced by encoding text

BUNDLED: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE, dim=256, n_layers=9, n_mtp_layers=3,
    n_heads=4, head_dim=96, rope_head_dim=32, q_lora_rank=128, o_groups=2, o_lora_rank=64,
    window_size=64,
    compress_ratios=[0, 0, 4, 16, 4, 16, 4, 16, 4, 0, 0, 0],
    compress_rope_theta=160000.0, rope_theta=10000.0,
    original_seq_len=256, rope_factor=4.0, beta_fast=32.0, beta_slow=1.0,
    index_n_heads=2, index_head_dim=64, index_topk=16,
    n_routed_experts=8, n_activated_experts=2, n_shared_experts=1, moe_inter_dim=128, n_hash_layers=3,
    score_func="sqrtsoftplus", route_scale=1.5, swiglu_limit=10.0,
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6,
    dspark_block_size=5, dspark_noise_token_id=NOISE_TOKEN_ID, dspark_target_layer_ids=[6, 7, 8],
    dspark_markov_rank=32, max_seq_len=1024, bos_token_id=0, eos_token_id=1,
    weight_dtype="fp8", expert_dtype="fp4", quant_sim=False,
)

# Bytes per element of each stored safetensors dtype (dsv4.inventory.TensorSpec.dtype).
_DTYPE_BYTES = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4, "I64": 8}


def bundled_config(**overrides: Any) -> ModelConfig:
    """The bundled model's `ModelConfig` (the table in the module docstring), with `overrides`.

    Raises:
        ValueError: an override makes the config invalid (named by `ModelConfig`).
    """
    return ModelConfig.from_dict({**BUNDLED, **overrides})


def stored_bytes(params: list[Param]) -> int:
    """Bytes of tensor data the checkpoint stores for `params` (fp8 + scales, packed fp4, ...)."""
    total = 0
    for p in params:
        for spec in p.stored().values():
            n = 1
            for s in spec.shape:
                n *= s
            total += n * _DTYPE_BYTES[spec.dtype]
    return total


def size_report(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts and stored bytes: trunk, drafter (`mtp.*` only) and the whole checkpoint.

    Returns keys trunk_params, drafter_params (logical elements, mtp.* only), active_params
    (per token in the trunk: routed experts counted k of E), trunk_bytes, drafter_bytes, total_bytes.
    """
    trunk = trunk_params(cfg)
    names = {p.name for p in trunk}
    mtp = [p for p in drafter_params(cfg) if p.name not in names]

    def count(ps: list[Param]) -> int:
        return sum(torch.Size(p.shape).numel() for p in ps)

    routed = sum(torch.Size(p.shape).numel() for p in trunk if ".experts." in p.name)
    active = count(trunk) - routed + routed * cfg.n_activated_experts // cfg.n_routed_experts
    active -= cfg.vocab_size * cfg.dim  # the embedding is a lookup
    return dict(trunk_params=count(trunk), drafter_params=count(mtp), active_params=active,
                trunk_bytes=stored_bytes(trunk), drafter_bytes=stored_bytes(mtp),
                total_bytes=stored_bytes(trunk) + stored_bytes(mtp))


def measure_draft_decode(cfg: ModelConfig, steps: int = 30, prompt_len: int = 32, seed: int = 0,
                         repeats: int = 3) -> dict[str, float]:
    """Median ms of one trunk decode step and of one draft round, random weights, fp32.

    One process, one thread count (the caller's). Per step: `Trunk.decode` of the next
    greedy token (taps on), then `DSparkDraft.write_main_kv` of its tap row and
    `DSparkDraft.draft` from it. `draft_ms` is the draft alone, `round_ms` commit + draft;
    ratios are against `decode_ms`. The first step of each repeat is a warm-up.
    Raises:
        ValueError: prompt_len + steps + block size exceeds cfg.max_seq_len.
    """
    from dsv4.dspark import DSparkDraft
    from dsv4.init import random_weights
    from dsv4.trunk import Trunk

    if prompt_len + steps + cfg.dspark_block_size + 1 > cfg.max_seq_len:
        raise ValueError(f"prompt_len + steps = {prompt_len + steps} leaves no room below max_seq_len={cfg.max_seq_len}")
    w = random_weights(cfg, "all", seed=seed)
    trunk = Trunk(cfg)
    trunk.load_weights({p.name: w[p.name] for p in trunk_params(cfg)})
    draft = DSparkDraft(cfg)
    draft.load_weights({p.name: w[p.name] for p in drafter_params(cfg)})
    ids = torch.randint(0, cfg.vocab_size - 1, (prompt_len,), generator=torch.Generator().manual_seed(seed))
    dec, com, drf = [], [], []
    for _ in range(repeats):
        ts, ds = trunk.new_state(), draft.new_state()
        out = trunk.prefill(ts, ids)
        draft.write_main_kv(ds, out.taps, range(prompt_len - out.taps.shape[0], prompt_len))
        token = int(out.logits.argmax())
        for i, pos in enumerate(range(prompt_len, prompt_len + steps + 1)):
            t0 = time.perf_counter()
            out = trunk.decode(ts, token, pos)
            t1 = time.perf_counter()
            draft.write_main_kv(ds, out.taps, [pos])
            t2 = time.perf_counter()
            draft.draft(ds, int(out.logits.argmax()), pos)
            t3 = time.perf_counter()
            token = int(out.logits.argmax())
            if i:
                dec.append(t1 - t0)
                com.append(t2 - t1)
                drf.append(t3 - t2)
    decode, commit, dr = (statistics.median(x) * 1e3 for x in (dec, com, drf))
    return dict(decode_ms=decode, commit_ms=commit, draft_ms=dr, draft_ratio=dr / decode,
                round_ratio=(commit + dr) / decode)


def main() -> None:
    ap = argparse.ArgumentParser(description="Bundled model: stored size and measured draft/decode ratio.")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per repeat (default 30)")
    ap.add_argument("--no-measure", action="store_true", help="print the sizes only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = bundled_config()
    s = size_report(cfg)
    print(f"config {cfg.config_hash()}: trunk {s['trunk_params'] / 1e6:.2f} M params "
          f"({s['active_params'] / 1e6:.2f} M active per token), drafter {s['drafter_params'] / 1e6:.2f} M; "
          f"stored trunk {s['trunk_bytes'] / 2**20:.1f} MiB + drafter {s['drafter_bytes'] / 2**20:.1f} MiB "
          f"= {s['total_bytes'] / 2**20:.1f} MiB")
    if not args.no_measure:
        m = measure_draft_decode(cfg, steps=args.steps)
        print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s): trunk decode {m['decode_ms']:.2f} ms/step, "
              f"draft {m['draft_ms']:.2f} ms (+ commit {m['commit_ms']:.2f} ms); draft/decode = "
              f"{m['draft_ratio']:.2f}, (commit + draft)/decode = {m['round_ratio']:.2f}")


if __name__ == "__main__":
    main()
