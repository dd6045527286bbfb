"""Tensor parallelism of the DSpark draft module, sharded differently from the trunk
(docs/architecture.md §10). This module owns the draft's sharding plan, the per-rank weights
and its two all-reduces per stage (`DraftTP`); it never changes a stage's math, never
spawns processes or builds a process group (the caller passes one in), and at TP=1 never
touches `torch.distributed`.

Dimension legend: H = n_heads, G = o_groups, Dh = head_dim, Lo = o_lora_rank, D = dim,
E = n_routed_experts, ws = world size, r = rank.

Sharded: attention heads (rank r owns heads [r*H/ws, (r+1)*H/ws), i.e. output groups
[r*G/ws, (r+1)*G/ws): `wq_b` rows, `attn_sink`, `wo_a` rows (block-diagonal per group),
`wo_b` columns) and routed experts (rank r owns experts [r*E/ws, (r+1)*E/ws), names keep
their global index). Replicated: everything else, in particular `head`, the Markov head,
the confidence head, `main_proj`, the gate and the shared expert; `wkv`/`kv_norm` too, so
every rank holds the full rings. The 5-step Markov loop needs no collective: every rank
computes the same logits, so the drafted ids are identical by construction.

Exactly two all-reduces per stage, over bf16 (`reduce_dtype`): after the attention output
projection (each rank holds only its heads' contribution) and after the routed MoE, BEFORE
the shared expert is added (every rank computes the shared expert in full; inside the
reduction it would be counted ws times). This is the only drafter module importing
torch.distributed; TP=1 never touches it.
"""

from __future__ import annotations

import numbers
import re
from typing import Any, Mapping

import torch

from dsv4.config import ModelConfig

_SHARDED = re.compile(r"^mtp\.\d+\.attn\.(wq_b\.weight|attn_sink|wo_a\.weight|wo_b\.weight)$")
_EXPERT = re.compile(r"^mtp\.\d+\.ffn\.experts\.(\d+)\.")


class DraftTP:
    """One rank's view of the draft module's tensor-parallel group.

    Args:
        rank, world_size: this rank and the group size (world_size 1 = no parallelism).
        group: a `torch.distributed` process group of `world_size` ranks (None only at TP=1).
        reduce_dtype: dtype the partial sums travel in (bf16, as the trunk's; docs/architecture.md §10).
    Raises:
        ValueError: rank or world_size not an integer, world_size < 1, rank outside
            [0, world_size), world_size > 1 without a process group (a partial sum would
            still read as a well-formed draft), or a group whose size/rank disagree with
            the arguments.
    `n_all_reduce` counts `all_reduce` calls (also at TP=1, where they are identities).
    """

    def __init__(self, rank: int = 0, world_size: int = 1, group: Any = None,
                 reduce_dtype: torch.dtype = torch.bfloat16):
        _check_world_size(world_size)
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank!r}: must be an integer in [0, world_size={world_size})")
        if world_size > 1:
            if group is None:
                raise ValueError(f"world_size={world_size} needs a torch.distributed process group, got None")
            import torch.distributed as dist

            if dist.get_world_size(group) != world_size or dist.get_rank(group) != rank:
                raise ValueError(f"process group has rank {dist.get_rank(group)} of {dist.get_world_size(group)}, "
                                 f"expected rank {rank} of {world_size}")
        self.rank, self.world_size, self.group = rank, world_size, group
        self.reduce_dtype = reduce_dtype
        self.n_all_reduce = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group in `reduce_dtype`; returns a tensor of x's dtype (x itself at TP=1)."""
        self.n_all_reduce += 1
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        y = x.to(self.reduce_dtype).contiguous()
        dist.all_reduce(y, group=self.group)
        return y.to(x.dtype)

    # ------------------------------------------------------------------ sharding
    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """cfg with this rank's head and group counts (H/ws, G/ws); experts stay global (the
        gate routes over all of them). Raises ValueError like `check_shardable`."""
        check_shardable(cfg, self.world_size)
        if self.world_size == 1:
            return cfg
        return cfg.replace(n_heads=cfg.n_heads // self.world_size, o_groups=cfg.o_groups // self.world_size)

    def local_experts(self, cfg: ModelConfig) -> range:
        """Global ids of the routed experts this rank owns."""
        return local_experts(cfg, self.rank, self.world_size)

    def shard_weights(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """See `shard_drafter_weights` (this rank's slice)."""
        return shard_drafter_weights(cfg, weights, self.rank, self.world_size)


def check_shardable(cfg: ModelConfig, world_size: int) -> None:
    """Raises ValueError naming the value when world_size is not an integer >= 1, or naming the
    field when n_heads, o_groups or n_routed_experts is not divisible by world_size."""
    _check_world_size(world_size)
    for name in ("n_heads", "o_groups", "n_routed_experts"):
        if getattr(cfg, name) % world_size:
            raise ValueError(f"{name}={getattr(cfg, name)} is not divisible by TP world_size={world_size}")


def _check_world_size(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: must be an integer >= 1")


def local_experts(cfg: ModelConfig, rank: int, world_size: int) -> range:
    """Global ids [rank*E/ws, (rank+1)*E/ws) of the routed experts rank `rank` owns."""
    n = cfg.n_routed_experts // world_size
    return range(rank * n, (rank + 1) * n)


def shard_drafter_weights(cfg: ModelConfig, weights: Mapping[str, torch.Tensor], rank: int,
                          world_size: int) -> dict[str, torch.Tensor]:
    """Full logical drafter weights -> rank `rank`'s: head-sharded attention tensors sliced,
    non-local experts dropped, the rest passed through (replicated). Names unchanged.

    Raises:
        ValueError: see `check_shardable`.
    """
    check_shardable(cfg, world_size)
    if world_size == 1:
        return dict(weights)
    H, G, Dh, Lo = cfg.n_heads, cfg.o_groups, cfg.head_dim, cfg.o_lora_rank
    h0, h1 = rank * H // world_size, (rank + 1) * H // world_size
    g0, g1 = rank * G // world_size, (rank + 1) * G // world_size
    experts = local_experts(cfg, rank, world_size)
    out = {}
    for name, t in weights.items():
        m = _EXPERT.match(name)
        if m and int(m.group(1)) not in experts:
            continue
        if _SHARDED.match(name):
            leaf = name.split(".attn.", 1)[1]
            if leaf == "wq_b.weight":
                t = t[h0 * Dh:h1 * Dh]  # rows of heads h0..h1-1
            elif leaf == "attn_sink":
                t = t[h0:h1]
            elif leaf == "wo_a.weight":
                t = t[g0 * Lo:g1 * Lo]  # block-diagonal: group g's rows g*Lo..(g+1)*Lo-1
            else:
                t = t[:, g0 * Lo:g1 * Lo]  # wo_b consumes the groups' Lo-wide outputs
        out[name] = t
    return out
