"""Gate costs: the costs in force and where each came from (profile, live rounds, variable, default).

This module owns the process-wide timing statistics of the round costs, their merge with the
start-up profile (`services.gateway.profile`) and the configured costs, and the per-field
report of their sources. It must not time anything itself (the scheduler reports each call's
wall time, the profile its medians) or make decisions with the costs (the gate does).

`CostTracker` keeps an exponentially weighted moving average (alpha 0.1) per cost: draft,
plain decode, drafter commit, and verify separately for each k (drafts submitted). The start-up
profile seeds them with its medians; every live round then refines them. Mode `configured`
uses the configured costs (`DSPARK_GATE_*_MS`, else `GateConfig`'s defaults) and a
commit cost of 0. Mode `measured` replaces every cost that no variable set (`pinned`) with the
measured one once draft, plain and verify are all measured (profiled, or online from at least
`MIN_SAMPLES` verify rounds over two distinct k); a variable always wins for its own field.
The measured verify costs form a table over k = 1..K (`CostModel.verify_table`): ks without a
sample come from the line through the measured ones, and the table is made non-decreasing in k
(pool-adjacent-violators, weighted by samples) because verifying more drafts never takes less
work, so a dip is noise the gate must not chase. base and slope are its least-squares line
(with a pinned one held fixed); a pinned verify field drops the table, so the variable's line
is what verify(k) reads. A generation takes a snapshot (`model`) when it starts.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from services.common.monotone import non_decreasing
from services.common.settings import COST_MODES, PINNABLE_COSTS
from services.gateway.gate import CostModel
from services.gateway.profile import CostProfile
from services.gateway.values import MIN_COST_MS

MIN_SAMPLES = 5
EWMA_ALPHA = 0.1
PINNABLE = PINNABLE_COSTS  # the cost fields a DSPARK_GATE_*_MS variable sets (and so pins)
# Every reported field of the costs in force.
REPORTED = ("draft_ms", "verify_base_ms", "verify_slope_ms", "verify_table", "plain_ms", "commit_ms")
PROFILED, ONLINE, DEFAULT = "profiled", "measured online", "default"


@dataclass
class _Ewma:
    """One cost's moving average (ms); `profiled`: seeded by the profile; `online`: live samples."""

    value: float | None = None
    profiled: bool = False
    online: int = 0

    def seed(self, x: float) -> None:
        self.value, self.profiled = x, True

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - EWMA_ALPHA) * self.value + EWMA_ALPHA * x
        self.online += 1

    @property
    def source(self) -> str | None:
        return ONLINE if self.online else PROFILED if self.profiled else None

    def counts(self) -> dict:
        return {"profiled": self.profiled, "online": self.online}


@dataclass(frozen=True)
class Measured:
    """The measured costs (ms): verify_table[k - 1] for k = 1..K (non-decreasing), its line
    (base, slope), draft, plain, commit (None: not measured) and each part's source label."""

    verify_table: tuple[float, ...]
    verify_base_ms: float
    verify_slope_ms: float
    draft_ms: float
    plain_ms: float
    commit_ms: float | None
    sources: dict[str, str]
    samples: int


def verify_line(table: Sequence, base: float | None = None, slope: float | None = None) -> tuple[float, float]:
    """Least-squares (base, slope) of verify(k) = base + slope * k over table[k - 1], with a
    given base or slope held fixed (ms). table: K >= 1 verify times (ms); K = 1 gives slope 0."""
    ks, ms = np.arange(1, len(table) + 1, dtype=np.float64), np.asarray(table, dtype=np.float64)
    if base is not None and slope is not None:
        return base, slope
    if len(table) == 1 and base is None and slope is None:
        return float(ms[0]), 0.0
    if slope is not None:
        return float(np.mean(ms - slope * ks)), slope
    if base is not None:
        return base, float(np.dot(ks, ms - base) / np.dot(ks, ks))
    fitted_slope, fitted_base = np.polyfit(ks, ms, 1)
    return float(fitted_base), float(fitted_slope)


