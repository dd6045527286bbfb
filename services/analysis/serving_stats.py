"""Figures of serving: per generation, per cell, and their spread over repetitions.

The serving benchmark (bench/bench_serving.py) and `dspark simulate` both fold their traces here.

Owns the arithmetic only (no timing, no I/O), so it is unit-tested on fixed numbers
(tests/test_bench_serving_stats.py). Times are seconds on `time.perf_counter()`'s clock
unless a name ends in `_ms`; counts are completion tokens.

Definitions:
  * TTFT: a generation's start to the arrival of its first message with tokens (ms).
  * inter-token latency (ITL): each later message's gap since the previous message, shared
    equally by its tokens (a speculative round that streams 4 tokens after 80 ms counts 4
    latencies of 20 ms), so that the figure is the per-token pace a client sees;
  * aggregate tok/s: all completion tokens of a cell / the cell's wall time (first start to
    last end); per-stream tok/s: the median over streams of tokens / (stream end - start).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Iterable, Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of `values`, linearly interpolated between ranks.

    Raises:
        ValueError: `values` is empty or q is outside [0, 100] (both named).
    """
    if not 0 <= q <= 100:
        raise ValueError(f"q={q}: must be in [0, 100]")
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    rank = (len(xs) - 1) * q / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


@dataclass
class GenerationTrace:
    """One generation as its client saw it: start, and (arrival time, tokens) per message.

    start: when the call was made (s). arrivals: perf_counter time of each message that
    carried tokens (s), with its token count, in order.
    """

    start: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.arrivals)

    @property
    def end(self) -> float:
        return self.arrivals[-1][0] if self.arrivals else self.start

    @property
    def ttft_ms(self) -> float | None:
        """None when no token arrived."""
        return (self.arrivals[0][0] - self.start) * 1e3 if self.arrivals else None

    def itl_ms(self) -> list[float]:
        """Per-token inter-token latencies (ms) after the first message (module docstring)."""
        out: list[float] = []
        for (t_prev, _), (t, n) in zip(self.arrivals, self.arrivals[1:]):
            out += [(t - t_prev) * 1e3 / n] * n
        return out


@dataclass(frozen=True)
class CellFigures:
    """One cell's figures (one arm, one numerics, one concurrency, one repetition)."""

    aggregate_tok_s: float
    per_stream_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    tokens: int
    wall_s: float

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def cell_figures(streams: Sequence[Sequence[GenerationTrace]]) -> CellFigures:
    """The figures of one cell from each stream's generations (a stream runs its generations
    one after another).

    Raises:
        ValueError: no stream, a stream with no generation, or no token in the whole cell.
    """
    if not streams or any(not s for s in streams):
        raise ValueError(f"a cell needs >= 1 stream with >= 1 generation, got {[len(s) for s in streams]}")
    gens = [g for s in streams for g in s]
    tokens = sum(g.tokens for g in gens)
    if tokens == 0:
        raise ValueError(f"no token streamed in a cell of {len(gens)} generations")
    wall = max(g.end for g in gens) - min(g.start for g in gens)
    per_stream = [sum(g.tokens for g in s) / max(s[-1].end - s[0].start, 1e-9) for s in streams]
    ttft = [g.ttft_ms for g in gens if g.ttft_ms is not None]
    itl = [x for g in gens for x in g.itl_ms()] or [0.0]
    return CellFigures(tokens / max(wall, 1e-9), statistics.median(per_stream), percentile(ttft, 50),
                       percentile(ttft, 99), percentile(itl, 50), percentile(itl, 99), tokens, wall)


@dataclass(frozen=True)
class Spread:
    """Median with min and max of one figure over repetitions."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread:
        """Raises ValueError on no values."""
        xs = list(values)
        if not xs:
            raise ValueError("a spread of no values")
        return cls(statistics.median(xs), min(xs), max(xs))

    def as_dict(self) -> dict:
        return {"median": self.median, "min": self.low, "max": self.high}
