"""fp8 / fp4 weight codecs and activation fake-quantisation, in pure torch (docs/model.md §2.4,
§6.3). This module owns the encoders, the activation round trips and the Hadamard rotation;
the storage formats themselves (block sizes, ue8m0 scales, the e2m1 grid) and their decoders
`fp8_decode` / `fp4_decode` are `kernels.formats`', the bottom of the project, whose GEMMs
read the same bytes (exported here too, so a codec's encode and decode come from one place).
It knows no tensor names, files or layers, and never imports triton.

Dimension legend: N = output rows of a weight, K = input columns (the reduction dim),
Nb = ceil(N/128), Kb = ceil(K/128) (fp8 128x128 blocks), Kq = K/32 (fp4 1x32 blocks),
... = any leading dims of an activation, d = its last dim.

Storage formats: `kernels.formats` (docs/model.md §6.3). The encoders write ue8m0 scales as
`torch.float8_e8m0fnu` (raw bytes: `.view(torch.uint8)`); a byte of 255 (NaN) is never written.

Every scale exponent is the exact `ceil(log2(amax / qmax))`, computed from the float's
mantissa and exponent (no rounded division or log), so a block's largest value never needs
clamping and decode -> encode reproduces the stored bytes whenever a block's largest code
lies in (qmax/2, qmax]. All functions return new tensors and never modify their inputs,
and follow the input's device.

Non-finite values. The encoders raise ValueError naming the first NaN / inf (or a float64
value beyond float32's range): a block's scale would be undefined and the whole block
silently corrupt. The decoders return what the bytes say (`kernels.formats`). The activation round trips propagate instead of raising
(no host sync in the hot path): a block holding a NaN or inf comes back all NaN, since its
scale is undefined; finite blocks are unaffected.
"""

from __future__ import annotations

import math

import torch

# The decoders are exported beside the encoders (F401): callers take a codec from one module.
from kernels.formats import (E8M0, FP4_BLOCK, FP8_BLOCK, e8m0_values, expand_blocks, fp4_decode,  # noqa: F401
                             fp4_values, fp8_decode)

FP8_MAX = 448.0  # largest finite e4m3fn value
FP4_MAX = 6.0  # largest e2m1 value
E8M0_BIAS = 127

# midpoints between neighbouring e2m1 magnitudes (`kernels.formats.FP4_GRID`), for round-to-nearest.
_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


