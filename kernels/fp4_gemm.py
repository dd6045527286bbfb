"""fp4 e2m1 dequant-GEMM for routed experts (docs/model.md §6.3), with a small-batch and a grouped
path, beside its torch reference `fp4_moe_gemm_ref`. This module owns how routed-expert
GEMMs and their combine are computed; it never routes tokens (`dsv4.moe`), never packs or
owns weights (`MoE.pack`) and takes the small-batch choice as an argument, never from the
environment.

Dimension legend: M = tokens, k = routes per token, E = experts, N = output features,
K = input features (reduction, a multiple of 32), T = row tiles of the grouped path.

Weights (kernels.formats.fp4_decode): packed [E, N, K/2] int8 (low nibble = even column),
ue8m0 scales [E, N, K/32]; W_e[n, c] = e2m1[n, c] * 2^(scale[n, c // 32] - 127), decoded in
the kernel. Route (m, j) multiplies input row x[m] ([M, K]: shared by a token's routes) or
x[m, j] ([M, k, K]: one input per route, e.g. the w2 input h) by W_{experts[m, j]}^T.
Output: per-route rows [M, k, N] fp32, or with `combine` their sum per token [M, N] fp32.

The combine is a fixed-order left fold, never an atomic add: with `deterministic` (the
`DSPARK_MOE_DETERMINISTIC_REDUCE` default) a token's routes are summed in ascending expert id,
so the result does not depend on the order the gate lists them; otherwise in slot order.

Paths. small-batch (`_fp4_moe_small_kernel`): one program per (token, N block) walks the
token's routes in the fold order and each route's K in order: every expert byte a token
needs is read once for it, the right shape for decode and a few-token verify, and a token's
result does not depend on the other tokens in the call. grouped (`_fp4_moe_grouped_kernel`):
routes sorted by expert, tiles of BLOCK_M routes of one expert through tl.dot (prefill);
per-route rows, then the same fold. A single token always takes the small path; several
take it when `small_batch` (`DSPARK_MOE_MULTI_TOKEN_FP4=1`): a multi-token verify on the
grouped path pays the prefill tiling for a handful of rows (docs/architecture.md §12).
"""

from __future__ import annotations

import torch

from kernels.formats import FP4_BLOCK, fp4_decode
from kernels.checks import interpreting, out_tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch references work without triton
    triton = None


