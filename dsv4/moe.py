"""Mixture of experts: gate (hash or scored), clamped SwiGLU experts, one shared expert (spec §6).

Dimension legend: N = tokens, D = dim, I = moe_inter_dim, E = n_routed_experts,
k = n_activated_experts (routes per token), V = vocab.

Combine (DESIGN.md §11, `DSV4_MOE_DETERMINISTIC_REDUCE`): every route (token, slot) gets an
fp32 partial = expert(x[token], weight) [D]. With `deterministic_reduce` the partials of a
token are summed in ascending expert-id order (a fixed left fold), so the output does not
depend on the order in which the gate lists a token's experts; without it they are summed
with `index_add_` in routing (slot) order. Experts are evaluated in ascending id order on
their tokens in ascending token order either way.

Exact mode (`n_real` given, `Trunk(verify_numerics="exact")`): every route of the first
n_real rows is evaluated on its own token (one 1-row call per route, never a group of the
tokens that share an expert), so a token's expert outputs do not depend on which other
tokens are in the call; the combine is the same fold.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.config import ModelConfig
from dsv4.layers import Linear, frozen_param


class Gate(nn.Module):
    """Router of one layer (spec §6.1).

    weight [E, D] fp32. Scored layers (layer_id >= n_hash_layers) hold `bias` [E] fp32, used
    only to select experts; hash layers hold the buffer `tid2eid` [V, k] int64 (experts by
    token id). Weights are always the unbiased scores of the chosen experts, renormalised
    (non-softmax score functions) and multiplied by route_scale.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int, device: torch.device | str = "cpu"):
        super().__init__()
        self.topk, self.score_func, self.route_scale = cfg.n_activated_experts, cfg.score_func, cfg.route_scale
        self.hash = cfg.is_hash_layer(layer_id)
        self.weight = frozen_param((cfg.n_routed_experts, cfg.dim), torch.float32, device)
        if self.hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.topk, dtype=torch.int64, device=device))
            self.bias = None
        else:
            self.bias = frozen_param((cfg.n_routed_experts,), torch.float32, device)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> affinity scores [N, E] fp32 (softmax | sigmoid | sqrt(softplus))."""
        logits = F.linear(x.float(), self.weight)
        if self.score_func == "softmax":
            return logits.softmax(-1)
        if self.score_func == "sigmoid":
            return logits.sigmoid()
        return F.softplus(logits).sqrt()

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D], ids [N] int64 -> (weights [N, k] fp32, experts [N, k] int64), in routing order."""
        s = self.scores(x)
        if self.hash:
            experts = self.tid2eid[ids]
        else:
            experts = (s + self.bias).topk(self.topk, dim=-1).indices
        weights = s.gather(1, experts)
        if self.score_func != "softmax":
            # denominator summed in ascending expert-id order: independent of the route order
            weights = weights / s.gather(1, experts.sort(-1).values).sum(-1, keepdim=True)
        return weights * self.route_scale, experts


