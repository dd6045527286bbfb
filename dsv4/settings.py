"""Process settings of the model math, read once from the environment.

`DSV4_MOE_DETERMINISTIC_REDUCE` (default 1): 1 sums a token's routed-expert partials in
ascending expert-id order, so the MoE output does not depend on routing order; 0 sums them
in routing order (`index_add_`). DESIGN.md §11 (the seed's `DSV4_CPP_MOE_DETERMINISTIC_REDUCE`).

`DSV4_KERNELS` (default torch): implementation of the `kernels/` ops the model selects
(`kernels.select.KernelConfig`): "torch" (the plain-torch `<op>_ref`) or "triton" (the Triton
kernels; CUDA tensors, or CPU tensors under `TRITON_INTERPRET=1`).

`DEEPSEEK_GPU_MOE_MULTI_TOKEN_FP4` (default 0): 1 runs multi-token fp4 routed-expert GEMMs
(verify) on the small-batch path instead of the grouped (prefill) path (seed: verify
850 -> 3273 ms without it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

ENV_MOE_DETERMINISTIC_REDUCE = "DSV4_MOE_DETERMINISTIC_REDUCE"
ENV_KERNELS = "DSV4_KERNELS"
ENV_MOE_MULTI_TOKEN_FP4 = "DEEPSEEK_GPU_MOE_MULTI_TOKEN_FP4"
KERNEL_BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class Settings:
    """Numerics switches of `dsv4` (see the module table)."""

    moe_deterministic_reduce: bool = True
    kernels: str = "torch"
    moe_multi_token_fp4: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        """Read the variables from `env` (default `os.environ`); unset or empty means default.

        Raises:
            ValueError: naming the variable and its value when a flag is not "0" or "1", or
                `DSV4_KERNELS` is not one of `KERNEL_BACKENDS`.
        """
        env = os.environ if env is None else env
        return cls(moe_deterministic_reduce=_flag(env, ENV_MOE_DETERMINISTIC_REDUCE, True),
                   kernels=_choice(env, ENV_KERNELS, KERNEL_BACKENDS, "torch"),
                   moe_multi_token_fp4=_flag(env, ENV_MOE_MULTI_TOKEN_FP4, False))


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "")
    value = raw.strip()
    if value == "":
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name}={raw!r}: must be 0 or 1")
    return value == "1"


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...], default: str) -> str:
    raw = env.get(name, "")
    value = raw.strip().lower()
    if value == "":
        return default
    if value not in choices:
        raise ValueError(f"{name}={raw!r}: must be one of {', '.join(choices)}")
    return value
