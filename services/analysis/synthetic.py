"""Synthetic rounds drawn from the reference calibration tables by a fixed, documented procedure.

This module owns the procedure that turns the reference pooled bucket table and always-k accept
rates (docs/architecture.md §12) into a byte-stable recorded-rounds file, and its command line.
It must not replay or score rounds (`replay.py` does), define the file format (`rounds.py`
does) or draw from any random source but one seeded PCG64 stream: the committed
tests/data/synthetic_rounds.json must regenerate from it byte for byte.

Procedure (one round = one drafted block of BLOCK_SIZE = 5 positions, submitted = 5):
1. Bucket weights: the reference pooled bucket counts n = 5/17/19/19/14/36 (confidence table),
   exponentially tilted per workload, w_b ∝ n_b · exp(θ · r_b) with r_b the bucket's match rate
   (20/65/79/89/100/100 %). Under w a position matches with probability q(θ) = Σ w_b r_b, and a
   round's accepted count (first miss, censored at 5) has E[accepted] = Σ_{i=1..5} q^i.
   θ is solved by bisection so that E[accepted] / 5 equals the reference always-k accept rate of
   the workload (repeat 100%, code 82.5%, prose 40%, math 17.5%). A target of 100% cannot be
   reached by tilting (q < 1 while any r_b < 1 has weight); it restricts to the rate-1 buckets
   (3.0..6.0 and >= 6.0) with their pooled counts 14:36.
2. Per position: a bucket by inverse CDF of w on one uniform draw; a logit uniform inside the
   bucket, rounded to 4 decimals and kept inside it. Open-ended buckets are closed at
   [-3.0, -0.5) and [6.0, 10.0) (the reference drafter's confidences reached about 4.7).
3. Per position: match when a uniform draw < r_b. accepted = index of the first miss (5 if none).
Only numpy's PCG64 `Generator.random()` is used (one stream, seed DEFAULT_SEED, workloads in the
order above, per round: 5 bucket draws, 5 logit draws, 5 match draws), so the output is
byte-stable. Run `python -m services.analysis.synthetic --out tests/data/synthetic_rounds.json`.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence

import numpy as np

from services.gateway.rounds import Round, RoundLog, save_rounds
from services.gateway.values import finite_float, is_integer, short_repr

BLOCK_SIZE = 5
BUCKET_COUNTS = (5, 17, 19, 19, 14, 36)  # docs/architecture.md §12: n per bucket, pooled
BUCKET_MATCH_RATES = (0.20, 0.65, 0.79, 0.89, 1.00, 1.00)  # docs/architecture.md §12: match rate per bucket
BUCKET_BOUNDS = ((-3.0, -0.5), (-0.5, 0.5), (0.5, 1.5), (1.5, 3.0), (3.0, 6.0), (6.0, 10.0))
# docs/architecture.md §12, always-k table: accept rate per workload.
TARGET_ACCEPT_RATES = {"repeat": 1.0, "code": 0.825, "prose": 0.40, "math": 0.175}
DEFAULT_SEED = 20260805
DEFAULT_ROUNDS = 200
MAX_ROUNDS = 100_000  # per workload; bounds the run time (about 4 s per 100,000 rounds)
MAX_SEED = 2**128 - 1  # PCG64's state width
_THETA_RANGE = (-60.0, 60.0)


def expected_accept_rate(match_prob: float, block_size: int = BLOCK_SIZE) -> float:
    """E[accepted] / block_size for iid positions matching with `match_prob` (first miss censors).

    Raises ValueError unless match_prob is a number in [0, 1] and block_size an integer >= 1.
    """
    p = finite_float(match_prob)
    if p is None or not 0.0 <= p <= 1.0:
        raise ValueError(f"match_prob={short_repr(match_prob)} must be a number in [0, 1]")
    if not is_integer(block_size) or block_size < 1:
        raise ValueError(f"block_size={short_repr(block_size)} must be an integer >= 1")
    return sum(match_prob**i for i in range(1, block_size + 1)) / block_size


def _tilt(theta: float) -> list[float]:
    raw = [n * math.exp(theta * r) for n, r in zip(BUCKET_COUNTS, BUCKET_MATCH_RATES)]
    total = sum(raw)
    return [w / total for w in raw]


def tilted_weights(target: float) -> tuple[float, ...]:
    """Bucket weights whose expected accept rate is `target` (fraction of the block accepted).

    Reachable: [rate at θ = -60, rate at θ = 60] (about [0.049985, 0.999828]) by tilting, and exactly
    1.0 (the rate-1 buckets alone). Raises ValueError naming the target and that range otherwise.
    """
    lo, hi = _THETA_RANGE

    def rate(theta: float) -> float:
        return expected_accept_rate(sum(w * r for w, r in zip(_tilt(theta), BUCKET_MATCH_RATES)))

    value = finite_float(target)
    if value == 1.0:
        ones = [n if r == 1.0 else 0 for n, r in zip(BUCKET_COUNTS, BUCKET_MATCH_RATES)]
        return tuple(w / sum(ones) for w in ones)
    if value is None or not rate(lo) <= value <= rate(hi):
        shown = f"[{math.ceil(rate(lo) * 1e6) / 1e6}, {math.floor(rate(hi) * 1e6) / 1e6}]"  # inside the true range
        raise ValueError(f"target accept rate {short_repr(target)} unreachable: must be in {shown} or exactly 1.0")
    target = value
    for _ in range(200):  # fixed iteration count: the result must not depend on a tolerance
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if rate(mid) < target else (lo, mid)
    return tuple(_tilt(0.5 * (lo + hi)))


def _draw_logit(bucket: int, uniform: float) -> float:
    lo, hi = BUCKET_BOUNDS[bucket]
    value = round(lo + uniform * (hi - lo), 4)
    return value if value < hi else round(hi - 1e-4, 4)


def draw_round(rng: np.random.Generator, workload: str, weights: Sequence[float]) -> Round:
    """One synthetic round (steps 2-3 of the module procedure)."""
    cdf = np.cumsum(weights)
    buckets = [min(int(np.searchsorted(cdf, u, side="right")), len(cdf) - 1) for u in rng.random(BLOCK_SIZE)]
    logits = tuple(_draw_logit(b, u) for b, u in zip(buckets, rng.random(BLOCK_SIZE)))
    hits = [u < BUCKET_MATCH_RATES[b] for b, u in zip(buckets, rng.random(BLOCK_SIZE))]
    accepted = hits.index(False) if False in hits else BLOCK_SIZE
    return Round(workload, logits, BLOCK_SIZE, accepted)


def generate(seed: int = DEFAULT_SEED, rounds_per_workload: int = DEFAULT_ROUNDS) -> RoundLog:
    """All workloads' synthetic rounds, deterministic for a given seed and round count.

    Raises ValueError unless seed is an integer in [0, 2**128) and rounds_per_workload an
    integer in [1, MAX_ROUNDS].
    """
    if not is_integer(seed) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed={short_repr(seed)} must be an integer in [0, 2**128)")
    if not is_integer(rounds_per_workload) or not 1 <= rounds_per_workload <= MAX_ROUNDS:
        shown = short_repr(rounds_per_workload)
        raise ValueError(f"rounds_per_workload={shown} must be an integer in [1, {MAX_ROUNDS}]")
    seed, rounds_per_workload = int(seed), int(rounds_per_workload)
    rng = np.random.Generator(np.random.PCG64(seed))
    rounds = []
    for workload, target in TARGET_ACCEPT_RATES.items():
        weights = tilted_weights(target)
        rounds += [draw_round(rng, workload, weights) for _ in range(rounds_per_workload)]
    metadata = {
        "generator": "services.analysis.synthetic",
        "seed": seed,
        "rounds_per_workload": rounds_per_workload,
        "block_size": BLOCK_SIZE,
        "target_accept_rates": dict(TARGET_ACCEPT_RATES),
        "note": ("synthetic, from the reference pooled bucket table (docs/architecture.md, Reference"
                 " measurements); timings unknown (null)"),
    }
    return RoundLog(tuple(rounds), metadata)


def realised_accept_rates(log: RoundLog) -> dict[str, float]:
    """accepted / submitted per workload."""
    return {
        name: sum(r.accepted for r in rs) / max(1, sum(r.submitted for r in rs))
        for name, rs in log.workloads().items()
    }


def _integer_arg(raw: str, flag: str, low: int, high: int, shown_range: str) -> int:
    text = raw.strip(" \t")
    if not re.fullmatch(r"-?[0-9]{1,40}", text) or not low <= int(text) <= high:
        raise ValueError(f"{flag}={short_repr(raw)} must be an integer in {shown_range}")
    return int(text)


def main(argv: Sequence[str] | None = None) -> int:
    """Write the synthetic rounds file; prints realised vs target accept rates to stderr.

    Bad flags or an unwritable --out: a one-line error on stderr and exit code 2.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output JSON path")
    parser.add_argument("--seed", default=str(DEFAULT_SEED), help="integer in [0, 2**128)")
    parser.add_argument("--rounds", default=str(DEFAULT_ROUNDS), help=f"rounds per workload, 1..{MAX_ROUNDS}")
    args = parser.parse_args(argv)
    try:
        seed = _integer_arg(args.seed, "--seed", 0, MAX_SEED, "[0, 2**128)")
        rounds = _integer_arg(args.rounds, "--rounds", 1, MAX_ROUNDS, f"[1, {MAX_ROUNDS}]")
        if not args.out:
            raise ValueError("--out is an empty path ('')")
        log = generate(seed, rounds)
        save_rounds(log, args.out)
    except OSError as exc:
        print(f"synthetic: error: cannot write --out {args.out!r}: {exc.strerror}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"synthetic: error: {exc}", file=sys.stderr)
        return 2
    for name, rate in realised_accept_rates(log).items():
        print(f"{name}: realised {rate:.3f}, target {TARGET_ACCEPT_RATES[name]:.3f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
