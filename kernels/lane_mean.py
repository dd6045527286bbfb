"""Lane-mean tap pooling: the mean of a block output's C mHC lanes (docs/model.md §3, §9.2),
beside its torch reference `lane_mean_ref`. This module owns that reduction's kernel and its
summation order; it does not choose which layers are tapped (`dsv4.trunk`).

Dimension legend: S = token rows, C = hc_mult lanes, D = dim.

taps[s, d] = (x[s, 0, d] + x[s, 1, d] + ... + x[s, C-1, d]) / C in fp32: a left fold over
the lanes, then one division. That is the order of torch's CPU mean for C <= 4 (hc_mult is 4),
so there the kernel equals `lane_mean_ref` bitwise, and the tests compare it exactly (a sum
would read C times the mean; docs/architecture.md §12). For C > 4 torch itself sums the columns of a
vector tail with 4 interleaved accumulators, so the two agree to fp32 rounding only.
"""

from __future__ import annotations

import torch

from kernels.checks import out_tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference works without triton
    triton = None


def lane_mean_ref(x: torch.Tensor) -> torch.Tensor:
    """x [S, C, D] (any float dtype) -> [S, D] fp32 mean over lanes (dsv4.mhc.lane_mean)."""
    return x.float().mean(-2)


if triton is not None:
    @triton.jit
    def _lane_mean_kernel(
        # Pointers: x [S, C, D], out [S, D] fp32
        x_ptr, out_ptr,
        # Sizes
        D,
        # Strides (elements): x's row, lane and column; out's row
        stride_xs, stride_xc, stride_xd, stride_os,
        # Meta-parameters
        C: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """Grid (S, cdiv(D, BLOCK_D)): one program per (row, column block)."""
        s = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = offs < D
        row = x_ptr + s * stride_xs + offs * stride_xd
        acc = tl.load(row, mask=mask).to(tl.float32)
        for c in tl.static_range(1, C):  # fixed lane order: the fold torch's mean uses
            acc += tl.load(row + c * stride_xc, mask=mask).to(tl.float32)
        tl.store(out_ptr + s * stride_os + offs, tl.math.div_rn(acc, tl.full([BLOCK_D], C, tl.float32)), mask=mask)


def lane_mean(x: torch.Tensor, block_d: int = 1024, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton lane mean: x [S, C, D] -> [S, D] fp32, bitwise equal to `lane_mean_ref`.

    out: optional [S, D] fp32 destination (rows may be strided).

    Raises:
        ValueError: x not 3-D float, or block_d not a power of two.
        ImportError: triton is not installed.
    """
    if triton is None:
        raise ImportError("kernels.lane_mean: triton is not installed (use lane_mean_ref)")
    if x.ndim != 3 or not x.is_floating_point():
        raise ValueError(f"lane_mean: expected a float [S, C, D] tensor, got {x.dtype} {tuple(x.shape)}")
    if block_d < 1 or block_d & (block_d - 1):
        raise ValueError(f"lane_mean: block_d={block_d} must be a power of two")
    S, C, D = x.shape
    out = out_tensor(out, (S, D), torch.float32, x.device, "lane_mean")
    if out.numel():
        grid = (S, triton.cdiv(D, block_d))
        _lane_mean_kernel[grid](x, out, D, x.stride(0), x.stride(1), x.stride(2), out.stride(0),
                                C=C, BLOCK_D=block_d)
    return out
