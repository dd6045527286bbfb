"""Tensor parallelism of the trunk (docs/model.md §2.5): shard an unmodified `Trunk` for one rank.
This module owns the sharding plan, the per-rank weights, the parallel embedding/linear/head,
the rendezvous (`create_store`, `connect`) and the trunk's collectives; it never edits the
trunk's forward, and never starts worker processes or drives them (`services.verifier.tp`).

Dimension legend: S = tokens, D = dim, V = vocab, H = n_heads, Dh = head_dim, G = o_groups,
Lo = o_lora_rank, Lq = q_lora_rank, Hi = index_n_heads, Di = index_head_dim,
E = n_routed_experts, E' = compressed entries, ws = world size, r = rank. A trailing `r`
marks a per-rank count (Hr = H / ws, Gr = groups on the rank, Vr = V / ws, Er = E / ws).

The model is built on the meta device, its sharded parameters are replaced by per-rank
shapes, a few modules get per-rank attributes (`Attention.n_heads/groups`,
`Indexer.n_heads`, `MoE.experts/expert_offset`), and it is then materialised and loaded
tensor by tensor: `shard_tensor` cuts one full tensor to the rank's part (`shard_weights` is it
over a dict, `shard_stream` over a checkpoint stream, so a rank reading a checkpoint holds its
shard plus one decoded tensor). Collectives, all sums over the ranks in fp32:

  * `embed` (vocab rows): each rank looks up its own rows, zeroes ids outside them, all-reduce.
  * attention: `wq_b` rows, `attn_sink`, `wo_a` rows of the rank's heads/groups; `wo_b`
    columns (row-parallel), its output all-reduced (one per layer).
  * indexer: `wq_b` and `weights_proj` rows of the rank's index heads; the per-head
    partial score sum [S, E'] all-reduced BEFORE the top-k (`Indexer.reduce_scores`).
  * MoE: rank r owns experts [r·E/ws, (r+1)·E/ws); the routed sum [S, D] is all-reduced
    BEFORE the replicated shared expert is added (`MoE.reduce_routed`), so the shared
    expert is counted once.
  * `head` (vocab rows): logits all-gathered along V.
Everything else (wq_a, wkv, norms, compressors, gate, shared expert, mHC) is replicated.

Attention heads may also be split inside an output group (G | ws, e.g. the tiny config's
G = 2 at ws = 4): the rank then holds the wo_a columns of its heads and the wo_b columns
of its group, and the all-reduce sums the per-head contributions (exact algebra, a
different summation order). A part whose size is not divisible is replicated instead
(recorded in `ShardPlan.replicated`), or raises with `strict=True`.

Numerics: sums are regrouped (per-rank partial sums, then the ranks' sum), so logits
differ from TP=1 by rounding only; tests/test_tp.py states the measured bound. In `dsv4`,
this module and `dsv4.dspark_tp` (the draft module's all-reduces, which import it lazily) are
the only users of `torch.distributed`.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dsv4.config import ModelConfig
from dsv4.inventory import trunk_params
from dsv4.layers import ACT_QUANT_BLOCK, Embedding, Linear, frozen_param
from dsv4.quantised import wire_quantised_gemms
from dsv4.rope import Rope
from dsv4.trunk import Trunk
from kernels.select import KernelConfig

BACKENDS = ("gloo", "nccl")


# ---------------------------------------------------------------------------- collectives
class Collectives:
    """Blocking sum all-reduce and all-gather over one c10d process group.

    Args:
        pg: a gloo or NCCL backend object (`connect`); None only for world_size 1.
        rank, world_size: this process's rank and the group size.
    """

    def __init__(self, pg, rank: int, world_size: int):
        self.pg, self.rank, self.world_size = pg, rank, world_size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of t over the ranks, reduced in fp32, returned in t.dtype (in place when t is fp32)."""
        buf = t.float().contiguous()
        self.pg.allreduce([buf]).wait()
        return buf.to(t.dtype)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenation along the last dim of every rank's t [..., n] -> [..., ws*n], rank order."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        self.pg.allgather([parts], [t]).wait()
        return torch.cat(parts, dim=-1)


