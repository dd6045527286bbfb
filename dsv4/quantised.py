"""Which of a model's linears run the quantised GEMM kernels of `kernels/`. This module owns
the mapping "stored as X -> kernel Y" and nothing else: the kernels live in `kernels/`, the
packing in `Linear.pack` / `MoE.pack`, and the torch backend never imports triton.

With the triton backend (`kernels.select.KernelConfig`), every linear the checkpoint stores
as fp8 runs `kernels.fp8_gemm.fp8_gemm` on its e4m3 bytes, and every MoE whose routed
experts are stored as fp4 runs `kernels.fp4_gemm.fp4_moe_gemm` on their packed e2m1 bytes.
Storage formats come from the checkpoint inventory (`dsv4.inventory`).

A layer runs its kernel only when its float weights are exactly representable in the stored
format (checked by `pack` after every load): a real checkpoint's dequantised weights are,
random or freshly trained ones are not and keep the torch GEMM. Either way the numbers
change by GEMM rounding only. `quantised_gemms` reports what runs where.
"""

from __future__ import annotations

from typing import Iterable

from torch import nn

from dsv4.inventory import Param
from dsv4.layers import Linear
from dsv4.moe import MoE
from kernels.select import KernelConfig


def wire_quantised_gemms(model: nn.Module, params: Iterable[Param], kernels: KernelConfig) -> None:
    """Point the fp8-stored linears and fp4-expert MoEs of `model` at the Triton GEMMs when
    `kernels.backend` is "triton"; a no-op for "torch". `params`: the model's logical
    parameters (`dsv4.inventory.trunk_params(cfg)`); module names equal parameter prefixes.

    Raises:
        ValueError / ImportError: what `KernelConfig.op` raises (no triton, nowhere to run).
    """
    if kernels.backend != "triton":
        return
    storage = {p.name: p.storage for p in params}
    fp8, fp4 = kernels.op("fp8_gemm"), kernels.op("fp4_moe_gemm")
    for name, module in model.named_modules():
        if name.endswith("wo_a"):
            continue  # applied per output group by `Attention.project_out`'s einsum, never as a Linear
        if isinstance(module, Linear) and storage.get(f"{name}.weight") == "fp8":
            module.use_fp8_gemm(fp8)
        elif isinstance(module, MoE) and storage.get(f"{name}.experts.0.w1.weight") == "fp4":
            module.use_fp4_gemm(fp4, kernels.moe_multi_token_fp4)


def pack_quantised(model: nn.Module) -> None:
    """After a weight load: let every wired layer keep its quantised encoding (or fall back)."""
    for module in model.modules():
        if isinstance(module, (Linear, MoE)):
            module.pack()


def quantised_gemms(model: nn.Module) -> dict[str, int]:
    """How many layers run a quantised kernel now: {"fp8_linears": n, "fp4_moes": m}."""
    mods = list(model.modules())
    return {"fp8_linears": sum(isinstance(m, Linear) and m.fp8_weight is not None for m in mods),
            "fp4_moes": sum(isinstance(m, MoE) and m.fp4_weights is not None for m in mods)}
