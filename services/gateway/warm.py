"""The gate's warm start: process-wide calibration per sampling band (docs/gate.md §6, §6a).

This module owns the bands a gateway keeps and what a new gated generation borrows from them.
It must not decide draft lengths (the gate does), count rounds (the record fold does: a band
merges finished generations' `GateStats`) or read the environment (the entry point passes
`WarmStart` settings down).

A confidence logit means a different acceptance probability under greedy decoding and under
sampling, and under sampling it depends on the temperature, the filters and the acceptance
rule (docs/gate.md §6a). So the calibration a finished generation leaves behind is merged only
into its own *sampling band*, and a new generation warm-starts from its band alone: a T = 1
generation never starts from T = 0 acceptance.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from dsv4.sampling import SamplingParams
from services.gateway.gate import RECENT_ROUNDS, Calibration
from services.gateway.probe import Streak
from services.gateway.record import GateStats
from services.gateway.survival import GREEDY_BAND  # T = 0's band: one name for the warm start and the estimate
from services.gateway.values import finite_float, parse_setting, short_repr

# Upper edges of the sampled temperature bands: (0, 0.5], (0.5, 1.0], and above 1.0.
TEMPERATURE_EDGES = (0.5, 1.0)
# Observations per bucket a warm start may lend a new gate. About what the gate's own decay
# (0.9) keeps from a steadily observed bucket, so the band counts as much as one warmed-up
# generation and the generation's own rounds outweigh it within a few dozen observations.
# Replayed leave-one-workload-out on the committed rounds under three cost shapes, 10 keeps
# every (file, shape, workload) at or above its cold result but for three bundled workloads
# whose own calibration curves differ from the others' (bench/README.md, gate_shapes).
DEFAULT_MAX_WEIGHT = 10.0
MAX_WEIGHT_LIMIT = 1e6
# Consecutive finished generations of a band that must end in a losing streak with dear probes
# before a new one continues it (starts skipping, its drafter asleep, on the band's probe
# schedule). Fewer would suspend a good workload behind losing neighbours: with 2, the bundled
# drafter's gated cells on the 2-core box (code, prose, math, repeat in turn) fell to 49-84 %
# plain rounds; a drafter that is never accepted loses every generation, so 4 costs it 4 cold
# starts once per process.
LOSING_GENERATIONS = 4


def sampling_band(sampling: SamplingParams) -> str:
    """The band a generation's calibration belongs to: "greedy" at T = 0, else
    "<rule>:<temperature band>:<filtered|unfiltered>", e.g. "coupled:T(0.5,1]:unfiltered".
    Filtered means top_p < 1, top_k > 0 or min_p > 0 (a sharper distribution accepts more)."""
    if sampling.greedy:
        return GREEDY_BAND
    t = sampling.temperature
    if t <= TEMPERATURE_EDGES[0]:
        temp = f"T(0,{TEMPERATURE_EDGES[0]:g}]"
    elif t <= TEMPERATURE_EDGES[1]:
        temp = f"T({TEMPERATURE_EDGES[0]:g},{TEMPERATURE_EDGES[1]:g}]"
    else:
        temp = f"T>{TEMPERATURE_EDGES[1]:g}"
    filtered = sampling.top_p < 1.0 or sampling.top_k > 0 or sampling.min_p > 0.0
    return f"{sampling.rule}:{temp}:{'filtered' if filtered else 'unfiltered'}"


@dataclass(frozen=True)
class WarmStart:
    """Warm-start settings.

    max_weight: the most observations per confidence bucket a band lends a new gate (> 0, at
    most MAX_WEIGHT_LIMIT). A band lends its recent drafted rounds only with a losing streak
    (`Band.calibration`): lent to every generation, they cost more where they wrongly suspend
    a good workload than they save where they rightly skip one first draft (replayed,
    docs/gate.md §6). Raises ValueError naming the value.
    """

    max_weight: float = DEFAULT_MAX_WEIGHT

    def __post_init__(self) -> None:
        weight = finite_float(self.max_weight)
        if isinstance(self.max_weight, bool) or weight is None or not 0.0 < weight <= MAX_WEIGHT_LIMIT:
            raise ValueError(f"max_weight={short_repr(self.max_weight)} must be a number in (0, {MAX_WEIGHT_LIMIT:g}]")
        object.__setattr__(self, "max_weight", weight)


def parse_warm_start(raw: str, name: str) -> WarmStart:
    """`WarmStart` from the text of a max weight (env var or flag `name`): an ASCII decimal
    number in (0, MAX_WEIGHT_LIMIT] (the gate settings' number rules, docs/gate.md §8).
    Raises ValueError naming `name` and `raw`."""
    weight = parse_setting("prior_weight", raw, name)  # the same rule: a finite number > 0
    if weight > MAX_WEIGHT_LIMIT:
        raise ValueError(f"{name}={short_repr(raw)} must be <= {MAX_WEIGHT_LIMIT:g}")
    return WarmStart(weight)


@dataclass
class Band:
    """One sampling band's merged history: generations that verified at least one draft,
    their gate counters (raw censored bucket counts included) and the confidence logits of
    the band's last RECENT_ROUNDS drafted rounds (oldest first)."""

    generations: int = 0
    gate: GateStats = field(default_factory=GateStats)
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_ROUNDS))
    losing: int = 0  # the last finished generations that ended in a losing streak, in a row
    streak: Streak | None = None  # the last one's streak, when it ended losing
    wake_ms: float = 0.0  # the last re-prime a losing generation measured (ms; 0: none yet)

    def add(self, gate: GateStats, recent: Sequence[Sequence[float]], streak: Streak | None = None) -> None:
        """Merge one finished generation: its gate counters, its recent drafted confidences
        and, when it ended losing, its streak (`Gate.streak`; None: it did not). A generation
        that verified no draft adds no counters or confidences, but its streak counts."""
        if gate.verified_rounds:
            self.generations += 1
            self.gate.merge(gate)
            self.recent.extend(tuple(float(c) for c in conf) for conf in recent)
        self.losing = self.losing + 1 if streak is not None else 0
        self.streak = streak
        if streak is not None and streak.wake_ms > 0:  # kept across generations that woke nothing
            self.wake_ms = streak.wake_ms

    def calibration(self, settings: WarmStart) -> Calibration:
        """The band as a frozen `Calibration`: bucket counts scaled to at most
        `settings.max_weight` observations each (`GateStats.calibration`); after
        LOSING_GENERATIONS generations in a row ended losing, also the band's last RECENT_ROUNDS
        drafted confidences and its streak (with the last measured re-prime, `wake_ms`), so the
        new gate goes on skipping and probing where the last one stopped."""
        counts = self.gate.calibration(settings.max_weight)
        if self.losing >= LOSING_GENERATIONS:
            streak = dataclasses.replace(self.streak, wake_ms=self.wake_ms)
            return Calibration(counts.matched, counts.observed, tuple(self.recent), streak)
        return counts


