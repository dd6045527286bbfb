"""The weighted non-decreasing least-squares fit (pool adjacent violators).

Shared by the gateway's verify-cost table (`services.gateway.costs`) and the verifier's
step-time table (`services.verifier.step_table`): both are costs that never fall as the work
grows, so a dip in the measurements is noise to pool away.
"""

from __future__ import annotations

import numpy as np


def non_decreasing(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The weighted least-squares non-decreasing fit of `values` (pool adjacent violators).

    values, weights: float64 arrays of shape [K]; weights > 0. Returns float64 [K].
    """
    blocks: list[list[float]] = []  # [mean, weight, length]
    for v, w in zip(values.tolist(), weights.tolist()):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks[-1]
            blocks[-1] = [(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2]
    return np.array([mean for mean, _, n in blocks for _ in range(n)], dtype=np.float64)
