"""Service settings read once from the environment into frozen dataclasses (CLI flags override).

| variable | default | meaning |
|---|---|---|
| DSPARK_VERIFIER_TARGET | 127.0.0.1:50051 | gateway -> verifier address(es) |
| DSPARK_DRAFTER_TARGET | 127.0.0.1:50052 | gateway -> drafter address(es); empty = no drafter |
| DSPARK_VERIFY_MODE | batched | verify path: sequential or batched |
| DSPARK_GATE_COSTS | configured | gate costs: configured (DEEPSEEK_DSPARK_GATE_*_MS) or measured |
| DSPARK_ROUND_TIMEOUT_S | 30 | gateway: deadline for one backend reply (s) |
| DSPARK_GENERATION_TIMEOUT_S | 600 | gateway: deadline of one generation's backend streams (s) |
| DSPARK_MAX_SESSIONS | 16 | verifier / drafter: concurrent sessions (streams) |
| DSPARK_STARTUP_TIMEOUT_S | 10 | gateway: deadline for the backends' Info at start (s) |
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from services.gateway.costs import COST_MODES
from services.gateway.scheduler import VERIFY_MODES


def _float(environ: Mapping[str, str], name: str, default: float, low: float = 0.0) -> float:
    raw = environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: not a number") from None
    if not (value > low) or value != value or value == float("inf"):
        raise ValueError(f"{name}={raw!r}: must be a finite number > {low:g}")
    return value


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None:
        return default
    if not raw.strip().isascii() or not raw.strip().isdigit() or int(raw) < 1:
        raise ValueError(f"{name}={raw!r}: must be an integer >= 1")
    return int(raw)


def _choice(environ: Mapping[str, str], name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = environ.get(name, default)
    if raw not in choices:
        raise ValueError(f"{name}={raw!r}: must be one of {choices}")
    return raw


@dataclass(frozen=True)
class GatewaySettings:
    verifier_target: str = "127.0.0.1:50051"
    drafter_target: str = "127.0.0.1:50052"
    verify_mode: str = "batched"
    cost_mode: str = "configured"
    round_timeout_s: float = 30.0
    generation_timeout_s: float = 600.0
    startup_timeout_s: float = 10.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "GatewaySettings":
        """Raises ValueError naming the variable and value when one is invalid."""
        return cls(
            verifier_target=environ.get("DSPARK_VERIFIER_TARGET", cls.verifier_target),
            drafter_target=environ.get("DSPARK_DRAFTER_TARGET", cls.drafter_target),
            verify_mode=_choice(environ, "DSPARK_VERIFY_MODE", cls.verify_mode, VERIFY_MODES),
            cost_mode=_choice(environ, "DSPARK_GATE_COSTS", cls.cost_mode, COST_MODES),
            round_timeout_s=_float(environ, "DSPARK_ROUND_TIMEOUT_S", cls.round_timeout_s),
            generation_timeout_s=_float(environ, "DSPARK_GENERATION_TIMEOUT_S", cls.generation_timeout_s),
            startup_timeout_s=_float(environ, "DSPARK_STARTUP_TIMEOUT_S", cls.startup_timeout_s),
        )


@dataclass(frozen=True)
class BackendSettings:
    max_sessions: int = 16
    verify_mode: str = "batched"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "BackendSettings":
        """Raises ValueError naming the variable and value when one is invalid."""
        return cls(max_sessions=_int(environ, "DSPARK_MAX_SESSIONS", cls.max_sessions),
                   verify_mode=_choice(environ, "DSPARK_VERIFY_MODE", cls.verify_mode, VERIFY_MODES))
