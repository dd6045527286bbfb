"""The layers of the DSpark draft module (docs/model.md §9.1): a stage (`DSparkStage`, a full
trunk `Block` with the DSpark attention), its MoE with this rank's routed experts
(`DraftMoE`), and the Markov and confidence heads of the last stage. This module owns their
parameters and per-block math; the draft forward, the rings and the checks are
`dsv4.dspark`'s, the sharding plan `dsv4.dspark_tp`'s.

Dimension legend: B = dspark_block_size (block slots), N = blocks in one forward (sessions),
D = dim, C = hc_mult, H = heads (this TP rank's), Dh = head_dim, W = window_size,
K = key-list length, V = vocab, Rm = dspark_markov_rank, k = n_activated_experts.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from dsv4.attention import sparse_attn
from dsv4.config import ModelConfig
from dsv4.dspark_tp import DraftTP
from dsv4.layers import Embedding, Linear, RMSNorm, frozen_param
from dsv4.moe import Expert, Gate, reduce_routes
from dsv4.rope import Rope
from dsv4.trunk import Block

Reduce = Callable[[torch.Tensor], torch.Tensor]


class DraftMoE(nn.Module):
    """A stage's MoE with this rank's routed experts (docs/model.md §6, docs/architecture.md §10).

    gate (replicated, routes over all E experts), `experts` = ModuleDict of the local experts
    keyed by global id, `shared_experts` (replicated). forward(x [N, D], ids [N]) -> [N, D]:
    routed sum over local experts (fp32, a token's partials folded in ascending expert id as
    `dsv4.moe.MoE` does), `reduce` (the TP all-reduce) of that sum, THEN + shared expert.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, quant_sim: bool,
                 deterministic_reduce: bool, experts: range, reduce: Reduce, device: torch.device | str):
        super().__init__()
        D, I, L = cfg.dim, cfg.moe_inter_dim, cfg.swiglu_limit
        self.deterministic_reduce, self.reduce = deterministic_reduce, reduce
        self.gate = Gate(cfg, layer_id, device)
        routed_aq = quant_sim and cfg.expert_dtype in ("fp4", "fp8")
        self.experts = nn.ModuleDict({str(e): Expert(D, I, L, dtype, device, routed_aq) for e in experts})
        self.shared_experts = Expert(D, I, L, dtype, device, quant_sim and cfg.weight_dtype == "fp8")

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x, ids)
        routed = self.reduce(self.routed(x, weights, experts))  # before the shared expert: counted once
        return (routed + self.shared_experts(x).float()).to(x.dtype)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [N, D], weights [N, k] fp32, experts [N, k] -> [N, D] fp32; routes to non-local experts add 0."""
        N, k = experts.shape
        partial = x.new_zeros(N, k, x.shape[1], dtype=torch.float32)  # [N, k, D] one row per route
        for e in torch.unique(experts).tolist():  # ascending expert id
            if str(e) not in self.experts:
                continue
            tok, slot = torch.nonzero(experts == e, as_tuple=True)  # ascending token
            partial[tok, slot] = self.experts[str(e)](x[tok], weights[tok, slot]).float()
        return reduce_routes(partial, experts, self.deterministic_reduce)


class MarkovHead(nn.Module):
    """markov_w1 [V, Rm] (embedding of the previous token), markov_w2 [V, Rm] (rank-Rm bigram
    bias head), fp32 (docs/model.md §9.1, §9.5)."""

    def __init__(self, vocab_size: int, rank: int, device: torch.device | str):
        super().__init__()
        self.markov_w1 = Embedding(vocab_size, rank, torch.float32, device)
        self.markov_w2 = Linear(rank, vocab_size, torch.float32, device)


class ConfidenceHead(nn.Module):
    """proj [1, D + Rm] fp32, no bias: confidence logit of [hidden ; markov embedding] (docs/model.md §9.5)."""

    def __init__(self, dim: int, rank: int, device: torch.device | str):
        super().__init__()
        self.proj = Linear(dim + rank, 1, torch.float32, device)


class DSparkStage(Block):
    """Stage s = a full `Block` with layer id n_layers + s (ratio 0, rope theta without YaRN,
    scored gate) whose MoE is a `DraftMoE`; stage 0 adds main_proj [D, T*D] + main_norm [D];
    the last stage adds norm [D], hc_head_fn [C, C*D] / _base [C] / _scale [1], markov_head
    and (optionally) confidence_head (docs/model.md §9.1). Built on the meta device, then materialised
    on `device` so non-local experts never allocate memory.
    """

    def __init__(self, cfg: ModelConfig, local_cfg: ModelConfig, stage: int, dtype: torch.dtype,
                 quant_sim: bool, deterministic_reduce: bool, tp: DraftTP, confidence_head: bool,
                 device: torch.device | str):
        layer_id = cfg.n_layers + stage
        super().__init__(local_cfg, layer_id, dtype, quant_sim, deterministic_reduce, device="meta")
        self.reduce = tp.all_reduce
        self.ffn = DraftMoE(local_cfg, layer_id, dtype, quant_sim, deterministic_reduce,
                            tp.local_experts(cfg), tp.all_reduce, "meta")
        D, C, meta = cfg.dim, cfg.hc_mult, "meta"
        if stage == 0:
            self.main_proj = Linear(cfg.tap_width, D, dtype, meta, act_quant=quant_sim and cfg.weight_dtype == "fp8")
            self.main_norm = RMSNorm(D, cfg.norm_eps, meta)
        if stage == cfg.n_mtp_layers - 1:
            self.norm = RMSNorm(D, cfg.norm_eps, meta)
            self.hc_head_fn = frozen_param((C, C * D), torch.float32, meta)
            self.hc_head_base = frozen_param((C,), torch.float32, meta)
            self.hc_head_scale = frozen_param((1,), torch.float32, meta)
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank, meta)
            if confidence_head:
                self.confidence_head = ConfidenceHead(D, cfg.dspark_markov_rank, meta)
        self.to_empty(device=device)
        self.attn.rope = Rope.for_layer(cfg, layer_id, device)  # to_empty left the table uninitialised
        stray = [n for n, _ in self.named_buffers() if n != "attn.rope.inv_freq"]
        assert not stray, f"buffers {stray} would be uninitialised after to_empty"

    def draft_attention(self, x: torch.Tensor, ring: torch.Tensor, n_ctx: int, pos: torch.Tensor) -> torch.Tensor:
        """DSparkAttention (docs/model.md §9.4) of one block: x [B, D] (normed sublayer input) at
        block positions pos [B]. Keys = [ring [W, Dh] | the block's own kv [B, Dh]]; every slot
        attends the first `n_ctx` ring slots (positions max(0, p-W+1)..p) and the whole block
        (non-causal). Returns [B, D] after the output projection and the first all-reduce.
        """
        W, B, dev = ring.shape[0], x.shape[0], x.device
        idx = torch.cat((torch.arange(n_ctx, device=dev), W + torch.arange(B, device=dev)))[None]  # [1, K]
        return self.draft_attention_batch(x, ring, idx, pos)

    def draft_attention_batch(self, x: torch.Tensor, ctx: torch.Tensor, idx: torch.Tensor,
                              pos: torch.Tensor) -> torch.Tensor:
        """`draft_attention` of N blocks of B slots at once: x [N*B, D] at block positions pos
        [N*B], ctx [N*W, Dh] the N rings stacked, idx [N, K] int64 each block's key list into
        [ctx | the blocks' own kv [N*B, Dh]] (-1 = masked): its live ring slots, then its own
        B rows. Returns [N*B, D] after the output projection and the first all-reduce.
        """
        attn, N = self.attn, idx.shape[0]
        q, _ = attn.project_q(x, pos)  # [N*B, H, Dh]
        keys = torch.cat((ctx, attn.project_kv(x, pos)))  # [N*W + N*B, Dh]
        rows = idx.repeat_interleave(x.shape[0] // N, dim=0)  # [N*B, K]: a block's list for each of its slots
        o = sparse_attn(q, keys, attn.attn_sink, rows, attn.softmax_scale)  # [N*B, H, Dh]
        return self.reduce(attn.project_out(o, pos))
