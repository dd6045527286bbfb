"""Which implementation of each `kernels/` op the model runs: `KernelConfig(backend=...)`.
This module owns the backends (`KERNEL_BACKENDS`) and the mapping from backend to
implementation; it computes nothing, imports nothing of the project outside `kernels/` and
never reads a project setting (the model side builds the config from its settings:
`dsv4.settings.Settings.kernel_config`; only Triton's own `TRITON_INTERPRET` is read, by
`kernels.checks`).

`backend="torch"` picks the plain-torch `<op>_ref` (CPU or GPU, the default); `"triton"`
picks the Triton kernel wrapper (CUDA tensors, or CPU tensors under `TRITON_INTERPRET=1`).
An op's module is imported only when the op is picked, for either backend; each module holds
the reference beside the kernel and imports triton when it is installed (the `dev` and
`kernels` extras install it), so the torch backend imports triton there but never runs it.
The model takes the config as a constructor argument and never reads a module global or the
environment.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Callable

import torch

from kernels.checks import interpreting

KERNEL_BACKENDS = ("torch", "triton")

# op name -> (module in kernels/, triton wrapper name, torch reference name)
OPS = {
    "fp4_gemm": ("kernels.fp4_gemm", "fp4_gemm", "fp4_gemm_ref"),
    "fp4_moe_gemm": ("kernels.fp4_gemm", "fp4_moe_gemm", "fp4_moe_gemm_ref"),
    "fp8_gemm": ("kernels.fp8_gemm", "fp8_gemm", "fp8_gemm_ref"),
    "lane_mean": ("kernels.lane_mean", "lane_mean", "lane_mean_ref"),
    "sparse_attn": ("kernels.sparse_attn", "sparse_attn", "sparse_attn_ref"),
}


@dataclass(frozen=True)
class KernelConfig:
    """backend: "torch" | "triton". moe_multi_token_fp4: decode / verify calls of several rows
    take the small-batch path of the fp4 routed-expert GEMM (`dsv4.moe.MoE`; one row always
    does, prefill takes the grouped path). deterministic_reduce: the fold order for callers of
    `fp4_moe_gemm(combine=True)` (the model's MoE folds in its own configured order).
    chosen_by: the setting that chose the backend, as errors name it (`DSPARK_KERNELS` when the
    model side builds the config); not part of the config's identity.

    Raises:
        ValueError: backend not one of `KERNEL_BACKENDS`.
    """

    backend: str = "torch"
    moe_multi_token_fp4: bool = False
    deterministic_reduce: bool = True
    chosen_by: str = field(default="backend", compare=False)

    def __post_init__(self) -> None:
        if self.backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel backend={self.backend!r}: must be one of {', '.join(KERNEL_BACKENDS)}")

    def op(self, name: str) -> Callable:
        """The implementation of op `name` (a key of OPS) for this backend.

        Raises:
            ValueError: unknown op name; backend "triton" on a machine with neither a CUDA
                device nor `TRITON_INTERPRET=1` (its kernels could not run: the error would
                come only at the first forward, from deep inside triton).
            ImportError: backend "triton" without triton installed (`chosen_by` named).
        """
        if name not in OPS:
            raise ValueError(f"unknown kernel op {name!r}: one of {', '.join(OPS)}")
        module, kernel, ref = OPS[name]
        if self.backend == "triton":
            _check_triton_runs(self.chosen_by)
        return getattr(importlib.import_module(module), kernel if self.backend == "triton" else ref)


def _check_triton_runs(chosen_by: str) -> None:
    """Raise unless triton is installed and has somewhere to run (`KernelConfig.op`'s Raises)."""
    if importlib.util.find_spec("triton") is None:
        raise ImportError(f"{chosen_by}=triton: triton is not installed (use {chosen_by}=torch)")
    if not interpreting() and not torch.cuda.is_available():
        raise ValueError(f"{chosen_by}=triton: no CUDA device here and TRITON_INTERPRET is not 1 (the CPU "
                         f"interpreter), so the triton kernels cannot run; use {chosen_by}=torch")