class Expert(nn.Module):
    """Clamped SwiGLU (spec §6.2): w1, w3 [I, D], w2 [D, I] in the model dtype.

    h = silu(min(w1 x, L)) * clamp(w3 x, -L, L) in fp32 (L = swiglu_limit, 0 = no clamp);
    the routing weight multiplies h before w2. x [N, D] -> [N, D] in the model dtype.
    """

    def __init__(self, dim: int, inter_dim: int, swiglu_limit: float, dtype: torch.dtype,
                 device: torch.device | str = "cpu", act_quant: bool = False):
        super().__init__()
        self.limit = swiglu_limit
        self.w1 = Linear(dim, inter_dim, dtype, device, act_quant)
        self.w2 = Linear(inter_dim, dim, dtype, device, act_quant)
        self.w3 = Linear(dim, inter_dim, dtype, device, act_quant)

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, D], weights [N] fp32 or None -> [N, D]."""
        gate, up = self.w1(x).float(), self.w3(x).float()
        if self.limit > 0:
            up = up.clamp(-self.limit, self.limit)
            gate = gate.clamp(max=self.limit)
        h = F.silu(gate) * up
        if weights is not None:
            h = weights.unsqueeze(-1) * h
        return self.w2(h.to(self.w2.weight.dtype))


class MoE(nn.Module):
    """Routed experts + one shared expert of one layer (spec §6.2): x [N, D], ids [N] -> [N, D].

    `deterministic_reduce` selects the combine order (see the module docstring).
    """

    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, quant_sim: bool,
                 deterministic_reduce: bool, device: torch.device | str = "cpu"):
        super().__init__()
        self.deterministic_reduce = deterministic_reduce
        D, I, L = cfg.dim, cfg.moe_inter_dim, cfg.swiglu_limit
        self.gate = Gate(cfg, layer_id, device)
        routed_aq = quant_sim and cfg.expert_dtype in ("fp4", "fp8")
        self.experts = nn.ModuleList(Expert(D, I, L, dtype, device, routed_aq) for _ in range(cfg.n_routed_experts))
        self.shared_experts = Expert(D, I, L, dtype, device, quant_sim and cfg.weight_dtype == "fp8")
        # Tensor-parallel hook points, set only by `dsv4.tp` (TP=1 leaves them as they are):
        # `experts` then holds this rank's experts [expert_offset, expert_offset + len(experts)),
        # and `reduce_routed` sums the fp32 routed output [N, D] over the ranks BEFORE the
        # replicated shared expert is added, so the shared expert is counted once.
        self.expert_offset = 0
        self.reduce_routed: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, ids: torch.Tensor, n_real: int | None = None) -> torch.Tensor:
        """x [N, D], ids [N] -> [N, D]; `n_real`: exact mode, routed experts only for rows < n_real."""
        weights, experts = self.gate(x, ids)
        if n_real is None:
            y = self.combine(x, weights, experts)
        else:
            y = self.combine_per_token(x, weights, experts, n_real)
        if self.reduce_routed is not None:
            y = self.reduce_routed(y)
        y = y + self.shared_experts(x).float()
        return y.to(x.dtype)

    def combine(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Routed sum: x [N, D], weights [N, k] fp32, experts [N, k] int64 -> [N, D] fp32.

        Under TP only this rank's experts contribute (the other routes' rows stay 0).
        """
        N, k = experts.shape
        lo, hi = self.expert_offset, self.expert_offset + len(self.experts)
        partial = x.new_zeros(N, k, x.shape[1], dtype=torch.float32)  # [N, k, D] one row per route
        for e in torch.unique(experts).tolist():  # ascending expert id
            if not lo <= e < hi:
                continue  # another TP rank's expert
            tok, slot = torch.nonzero(experts == e, as_tuple=True)  # ascending token
            partial[tok, slot] = self.experts[e - lo](x[tok], weights[tok, slot]).float()
        return self._reduce(partial, experts)

    def combine_per_token(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                          n_real: int) -> torch.Tensor:
        """Exact-mode routed sum: like `combine`, but each route of rows < n_real is its own
        1-row expert call; rows >= n_real (padding) get 0."""
        N, k = experts.shape
        lo, hi = self.expert_offset, self.expert_offset + len(self.experts)
        partial = x.new_zeros(N, k, x.shape[1], dtype=torch.float32)  # [N, k, D] one row per route
        for t, row in enumerate(experts[:n_real].tolist()):
            for slot, e in enumerate(row):
                if lo <= e < hi:
                    partial[t, slot] = self.experts[e - lo](x[t:t + 1], weights[t, slot:slot + 1])[0].float()
        return self._reduce(partial, experts)

    def _reduce(self, partial: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Per-route partials [N, k, D] fp32 -> [N, D] in the configured order (module docstring)."""
        N, k, D = partial.shape
        if not self.deterministic_reduce:
            rows = torch.arange(N, device=partial.device).repeat_interleave(k)  # [N*k] token of each route
            return partial.new_zeros(N, D).index_add_(0, rows, partial.flatten(0, 1))
        order = experts.argsort(dim=1, stable=True)  # [N, k] slots by ascending expert id
        partial = partial.gather(1, order.unsqueeze(-1).expand_as(partial))
        y = partial[:, 0].clone()
        for j in range(1, k):
            y += partial[:, j]
        return y
