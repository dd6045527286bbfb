"""fp8 e4m3 block-scaled GEMM: y = x @ W^T with W stored as e4m3 and ue8m0 128x128 scales
(docs/model.md §6.3), beside its torch reference `fp8_gemm_ref`. This module owns that GEMM
only; it never packs or owns weights (`Linear.pack`) and does not decide when it runs
(`dsv4.quantised`).

Dimension legend: M = activation rows, K = input features (reduction), N = output features,
Nb = ceil(N/128), Kb = ceil(K/128).

W[n, k] = e4m3[n, k] * 2^(scale[n // 128, k // 128] - 127) (kernels.formats.fp8_decode). The
kernel decodes the e4m3 bytes itself (sign, 4-bit exponent with bias 7, 3-bit mantissa,
subnormals), so it runs the same under the interpreter and on GPUs without native fp8, and
multiplies by the block scale before the dot. Every dequantised weight is exact in bf16.
"""

from __future__ import annotations

import torch

from kernels.formats import FP8_BLOCK, fp8_decode
from kernels.checks import interpreting, out_tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference works without triton
    triton = None


def fp8_gemm_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] float, weight [N, K] float8_e4m3fn (or uint8 bytes), scale [Nb, Kb] ue8m0 -> [M, N] fp32."""
    return x.float() @ fp8_decode(weight, scale).T  # reads M*K + N*K, writes M*N


if triton is not None:
    @triton.jit
    def _pow2(exponent):
        """2^exponent as fp32 for integer exponents in [-126, 127] (built from the bits)."""
        return ((exponent + 127).to(tl.int32) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _fp8_gemm_kernel(
        # Pointers: x [M, K], w [N, K] e4m3 bytes (uint8), scale [Nb, Kb] ue8m0 bytes, out [M, N] fp32
        x_ptr, w_ptr, s_ptr, out_ptr,
        # Sizes
        M, N, K,
        # Strides (elements)
        stride_xm, stride_wn, stride_sn, stride_om,
        # Meta-parameters; DOT_F32: fp32 tiles for tl.dot (fp32 input, or the interpreter)
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
        SCALE_BLOCK: tl.constexpr,
    ):
        """Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)); K is walked in order (no split-K)."""
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask, n_mask = offs_m < M, offs_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                         mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
            wmask = n_mask[:, None] & k_mask[None, :]
            b = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=wmask, other=0).to(tl.int32)
            e, man = (b >> 3) & 0xF, (b & 7).to(tl.float32)
            mag = tl.where(e == 0, man * 0.001953125, (man + 8.0) * _pow2(e - 10))  # subnormal: m * 2^-9
            w = tl.where((b & 0x80) != 0, -mag, mag)
            sc = tl.load(s_ptr + (offs_n[:, None] // SCALE_BLOCK) * stride_sn + offs_k[None, :] // SCALE_BLOCK,
                         mask=wmask, other=127).to(tl.int32)
            w = w * _pow2(sc - 127)  # [BN, BK], exact
            if DOT_F32:
                acc += tl.dot(xt.to(tl.float32), tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(xt.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc,
                 mask=m_mask[:, None] & n_mask[None, :])


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_m: int | None = None,
             block_n: int | None = None, block_k: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton fp8 GEMM: x [M, K] fp32/bf16, weight [N, K] float8_e4m3fn or uint8, scale [Nb, Kb]
    (float8_e8m0fnu or uint8) -> [M, N] fp32, within fp32 rounding of `fp8_gemm_ref`.

    Blocks default to 16x64x64 on a GPU and 16x128x128 under the interpreter; out: optional
    [M, N] fp32 destination (rows may be strided).
    Raises:
        ValueError: wrong ranks, dtypes or shapes (named).
        ImportError: triton is not installed.
    """
    if triton is None:
        raise ImportError("kernels.fp8_gemm: triton is not installed (use fp8_gemm_ref)")
    if x.ndim != 2 or weight.ndim != 2 or scale.ndim != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"fp8_gemm: expected x [M, K], weight [N, K], scale [Nb, Kb]; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(scale.shape)}")
    if weight.dtype not in (torch.float8_e4m3fn, torch.uint8) or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"fp8_gemm: x fp32/bf16 and weight float8_e4m3fn/uint8 expected, got {x.dtype}, "
                         f"{weight.dtype}")
    M, K = x.shape
    N = weight.shape[0]
    want = (-(-N // FP8_BLOCK), -(-K // FP8_BLOCK))
    if tuple(scale.shape) != want:
        raise ValueError(f"fp8_gemm: scale shape {tuple(scale.shape)}, expected {want} for weight {(N, K)}")
    interpret = interpreting()
    bm, bn, bk = block_m or 16, block_n or (128 if interpret else 64), block_k or (128 if interpret else 64)
    x, w, s = x.contiguous(), weight.contiguous().view(torch.uint8), scale.contiguous().view(torch.uint8)
    out = out_tensor(out, (M, N), torch.float32, x.device, "fp8_gemm")
    if out.numel():
        grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
        _fp8_gemm_kernel[grid](x, w, s, out, M, N, K, x.stride(0), w.stride(0), s.stride(0), out.stride(0),
                               BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_F32=interpret or x.dtype == torch.float32,
                               SCALE_BLOCK=FP8_BLOCK)
    return out
