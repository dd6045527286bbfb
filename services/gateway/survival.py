"""Survival of a drafted block: P(draft position j is accepted AND every position before it is).

This module owns the conditional acceptance estimate the gate's length choice (and a step's
verification budget) prices a block with: per sampling band, decayed censored counts of
(position class, confidence bucket) -> accepted given reached, turned into a survival curve
S_j = prod_{i<=j} h(class(i), bucket(i)). It never decides (`decision.py` prices S), never
counts rounds for reporting (the record fold does) and never reads the environment.
docs/gate.md §4 states the model, why and how to tune it.

Why not a product of per-bucket marginals. A position is observed only when every earlier
position was accepted (censoring), so the per-bucket rate `BucketEstimator` learns is a
hazard pooled over positions. On the bundled model's recorded rounds the hazard at equal
confidence rises with the position: the first draft (right after the anchor) is the weakest,
and a position reached through accepted drafts is more likely to be accepted itself
(`bench/bench_survival.py`; e.g. confidence 1.5..3.0: 0.71 at position 0, 0.79 at 1, 0.82 at
2+). Pooling over positions then overestimates S_0 (0.875 against the realised 0.845) and
underestimates the tail (0.519 against 0.548 at j = 4), which shortens blocks that pay.

The hazard of class c = min(j, classes - 1) and bucket b:

    p_b    = the band's pooled per-bucket estimate (`BucketEstimator`: shrunk, monotone),
    q_{cb} = (m_{cb} + w1 * p_b) / (o_{cb} + w1)     cell counts shrunk towards the pooled rate,
    h_c    = weighted pool-adjacent-violators fit of q_{c.} over the buckets (weights o_{cb} + w1),
             non-decreasing in confidence,

so a cold cell borrows the pooled rate (1.0 when cold everywhere: a cold gate drafts the full
block), and with `classes` = 1 the hazard is the pooled rate itself (the product of per-bucket
rates, the model before this one). w1 = CELL_PRIOR_WEIGHT: a cell splits a bucket's evidence
C ways, so it needs a firmer pull towards the pooled rate than a bucket does (replayed on the
committed and synthetic rounds, w1 = 3 beat 1 and 10, docs/gate.md §4). A cell's counts are
multiplied by `decay` only when an observation lands in it, as in `BucketEstimator`.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from services.gateway.estimator import BucketEstimator, pool_adjacent_violators
from services.gateway.values import MAX_POSITION_CLASSES, short_repr

# The band of greedy generations (the warm start's name for T = 0, services.gateway.warm).
GREEDY_BAND = "greedy"
# Position classes: 0 (the draft after the anchor), 1, and 2+ (pooled: later positions are
# reached rarely enough that separate cells would stay near their prior). bench_survival.py
# measured the split; 1 class is the pooled per-bucket model.
DEFAULT_POSITION_CLASSES = 3
# w1: pseudo-observations of the pooled per-bucket rate in each (class, bucket) cell.
CELL_PRIOR_WEIGHT = 3.0


class BandCounts:
    """One sampling band's counts: `pooled`, the per-bucket estimator over every position, and
    per (class, bucket) cell the decayed `matched` and `observed` counts (C lists of B floats)."""

    def __init__(self, buckets: int, classes: int, decay: float, prior_weight: float,
                 matched: Sequence[float] | None = None, observed: Sequence[float] | None = None) -> None:
        self.pooled = BucketEstimator(buckets, decay, prior_weight, matched, observed)
        self.matched = [[0.0] * buckets for _ in range(classes)]
        self.observed = [[0.0] * buckets for _ in range(classes)]
        self._hazards: tuple[tuple[float, ...], ...] | None = None

    def observe(self, buckets: Sequence[int], accepted: int, decay: float) -> None:
        """One round's observed positions (their buckets, in order), the first `accepted` accepted."""
        self.pooled.observe(buckets, accepted)
        last = len(self.matched) - 1
        for pos, b in enumerate(buckets):
            c = min(pos, last)
            self.matched[c][b] = self.matched[c][b] * decay + (1.0 if pos < accepted else 0.0)
            self.observed[c][b] = self.observed[c][b] * decay + 1.0
        self._hazards = None

    def hazards(self, cell_weight: float) -> tuple[tuple[float, ...], ...]:
        """h[c][b] (module docstring), cached until the next observation."""
        if self._hazards is None:
            pooled = self.pooled.estimates()
            if len(self.matched) == 1:
                self._hazards = (pooled,)
            else:
                rows = []
                for m_row, o_row in zip(self.matched, self.observed):
                    raw = [(m + cell_weight * p) / (o + cell_weight) for m, o, p in zip(m_row, o_row, pooled)]
                    fit = pool_adjacent_violators(raw, [o + cell_weight for o in o_row])
                    rows.append(tuple(min(1.0, max(0.0, h)) for h in fit))
                self._hazards = tuple(rows)
        return self._hazards