def create_store(world_size: int, timeout_s: float, host: str = "127.0.0.1"):
    """Rank 0's rendezvous store on a free port; returns (store, port).

    The store's timeout bounds every wait on it (`wait_joined`), so it is the init timeout.
    """
    store = dist.TCPStore(host, 0, world_size, True, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    return store, store.port


def join_store(port: int, world_size: int, timeout_s: float, host: str = "127.0.0.1"):
    """A worker's client of rank 0's store (retries until `timeout_s` if it is not up yet)."""
    return dist.TCPStore(host, port, world_size, False, timeout=datetime.timedelta(seconds=timeout_s))


def mark_joined(store, rank: int) -> None:
    """Announce that `rank` is ready to create the process group."""
    store.set(f"joined/{rank}", "1")


def wait_joined(store, world_size: int) -> None:
    """Block until every rank has called `mark_joined` (bounded by the store's timeout)."""
    store.wait([f"joined/{r}" for r in range(world_size)])


def missing_ranks(store, world_size: int) -> list[int]:
    """Ranks that have not called `mark_joined` yet (a non-blocking check)."""
    return [r for r in range(world_size) if not store.check([f"joined/{r}"])]


def connect(store, rank: int, world_size: int, backend: str, call_timeout_s: float,
            device: torch.device | None = None) -> Collectives:
    """Create this rank's process group from `store`; every collective then fails after
    `call_timeout_s` instead of waiting forever on a dead or stalled rank.

    Call it only when every rank has joined (`missing_ranks` empty): group creation itself
    waits at most `call_timeout_s` for the others.
    Raises:
        ValueError: unknown backend.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: must be one of {BACKENDS}")
    prefix = dist.PrefixStore("dsv4_tp", store)
    timeout = datetime.timedelta(seconds=call_timeout_s)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefix, rank, world_size, timeout)
    else:  # untested on CPU-only CI: the c10d NCCL backend with its op timeout
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
        if device is not None:
            torch.cuda.set_device(device)
    return Collectives(pg, rank, world_size)


# ---------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class ShardPlan:
    """Which parts of the trunk are sharded over `world_size` ranks (True) or replicated.

    attention_split: "groups" (whole output groups per rank), "in_group" (a rank's heads lie
    inside one group) or "" (replicated). `replicated` holds one reason per replicated
    part, naming the config field.
    """

    world_size: int
    vocab: bool
    attention_split: str
    indexer: bool
    experts: bool
    replicated: tuple[str, ...]


def plan_sharding(cfg: ModelConfig, world_size: int, quant_sim: bool | None = None,
                  strict: bool = False) -> ShardPlan:
    """Decide the sharding of every part (see the module docstring).

    Raises:
        ValueError: world_size < 1; with `strict`, any part that cannot be sharded (the
            message names the field, its value and world_size).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: must be >= 1")
    qs = cfg.quant_sim if quant_sim is None else quant_sim
    ws, why = world_size, []

    def divisible(field: str) -> bool:
        value = getattr(cfg, field)
        if value % ws:
            why.append(f"{field}={value} not divisible by tp={ws}")
            return False
        return True

    vocab = divisible("vocab_size")
    split = ""
    if divisible("n_heads"):
        G, Hr, Hg = cfg.o_groups, cfg.n_heads // ws, cfg.n_heads // cfg.o_groups
        aq = qs and cfg.weight_dtype == "fp8"  # wo_b quantises its (per-rank) input per 128
        if Hr % Hg == 0 and not (aq and (Hr // Hg * cfg.o_lora_rank) % ACT_QUANT_BLOCK):
            split = "groups"
        elif Hg % Hr == 0 and not aq:
            split = "in_group"
        else:
            why.append(f"o_groups={G} does not fit tp={ws} with n_heads={cfg.n_heads}"
                       + (" under quant_sim" if aq else ""))
    indexer = divisible("index_n_heads")
    experts = divisible("n_routed_experts")
    if why and strict and ws > 1:
        raise ValueError("cannot shard the trunk: " + "; ".join(why))
    if ws == 1:
        return ShardPlan(1, False, "", False, False, ())
    return ShardPlan(ws, vocab, split, indexer, experts, tuple(why))


# ---------------------------------------------------------------------------- weights
def _part(t: torch.Tensor, dim: int, rank: int, ws: int) -> torch.Tensor:
    n = t.shape[dim] // ws
    return t.narrow(dim, rank * n, n)


def _attention_slices(cfg: ModelConfig, plan: ShardPlan, rank: int) -> tuple[slice, slice, slice]:
    """(wo_a rows, wo_a columns, wo_b columns) of `rank` for the attention split."""
    ws, Lo, Dh = plan.world_size, cfg.o_lora_rank, cfg.head_dim
    Hr, Hg = cfg.n_heads // ws, cfg.n_heads // cfg.o_groups
    if plan.attention_split == "groups":
        Gr = Hr // Hg
        rows = slice(rank * Gr * Lo, (rank + 1) * Gr * Lo)
        return rows, slice(0, Hg * Dh), rows
    g, j0 = divmod(rank * Hr, Hg)  # the rank's group and its first head inside it
    rows = slice(g * Lo, (g + 1) * Lo)
    return rows, slice(j0 * Dh, (j0 + Hr) * Dh), rows


def shard_name(cfg: ModelConfig, plan: ShardPlan, rank: int, name: str) -> str | None:
    """Rank `rank`'s name for logical trunk tensor `name` (a routed expert renumbered from 0 on
    its rank), or None when the tensor is another rank's expert (this rank never reads it).

    Raises:
        ValueError: rank outside [0, world_size).
    """
    ws = plan.world_size
    if not 0 <= rank < ws:
        raise ValueError(f"rank={rank}: must lie in [0, {ws})")
    parts = name.split(".")
    if not (plan.experts and parts[2:4] == ["ffn", "experts"]):
        return name
    Er = cfg.n_routed_experts // ws
    e = int(parts[4]) - rank * Er
    return ".".join(parts[:4] + [str(e)] + parts[5:]) if 0 <= e < Er else None


def shard_tensor(cfg: ModelConfig, plan: ShardPlan, rank: int, name: str,
                 t: torch.Tensor) -> tuple[str, torch.Tensor] | None:
    """Rank `rank`'s part of ONE full logical trunk tensor: (its name on the rank, a view of
    `t`: rows / columns of the rank's vocab, heads, groups or index heads; `t` itself when
    replicated), or None for another rank's expert. Same dtype and device as `t`.

    Raises:
        ValueError: rank outside [0, world_size).
    """
    local = shard_name(cfg, plan, rank, name)
    if local is None:
        return None
    ws, parts = plan.world_size, name.split(".")
    if plan.vocab and name in ("embed.weight", "head.weight"):
        t = _part(t, 0, rank, ws)
    elif plan.attention_split and parts[2:3] == ["attn"] and parts[3] in ("wq_b", "attn_sink"):
        t = _part(t, 0, rank, ws)
    elif plan.attention_split and name.endswith("attn.wo_a.weight"):
        rows, cols, _ = _attention_slices(cfg, plan, rank)
        t = t[rows, cols]
    elif plan.attention_split and name.endswith("attn.wo_b.weight"):
        t = t[:, _attention_slices(cfg, plan, rank)[2]]
    elif plan.indexer and name.endswith(("indexer.wq_b.weight", "indexer.weights_proj.weight")):
        t = _part(t, 0, rank, ws)
    return local, t


def shard_weights(cfg: ModelConfig, weights: Mapping[str, torch.Tensor], plan: ShardPlan,
                  rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s logical weights (views of `weights`, `trunk_params` names; its routed
    experts renumbered from 0) for a trunk built by `build_rank_trunk` with `plan`: `shard_tensor`
    of every tensor.

    Raises:
        ValueError: rank outside [0, world_size).
    """
    shard_name(cfg, plan, rank, "embed.weight")  # checks the rank even for an empty dict
    return dict(s for name, t in weights.items() if (s := shard_tensor(cfg, plan, rank, name, t)))


def shard_stream(cfg: ModelConfig, plan: ShardPlan, rank: int,
                 items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`shard_tensor` of each (name, full tensor) as `items` yields it (another rank's experts
    skipped), for `Trunk.load_streamed`: the full tensor and its slice are dropped before the
    next one is pulled, so a streamed rank holds its shard plus one decoded tensor.

    Raises:
        ValueError: rank outside [0, world_size) (when the first item is pulled).
    """
    for name, t in items:
        local = shard_tensor(cfg, plan, rank, name, t)
        del t  # the slice alone keeps the tensor alive until the consumer has copied it
        if local is not None:
            yield local
        del local


# ---------------------------------------------------------------------------- parallel modules
class VocabParallelEmbedding(Embedding):
    """Rows [first, first + Vr) of the embedding; ids [...] int64 -> [..., D] summed over ranks."""

    def __init__(self, vocab_rows: int, dim: int, first: int, comm: Collectives, dtype: torch.dtype,
                 device: torch.device | str = "meta"):
        super().__init__(vocab_rows, dim, dtype, device)
        self.first, self.comm = first, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        outside = (local < 0) | (local >= self.weight.shape[0])
        y = F.embedding(local.masked_fill(outside, 0), self.weight)  # [..., D]
        return self.comm.all_reduce(y.masked_fill(outside.unsqueeze(-1), 0))


class RowParallelLinear(Linear):
    """Input-sharded linear: the local partial x_r @ W_r^T [..., O] is all-reduced in fp32
    and returned in the weight dtype (the partial itself is computed in the weight dtype)."""

    def __init__(self, in_features: int, out_features: int, comm: Collectives, dtype: torch.dtype,
                 device: torch.device | str = "meta", act_quant: bool = False):
        super().__init__(in_features, out_features, dtype, device, act_quant)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(super().forward(x))


class VocabParallelHead(Linear):
    """Vocab rows of the head: x [..., D] -> local logits [..., Vr], all-gathered to [..., V]."""

    def __init__(self, dim: int, vocab_rows: int, comm: Collectives, dtype: torch.dtype,
                 device: torch.device | str = "meta"):
        super().__init__(dim, vocab_rows, dtype, device)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather(super().forward(x))


# ---------------------------------------------------------------------------- the rank's trunk
def build_rank_trunk(cfg: ModelConfig, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                     comm: Collectives, plan: ShardPlan, dtype: torch.dtype = torch.float32,
                     quant_sim: bool | None = None, deterministic_reduce: bool | None = None,
                     device: torch.device | str = "cpu", kernels: KernelConfig | None = None) -> Trunk:
    """This rank's loaded `Trunk` shard on `device`: full logical weights in, `plan` applied.

    weights: a mapping name -> full tensor (`Trunk.load_weights`, atomic), or an iterable of
    (name, full tensor) pairs such as `dsv4.checkpoint.stream_trunk_weights` yields, each
    sliced by `shard_stream` and copied in one at a time (`Trunk.load_streamed`: the rank
    holds its shard plus one decoded tensor, never the whole model). Both give the same bits.
    Every rank must build with the same cfg, plan, dtype and flags; the returned model's
    forward calls collectives, so all ranks must then run the same calls in the same order.
    Raises:
        ValueError: plan.world_size != comm.world_size, or what `Trunk.load_weights` /
            `Trunk.load_streamed` raise.
    """
    if plan.world_size != comm.world_size:
        raise ValueError(f"plan for tp={plan.world_size} used with a group of {comm.world_size} ranks")
    model = Trunk(cfg, dtype, quant_sim, deterministic_reduce, device="meta", kernels=kernels)  # no memory yet
    _shard_modules(model, cfg, plan, comm)
    wire_quantised_gemms(model, trunk_params(cfg), model.kernels)  # the sharded linears are new modules
    _materialise(model, device)
    _restore_rope(model, cfg, device)
    if isinstance(weights, Mapping):
        model.load_weights(shard_weights(cfg, weights, plan, comm.rank))
    else:
        model.load_streamed(shard_stream(cfg, plan, comm.rank, weights))
    return model


def _shard_modules(model: Trunk, cfg: ModelConfig, plan: ShardPlan, comm: Collectives) -> None:
    """Replace the meta model's sharded parameters/modules by per-rank ones (see the docstring)."""
    ws, rank, dt = plan.world_size, comm.rank, model.dtype
    if plan.vocab:
        Vr = cfg.vocab_size // ws
        model.embed = VocabParallelEmbedding(Vr, cfg.dim, rank * Vr, comm, dt)
        model.head = VocabParallelHead(cfg.dim, Vr, comm, torch.float32)
    for block in model.layers:
        attn = block.attn
        if plan.attention_split:
            rows, cols, b_cols = _attention_slices(cfg, plan, rank)
            Hr = cfg.n_heads // ws
            n_rows, n_cols = rows.stop - rows.start, cols.stop - cols.start
            attn.n_heads, attn.groups = Hr, n_rows // cfg.o_lora_rank
            attn.wq_b.weight = frozen_param((Hr * cfg.head_dim, cfg.q_lora_rank), dt, "meta")
            attn.attn_sink = frozen_param((Hr,), torch.float32, "meta")
            attn.wo_a.weight = frozen_param((n_rows, n_cols), dt, "meta")
            attn.wo_b = RowParallelLinear(b_cols.stop - b_cols.start, cfg.dim, comm, dt,
                                          act_quant=attn.wo_b.act_quant)
        if attn.indexer is not None and plan.indexer:
            idx, Hir = attn.indexer, cfg.index_n_heads // ws
            idx.n_heads = Hir  # `score_scale` keeps the global head count
            idx.wq_b.weight = frozen_param((Hir * cfg.index_head_dim, cfg.q_lora_rank), dt, "meta")
            idx.weights_proj.weight = frozen_param((Hir, cfg.dim), dt, "meta")
            idx.reduce_scores = comm.all_reduce
        if plan.experts:
            Er = cfg.n_routed_experts // ws
            block.ffn.experts = nn.ModuleList(list(block.ffn.experts)[rank * Er:(rank + 1) * Er])
            block.ffn.expert_offset = rank * Er
            block.ffn.reduce_routed = comm.all_reduce


def _materialise(model: nn.Module, device: torch.device | str) -> None:
    """Uninitialised per-rank storage for every meta parameter and buffer (what `Module.to_empty`
    does, but keeping parameters frozen: the model is inference-only)."""
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            setattr(mod, name, frozen_param(tuple(p.shape), p.dtype, device))
        for name, b in list(mod.named_buffers(recurse=False)):
            setattr(mod, name, torch.empty(b.shape, dtype=b.dtype, device=device))


def _restore_rope(model: Trunk, cfg: ModelConfig, device: torch.device | str) -> None:
    """`_materialise` leaves non-persistent buffers uninitialised: recompute the rope tables (the
    only ones), and refuse a model that grew another non-persistent buffer."""
    persistent = set(model.state_dict())
    for i, block in enumerate(model.layers):
        block.attn.rope.inv_freq = Rope.for_layer(cfg, i, device).inv_freq
    stray = [n for n, _ in model.named_buffers() if n not in persistent and not n.endswith("rope.inv_freq")]
    if stray:
        raise RuntimeError(f"build_rank_trunk cannot restore non-persistent buffers {stray}")
