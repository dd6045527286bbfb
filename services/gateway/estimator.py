"""The gate's per-bucket estimator, P(match | confidence bucket).

This module owns the arithmetic of what the gate believes; it never decides (the gate does),
never counts rounds (the record fold does) and never reads the environment. docs/gate.md §3–§4
states the estimator and why.

`BucketEstimator` keeps, per confidence bucket b, decayed counts (matched m_b, observed o_b) of
censored observations. Forgetting is per observation *in that bucket*: a bucket's counts are
multiplied by `decay` only when a new observation lands in it, so a rarely seen bucket keeps
its evidence instead of sliding back to a prior. The estimate is

    mu_b  = pooled prior mean: (m_{b-1} + m_{b+1} + w0) / (o_{b-1} + o_{b+1} + w0), the rate
            of the two neighbouring buckets together with one optimistic pseudo-observation of
            weight w0 (so 1.0 when neither has evidence, and never exactly 0),
    q_b   = (m_b + w0 * mu_b) / (o_b + w0)            (w0 = prior weight, weak),
    p     = weighted pool-adjacent-violators fit of q over the buckets with evidence (weights
            o_b + w0), non-decreasing in b; a bucket without evidence keeps q_b clipped into
            the range its fitted neighbours allow, so its prior follows the observed buckets
            rather than pulls them,

so a cold estimator says 1.0 everywhere (the gate drafts the full block), an unseen bucket
borrows its neighbours' rate (bounded by the monotone fit), and the curve stays monotone in
confidence as every measured calibration table is. A bucket's estimate is biased towards its
neighbours by at most w0 / (o_b + w0) of their difference: with decay 0.9 a steadily observed
bucket holds o_b ~ 10, so the pull is under a tenth of the gap.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

# Prior mean of a bucket whose neighbours have no evidence either: optimistic, so a cold gate
# drafts the full block and an unexplored confidence range is tried rather than assumed bad.
COLD_MEAN = 1.0


def pool_adjacent_violators(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """Weighted least-squares non-decreasing fit of `values` (one per bucket, same length as
    `weights`, all weights > 0). O(B) for B buckets; returns a new list of floats.

    Raises ValueError when the lengths differ or a weight is not > 0.
    """
    if len(values) != len(weights):
        raise ValueError(f"{len(values)} values but {len(weights)} weights")
    blocks: list[list[float]] = []  # [mean, weight, size]
    for v, w in zip(values, weights):
        if not w > 0:
            raise ValueError(f"weight={w!r} must be > 0")
        blocks.append([float(v), float(w), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean2, w2, n2 = blocks.pop()
            mean1, w1, n1 = blocks[-1]
            blocks[-1] = [(mean1 * w1 + mean2 * w2) / (w1 + w2), w1 + w2, n1 + n2]
    return [mean for mean, _, size in blocks for _ in range(size)]


class BucketEstimator:
    """Per-bucket censored match counts with per-observation forgetting (module docstring).

    Args:
        buckets: number of confidence buckets B (>= 1).
        decay: factor in (0, 1] applied to a bucket's counts before each new observation in it.
        prior_weight: w0 > 0, weight of the pooled prior per bucket (pseudo-observations).
        matched, observed: optional warm-start counts (B floats each, 0 <= m_b <= o_b).
    Raises ValueError when the warm-start counts do not have B entries.
    """

    def __init__(self, buckets: int, decay: float, prior_weight: float,
                 matched: Sequence[float] | None = None, observed: Sequence[float] | None = None) -> None:
        self.decay, self.prior_weight = decay, prior_weight
        self.matched = list(matched) if matched is not None else [0.0] * buckets
        self.observed = list(observed) if observed is not None else [0.0] * buckets
        if len(self.matched) != buckets or len(self.observed) != buckets:
            raise ValueError(f"warm-start counts need {buckets} buckets")
        self._cache: tuple[float, ...] | None = None

    def observe(self, buckets: Sequence[int], accepted: int) -> None:
        """Add one verified round's censored observations: `buckets[i]` is the bucket of
        observed position i (positions 0..min(accepted, submitted - 1)); positions < accepted
        matched, position `accepted` (when present) missed."""
        for pos, b in enumerate(buckets):
            self.matched[b] = self.matched[b] * self.decay + (1.0 if pos < accepted else 0.0)
            self.observed[b] = self.observed[b] * self.decay + 1.0
        self._cache = None

    def prior_means(self) -> list[float]:
        """mu_b per bucket: the pooled rate of buckets b - 1 and b + 1 with w0 pseudo-observations
        of COLD_MEAN (so COLD_MEAN when neither neighbour has evidence)."""
        out, last, w0 = [], len(self.observed) - 1, self.prior_weight
        for b in range(last + 1):
            near = [j for j in (b - 1, b + 1) if 0 <= j <= last]
            matched = sum(self.matched[j] for j in near) + w0 * COLD_MEAN
            out.append(matched / (sum(self.observed[j] for j in near) + w0))
        return out

    def estimates(self) -> tuple[float, ...]:
        """P(match | bucket) per bucket (B floats in [0, 1]), monotone non-decreasing in b."""
        if self._cache is None:
            w0 = self.prior_weight
            raw = [(m + w0 * mu) / (o + w0) for m, o, mu in zip(self.matched, self.observed, self.prior_means())]
            seen = [b for b, o in enumerate(self.observed) if o > 0]
            fit = dict(zip(seen, pool_adjacent_violators([raw[b] for b in seen],
                                                         [self.observed[b] + w0 for b in seen])))
            out = []
            for b, q in enumerate(raw):
                if b not in fit:  # no evidence: the monotone fit of the others bounds the prior
                    low = max((fit[j] for j in seen if j < b), default=0.0)
                    high = min((fit[j] for j in seen if j > b), default=1.0)
                    q = min(max(q, low), high)
                out.append(min(1.0, max(0.0, fit.get(b, q))))
            self._cache = tuple(itertools.accumulate(out, max))  # unseen neighbours stay in order too
        return self._cache
