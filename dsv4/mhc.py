"""Manifold-constrained hyper-connections (mHC): C residual lanes per token (docs/model.md §4).
This module owns the lane mixing as pure functions of their arguments (the lane mean of the
taps included); it holds no parameters and no state: the calling block or stage owns the `hc_*` weights.

Dimension legend: S = tokens, C = hc_mult lanes, D = dim, M = (2 + C) * C mixing logits.

Per sublayer: `hc_pre` reduces the C lanes to one input (weights `pre`) and returns the
`post` weights and the doubly-stochastic `comb` [C, C] (Sinkhorn); `hc_post` writes the
sublayer output back: out[k] = post[k] * y + sum_j comb[j, k] * res[j] (row j = source lane,
column k = destination lane). `hc_head` is the final lane reduction (sigmoid weights, no
Sinkhorn). All mixing math is fp32; outputs are cast to the residual dtype.
"""

from __future__ import annotations

import torch


def _mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """(flatten(x) @ fn^T) * rsqrt(mean(flatten(x)^2) + norm_eps): x [S, C, D], fn [K, C*D] -> [S, K] fp32."""
    xf = x.flatten(-2).float()  # [S, C*D]
    return (xf @ fn.T) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)


def split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_mult: int,
                   hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split mixing logits into pre [..., C], post [..., C], comb [..., C, C] (docs/model.md §4.2).

    mixes [..., M] fp32, scale [3], base [M]. pre = sigmoid(.) + hc_eps; post = 2 sigmoid(.);
    comb = row softmax + hc_eps, then a column normalisation, then `iters - 1` (row, column)
    normalisation pairs (the last step is a column step).
    """
    C = hc_mult
    pre = torch.sigmoid(mixes[..., :C] * scale[0] + base[:C]) + hc_eps
    post = 2 * torch.sigmoid(mixes[..., C:2 * C] * scale[1] + base[C:2 * C])
    logits = (mixes[..., 2 * C:] * scale[2] + base[2 * C:]).unflatten(-1, (C, C))  # [..., C(j), C(k)]
    comb = torch.softmax(logits, dim=-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return pre, post, sinkhorn_pairs(comb, hc_eps, iters - 1)


def sinkhorn_pairs(comb: torch.Tensor, hc_eps: float, n: int) -> torch.Tensor:
    """n (row, column) normalisation pairs of comb [..., C, C] fp32 (the tail of
    `split_sinkhorn`; n <= 0: comb as it is).

    Each element's arithmetic is divisions, additions and sums over the C lanes of its own
    row: no GEMM and no transcendental function, so the result of a row is the same
    whatever the leading shape (the batched forward runs these pairs once over every row of
    a pass, exact numerics included, `dsv4.batch.layer`)."""
    for _ in range(n):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return comb


def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
           hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lanes -> one sublayer input (docs/model.md §4.1).

    x [S, C, D] (residual dtype), fn [M, C*D], scale [3], base [M] (fp32).
    Returns y [S, D] in x.dtype (not normalised), post [S, C] and comb [S, C, C] fp32.
    """
    pre, post, comb = split_sinkhorn(_mixes(x, fn, norm_eps), scale, base, x.shape[-2], hc_eps, iters)
    y = (pre.unsqueeze(-1) * x.float()).sum(-2)  # [S, D]
    return y.to(x.dtype), post, comb


def hc_post(y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """One -> lanes (docs/model.md §4.3): out[s, k] = post[s, k] y[s] + sum_j comb[s, j, k] res[s, j].

    y [S, D], res [S, C, D], post [S, C], comb [S, C(j source), C(k dest)]; returns [S, C, D] in y.dtype.
    """
    out = post.unsqueeze(-1) * y.float().unsqueeze(-2) + torch.einsum("sjk,sjd->skd", comb, res.float())
    return out.to(y.dtype)


def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
            hc_eps: float) -> torch.Tensor:
    """Final lane reduction (docs/model.md §4.4): x [S, C, D], fn [C, C*D], scale [1], base [C] -> [S, D] in x.dtype.

    w = sigmoid(mixes * scale + base) + hc_eps; out = sum_c w[c] x[c].
    """
    w = torch.sigmoid(_mixes(x, fn, norm_eps) * scale + base) + hc_eps  # [S, C]
    return (w.unsqueeze(-1) * x.float()).sum(-2).to(x.dtype)


def lane_mean(x: torch.Tensor) -> torch.Tensor:
    """Plain mean over lanes (the DSpark target tap, docs/model.md §3 / §9.2): x [S, C, D] -> [S, D] fp32."""
    return x.float().mean(-2)
