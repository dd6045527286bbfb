"""Process settings of the model math, read once from the environment.

`DSV4_MOE_DETERMINISTIC_REDUCE` (default 1): 1 sums a token's routed-expert partials in
ascending expert-id order, so the MoE output does not depend on routing order; 0 sums them
in routing order (`index_add_`). DESIGN.md §11 (the seed's `DSV4_CPP_MOE_DETERMINISTIC_REDUCE`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

ENV_MOE_DETERMINISTIC_REDUCE = "DSV4_MOE_DETERMINISTIC_REDUCE"


@dataclass(frozen=True)
class Settings:
    """Numerics switches of `dsv4` (see the module table)."""

    moe_deterministic_reduce: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        """Read the variables from `env` (default `os.environ`); unset or empty means default.

        Raises:
            ValueError: naming the variable and its value when it is not "0" or "1".
        """
        env = os.environ if env is None else env
        return cls(moe_deterministic_reduce=_flag(env, ENV_MOE_DETERMINISTIC_REDUCE, True))


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "")
    value = raw.strip()
    if value == "":
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name}={raw!r}: must be 0 or 1")
    return value == "1"