class CostTracker:
    """Thread-safe process-wide cost statistics and the costs in force (module docstring).

    configured: the costs of `GateConfig` (the variables or the defaults). pinned: cost field
    -> the variable that set it (only `PINNABLE` fields); measured costs never replace those.
    Raises ValueError naming a pinned key that is not a pinnable field.
    """

    def __init__(self, configured: CostModel, pinned: Mapping[str, str] | None = None):
        pinned = dict(pinned or {})
        bad = sorted(set(pinned) - set(PINNABLE))
        if bad:
            raise ValueError(f"pinned cost fields {bad}: must be among {PINNABLE}")
        self.configured, self.pinned = configured, pinned
        self._lock = threading.Lock()
        self._verify: dict[int, _Ewma] = {}
        self._verify_rounds = 0
        self._draft, self._plain, self._commit = _Ewma(), _Ewma(), _Ewma()
        self.profile: CostProfile | None = None
        self.profile_error: str | None = None
        # the samples' version and each mode's model at the version it was built from: the
        # regime asks for the model every round, and building it (a weighted fit, a monotone
        # pass, a validated CostModel) cost as much gateway CPU as the rest of a plain round
        self._version = 0
        self._models: dict[str, tuple[int, CostModel]] = {}

    # ------------------------------------------------------------------ samples
    def seed(self, profile: CostProfile) -> None:
        """Start every moving average at the start-up profile's medians (ms)."""
        with self._lock:
            self.profile = profile
            self._version += 1
            for k, ms in enumerate(profile.verify_ms, start=1):
                self._verify.setdefault(k, _Ewma()).seed(ms)
            self._draft.seed(profile.draft_ms)
            self._plain.seed(profile.plain_ms)
            self._commit.seed(profile.commit_ms)

    def profile_failed(self, reason: str) -> None:
        """Record why the start-up profile gave nothing (reported by `to_dict`)."""
        with self._lock:
            self.profile_error = reason

    def add_verify(self, k: int, ms: float) -> None:
        """One verify round of k >= 1 submitted drafts that took `ms` wall time."""
        with self._lock:
            self._verify.setdefault(k, _Ewma()).add(ms)
            self._verify_rounds += 1
            self._version += 1

    def add_draft(self, ms: float) -> None:
        """One drafter call that took `ms` wall time."""
        with self._lock:
            self._draft.add(ms)
            self._version += 1

    def add_plain(self, ms: float) -> None:
        """One plain decode that took `ms` wall time."""
        with self._lock:
            self._plain.add(ms)
            self._version += 1

    def add_commit(self, ms: float) -> None:
        """One drafter commit after a round that took `ms` wall time."""
        with self._lock:
            self._commit.add(ms)
            self._version += 1

    # ------------------------------------------------------------------ the costs
    def measured(self) -> Measured | None:
        """The measured costs, or None until draft, plain and verify are all measured: the
        profile seeded them, or live rounds gave a draft, a plain decode and at least
        `MIN_SAMPLES` verify rounds over two distinct k."""
        with self._lock:
            verify = {k: (e.value, e.online + (self.profile.repeats if e.profiled and self.profile else 0), e.source)
                      for k, e in self._verify.items() if e.value is not None}
            draft, plain, commit = (_Ewma(e.value, e.profiled, e.online) for e in (self._draft, self._plain, self._commit))
            rounds, profiled = self._verify_rounds, self.profile is not None
        if draft.value is None or plain.value is None or not verify:
            return None
        if not profiled and (rounds < MIN_SAMPLES or len(verify) < 2):
            return None
        table = _verify_table(verify)
        base, slope = verify_line(table)
        sources = {"verify": ONLINE if any(s == ONLINE for _, _, s in verify.values()) else PROFILED,
                   "draft_ms": draft.source, "plain_ms": plain.source, "commit_ms": commit.source}
        return Measured(table, base, slope, draft.value, plain.value, commit.value, sources,
                        rounds + (self.profile.repeats * len(table) if self.profile else 0))

    def fit(self) -> dict | None:
        """The measured costs as JSON ({'verify_base_ms', 'verify_slope_ms', 'draft_ms',
        'plain_ms', 'commit_ms', 'verify_table', 'samples'}; ms), or None while unmeasured."""
        m = self.measured()
        if m is None:
            return None
        return {"verify_base_ms": m.verify_base_ms, "verify_slope_ms": m.verify_slope_ms, "draft_ms": m.draft_ms,
                "plain_ms": m.plain_ms, "commit_ms": m.commit_ms, "verify_table": list(m.verify_table),
                "samples": m.samples}

    def in_force(self, mode: str) -> tuple[dict, dict[str, str]]:
        """(values, sources) of every `REPORTED` field under `mode` (module docstring).

        values: ms (verify_table a tuple or None). sources: "profiled", "measured online",
        "configured by <variable>", "default", or "not used" (no verify table).
        Raises ValueError naming the mode unless it is one of COST_MODES.
        """
        if mode not in COST_MODES:
            raise ValueError(f"gate cost mode={mode!r}: must be one of {COST_MODES}")
        c = self.configured
        values = {"draft_ms": c.draft_ms, "verify_base_ms": c.verify_base_ms, "verify_slope_ms": c.verify_slope_ms,
                  "verify_table": c.verify_table, "plain_ms": c.plain_ms, "commit_ms": c.commit_ms}
        sources = {f: f"configured by {self.pinned[f]}" if f in self.pinned else DEFAULT for f in REPORTED}
        if values["verify_table"] is None:
            sources["verify_table"] = "not used"
        m = self.measured() if mode == "measured" else None
        if m is None:
            return values, sources
        for f in ("draft_ms", "plain_ms", "commit_ms"):
            if f not in self.pinned and getattr(m, f) is not None:
                values[f], sources[f] = max(getattr(m, f), MIN_COST_MS if f != "commit_ms" else 0.0), m.sources[f]
        base_pin, slope_pin = "verify_base_ms" in self.pinned, "verify_slope_ms" in self.pinned
        base, slope = verify_line(m.verify_table, c.verify_base_ms if base_pin else None,
                                  c.verify_slope_ms if slope_pin else None)
        for f, value, pin in (("verify_base_ms", base, base_pin), ("verify_slope_ms", slope, slope_pin)):
            if not pin:
                values[f], sources[f] = max(value, 0.0), m.sources["verify"]
        if not (base_pin or slope_pin):  # a verify variable means its line, not the table, prices verify(k)
            values["verify_table"], sources["verify_table"] = m.verify_table, m.sources["verify"]
        return values, sources

    def model(self, mode: str) -> CostModel:
        """The cost model a new generation uses under `mode` ("configured" or "measured").

        Measured costs are clamped to what CostModel accepts (draft and plain >= 1e-3 ms, the
        rest >= 0). Raises ValueError naming the mode unless it is one of COST_MODES.
        """
        with self._lock:
            version, cached = self._version, self._models.get(mode)
        if cached is not None and cached[0] == version:
            return cached[1]
        values, sources = self.in_force(mode)
        source = f"{mode}: " + ", ".join(f"{f} {sources[f]}" for f in REPORTED)
        model = CostModel(values["draft_ms"], values["verify_base_ms"], values["verify_slope_ms"], values["plain_ms"],
                         commit_ms=values["commit_ms"], verify_table=values["verify_table"], source=source)
        with self._lock:  # built from samples no newer than `version`; a later one rebuilds it
            self._models[mode] = (version, model)
        return model

    def to_dict(self, mode: str) -> dict:
        """The Stats RPC's `costs`: configured (the four configured ms), measured (`fit`),
        in_force and sources (`in_force` under `mode`), samples (per cost: seeded by the
        profile, live samples), profile (its medians, or None) and profile_error (or None)."""
        c = self.configured
        values, sources = self.in_force(mode)
        with self._lock:
            samples = {"draft_ms": self._draft.counts(), "plain_ms": self._plain.counts(),
                       "commit_ms": self._commit.counts(),
                       "verify": {str(k): e.counts() for k, e in sorted(self._verify.items())}}
            profile, error = self.profile, self.profile_error
        if values["verify_table"] is not None:
            values["verify_table"] = list(values["verify_table"])
        return {"configured": {"draft_ms": c.draft_ms, "verify_base_ms": c.verify_base_ms,
                               "verify_slope_ms": c.verify_slope_ms, "plain_ms": c.plain_ms},
                "measured": self.fit(), "in_force": values, "sources": sources, "samples": samples,
                "profile": None if profile is None else profile.to_dict(), "profile_error": error}


def _verify_table(verify: Mapping[int, tuple[float, int, str | None]]) -> tuple[float, ...]:
    """verify(k) for k = 1..max measured k (ms) from {k: (moving average, weight, source)}:
    unmeasured ks from the weighted line through the measured ones, then `non_decreasing`,
    then clamped >= 0."""
    ks = np.array(sorted(verify), dtype=np.float64)
    ms = np.array([verify[int(k)][0] for k in ks], dtype=np.float64)
    weights = np.array([max(verify[int(k)][1], 1) for k in ks], dtype=np.float64)
    full = np.arange(1, int(ks[-1]) + 1, dtype=np.float64)
    if len(ks) >= 2:
        slope, base = np.polyfit(ks, ms, 1, w=np.sqrt(weights))
        line = base + slope * full
    else:
        line = np.full_like(full, ms[0])
    table, weight = line.copy(), np.full_like(full, 1e-3)  # a filled k barely pulls on its measured neighbours
    table[ks.astype(int) - 1], weight[ks.astype(int) - 1] = ms, weights
    return tuple(float(max(v, 0.0)) for v in non_decreasing(table, weight))
