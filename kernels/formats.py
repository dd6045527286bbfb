"""The fp8 / fp4 weight storage formats the GEMM kernels read, and their torch decoders
(docs/model.md §6.3). This module owns the formats' constants (block sizes, the e2m1 grid,
the ue8m0 scale dtype) and decoding; encoding and the activation round trips are
`dsv4.codecs`', which imports these. It imports nothing of the project and never triton.

Dimension legend: N = output rows of a weight, K = input columns (the reduction dim),
Nb = ceil(N/128), Kb = ceil(K/128) (fp8 128x128 blocks), Kq = K/32 (fp4 1x32 blocks).

* **fp8**: weight `float8_e4m3fn` [N, K] and a ue8m0 block scale [Nb, Kb];
  `W[n, k] = e4m3[n, k] * 2^(scale[n // 128, k // 128] - 127)`.
* **fp4**: packed e2m1 codes `int8` [N, K/2] (low nibble = even column 2i, high nibble = odd
  column 2i+1; code 0..7 -> 0, .5, 1, 1.5, 2, 3, 4, 6, bit 3 = sign) and a ue8m0 scale
  [N, Kq]; `W[n, k] = e2m1[n, k] * 2^(scale[n, k // 32] - 127)`.

A ue8m0 scale is one biased-exponent byte b (value 2^(b-127)); decoders accept
`torch.float8_e8m0fnu` or its raw `uint8` bytes, return float32 and follow the input's
device. They return what the bytes say: an e4m3 NaN byte, a scale byte 0xFF or a scale that
overflows float32 decode to NaN/inf (`dsv4.checkpoint` rejects such tensors by name).
"""

from __future__ import annotations

import torch

FP8_BLOCK = 128  # weight block (rows and columns), docs/model.md §6.3
FP4_BLOCK = 32  # weight / activation block along K, docs/model.md §2.4, §6.3
E8M0 = getattr(torch, "float8_e8m0fnu", None)  # torch >= 2.7; raw uint8 bytes otherwise

# e2m1 magnitudes by code 0..7 (bit 3 of a code is the sign).
FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e8m0_values(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 scale (float8_e8m0fnu or uint8 bytes) -> float32 2^(byte-127), exact."""
    if E8M0 is not None and scale.dtype == E8M0:
        return scale.float()
    if scale.dtype != torch.uint8:
        raise ValueError(f"scale dtype {scale.dtype}: expected float8_e8m0fnu or uint8 bytes")
    if E8M0 is not None:
        return scale.view(E8M0).float()
    e = scale.to(torch.int32)  # bytes 1..254 are normal floats, byte 0 is 2^-127 (subnormal)
    normal = (e << 23).view(torch.float32)
    return torch.where(e == 0, torch.full_like(normal, 2.0**-127), normal)


def fp8_decode(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Dequantise an fp8 weight: e4m3 [N, K] times its ue8m0 block scale [Nb, Kb] -> float32 [N, K].

    `weight` may be float8_e4m3fn or its raw uint8 bytes; `scale` float8_e8m0fnu or uint8.
    Raises:
        ValueError: wrong dtypes or a scale shape other than [ceil(N/128), ceil(K/128)].
    """
    if weight.dtype == torch.uint8:
        weight = weight.view(torch.float8_e4m3fn)
    if weight.dtype != torch.float8_e4m3fn or weight.ndim != 2:
        raise ValueError(f"fp8 weight: expected 2-D float8_e4m3fn, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    want = (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
    if tuple(scale.shape) != want:
        raise ValueError(f"fp8 scale shape {tuple(scale.shape)}: expected {want} for weight {(n, k)}")
    s = e8m0_values(scale)
    if n % FP8_BLOCK or k % FP8_BLOCK:  # ragged edge blocks: materialise the [N, K] scale
        return weight.float() * expand_blocks(s, n, k)
    w = weight.float().view(n // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK)  # (Nb, 128, Kb, 128)
    return (w * s[:, None, :, None]).view(n, k)


def expand_blocks(per_block: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[Nb, Kb] -> [N, K]: each entry repeated over its 128x128 block, cropped at the edges."""
    full = per_block.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return full[:n, :k]


def fp4_values(code: torch.Tensor) -> torch.Tensor:
    """e2m1 codes 0..15 (any int dtype) -> float32 values (code 8 = -0.0)."""
    lut = torch.tensor(FP4_GRID + tuple(-g for g in FP4_GRID), dtype=torch.float32, device=code.device)
    return lut[code.long()]


def fp4_decode(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Dequantise packed e2m1 [N, K/2] (int8 or uint8) with ue8m0 scale [N, Kq] -> float32 [N, K].

    Raises:
        ValueError: wrong dtypes, K = 2 * packed columns not a multiple of 32, or a scale
            shape other than [N, K/32].
    """
    if packed.dtype not in (torch.int8, torch.uint8) or packed.ndim != 2:
        raise ValueError(f"fp4 weight: expected 2-D int8, got {packed.dtype} {tuple(packed.shape)}")
    n, half = packed.shape
    k = 2 * half
    if k % FP4_BLOCK:
        raise ValueError(f"fp4 weight: K = 2 * {half} packed columns = {k} is not a multiple of {FP4_BLOCK}")
    if tuple(scale.shape) != (n, k // FP4_BLOCK):
        raise ValueError(f"fp4 scale shape {tuple(scale.shape)}: expected {(n, k // FP4_BLOCK)} for K={k}")
    b = packed.view(torch.uint8)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).view(n, k)  # low nibble = even column
    values = fp4_values(codes).view(n, k // FP4_BLOCK, FP4_BLOCK)  # (N, Kq, 32)
    return (values * e8m0_values(scale)[..., None]).view(n, k)
