"""Numerics switches of the model math (`Settings`), passed to the models by their builders.
This module owns the switches, their defaults and their validation, and the model side's
choice of `kernels/` backend (`Settings.kernel_config`); it never reads the process
environment: `services.settings` parses the variables named here once at each entry point and
builds a `Settings` (`services.settings_vars` declares them; docs/settings.md).
The old names (`DSV4_MOE_DETERMINISTIC_REDUCE`, `DSV4_KERNELS`, `DEEPSEEK_GPU_MOE_MULTI_TOKEN_FP4`)
are deprecated aliases.

`DSPARK_MOE_DETERMINISTIC_REDUCE` (default 1): 1 sums a token's routed-expert partials in
ascending expert-id order, so the MoE output does not depend on routing order; 0 sums them
in routing order (`index_add_`).

`DSPARK_KERNELS` (default torch): implementation of the `kernels/` ops the model selects
(`Settings.kernel_config` builds the `kernels.select.KernelConfig`): "torch" (the plain-torch
`<op>_ref`) or "triton" (the Triton kernels; CUDA tensors, or CPU tensors under
`TRITON_INTERPRET=1`).

`DSPARK_MOE_MULTI_TOKEN_FP4` (default 0): 1 runs multi-token fp4 routed-expert GEMMs
(verify) on the small-batch path instead of the grouped (prefill) path.
"""

from __future__ import annotations

from dataclasses import dataclass

from kernels.select import KERNEL_BACKENDS, KernelConfig

ENV_MOE_DETERMINISTIC_REDUCE = "DSPARK_MOE_DETERMINISTIC_REDUCE"
ENV_KERNELS = "DSPARK_KERNELS"
ENV_MOE_MULTI_TOKEN_FP4 = "DSPARK_MOE_MULTI_TOKEN_FP4"


@dataclass(frozen=True)
class Settings:
    """Numerics switches of `dsv4` (see the module docstring).

    moe_deterministic_reduce: MoE combine in ascending expert id (True) or routing order.
    kernels: one of KERNEL_BACKENDS. moe_multi_token_fp4: small-batch path for multi-token
    fp4 routed-expert GEMMs.
    Raises:
        ValueError: kernels not one of KERNEL_BACKENDS, or a switch that is not a bool (named).
    """

    moe_deterministic_reduce: bool = True
    kernels: str = "torch"
    moe_multi_token_fp4: bool = False

    def __post_init__(self) -> None:
        if self.kernels not in KERNEL_BACKENDS:
            raise ValueError(f"kernels={self.kernels!r}: must be one of {', '.join(KERNEL_BACKENDS)}")
        for name in ("moe_deterministic_reduce", "moe_multi_token_fp4"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: must be True or False")

    def kernel_config(self) -> KernelConfig:
        """The `kernels/` backend and switches these settings choose, errors naming
        `DSPARK_KERNELS` (the model side's choice; `kernels/` knows no project setting)."""
        return KernelConfig(self.kernels, self.moe_multi_token_fp4, self.moe_deterministic_reduce,
                            chosen_by=ENV_KERNELS)
