"""Goodness-of-fit statistics for the sampling losslessness tests (no SciPy: torch's
regularised incomplete gamma gives the chi-square tail).

* `fit_exact`: observed samples against an exactly known distribution (one-sample chi-square
  with cells of expected count < 5 pooled into one, and the total-variation distance with
  its sampling-error bound).
* `fit_two_sample`: two sample sets against each other (two-sample chi-square, pooled the
  same way on the combined counts).
* `detectable_tv`: the power statement: the smallest TV distance (on the pooled cells) that a
  chi-square test at level alpha detects with probability `power`.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch


def chi2_sf(x: float, df: int) -> float:
    """P(chi2_df > x): the regularised upper incomplete gamma Q(df/2, x/2), in fp64."""
    if df <= 0:
        raise ValueError(f"df={df}: must be >= 1")
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(max(x, 0.0) / 2, dtype=torch.float64)))


def chi2_critical(df: int, alpha: float) -> float:
    """The x with chi2_sf(x, df) = alpha (bisection, 1e-9 relative)."""
    lo, hi = 0.0, float(df + 100 * math.sqrt(df) + 100)
    while hi - lo > 1e-9 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > alpha else (lo, mid)
    return hi


def ncx2_sf(x: float, df: int, lam: float) -> float:
    """P(noncentral chi2_df(lam) > x) as the Poisson(lam/2) mixture of central tails."""
    total, j, half = 0.0, 0, lam / 2
    while True:
        w = math.exp(-half + j * math.log(half) - math.lgamma(j + 1)) if half > 0 else float(j == 0)
        total += w * chi2_sf(x, df + 2 * j)
        if j > half and w < 1e-14:
            return total
        j += 1


def detectable_tv(n: int, df: int, alpha: float = 0.01, power: float = 0.99) -> float:
    """The smallest TV a one-sample chi-square test of n samples with df degrees of freedom
    rejects at level alpha with probability >= power. The test's noncentrality for a true
    distribution p' against the claimed p is n * sum (p' - p)^2 / p >= 4 n TV^2
    (Cauchy-Schwarz), so every p' at TV >= sqrt(lam* / (4n)) has at least the power reached at lam*."""
    crit = chi2_critical(df, alpha)
    lo, hi = 0.0, 10.0 * (df + 10)
    while ncx2_sf(crit, df, hi) < power:
        hi *= 2
    while hi - lo > 1e-3:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ncx2_sf(crit, df, mid) < power else (lo, mid)
    return math.sqrt(hi / (4 * n))


@dataclass(frozen=True)
class Fit:
    """pvalue: chi-square tail; stat, df: the statistic and its degrees of freedom; tv: total
    variation between the samples' frequencies and the reference; tv_bound: the TV an exact
    sampler stays under with probability >= 0.999 (one-sample fits only; else nan)."""

    pvalue: float
    stat: float
    df: int
    tv: float
    tv_bound: float


def fit_exact(samples: list, exact: dict) -> Fit:
    """Samples (hashable outcomes) against the exact distribution `exact` {outcome: prob}.

    Cells of expected count < 5 are pooled into one. The TV bound: E[TV] <= 1/2 sum_i
    sqrt(p_i (1 - p_i) / n) (Jensen, per cell), and TV moves by at most 1/n per sample, so
    McDiarmid adds sqrt(ln(1000) / (2n)) for a 0.999 bound.
    Raises:
        ValueError: an outcome outside `exact`'s support.
    """
    n, counts = len(samples), Counter(samples)
    if set(counts) - {c for c, p in exact.items() if p > 0}:
        raise ValueError(f"outcomes with probability 0: {sorted(set(counts) - set(exact))[:5]}")
    big = [c for c, p in exact.items() if p * n >= 5]
    small = [c for c, p in exact.items() if 0 < p * n < 5]
    obs = [counts[c] for c in big] + ([sum(counts[c] for c in small)] if small else [])
    exp = [exact[c] * n for c in big] + ([sum(exact[c] for c in small) * n] if small else [])
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    tv = 0.5 * sum(abs(counts[c] / n - p) for c, p in exact.items())
    bound = 0.5 * sum(math.sqrt(p * (1 - p) / n) for p in exact.values()) + math.sqrt(math.log(1000) / (2 * n))
    return Fit(chi2_sf(stat, len(obs) - 1), stat, len(obs) - 1, tv, bound)


def fit_two_sample(a: list, b: list) -> Fit:
    """Two-sample chi-square (homogeneity) of sample sets a and b: cells whose expected count
    in either set is < 5 are pooled into one. tv: TV between the two empirical distributions."""
    ca, cb, na, nb = Counter(a), Counter(b), len(a), len(b)
    cells = set(ca) | set(cb)
    share = {c: (ca[c] + cb[c]) / (na + nb) for c in cells}
    big = [c for c in cells if share[c] * min(na, nb) >= 5]
    small = [c for c in cells if c not in big]
    rows = [(ca[c], cb[c]) for c in big] + ([(sum(ca[c] for c in small), sum(cb[c] for c in small))] if small else [])
    stat = 0.0
    for oa, ob in rows:
        tot = oa + ob
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb
    tv = 0.5 * sum(abs(ca[c] / na - cb[c] / nb) for c in cells)
    return Fit(chi2_sf(stat, max(len(rows) - 1, 1)), stat, len(rows) - 1, tv, math.nan)
