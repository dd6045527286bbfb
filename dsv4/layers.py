"""Shared building blocks: RMSNorm, bias-free linear with optional fp8 activation sim, embedding.

Dimension legend: ... = any leading dims, D = input features, O = output features, V = vocab.

Numerics (spec §2.1, §2.4): norms hold fp32 weights and compute in fp32, returning the
input dtype. A `Linear` holds its weight in the model dtype (fp32 or bf16); with
`act_quant=True` (quantisation simulation of an fp8/fp4-stored linear) its input goes
through the fp8 round trip `act_quant_fp8(x, 128)` first, as the reference's w8a8 / w4a8
GEMMs quantise activations per 128 along K.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.codecs import act_quant_fp8
from dsv4.config import ACT_QUANT_BLOCK  # fp8 activation block of the reference's fp8/fp4 GEMMs (spec §2.4)


def frozen_param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """An uninitialised parameter without grad (weights come from `load_weights`)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    """y = weight * x * rsqrt(mean(x^2) + eps) over the last dim (spec §2.1).

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.weight.dtype)
        if self.act_quant:
            x = act_quant_fp8(x, ACT_QUANT_BLOCK)
        return F.linear(x, self.weight)


class Embedding(nn.Module):
    """Token embedding: `weight` [V, D] in `dtype`; ids [...] int64 -> [..., D]."""

    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        super().__init__()
        self.weight = frozen_param((vocab_size, dim), dtype, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
