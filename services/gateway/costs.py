"""Gate costs: `configured` (the DEEPSEEK_DSPARK_GATE_*_MS values) or `measured` from round timings.

This module owns the process-wide fit of the four round costs and the choice between it and
the configured costs. It must not time anything itself (the scheduler reports each call's wall
time) or make decisions with the costs (the gate does).

`CostTracker` keeps, process-wide, the least-squares fit verify(k) = base + slope·k over
(k = drafts submitted, verify wall ms) of every verify round, and exponentially weighted
moving averages of draft and plain-decode wall times (alpha 0.1). A generation in `measured`
mode takes a snapshot of the fitted `CostModel` when it starts (so its decisions do not
change mid-generation); until the fit has at least `MIN_SAMPLES` verify rounds over two
distinct k, a draft sample and a plain sample, the configured costs are used.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from services.common.settings import COST_MODES
from services.gateway.gate import CostModel

MIN_SAMPLES = 5
EWMA_ALPHA = 0.1
MAX_VERIFY_SAMPLES = 4096  # most recent verify rounds kept for the fit


@dataclass
class _Ewma:
    value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - EWMA_ALPHA) * self.value + EWMA_ALPHA * x


class CostTracker:
    """Thread-safe process-wide timing statistics; see the module docstring."""

    def __init__(self, configured: CostModel):
        self.configured = configured
        self._lock = threading.Lock()
        self._verify: list[tuple[int, float]] = []
        self._draft, self._plain = _Ewma(), _Ewma()

    def add_verify(self, k: int, ms: float) -> None:
        """One verify round of k >= 1 submitted drafts that took `ms` wall time."""
        with self._lock:
            self._verify.append((k, ms))
            del self._verify[:-MAX_VERIFY_SAMPLES]

    def add_draft(self, ms: float) -> None:
        with self._lock:
            self._draft.add(ms)

    def add_plain(self, ms: float) -> None:
        with self._lock:
            self._plain.add(ms)

    def fit(self) -> dict | None:
        """{'verify_base_ms', 'verify_slope_ms', 'draft_ms', 'plain_ms', 'samples'} or None when too few."""
        with self._lock:
            samples = list(self._verify)
            draft, plain = self._draft.value, self._plain.value
        ks = np.array([k for k, _ in samples], dtype=float)
        if len(samples) < MIN_SAMPLES or len(set(ks.tolist())) < 2 or draft is None or plain is None:
            return None
        ms = np.array([m for _, m in samples])
        slope, base = np.polyfit(ks, ms, 1)
        return {"verify_base_ms": float(base), "verify_slope_ms": float(slope), "draft_ms": float(draft),
                "plain_ms": float(plain), "samples": len(samples)}

    def model(self, mode: str) -> CostModel:
        """The cost model a new generation uses: configured, or the measured fit when available.

        A measured fit with a non-positive slope or cost is clamped to small positive values
        (the gate needs positive costs).
        """
        if mode not in COST_MODES:
            raise ValueError(f"gate cost mode={mode!r}: must be one of {COST_MODES}")
        fit = self.fit() if mode == "measured" else None
        if fit is None:
            return self.configured
        return CostModel(draft_ms=max(fit["draft_ms"], 1e-3), verify_base_ms=max(fit["verify_base_ms"], 1e-3),
                         verify_slope_ms=max(fit["verify_slope_ms"], 0.0), plain_ms=max(fit["plain_ms"], 1e-3))

    def to_dict(self) -> dict:
        c = self.configured
        return {"configured": {"draft_ms": c.draft_ms, "verify_base_ms": c.verify_base_ms,
                               "verify_slope_ms": c.verify_slope_ms, "plain_ms": c.plain_ms},
                "measured": self.fit()}
