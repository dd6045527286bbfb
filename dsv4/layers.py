"""Shared building blocks: RMSNorm, bias-free linear with optional fp8 activation sim, embedding.
This module owns those three modules and their numerics; they hold no per-sequence state,
and a `Linear` never decides by itself to run the fp8 GEMM kernel (`dsv4.quantised` wires it).

Dimension legend: ... = any leading dims, D = input features, O = output features, V = vocab.

Numerics (docs/model.md §2.1, §2.4): norms hold fp32 weights and compute in fp32, returning the
input dtype. A `Linear` holds its weight in the model dtype (fp32 or bf16); with
`act_quant=True` (quantisation simulation of an fp8/fp4-stored linear) its input goes
through the fp8 round trip `act_quant_fp8(x, 128)` first, as the reference's w8a8 / w4a8
GEMMs quantise activations per 128 along K.

Quantised GEMMs (`Linear.use_fp8_gemm`, wired by `dsv4.quantised`): an fp8-stored linear can
run an fp8 GEMM kernel on the weight's e4m3 bytes instead of `F.linear` on the float weight.
It does so only when the weight is exactly an fp8 weight (what a checkpoint's dequantised
tensor is), so choosing the kernel changes results by GEMM rounding only.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.codecs import act_quant_fp8, fp8_decode, fp8_encode
from dsv4.config import ACT_QUANT_BLOCK  # fp8 activation block of the reference's fp8/fp4 GEMMs (docs/model.md §2.4)


def pad_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """t [N, ...] -> [n, ...] (n >= N), the extra rows zero (a fixed tile's padding)."""
    if t.shape[0] == n:
        return t
    return torch.cat((t, t.new_zeros(n - t.shape[0], *t.shape[1:])))


def frozen_param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """An uninitialised parameter without grad (weights come from `load_weights`)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def copy_streamed(own: Mapping[str, torch.Tensor], items: Iterable[tuple[str, torch.Tensor]],
                  problem: Callable[[str, torch.Tensor, torch.Tensor], str | None]) -> None:
    """Copy weights into a module's tensors one at a time, as a checkpoint stream yields them.

    own: the module's `state_dict(keep_vars=True)` (each copy casts to the tensor's dtype and
    device); items: (name, tensor) pairs, each dropped after its copy, so the caller never
    holds a second copy of the model; problem(name, value, own tensor): why a value cannot be
    loaded, or None. Not atomic: a failure leaves some tensors copied (the caller keeps its
    model marked unloaded).

    Raises:
        ValueError: the first unexpected, repeated or failing tensor (named), or, at the end,
            every name the stream never yielded.
    """
    seen: set[str] = set()
    with torch.no_grad():
        for name, value in items:
            if name not in own or name in seen:
                raise ValueError(f"load_streamed: {'repeated' if name in seen else 'unexpected'} weight {name!r}")
            why = problem(name, value, own[name])
            if why:
                raise ValueError(f"load_streamed: {why}")
            own[name].copy_(value)
            seen.add(name)
            del value
    missing = sorted(set(own) - seen)
    if missing:
        raise ValueError(f"load_streamed: missing: {missing}")


class RMSNorm(nn.Module):
    """y = weight * x * rsqrt(mean(x^2) + eps) over the last dim (docs/model.md §2.1).

    `weight` [D] fp32. Input [..., D] any float dtype; computed in fp32, returned in the
    input's dtype.
    """

    def __init__(self, dim: int, eps: float, device: torch.device | str = "cpu"):
        super().__init__()
        self.eps = eps
        self.weight = frozen_param((dim,), torch.float32, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * y).to(x.dtype)


class Linear(nn.Module):
    """y = x @ weight^T, no bias. `weight` [O, D] in `dtype`; input [..., D] -> [..., O] in `dtype`.

    Raises:
        ValueError: `act_quant` with D not a multiple of 128 (the fp8 activation block).
    """

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", act_quant: bool = False):
        super().__init__()
        if act_quant and in_features % ACT_QUANT_BLOCK:
            raise ValueError(f"in_features={in_features}: fp8 activation simulation needs a multiple "
                             f"of {ACT_QUANT_BLOCK}")
        self.act_quant = act_quant
        self.weight = frozen_param((out_features, in_features), dtype, device)
        self.fp8_gemm: Callable[..., torch.Tensor] | None = None
        self.fp8_weight: tuple[torch.Tensor, torch.Tensor] | None = None  # (e4m3 [O, D], scale [Ob, Db])

    def use_fp8_gemm(self, gemm: Callable[..., torch.Tensor]) -> None:
        """Run `gemm(x [M, D], e4m3 [O, D], scale) -> [M, O] fp32` (`kernels.fp8_gemm`) once
        `pack` has found the weight to be an exact fp8 weight."""
        self.fp8_gemm = gemm

    def pack(self) -> bool:
        """After a weight load: keep the weight's fp8 encoding for the GEMM kernel if it is
        exact (decode(encode(w)) == w), else drop it and use `F.linear`. Returns whether the
        kernel runs."""
        self.fp8_weight = None
        if self.fp8_gemm is None or self.weight.device.type == "meta":
            return False
        w = self.weight.detach().float()
        packed = fp8_encode(w)
        if torch.equal(fp8_decode(*packed), w):
            self.fp8_weight = packed
        return self.fp8_weight is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.weight.dtype)
        if self.act_quant:
            x = act_quant_fp8(x, ACT_QUANT_BLOCK)
        if self.fp8_weight is not None:
            y = self.fp8_gemm(x.reshape(-1, x.shape[-1]), *self.fp8_weight)  # [M, O] fp32
            return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])
        return F.linear(x, self.weight)


class Embedding(nn.Module):
    """Token embedding: `weight` [V, D] in `dtype`; ids [...] int64 -> [..., D]."""

    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        super().__init__()
        self.weight = frozen_param((vocab_size, dim), dtype, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