# ----------------------------------------------------------------------------- scales
def _ceil_log2_ratio(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Exact ceil(log2(amax / qmax)) as int32, for amax > 0 (float32, any shape).

    With amax = m * 2^E (m in [0.5, 1)) and qmax = mq * 2^Eq, the smallest k with
    amax <= qmax * 2^k is E - Eq, plus one when m > mq.
    """
    mq, eq = math.frexp(qmax)
    m, e = torch.frexp(amax.float())
    return (e - eq + (m > mq).to(torch.int32)).to(torch.int32)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent as float32, exact, for integer exponents in [-127, 127]."""
    return e8m0_values((exponent + E8M0_BIAS).to(torch.uint8))


def _e8m0_bytes(exponent: torch.Tensor) -> torch.Tensor:
    """Integer exponents in [-127, 127] -> stored ue8m0 scale tensor."""
    raw = (exponent + E8M0_BIAS).to(torch.uint8)
    return raw.view(E8M0) if E8M0 is not None else raw


def _weight_exponent(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Per-block scale exponent for a weight block; all-zero blocks get the smallest, -127."""
    k = _ceil_log2_ratio(amax, qmax)
    k = torch.where(amax > 0, k, torch.full_like(k, -E8M0_BIAS))
    return k.clamp(-E8M0_BIAS, E8M0_BIAS)


def _last_dim_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the last dim, [..., b] -> [...]; via a 2-D view (much faster on CPU)."""
    return x.abs().reshape(-1, x.shape[-1]).amax(dim=1).reshape(x.shape[:-1])


def _check_2d(name: str, w: torch.Tensor) -> None:
    if w.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D [out, in] tensor, got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise ValueError(f"{name}: expected a float tensor, got {w.dtype}")


def _check_finite(name: str, w: torch.Tensor, x: torch.Tensor) -> None:
    """ValueError naming the first element of x (= w in float32) that is NaN or +-inf."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        pos = [int(i) for i in bad.nonzero()[0]]
        v = float(w[tuple(pos)])
        why = "not finite" if not math.isfinite(v) else "outside the float32 range"
        raise ValueError(f"{name}: value {v!r} at {pos} is {why}; the block's scale would be undefined")


# ----------------------------------------------------------------------------- fp8 weights
def fp8_encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a weight to e4m3 with ue8m0 128x128 block scales (docs/model.md §6.3).

    Args:
        w: float [N, K], any N, K >= 1 (edge blocks are partial).
    Returns:
        (weight float8_e4m3fn [N, K], scale float8_e8m0fnu [Nb, Kb]) with
        scale = 2^ceil(log2(block amax / 448)) (all-zero block: 2^-127) and
        weight = RNE-cast of w / scale clamped to +-448.
    Raises:
        ValueError: `w` not a 2-D float tensor, or an element that is NaN, inf or beyond
            float32's range (the first one is named).
    """
    _check_2d("fp8_encode input", w)
    n, k = w.shape
    x = w.float()
    _check_finite("fp8_encode input", w, x)
    nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    padded = x.new_zeros(nb * FP8_BLOCK, kb * FP8_BLOCK)
    padded[:n, :k] = x
    blocks = padded.view(nb, FP8_BLOCK, kb, FP8_BLOCK)  # (Nb, 128, Kb, 128)
    amax = blocks.abs().amax(dim=3).amax(dim=1)  # [Nb, Kb]; two single-dim passes are far faster
    exponent = _weight_exponent(amax, FP8_MAX)
    inv = expand_blocks(_pow2(-exponent), n, k)  # [N, K]
    q = (x * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, _e8m0_bytes(exponent)


# ----------------------------------------------------------------------------- fp4 weights
def _fp4_codes(y: torch.Tensor) -> torch.Tensor:
    """Float y (already divided by its scale) -> e2m1 codes 0..15 (uint8), RNE, sign in bit 3.

    |y| is clamped to 6. A tie between two grid values goes to the even code (the one whose
    mantissa bit is 0), i.e. midpoint i rounds up exactly when i is odd.
    """
    a = y.abs().clamp(max=FP4_MAX)
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for i, mid in enumerate(_FP4_MIDPOINTS):
        up = (a > mid) | ((a == mid) & (i % 2 == 1))
        code += up.to(torch.uint8)
    return code | (torch.signbit(y).to(torch.uint8) << 3)


def fp4_encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a weight to packed e2m1 with ue8m0 1x32 scales (docs/model.md §6.3).

    Args:
        w: float [N, K], K a multiple of 32.
    Returns:
        (packed int8 [N, K/2], scale float8_e8m0fnu [N, Kq]); byte i of a row holds column
        2i in its low nibble and column 2i+1 in its high nibble; scale =
        2^ceil(log2(block amax / 6)) (all-zero block: 2^-127); codes are the round-to-nearest-
        even e2m1 values of w / scale, sign kept.
    Raises:
        ValueError: `w` not 2-D float, K not a multiple of 32, or an element that is NaN, inf
            or beyond float32's range (the first one is named).
    """
    _check_2d("fp4_encode input", w)
    n, k = w.shape
    if k % FP4_BLOCK:
        raise ValueError(f"fp4_encode: in_features={k} must be a multiple of {FP4_BLOCK}")
    x = w.float()
    _check_finite("fp4_encode input", w, x)
    x = x.view(n, k // FP4_BLOCK, FP4_BLOCK)  # (N, Kq, 32)
    exponent = _weight_exponent(_last_dim_amax(x), FP4_MAX)  # [N, Kq]
    codes = _fp4_codes(x * _pow2(-exponent)[..., None]).view(n, k // 2, 2)  # (N, K/2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return packed.view(torch.int8), _e8m0_bytes(exponent)


# ----------------------------------------------------------------------------- activations
def _blocks(x: torch.Tensor, block: int, who: str) -> torch.Tensor:
    """x [..., d] -> float32 (..., d/block, block); ValueError for non-float x or a bad block."""
    if not x.is_floating_point():
        raise ValueError(f"{who}: expected a float tensor, got {x.dtype}")
    if block <= 0 or x.ndim == 0 or x.shape[-1] % block:
        raise ValueError(f"{who}: block={block} must be > 0 and divide the last dim of shape {tuple(x.shape)}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)  # (..., d/block, block)


def _nan_if_non_finite(scale: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Per-block scale [..., 1] with NaN where the block's amax is NaN / inf: the output
    multiply then turns the whole block NaN, without a full-size extra pass or a host sync."""
    return scale + amax * 0.0  # amax * 0 is 0 when finite, NaN for NaN and inf (inf * 0 = NaN)


def act_quant_fp8(x: torch.Tensor, block: int) -> torch.Tensor:
    """fp8 activation round trip (docs/model.md §2.4 `act_quant`, ue8m0 scales): same shape and dtype as x.

    Per block of `block` along the last dim: amax = max(|x|, 1e-4),
    s = 2^ceil(log2(amax / 448)), result = e4m3(clamp(x / s, +-448)) * s, cast to x.dtype.
    A block holding a NaN or inf comes back all NaN (see the module docstring).
    Raises:
        ValueError: `block` does not divide x.shape[-1].
    """
    xb = _blocks(x, block, "act_quant_fp8")
    amax = _last_dim_amax(xb).unsqueeze(-1)  # (..., d/block, 1); NaN / inf if the block holds one
    exponent = _ceil_log2_ratio(amax.clamp(min=1e-4), FP8_MAX)
    q = (xb * _pow2(-exponent)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * _nan_if_non_finite(_pow2(exponent), amax)).reshape(x.shape).to(x.dtype)


def act_quant_fp4(x: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """fp4 activation round trip (docs/model.md §2.4 `fp4_act_quant`): same shape and dtype as x.

    Per block of `block` along the last dim: amax = max(|x|, 6 * 2^-126),
    s = 2^ceil(log2(amax / 6)), result = RNE_e2m1(clamp(x / s, +-6)) * s (sign kept),
    cast to x.dtype. A block holding a NaN or inf comes back all NaN (see the module docstring).
    Raises:
        ValueError: `block` does not divide x.shape[-1].
    """
    xb = _blocks(x, block, "act_quant_fp4")
    amax = _last_dim_amax(xb).unsqueeze(-1)  # (..., d/block, 1); NaN / inf if the block holds one
    exponent = _ceil_log2_ratio(amax.clamp(min=FP4_MAX * 2.0**-126), FP4_MAX)
    q = fp4_values(_fp4_codes(xb * _pow2(-exponent)))
    return (q * _nan_if_non_finite(_pow2(exponent), amax)).reshape(x.shape).to(x.dtype)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh–Hadamard transform over the last dim (docs/model.md §2.4 `rotate`).

    Sylvester natural order, H[i, j] = (-1)^popcount(i & j), scaled by d^-0.5; computed by
    butterflies in float32 (float64 for float64 input) and returned in x.dtype, same shape.
    Raises:
        ValueError: the last dim is not a power of two.
    """
    d = x.shape[-1] if x.ndim else 0
    if d < 1 or d & (d - 1):
        raise ValueError(f"hadamard_rotate: last dim {d} must be a power of two")
    y = x.to(torch.promote_types(x.dtype, torch.float32)).reshape(-1, d)  # (M, d)
    h = 1
    while h < d:
        pairs = y.view(-1, d // (2 * h), 2, h)  # (M, d/2h, 2, h): index bit log2(h) split out
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).view(-1, d)  # (M, d)
        h *= 2
    return (y * d**-0.5).reshape(x.shape).to(x.dtype)