# ----------------------------------------------------------------------------- references
def _route_inputs(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [M, K] or [M, k, K] -> [M, k, K] fp32 (a token's row repeated for each of its routes)."""
    return (x.float().unsqueeze(1).expand(-1, k, -1) if x.ndim == 2 else x.float())


def fold_routes(partial: torch.Tensor, experts: torch.Tensor, deterministic: bool) -> torch.Tensor:
    """Per-route rows [M, k, N] fp32 -> [M, N]: a left fold in ascending expert id
    (`deterministic`) or in slot order (dsv4.moe.MoE._reduce's two orders)."""
    if deterministic:
        order = experts.argsort(dim=1, stable=True)  # [M, k] slots by ascending expert id
        partial = partial.gather(1, order.unsqueeze(-1).expand_as(partial))
    y = partial[:, 0].clone()
    for j in range(1, partial.shape[1]):
        y += partial[:, j]
    return y


def fp4_moe_gemm_ref(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, experts: torch.Tensor,
                     combine: bool = False, deterministic: bool = True) -> torch.Tensor:
    """Torch reference: x [M, K] or [M, k, K], packed [E, N, K/2], scale [E, N, K/32],
    experts [M, k] -> [M, k, N] fp32, or [M, N] fp32 with `combine` (module docstring)."""
    M, k = experts.shape
    xr = _route_inputs(x, k)  # [M, k, K]
    out = xr.new_zeros(M, k, packed.shape[1])
    for e in torch.unique(experts).tolist():
        tok, slot = torch.nonzero(experts == e, as_tuple=True)
        out[tok, slot] = xr[tok, slot] @ fp4_decode(packed[e], scale[e]).T  # reads the expert once
    return fold_routes(out, experts, deterministic) if combine else out


def fp4_gemm_ref(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Dense reference: x [M, K], packed [N, K/2], scale [N, K/32] -> x @ W^T [M, N] fp32."""
    return x.float() @ fp4_decode(packed, scale).T


# ----------------------------------------------------------------------------- kernels
if triton is not None:
    @triton.jit
    def _fp4_tile(w_ptr, s_ptr, e, offs_n, offs_k, mask, stride_we, stride_wn, stride_se, stride_sn):
        """Dequantised W_e[offs_n, offs_k] as fp32 [BN, BK]: nibble, e2m1 value, ue8m0 scale."""
        b = tl.load(w_ptr + e * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :] // 2,
                    mask=mask, other=0).to(tl.int32)
        code = (b >> ((offs_k[None, :] % 2) * 4)) & 0xF  # low nibble = even column
        mag_code = code & 7
        ex, man = mag_code >> 1, (mag_code & 1).to(tl.float32)
        step = tl.where(ex == 1, 0.5, tl.where(ex == 2, 1.0, 2.0))  # 2^(ex - 2)
        mag = tl.where(ex == 0, 0.5 * man, (2.0 + man) * step)  # 0 .5 1 1.5 2 3 4 6
        val = tl.where((code & 8) != 0, -mag, mag)
        sc = tl.load(s_ptr + e * stride_se + offs_n[:, None] * stride_sn + offs_k[None, :] // 32,
                     mask=mask, other=127).to(tl.int32)
        return val * ((sc << 23).to(tl.float32, bitcast=True))  # 2^(sc - 127); sc >= 1 in practice

    @triton.jit
    def _fp4_moe_small_kernel(
        # Pointers: x [M, (k,) K], packed [E, N, K/2] uint8, scale [E, N, K/32] uint8,
        # experts [M, k] int32, order [M, k] int32 (slots in fold order), out [M, N] or [M, k, N] fp32
        x_ptr, w_ptr, s_ptr, experts_ptr, order_ptr, out_ptr,
        # Sizes
        N, K,
        # Strides (elements): x's token / route (0 when shared) rows, weight/scale expert and
        # row strides, out's token / route rows
        stride_xm, stride_xj, stride_we, stride_wn, stride_se, stride_sn, stride_om, stride_oj,
        # Meta-parameters
        TOPK: tl.constexpr, COMBINE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """Grid (M, cdiv(N, BLOCK_N)): one program per (token, N block), routes in fold order."""
        m = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(TOPK):
            slot = tl.load(order_ptr + m * TOPK + j)
            e = tl.load(experts_ptr + m * TOPK + slot)
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):  # K in order: no split-K
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = offs_k < K
                xk = tl.load(x_ptr + m * stride_xm + slot * stride_xj + offs_k, mask=k_mask, other=0.0)
                w = _fp4_tile(w_ptr, s_ptr, e, offs_n, offs_k, n_mask[:, None] & k_mask[None, :],
                              stride_we, stride_wn, stride_se, stride_sn)
                acc += tl.sum(w * xk.to(tl.float32)[None, :], axis=1)  # GEMV: M is too small for tl.dot
            if COMBINE:
                total += acc  # fixed-order fold, no atomics
            else:
                tl.store(out_ptr + m * stride_om + slot * stride_oj + offs_n, acc, mask=n_mask)
        if COMBINE:
            tl.store(out_ptr + m * stride_om + offs_n, total, mask=n_mask)

    @triton.jit
    def _fp4_moe_grouped_kernel(
        # Pointers: x [M, (k,) K], packed, scale as above; routes [M*k] int32 sorted by expert;
        # tile_expert, tile_start, tile_rows [T] int32; out [M, k, N] fp32 per-route rows
        x_ptr, w_ptr, s_ptr, routes_ptr, tile_expert_ptr, tile_start_ptr, tile_rows_ptr, out_ptr,
        # Sizes
        N, K,
        # Strides (elements)
        stride_xm, stride_xj, stride_we, stride_wn, stride_se, stride_sn, stride_om, stride_oj,
        # Meta-parameters; DOT_F32: fp32 tiles for tl.dot (fp32 input, or the interpreter)
        TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        """Grid (T, cdiv(N, BLOCK_N)): one program per (tile of <= BLOCK_M routes of one expert, N block)."""
        t = tl.program_id(0)
        e = tl.load(tile_expert_ptr + t)
        start, rows = tl.load(tile_start_ptr + t), tl.load(tile_rows_ptr + t)
        offs_r = tl.arange(0, BLOCK_M)
        r_mask = offs_r < rows
        route = tl.load(routes_ptr + start + offs_r, mask=r_mask, other=0)
        tok, slot = route // TOPK, route % TOPK
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            xt = tl.load(x_ptr + tok[:, None] * stride_xm + slot[:, None] * stride_xj + offs_k[None, :],
                         mask=r_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK] gathered rows
            w = _fp4_tile(w_ptr, s_ptr, e, offs_n, offs_k, n_mask[:, None] & k_mask[None, :],
                          stride_we, stride_wn, stride_se, stride_sn)
            if DOT_F32:
                acc += tl.dot(xt.to(tl.float32), tl.trans(w), input_precision="ieee")
            else:  # fp4 values times a power of two are exact in bf16
                acc += tl.dot(xt.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
        tl.store(out_ptr + tok[:, None] * stride_om + slot[:, None] * stride_oj + offs_n[None, :], acc,
                 mask=r_mask[:, None] & n_mask[None, :])


# ----------------------------------------------------------------------------- wrappers
def _check(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, experts: torch.Tensor) -> None:
    if triton is None:
        raise ImportError("kernels.fp4_gemm: triton is not installed (use the *_ref functions)")
    if packed.ndim != 3 or scale.ndim != 3 or experts.ndim != 2 or x.ndim not in (2, 3):
        raise ValueError(f"fp4_moe_gemm: expected x [M, (k,) K], packed [E, N, K/2], scale [E, N, K/32], "
                         f"experts [M, k]; got {tuple(x.shape)}, {tuple(packed.shape)}, {tuple(scale.shape)}, "
                         f"{tuple(experts.shape)}")
    E, N, half = packed.shape
    K = 2 * half
    M, k = experts.shape
    if K % FP4_BLOCK or tuple(scale.shape) != (E, N, K // FP4_BLOCK):
        raise ValueError(f"fp4_moe_gemm: K={K} must be a multiple of {FP4_BLOCK} and scale {tuple(scale.shape)} "
                         f"equal {(E, N, K // FP4_BLOCK)}")
    want_x = (M, K) if x.ndim == 2 else (M, k, K)
    if tuple(x.shape) != want_x or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"fp4_moe_gemm: x {x.dtype} {tuple(x.shape)}, expected fp32/bf16 {want_x}")
    if packed.dtype not in (torch.int8, torch.uint8) or experts.is_floating_point():
        raise ValueError(f"fp4_moe_gemm: packed int8/uint8 and integer experts expected, got {packed.dtype}, "
                         f"{experts.dtype}")
    if experts.numel() and (int(experts.min()) < 0 or int(experts.max()) >= E):
        raise ValueError(f"fp4_moe_gemm: expert ids must lie in [0, {E})")


def fp4_moe_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, experts: torch.Tensor,
                 combine: bool = False, deterministic: bool = True, small_batch: bool = False,
                 block_n: int | None = None, block_k: int | None = None, block_m: int = 16,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton routed fp4 GEMM; same contract as `fp4_moe_gemm_ref` (module docstring).

    small_batch: several tokens also take the small-batch path (one token always does).
    Blocks default to N 64 / K 128 on a GPU and N 256 / K 256 under the interpreter.
    out: optional fp32 destination, [M, N] with `combine` else [M, k, N] (leading dims may
    be strided).
    Raises:
        ValueError: wrong ranks, dtypes, shapes or expert ids (named).
        ImportError: triton is not installed.
    """
    _check(x, packed, scale, experts)
    E, N, half = packed.shape
    K, (M, k) = 2 * half, experts.shape
    interpret = interpreting()
    bn, bk = block_n or (256 if interpret else 64), block_k or (256 if interpret else 128)
    x = x.contiguous()
    w, s = packed.contiguous().view(torch.uint8), scale.contiguous().view(torch.uint8)
    stride_xj = 0 if x.ndim == 2 else x.stride(1)  # a token's routes share its row
    ex = experts.to(torch.int32).contiguous()
    out = out_tensor(out, (M, N) if combine else (M, k, N), torch.float32, x.device, "fp4_moe_gemm")
    if M == 0:
        return out
    if M == 1 or small_batch:
        order = (experts.argsort(dim=1, stable=True) if deterministic
                 else torch.arange(k, device=x.device).expand(M, k)).to(torch.int32).contiguous()
        _fp4_moe_small_kernel[(M, triton.cdiv(N, bn))](
            x, w, s, ex, order, out, N, K, x.stride(0), stride_xj, w.stride(0), w.stride(1), s.stride(0),
            s.stride(1), out.stride(0), 0 if combine else out.stride(1),
            TOPK=k, COMBINE=combine, BLOCK_N=bn, BLOCK_K=bk)
        return out
    routes = torch.argsort(ex.flatten(), stable=True)  # [M*k] route ids grouped by expert
    counts = torch.bincount(ex.flatten().long(), minlength=E).tolist()
    tiles, start = [], 0
    for e, c in enumerate(counts):  # host-side tile list: a handful of entries per call
        tiles += [(e, start + r, min(block_m, c - r)) for r in range(0, c, block_m)]
        start += c
    tile = torch.tensor(tiles, dtype=torch.int32, device=x.device).T.contiguous()  # [3, T]
    rows = torch.empty(M, k, N, dtype=torch.float32, device=x.device) if combine else out
    _fp4_moe_grouped_kernel[(len(tiles), triton.cdiv(N, bn))](
        x, w, s, routes.to(torch.int32), tile[0], tile[1], tile[2], rows, N, K, x.stride(0), stride_xj,
        w.stride(0), w.stride(1), s.stride(0), s.stride(1), rows.stride(0), rows.stride(1),
        TOPK=k, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, DOT_F32=interpret or x.dtype == torch.float32)
    if combine:
        out.copy_(fold_routes(rows, experts, deterministic))
    return out


def fp4_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, small_batch: bool = False,
             **kwargs) -> torch.Tensor:
    """Dense Triton fp4 GEMM: x [M, K], packed [N, K/2], scale [N, K/32] -> [M, N] fp32 (one expert;
    `kwargs`: blocks and `out` as for `fp4_moe_gemm`)."""
    if packed.ndim != 2:
        raise ValueError(f"fp4_gemm: packed must be [N, K/2], got {tuple(packed.shape)}")
    experts = torch.zeros(x.shape[0], 1, dtype=torch.int64, device=x.device)
    return fp4_moe_gemm(x, packed[None], scale[None], experts, combine=True, small_batch=small_batch, **kwargs)
