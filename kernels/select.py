"""Which implementation of each `kernels/` op the model runs: `KernelConfig(backend=...)`.

`backend="torch"` picks the plain-torch `<op>_ref` (CPU or GPU, the default); `"triton"`
picks the Triton kernel wrapper (CUDA tensors, or CPU tensors under `TRITON_INTERPRET=1`).
The triton modules are imported only when picked, so the torch backend never imports triton.
The process default comes from `DSV4_KERNELS` (`dsv4.settings`); the model takes the config
as a constructor argument and never reads a module global.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Mapping

from dsv4.settings import KERNEL_BACKENDS, Settings

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
    """backend: "torch" | "triton". moe_multi_token_fp4: multi-token fp4 routed-expert GEMMs
    take the small-batch path (`DEEPSEEK_GPU_MOE_MULTI_TOKEN_FP4`); deterministic_reduce: the
    fp4 MoE combine sums routes in ascending expert id (`DSV4_MOE_DETERMINISTIC_REDUCE`)."""

    backend: str = "torch"
    moe_multi_token_fp4: bool = False
    deterministic_reduce: bool = True

    def __post_init__(self) -> None:
        if self.backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel backend={self.backend!r}: must be one of {', '.join(KERNEL_BACKENDS)}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "KernelConfig":
        """From `DSV4_KERNELS`, `DEEPSEEK_GPU_MOE_MULTI_TOKEN_FP4`, `DSV4_MOE_DETERMINISTIC_REDUCE`."""
        s = Settings.from_env(env)
        return cls(s.kernels, s.moe_multi_token_fp4, s.moe_deterministic_reduce)

    def op(self, name: str) -> Callable:
        """The implementation of op `name` (a key of OPS) for this backend.

        Raises:
            ValueError: unknown op name.
            ImportError: backend "triton" without triton installed.
        """
        if name not in OPS:
            raise ValueError(f"unknown kernel op {name!r}: one of {', '.join(OPS)}")
        module, kernel, ref = OPS[name]
        return getattr(importlib.import_module(module), kernel if self.backend == "triton" else ref)