class WarmBands:
    """The process's bands (thread-safe): finished generations are merged in, new gated
    generations borrow a snapshot. One per gateway process.

    Args:
        settings: the `WarmStart` settings (max_weight).
    """

    def __init__(self, settings: WarmStart) -> None:
        self.settings = settings
        self._bands: dict[str, Band] = {}
        self._lock = threading.Lock()

    def add(self, band: str, gate: GateStats, recent: Sequence[Sequence[float]],
            streak: Streak | None = None) -> None:
        """Merge a finished generation of sampling band `band` (see `sampling_band`); `streak`:
        its `Gate.streak()` (None: it did not end losing, or its probes are cheap). A generation
        that verified no draft teaches the estimates nothing: it starts no band, and adds only
        its streak to one that exists; one whose gate was never asked (spec off) adds nothing."""
        with self._lock:
            if gate.rounds == 0 or (gate.verified_rounds == 0 and band not in self._bands):
                return  # a generation whose gate was never asked (spec off) says nothing of the band
            self._bands.setdefault(band, Band()).add(gate, recent, streak)

    def calibration(self, band: str) -> Calibration | None:
        """What a new generation of `band` warm-starts from; None (cold) before any generation
        of that band verified a draft."""
        with self._lock:
            state = self._bands.get(band)
            return None if state is None else state.calibration(self.settings)

    def to_dict(self) -> dict:
        """JSON-ready per band: generations merged, verified rounds, raw observed positions,
        the recent drafted rounds held, the observations per bucket a new gate borrows, the
        losing generations in a row, the last one's streak and the last re-prime (ms)."""
        with self._lock:
            out = {}
            for name, state in sorted(self._bands.items()):
                lent = state.gate.calibration(self.settings.max_weight).observed
                out[name] = {"generations": state.generations, "verified_rounds": state.gate.verified_rounds,
                             "observed": sum(state.gate.bucket_observed), "recent_rounds": len(state.recent),
                             "lent_observed": list(lent), "losing_generations": state.losing,
                             "streak": None if state.streak is None else dataclasses.asdict(state.streak),
                             "wake_ms": state.wake_ms}
            return {"max_weight": self.settings.max_weight, "bands": out}
