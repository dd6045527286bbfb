"""Mixture of experts: gate (hash or scored), clamped SwiGLU experts, one shared expert
(docs/model.md §6). This module owns routing, the experts and the fixed-order combine; it
holds no per-sequence state, does not choose the numerics recipe (`dsv4.numerics` calls
`combine_tiled` in exact mode) and does not shard itself (`dsv4.tp` sets its local
experts; the draft module's `DraftMoE` is in `dsv4.dspark`).

Dimension legend: N = tokens, D = dim, I = moe_inter_dim, E = n_routed_experts,
k = n_activated_experts (routes per token), V = vocab.

Combine (`Settings.moe_deterministic_reduce`): every route (token, slot) gets an
fp32 partial = expert(x[token], weight) [D]. With `deterministic_reduce` the partials of a
token are summed in ascending expert-id order (a fixed left fold), so the output does not
depend on the order in which the gate lists a token's experts; without it they are summed
with `index_add_` in routing (slot) order. Experts are evaluated in ascending id order on
their tokens in ascending token order either way.

Exact mode (`combine_tiled`, `dsv4.numerics.ExactNumerics`): each expert runs on fixed tiles
of the rows routed to it (never one GEMM over however many rows the batch routes there), so
a token's expert outputs do not depend on which other tokens, of its own session or of
others, are in the call; the combine is the same fold.

fp4 expert GEMM (`MoE.use_fp4_gemm`, wired by `dsv4.quantised`): routed experts stored as
fp4 can run the routed fp4 kernel (`kernels.fp4_gemm.fp4_moe_gemm`) on their packed e2m1
bytes, all routes of a call at once, when every local expert weight is exactly an fp4
weight. Calls with few rows (decode, verify: `small_m`) take its small-batch path when
`multi_token` is set (one row always does); prefill takes the grouped path. Exact mode always
takes the small-batch path, whose rows do not depend on each other. Per-route rows are
rounded to the model dtype as `Expert` rounds them, then folded by `_reduce`, so the kernel
changes results by GEMM rounding only.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.codecs import act_quant_fp8, fp4_decode, fp4_encode
from dsv4.config import ACT_QUANT_BLOCK, ModelConfig
from dsv4.layers import Linear, frozen_param


class Gate(nn.Module):
    """Router of one layer (docs/model.md §6.1).

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
    """Clamped SwiGLU (docs/model.md §6.2): w1, w3 [I, D], w2 [D, I] in the model dtype.

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
        h = swiglu(self.w1(x).float(), self.w3(x).float(), self.limit, weights)
        return self.w2(h.to(self.w2.weight.dtype))


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, weights: torch.Tensor | None) -> torch.Tensor:
    """Clamped SwiGLU of fp32 projections [..., I] (limit 0: no clamp), times the routing
    weights [...] when given -> [..., I] fp32."""
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    h = F.silu(gate) * up
    return h if weights is None else weights.unsqueeze(-1) * h


Route = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class MoE(nn.Module):
    """Routed experts + one shared expert of one layer (docs/model.md §6.2): x [N, D], ids [N] -> [N, D].

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
        self.fp4_gemm: Callable[..., torch.Tensor] | None = None
        self.multi_token = False
        self.fp4_weights: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None  # w1/w2/w3 -> packed, scale

    def forward(self, x: torch.Tensor, ids: torch.Tensor, route: Route | None = None) -> torch.Tensor:
        """x [N, D], ids [N] -> [N, D]; `route(x, weights, experts)` -> routed sum [N, D] fp32
        (default `combine`; the trunk's numerics strategy passes its own)."""
        weights, experts = self.gate(x, ids)
        y = (route or self.combine)(x, weights, experts)
        if self.reduce_routed is not None:
            y = self.reduce_routed(y)
        y = y + self.shared_experts(x).float()
        return y.to(x.dtype)

    def combine(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                small_m: bool = False) -> torch.Tensor:
        """Routed sum: x [N, D], weights [N, k] fp32, experts [N, k] int64 -> [N, D] fp32.

        Under TP only this rank's experts contribute (the other routes' rows stay 0).
        `small_m`: a decode or verify call (selects the fp4 kernel's path, module docstring).
        """
        if self.fp4_weights is not None:
            return self._reduce(self._routed_fp4(x, weights, experts, small_m and self.multi_token), experts)
        N, k = experts.shape
        lo, hi = self.expert_offset, self.expert_offset + len(self.experts)
        partial = x.new_zeros(N, k, x.shape[1], dtype=torch.float32)  # [N, k, D] one row per route
        for e in torch.unique(experts).tolist():  # ascending expert id
            if not lo <= e < hi:
                continue  # another TP rank's expert
            tok, slot = torch.nonzero(experts == e, as_tuple=True)  # ascending token
            partial[tok, slot] = self.experts[e - lo](x[tok], weights[tok, slot]).float()
        return self._reduce(partial, experts)

    def combine_tiled(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                      tile: int) -> torch.Tensor:
        """Exact-mode routed sum: like `combine`, but each expert runs on fixed tiles of `tile`
        rows (the tokens routed to it in ascending order, the last tile zero-padded), so a
        token's expert output is computed by the same-shaped GEMM whichever other tokens share
        the expert. x [N, D], weights [N, k] fp32, experts [N, k] -> [N, D] fp32.

        The tiles' rows and weights are gathered in one op each (padding rows read a zero row
        and weight 0, their output discarded) and the outputs scattered back in one op."""
        if self.fp4_weights is not None:  # the small-batch path: one program per token
            return self._reduce(self._routed_fp4(x, weights, experts, True), experts)
        N, k = experts.shape
        lo, hi = self.expert_offset, self.expert_offset + len(self.experts)
        flat = experts.flatten()  # [N*k], route r = token r // k, slot r % k
        order = torch.argsort(flat, stable=True).tolist()  # by expert, ascending token within one
        counts = torch.bincount(flat, minlength=hi).tolist()
        routes, tiles, at = [], [], 0  # routes: every tile's route ids, N*k = padding
        for e in range(hi):
            mine, at = order[at:at + counts[e]], at + counts[e]
            if not mine or e < lo:
                continue  # no token, or another TP rank's expert
            for c in range(0, len(mine), tile):
                part = mine[c:c + tile]
                tiles.append((e - lo, len(routes), len(part)))
                routes += part + [N * k] * (tile - len(part))
        partial = x.new_zeros(N * k, x.shape[1], dtype=torch.float32)  # one row per route
        if not tiles:
            return self._reduce(partial.view(N, k, -1), experts)
        idx = torch.tensor(routes, device=x.device)
        xs = torch.cat((x, x.new_zeros(1, x.shape[1])))[idx // k]  # [T*tile, D]
        ws = torch.cat((weights.flatten(), weights.new_zeros(1)))[idx]  # [T*tile]
        outs = [self.experts[e](xs[a:a + tile], ws[a:a + tile])[:n] for e, a, n in tiles]
        real = torch.tensor([r for _, a, n in tiles for r in routes[a:a + n]], device=x.device)
        partial[real] = torch.cat(outs).float()
        return self._reduce(partial.view(N, k, -1), experts)

    # ------------------------------------------------------------------ fp4 expert kernel
    def use_fp4_gemm(self, gemm: Callable[..., torch.Tensor], multi_token: bool) -> None:
        """Run the routed experts with `gemm` (`kernels.fp4_gemm.fp4_moe_gemm`) once `pack` has
        found every local expert weight to be an exact fp4 weight; `multi_token`: several-row
        decode/verify calls take its small-batch path."""
        self.fp4_gemm, self.multi_token = gemm, multi_token

    def pack(self) -> bool:
        """After a weight load: stack the local experts' fp4 encodings [E, O, I/2] + scales for
        the kernel if every one is exact, else use the per-expert torch path. Returns whether
        the kernel runs."""
        self.fp4_weights = None
        if self.fp4_gemm is None or self.gate.weight.device.type == "meta":
            return False
        packed = {}
        for part in ("w1", "w2", "w3"):
            codes = []
            for expert in self.experts:
                w = getattr(expert, part).weight.detach().float()
                code = fp4_encode(w)
                if not torch.equal(fp4_decode(*code), w):
                    return False
                codes.append(code)
            packed[part] = (torch.stack([c for c, _ in codes]), torch.stack([s for _, s in codes]))
        self.fp4_weights = packed
        return True

    def _routed_fp4(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                    small_batch: bool) -> torch.Tensor:
        """Per-route rows [N, k, D] fp32 of every local route through the fp4 kernel, rounded to
        the model dtype as `Expert.forward` rounds them; other ranks' routes are 0."""
        first = self.experts[0]
        dtype, lo = first.w1.weight.dtype, self.expert_offset
        local = (experts >= lo) & (experts < lo + len(self.experts))
        ex = torch.where(local, experts - lo, 0)
        w = torch.where(local, weights, 0.0)  # a zero weight makes the route's h, and so its row, 0

        def gemm(inp: torch.Tensor, part: str) -> torch.Tensor:
            inp = inp.to(dtype)
            if first.w1.act_quant:
                inp = act_quant_fp8(inp, ACT_QUANT_BLOCK)
            return self.fp4_gemm(inp, *self.fp4_weights[part], ex, small_batch=small_batch).to(dtype).float()

        h = swiglu(gemm(x, "w1"), gemm(x, "w3"), first.limit, w)  # [N, k, I]
        return gemm(h, "w2")  # [N, k, D]

    def _reduce(self, partial: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return reduce_routes(partial, experts, self.deterministic_reduce)


def reduce_routes(partial: torch.Tensor, experts: torch.Tensor, deterministic: bool) -> torch.Tensor:
    """Per-route partials [N, k, D] fp32, experts [N, k] -> [N, D]: a left fold in ascending
    expert id (`deterministic`), else `index_add_` in routing order (module docstring)."""
    N, k, D = partial.shape
    if not deterministic:
        rows = torch.arange(N, device=partial.device).repeat_interleave(k)  # [N*k] token of each route
        return partial.new_zeros(N, D).index_add_(0, rows, partial.flatten(0, 1))
    order = experts.argsort(dim=1, stable=True)  # [N, k] slots by ascending expert id
    partial = partial.gather(1, order.unsqueeze(-1).expand_as(partial))
    y = partial[:, 0].clone()
    for j in range(1, k):
        y += partial[:, j]
    return y
