"""The verifier's step-time table and its system-wide committed-token rate.

This module owns two load figures the gateway's gate prices drafts with (docs/gate.md §13):

* `StepTable`: the wall time of one batch step (ms) against the rows it forwarded (tokens),
  one point per row bucket. A bucket keeps a moving average (alpha 0.1) of its steps' rows
  and ms; the start-up profile (`services.verifier.step_profile`) seeds the buckets and every
  live batch step refines its own. The published table is the samples-weighted
  non-decreasing fit of the bucket means (forwarding more rows never takes less work, so a
  dip is noise the gate must not chase).
* `CommitRate`: committed tokens per wall ms over recent steps, the system's long-run rate
  lambda_sys (decayed per step, idle gaps between steps capped so a quiet period does not
  drag the rate of the next burst down).

`LoadTracker` holds both behind one lock and is fed by the step loop's `on_step` hook. It
never times anything itself and never decides anything: the loop reports each step, the
gateway decides.
"""

from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from dspark_proto.v1 import common_pb2
from services.common.budget import StepTimes
from services.common.monotone import non_decreasing

# Lower edges of the row buckets (tokens forwarded in one step). Fine at the small sizes a
# few streams produce, then doubling: step time is close to flat over small row counts and
# bends where the dense ops turn compute-bound, which the wide buckets still resolve.
ROW_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
EWMA_ALPHA = 0.1
RATE_DECAY = 0.95  # per step: the rate forgets over about 20 steps
PROFILED, ONLINE = "profiled", "measured online"


@dataclass
class _Bucket:
    rows: float
    ms: float
    profiled: int = 0
    online: int = 0

    def add(self, rows: float, ms: float) -> None:
        self.rows += EWMA_ALPHA * (rows - self.rows)
        self.ms += EWMA_ALPHA * (ms - self.ms)


@dataclass(frozen=True)
class StepTableSnapshot:
    """The published table: rows[i] (mean rows of bucket i's steps, tokens, increasing) and
    ms[i] (its fitted step time, ms, non-decreasing), samples[i] (steps behind it), source
    ("profiled", "measured online" or "" when empty). All tuples have one length."""

    rows: tuple[float, ...] = ()
    ms: tuple[float, ...] = ()
    samples: tuple[int, ...] = ()
    source: str = ""


class StepTable:
    """Batch-step wall time (ms) against rows forwarded (tokens); see the module docstring.

    Not thread-safe by itself (`LoadTracker` locks it).
    """

    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}

    def add(self, rows: int, ms: float, profiled: bool = False) -> None:
        """One step of `rows` >= 1 tokens that took `ms` >= 0 wall ms. `profiled`: a start-up
        sample (counted apart from live ones). Raises ValueError naming a bad value."""
        if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows < 1:
            raise ValueError(f"step rows={rows!r}: must be an integer >= 1")
        if not (isinstance(ms, (int, float)) and 0.0 <= ms < 1e8):
            raise ValueError(f"step ms={ms!r}: must be a finite number of ms >= 0")
        b = bisect.bisect_right(ROW_BUCKETS, int(rows)) - 1
        bucket = self._buckets.get(b)
        if bucket is None:
            self._buckets[b] = bucket = _Bucket(float(rows), float(ms))
        else:
            bucket.add(float(rows), float(ms))
        if profiled:
            bucket.profiled += 1
        else:
            bucket.online += 1

    def snapshot(self) -> StepTableSnapshot:
        """The fitted table (module docstring); empty before the first step."""
        if not self._buckets:
            return StepTableSnapshot()
        ordered = [self._buckets[b] for b in sorted(self._buckets)]
        counts = np.array([x.profiled + x.online for x in ordered], dtype=np.float64)
        fitted = non_decreasing(np.array([x.ms for x in ordered], dtype=np.float64), counts)
        source = ONLINE if any(x.online for x in ordered) else PROFILED
        return StepTableSnapshot(tuple(x.rows for x in ordered), tuple(float(v) for v in fitted),
                                 tuple(int(c) for c in counts), source)


@dataclass
class CommitRate:
    """Committed tokens per wall ms over recent steps (lambda_sys), see the module docstring.

    idle_cap_ms: the most idle time before one step that counts (ms). Not thread-safe alone.
    """

    idle_cap_ms: float = 1000.0
    _tokens: float = 0.0
    _ms: float = 0.0
    _last_end: float | None = None
    total: int = 0

    def add(self, tokens: int, ms: float, end_s: float) -> None:
        """A step that committed `tokens` and took `ms` wall ms, ending at `end_s`
        (time.perf_counter seconds)."""
        idle = 0.0 if self._last_end is None else (end_s - self._last_end) * 1e3 - ms
        elapsed = ms + min(max(idle, 0.0), self.idle_cap_ms)
        self._tokens = self._tokens * RATE_DECAY + tokens
        self._ms = self._ms * RATE_DECAY + elapsed
        self._last_end, self.total = end_s, self.total + tokens

    def tokens_per_ms(self) -> float:
        """The decayed rate (tokens per ms); 0.0 before any step took time."""
        return self._tokens / self._ms if self._ms > 0 else 0.0


@dataclass
class LoadTracker:
    """The verifier's load figures (thread-safe): the step table and the commit rate.

    Fed on the step loop's thread (`record`) and read by the servicer (`identity_fields`,
    `tokens_per_ms`) from the event loop.
    """

    table: StepTable = field(default_factory=StepTable)
    rate: CommitRate = field(default_factory=CommitRate)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, step) -> None:
        """One step of the loop (a `services.verifier.batcher.StepRecord`): a batch step adds
        its rows and ms to the table; every step adds its committed tokens to the rate."""
        now = time.perf_counter()
        with self._lock:
            if step.kind == "batch" and step.rows > 0:
                self.table.add(step.rows, step.ms)
            self.rate.add(step.tokens, step.ms, now)

    def seed(self, rows: int, ms: float) -> None:
        """One start-up profile step of `rows` tokens taking `ms` (into the table only)."""
        with self._lock:
            self.table.add(rows, ms, profiled=True)

    def tokens_per_ms(self) -> float:
        """lambda_sys: committed tokens per wall ms over recent steps (0.0 before any)."""
        with self._lock:
            return self.rate.tokens_per_ms()

    def prices(self) -> tuple[StepTimes | None, float]:
        """What the step's budget prices drafts with (`services.common.budget`): the fitted
        table (None before any step) and lambda_sys (tokens per ms)."""
        with self._lock:
            snap, lam = self.table.snapshot(), self.rate.tokens_per_ms()
        return (StepTimes(snap.rows, snap.ms) if snap.rows else None), lam

    def fill_identity(self, identity: common_pb2.ModelIdentity) -> None:
        """Write the table and the rate into ModelIdentity fields 29-34."""
        with self._lock:
            snap, lam, total = self.table.snapshot(), self.rate.tokens_per_ms(), self.rate.total
        identity.step_table_rows.extend(snap.rows)
        identity.step_table_ms.extend(snap.ms)
        identity.step_table_samples.extend(snap.samples)
        identity.step_table_source = snap.source
        identity.committed_tokens_per_ms = lam
        identity.committed_tokens = total
