"""The gate's cost model and its decision rule, as pure functions of a block's survival curve.

Owns `CostModel` (what a round costs, ms) and the arithmetic of the length choice: expected
tokens from a block's survival curve (S_j = P(positions 0..j all accepted)), the long-run-rate
objective (`length_decision`, `pick_length`) and the pre-draft value of drafting
(`draft_advantage`), docs/gate.md §2 (a product of independent marginals is a reference,
`services.analysis.references.decide_length`). It keeps no state and never estimates
probabilities (`services.gateway.survival` does) or decides when to probe (`services.gateway.gate`
does).
Units: costs in ms, expected tokens in tokens, rates in tokens per ms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.common.budget import check_survival
from services.gateway.values import MIN_COST_MS, check_setting, finite_float, is_integer, short_repr

DEFAULT_WIN_FACTOR = 1.15


def _check_count(name: str, value: object, upper: int) -> int:
    if not is_integer(value) or not 0 <= value <= upper:
        raise ValueError(f"{name}={short_repr(value)} must be an integer in [0, {upper}]")
    return int(value)


@dataclass(frozen=True)
class CostModel:
    """Round costs in ms: draft, verify(n), plain decode and the drafter commit of a round.

    `n` counts DRAFT tokens submitted to verify. verify(n) reads `verify_table[n - 1]` for
    1 <= n <= len(verify_table) when a table is given (a measured cost per n, docs/gate.md
    §2), else the linear fit verify_base_ms + verify_slope_ms * n (default 300 + 109n ms; the
    default fit counts n in drafts although its measured points were indexed by forwarded
    tokens, docs/gate.md §2 says why it is kept as stated). commit_ms is the drafter commit
    every round of a speculating generation pays after its verify or decode (0 = not
    modelled). `source` describes where the costs came from (for reports; ignored by ==).
    Only ratios affect decisions. The first four fields stay positional:
    CostModel(draft_ms, verify_base_ms, verify_slope_ms, plain_ms).
    Raises ValueError naming the field unless each cost (and each table entry) is in
    [0, 1e7] ms, plain_ms >= 1e-3 ms, draft_ms + verify_base_ms + verify_slope_ms >= 1e-3 ms
    and the table, when given, is a non-empty sequence with draft_ms + entry >= 1e-3 ms.
    """

    draft_ms: float = 196.0
    verify_base_ms: float = 300.0
    verify_slope_ms: float = 109.0
    plain_ms: float = 303.0
    commit_ms: float = 0.0
    verify_table: tuple[float, ...] | None = None
    source: str = field(default="configured", compare=False)

    def __post_init__(self) -> None:
        for name in ("draft_ms", "verify_base_ms", "verify_slope_ms", "plain_ms"):
            object.__setattr__(self, name, check_setting(name, getattr(self, name), name))
        object.__setattr__(self, "commit_ms", check_setting("draft_ms", self.commit_ms, "commit_ms"))
        fixed = self.draft_ms + self.verify_base_ms + self.verify_slope_ms
        if fixed < MIN_COST_MS:
            raise ValueError(f"draft_ms + verify_base_ms + verify_slope_ms = {fixed:g} must be >= {MIN_COST_MS:g} ms")
        if self.verify_table is not None:
            object.__setattr__(self, "verify_table", self._checked_table(self.verify_table))
        if not isinstance(self.source, str):
            raise ValueError(f"source={short_repr(self.source)} must be a string")

    def _checked_table(self, table: object) -> tuple[float, ...]:
        """`table` as a tuple of validated ms values (check_setting's cost rule per entry)."""
        if isinstance(table, (str, bytes)) or not isinstance(table, Sequence) or len(table) == 0:
            raise ValueError(f"verify_table={short_repr(table)} must be a non-empty sequence of ms (index n - 1)")
        values = tuple(check_setting("verify_base_ms", v, f"verify_table[{i}]") for i, v in enumerate(table))
        if self.draft_ms + min(values) < MIN_COST_MS:
            raise ValueError(f"draft_ms + min(verify_table) = {self.draft_ms + min(values):g} must be >= "
                             f"{MIN_COST_MS:g} ms")
        return values

    def verify_ms(self, n: int) -> float:
        """Verify of `n` drafts (ms): verify_table[n - 1] when the table covers n, else
        verify_base_ms + verify_slope_ms * n."""
        table = self.verify_table
        if table is not None and 1 <= n <= len(table):
            return table[n - 1]
        return self.verify_base_ms + self.verify_slope_ms * n

    def round_ms(self, n: int) -> float:
        """cost(n) in ms (docs/gate.md §2): draft_ms + verify(n) + commit_ms for n > 0, plain_ms
        for n = 0 (a round that drafted nothing; a round cut to 0 after drafting costs
        `skipped_after_draft_ms`, and `drafted_round_ms` is what the decision rule charges).
        Raises ValueError unless n is an integer >= 0.
        """
        if not is_integer(n) or n < 0:
            raise ValueError(f"n={short_repr(n)} must be an integer >= 0")
        return self.draft_ms + self.verify_ms(n) + self.commit_ms if n > 0 else self.plain_ms

    def drafted_round_ms(self, n: int) -> float:
        """A round that drafted, from before the draft (ms): draft_ms + verify(n) for n > 0, and
        draft_ms + plain_ms for n = 0 (a cut after the draft saves the verify, never the draft),
        plus the drafter commit every such round pays (a constant across n, so it never moves
        the choice of n; it keeps the modelled time honest). `n` is trusted (an integer >= 0)."""
        return self.draft_ms + (self.verify_ms(n) if n > 0 else self.plain_ms) + self.commit_ms

    def skipped_after_draft_ms(self) -> float:
        """A round cut to n = 0 after drafting (ms): the draft was paid, then a plain step and
        the drafter commit of its row.

        A post-draft cut saves the verify, never the draft (docs/architecture.md §5).
        """
        return self.draft_ms + self.plain_ms + self.commit_ms

def _expected_totals(survival: Sequence[float], n: int) -> list[float]:
    """E[tokens(k)] = 1 + sum_{j<k} S_j for k = 0..n (inputs already validated)."""
    totals = [1.0]
    for s in survival[:n]:
        totals.append(totals[-1] + s)
    return totals


def _values(survival: Sequence[float], max_n: int, cost: CostModel, rate: float) -> list[float]:
    """value(k) = E[tokens(k)] - rate * drafted_round_ms(k) for k = 0..max_n (tokens)."""
    totals = _expected_totals(survival, max_n)
    return [totals[k] - rate * cost.drafted_round_ms(k) for k in range(max_n + 1)]


def pick_length(values: Sequence[float], full_tokens: float, win_factor: float, floor: int) -> int:
    """The length rule on value(k) for k = 0..max_n (tokens, max_n = len(values) - 1): the
    full block unless a truncation n in [floor, max_n) beats it by more than (win_factor - 1) *
    full_tokens (E[tokens(max_n)]); ties between truncations go to the longer one. Inputs are
    trusted (`length_decision` checks them; a round record's recorded values replay through
    here, `services.analysis.replay.redecide`)."""
    max_n = len(values) - 1
    if max_n <= 0:
        return 0
    best_n, best_value = max_n, -math.inf
    for n in range(floor, max_n):
        if values[n] >= best_value:
            best_n, best_value = n, values[n]
    if best_n < max_n and best_value - values[max_n] > (win_factor - 1.0) * full_tokens:
        return best_n
    return max_n


def length_decision(
    survival: Sequence[float],
    max_n: int,
    cost: CostModel,
    win_factor: float = DEFAULT_WIN_FACTOR,
    floor: int = 0,
    rate: float | None = None,
) -> tuple[int, tuple[float, ...]]:
    """Draft tokens to submit after drafting, and value(k) for k = 0..max_n (tokens, what a
    round record keeps of the decision; `pick_length` chooses over them):
    n* = argmax_n E[tokens(n)] - rate * cost(n).

    `survival[j]` is P(draft position j accepted AND every position before it), non-increasing
    in j, so E[tokens(n)] = 1 + sum_{j<n} survival[j] (`services.gateway.survival`).
    cost(n) = drafted_round_ms(n): draft + verify(n), or draft + plain for n = 0 (the draft is
    paid either way, so only verify(n) against a plain step tells the choices apart). `rate`
    (tokens per ms) is the long-run rate the generation earns; maximising this difference per
    round maximises tokens per ms over the generation (docs/gate.md §2); None uses the plain
    rate 1 / plain_ms, the least any policy can earn. n ranges over [min(floor, max_n), max_n]
    (a probe's floor is 1 draft, docs/gate.md §5b). A truncation (n < max_n, 0 included) is taken only when its value beats the full
    block's by more than (win_factor - 1) * E[tokens(max_n)]; ties between truncations go to the
    longer one. Raises ValueError naming the value on a max_n that is not an integer in [0,
    len(survival)], a win_factor GateConfig would reject, a floor that is not an integer >= 0, a survival[:max_n] entry
    outside [0, 1] (NaN included) or above the one before it, or a rate that is not a finite
    number > 0.
    """
    max_n = _check_count("max_n", max_n, len(survival))
    factor = check_setting("win_factor", win_factor, "win_factor")
    if not is_integer(floor) or floor < 0:
        raise ValueError(f"floor={short_repr(floor)} must be an integer >= 0")
    floor = min(int(floor), max_n)
    lam = 1.0 / cost.plain_ms if rate is None else finite_float(rate)
    if lam is None or lam <= 0:
        raise ValueError(f"rate={short_repr(rate)} must be a finite number > 0 (tokens per ms)")
    check_survival(survival[:max_n], max_n)
    values = _values(survival, max_n, cost, lam)
    return pick_length(values, _expected_totals(survival, max_n)[max_n], factor, floor), tuple(values)


def draft_advantage(survival: Sequence[float], cost: CostModel, rate: float) -> float:
    """What drafting is worth before the draft, in tokens: max_k value(k) - value_plain, where
    value_plain = 1 - rate * plain_ms is a round that does not draft and `survival[j]` is
    P(positions 0..j all accepted). The draft's cost is in every value(k), so a negative result
    says skipping the draft (saving draft + verify) wins. Inputs are trusted (the gate's own
    estimates, rate > 0)."""
    values = _values(survival, len(survival), cost, rate)
    return max(values) - (1.0 - rate * cost.plain_ms)
