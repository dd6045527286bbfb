"""Which implementation of each `kernels/` op the model runs: `KernelConfig(backend=...)`.
This module owns the mapping from backend to implementation; it computes nothing and never
reads a project setting from the environment (the entry point builds the config from its
`Settings`; only Triton's own `TRITON_INTERPRET` is read, by `kernels.checks`).

`backend="torch"` picks the plain-torch `<op>_ref` (CPU or GPU, the default); `"triton"`
picks the Triton kernel wrapper (CUDA tensors, or CPU tensors under `TRITON_INTERPRET=1`).
An op's module is imported only when the op is picked, for either backend; each module holds
the reference beside the kernel and imports triton when it is installed (the `dev` and
`kernels` extras install it), so the torch backend imports triton there but never runs it.
The entry point builds the config from its `dsv4.settings.Settings` (`from_settings`); the
model takes it as a constructor argument and never reads a module global or the environment.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch

from dsv4.settings import ENV_KERNELS, KERNEL_BACKENDS, Settings
from kernels.checks import interpreting

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

    Raises:
        ValueError: backend not one of `KERNEL_BACKENDS`.
    """

    backend: str = "torch"
    moe_multi_token_fp4: bool = False
    deterministic_reduce: bool = True

    def __post_init__(self) -> None:
        if self.backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel backend={self.backend!r}: must be one of {', '.join(KERNEL_BACKENDS)}")

    @classmethod
    def from_settings(cls, s: Settings) -> "KernelConfig":
        """The kernel switches of `s` (`DSPARK_KERNELS`, `DSPARK_MOE_MULTI_TOKEN_FP4`,
        `DSPARK_MOE_DETERMINISTIC_REDUCE`, parsed by `services.settings`)."""
        return cls(s.kernels, s.moe_multi_token_fp4, s.moe_deterministic_reduce)

    def op(self, name: str) -> Callable:
        """The implementation of op `name` (a key of OPS) for this backend.

        Raises:
            ValueError: unknown op name; backend "triton" on a machine with neither a CUDA
                device nor `TRITON_INTERPRET=1` (its kernels could not run: the error would
                come only at the first forward, from deep inside triton).
            ImportError: backend "triton" without triton installed (DSPARK_KERNELS named).
        """
        if name not in OPS:
            raise ValueError(f"unknown kernel op {name!r}: one of {', '.join(OPS)}")
        module, kernel, ref = OPS[name]
        if self.backend == "triton":
            _check_triton_runs()
        return getattr(importlib.import_module(module), kernel if self.backend == "triton" else ref)


def _check_triton_runs() -> None:
    """Raise unless triton is installed and has somewhere to run (module `op`'s Raises)."""
    if importlib.util.find_spec("triton") is None:
        raise ImportError(f"{ENV_KERNELS}=triton: triton is not installed (use {ENV_KERNELS}=torch)")
    if not interpreting() and not torch.cuda.is_available():
        raise ValueError(f"{ENV_KERNELS}=triton: no CUDA device here and TRITON_INTERPRET is not 1 (the CPU "
                         f"interpreter), so the triton kernels cannot run; use {ENV_KERNELS}=torch")
