"""One verification budget per verifier step: which drafted positions a step verifies.

Every verify block that reaches the verifier with acceptance estimates carries, per draft
position j, its survival s_j = P(drafts 1..j are all accepted): the gateway's estimate, made
from the drafter's confidences before the block was verified (non-increasing in j). A draft
position j of a block adds s_j expected tokens to the step (the block's bonus token is there
whatever is admitted) and one row to the step's forward. Over every budgeted block of a step,
`admit_drafts` admits the N positions of highest survival (a block's positions in order, so
each block is cut to a prefix) where N maximises

    value(N) = sum of the N survivals - rate * step_ms(base_rows + N)

with step_ms the verifier's step table (`StepTimes`, ms against rows) and rate lambda, the
committed tokens per wall ms the system earns (the verifier's `CommitRate`): a position is
worth its expected tokens, and the step ms it adds delay every session of the step, each ms
worth lambda tokens. Checking every N, not stopping at the first position that does not pay,
keeps the rule right on a table with steps and flats. A trimmed block still gets its bonus
token (the target's choice at the first position not admitted), so what a session commits
never depends on the trim in exact numerics or under the coupled sampling rule
(docs/sampling.md): only how many tokens one step commits.

Non-anticipating by construction: the rule reads the estimates, the table and the rate, all
fixed before the step's forward; nothing of the step's own verification reaches it.

This module owns the rule and the step table type (`StepTimes`, also what the gateway's
regime and the simulator's models read). It never times anything and never reads the
environment; the verifier's step loop and the simulator's verifier loop call the same
`StepBudget`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from dspark_proto.v1 import common_pb2


@dataclass(frozen=True)
class StepTimes:
    """The verifier's batch-step time against rows: rows[i] (tokens, > 0, strictly increasing)
    takes ms[i] (ms, finite, >= 0, non-decreasing). Raises ValueError naming the value when
    the points break those rules or the tuples differ in length or are empty."""

    rows: tuple[float, ...]
    ms: tuple[float, ...]

    def __post_init__(self) -> None:
        rows, ms = tuple(float(r) for r in self.rows), tuple(float(m) for m in self.ms)
        if not rows or len(rows) != len(ms):
            raise ValueError(f"step table of {len(rows)} rows and {len(ms)} ms: need equal, non-zero lengths")
        if not all(math.isfinite(r) and r > 0 for r in rows) or any(b <= a for a, b in zip(rows, rows[1:])):
            raise ValueError(f"step table rows={rows}: must be finite, > 0 and strictly increasing")
        if not all(math.isfinite(m) and 0 <= m < 1e8 for m in ms) or any(b < a for a, b in zip(ms, ms[1:])):
            raise ValueError(f"step table ms={ms}: must be finite, in [0, 1e8) and non-decreasing")
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "ms", ms)

    @classmethod
    def from_identity(cls, identity: common_pb2.ModelIdentity) -> StepTimes | None:
        """The table of a verifier's Info (fields 29-30), or None when it reports none.
        Raises ValueError as the constructor."""
        if not identity.step_table_rows:
            return None
        return cls(tuple(identity.step_table_rows), tuple(identity.step_table_ms))

    def ms_at(self, rows: float) -> float:
        """Step time (ms) at `rows` tokens: linear between the points; the first point's ms
        below it; beyond the last, the last segment's slope (flat with one point)."""
        xs, ys = self.rows, self.ms
        if rows <= xs[0]:
            return ys[0]
        i = bisect.bisect_left(xs, rows)
        if i < len(xs) and xs[i] == rows:  # a point's own ms: interpolating to it can round above the next
            return ys[i]
        if i == len(xs):
            if len(xs) == 1:
                return ys[0]
            i = len(xs) - 1
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)

    def marginal_ms(self, other_rows: float, k: int) -> float:
        """What k drafts add to a step (ms): table(R + k + 1) - table(R + 1), R = other_rows."""
        return self.ms_at(other_rows + k + 1) - self.ms_at(other_rows + 1)



def check_survival(survival: Sequence[float], drafts: int) -> tuple[float, ...]:
    """`survival` as a tuple of `drafts` floats in [0, 1], non-increasing. Raises ValueError
    naming the value on another length, a value outside [0, 1] (NaN included) or a rise."""
    values = tuple(float(v) for v in survival)
    if len(values) != drafts:
        raise ValueError(f"survival has {len(values)} entries for {drafts} drafts: one per draft")
    for j, v in enumerate(values):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"survival[{j}]={v!r}: must be a probability in [0, 1]")
        if j and v > values[j - 1]:
            raise ValueError(f"survival[{j}]={v!r} > survival[{j - 1}]={values[j - 1]!r}: "
                             f"P(drafts 1..j all accepted) cannot rise with j")
    return values


def admit_drafts(survival: Sequence[Sequence[float]], base_rows: int, table: StepTimes, rate: float) -> list[int]:
    """Drafts admitted per budgeted block of one step (module docstring).

    survival: per block, its checked survivals (`check_survival`), one per draft.
    base_rows: the step's rows besides the budgeted drafts (every block's anchor, the other
        requests' rows, prompt chunks; tokens, >= 0).
    table: step ms against rows. rate: lambda, tokens per ms (>= 0; 0 admits every draft).
    Returns one count per block, each in 0..len(its survival): a prefix of the block. Ties
    between positions of equal survival go to the earlier position, then the earlier block;
    between equal values of N to the smaller N.
    Raises ValueError on a negative or non-finite rate.
    """
    if not (math.isfinite(rate) and rate >= 0):
        raise ValueError(f"rate={rate!r}: must be a finite number of tokens per ms >= 0")
    order = sorted(((-s, j, b) for b, block in enumerate(survival) for j, s in enumerate(block)))
    best_n, best, gain = 0, -rate * table.ms_at(base_rows), 0.0
    for n, (neg_s, _, _) in enumerate(order, start=1):
        gain -= neg_s
        value = gain - rate * table.ms_at(base_rows + n)
        if value > best:
            best_n, best = n, value
    admitted = [0] * len(survival)
    for _, _, b in order[:best_n]:
        admitted[b] += 1
    return admitted


class Budgeted(Protocol):
    """What the budget reads of a step's request: for a budgeted verify block its survivals
    (`survival`, one per draft; None when the request is not a budgeted block) and how to cut
    it to its first n drafts (`trim`)."""

    @property
    def survival(self) -> tuple[float, ...] | None: ...

    def trim(self, drafts: int) -> None: ...


class StepBudget:
    """The budget of a step loop: `apply` cuts a step's budgeted blocks to what they admit.

    prices: called once per step that holds a budgeted block; returns (the step table, or
    None when there is none yet, and lambda in tokens per ms). Without a table every draft is
    admitted.
    """

    def __init__(self, prices: Callable[[], tuple[StepTimes | None, float]]):
        self.prices = prices

    def apply(self, requests: Sequence[Budgeted], rows: int) -> list[int] | None:
        """Cut every budgeted block among `requests` (a step of `rows` rows, every block
        whole) to its admitted prefix; returns the admitted drafts per budgeted block, in
        order (None: the step holds none, or there is no table yet)."""
        blocks = [r for r in requests if r.survival is not None]
        if not blocks:
            return None
        table, rate = self.prices()
        if table is None:
            return None
        base = rows - sum(len(r.survival) for r in blocks)
        admitted = admit_drafts([r.survival for r in blocks], base, table, rate)
        for r, n in zip(blocks, admitted):
            if n < len(r.survival):
                r.trim(n)
        return admitted