class SurvivalEstimator:
    """Per sampling band, the hazard table h[class][bucket] and the survival of a block.

    Args:
        edges: confidence bucket edges (logits, ascending; B = len(edges) + 1 buckets, a logit
            equal to an edge belongs to the bucket above it).
        classes: position classes C in [1, 16] (position j is in class min(j, C - 1); C = 1 is
            the pooled per-bucket model).
        decay: forgetting in (0, 1] per observation landing in a cell (and in a pooled bucket).
        prior_weight: w0 > 0, pseudo-observations of a bucket's pooled prior (`BucketEstimator`).
        warm: optional {band: (matched, observed)} pooled per-bucket counts (B floats each) a
            band starts from (the warm start lends pooled counts; its cells start empty).
    A cell is pulled towards its band's pooled rate by CELL_PRIOR_WEIGHT pseudo-observations.
    Raises ValueError naming the value when classes is not an integer in [1, 16], or warm
    counts do not have B entries.
    """

    def __init__(self, edges: Sequence[float], classes: int, decay: float, prior_weight: float,
                 warm: dict[str, tuple[Sequence[float], Sequence[float]]] | None = None) -> None:
        if isinstance(classes, bool) or not isinstance(classes, int) or not 1 <= classes <= MAX_POSITION_CLASSES:
            raise ValueError(f"position classes={short_repr(classes)} must be an integer in [1, {MAX_POSITION_CLASSES}]")
        self.edges = tuple(edges)
        self.classes, self.decay, self.prior_weight = classes, decay, prior_weight
        self._bands = {band: BandCounts(len(self.edges) + 1, classes, decay, prior_weight, m, o)
                       for band, (m, o) in (warm or {}).items()}

    def buckets(self, confidences: Sequence[float]) -> list[int]:
        """Bucket index (0..B-1) of each confidence logit (trusted: numbers, not NaN)."""
        return [bisect.bisect_right(self.edges, c) for c in confidences]

    def band(self, band: str) -> BandCounts:
        """The counts of `band` (created cold on first use)."""
        counts = self._bands.get(band)
        if counts is None:
            counts = self._bands[band] = BandCounts(len(self.edges) + 1, self.classes, self.decay, self.prior_weight)
        return counts

    def observe(self, confidences: Sequence[float], accepted: int, band: str = GREEDY_BAND) -> None:
        """Add one verified round's censored observations to `band`: `confidences[i]` is the
        logit of observed position i, i.e. of positions 0..min(accepted, submitted - 1);
        positions < accepted were accepted, position `accepted` (when present) missed. Positions
        after the first miss, and past the submitted count, were never compared and are not
        passed. Inputs are trusted (the gate validates them)."""
        self.band(band).observe(self.buckets(confidences), accepted, self.decay)

    def hazards(self, band: str = GREEDY_BAND) -> tuple[tuple[float, ...], ...]:
        """h[c][b] = P(a position of class c, bucket b is accepted | every earlier one was),
        C tuples of B floats in [0, 1], each non-decreasing in b (1.0 everywhere when cold)."""
        return self.band(band).hazards(CELL_PRIOR_WEIGHT)

    def survival(self, confidences: Sequence[float], band: str = GREEDY_BAND) -> tuple[float, ...]:
        """S_j = P(position j accepted AND every position before it), one float in [0, 1] per
        drafted confidence logit (in order), non-increasing in j: E[tokens(k)] = 1 + sum_{j<k} S_j.
        The function the gate's length choice and a step's budget both price a block with.
        Confidences are trusted (numbers, not NaN; the gate validates them)."""
        return survival_from_hazards(self.hazards(band), self.buckets(confidences))


def survival_from_hazards(hazards: Sequence[Sequence[float]], buckets: Sequence[int]) -> tuple[float, ...]:
    """The survival curve of a block from a hazard table h[class][bucket] (class = min(j, C - 1)):
    S_j = prod_{i<=j} h[class(i)][buckets[i]]; len(buckets) floats in [0, 1], non-increasing."""
    out, s, last = [], 1.0, len(hazards) - 1
    for j, b in enumerate(buckets):
        s *= hazards[min(j, last)][b]
        out.append(s)
    return tuple(out)
