"""Confidence gate: one generation's choice of how many drafted tokens to verify.

This module owns the gate's estimator (decayed per-bucket match counts with an optimistic
prior), the cost model and the length decision, and the typed `GateConfig`. It must not count
rounds (the `services.gateway.record` fold does), read the environment (`services.settings`
does, at the entry point), time anything or talk to a backend: it is pure arithmetic on the
confidences and counts it is handed.

docs/architecture.md §5 summarises the gate; docs/gate.md states every formula, the bucket
edges, the prior and the decisions taken where the reference measurements are silent.
Units: costs in ms, expected tokens in tokens, rates in tokens per ms.
"""

from __future__ import annotations

import bisect
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from services.gateway.values import MIN_COST_MS, check_setting, finite_float, is_integer, short_repr

# The reference calibration table's buckets (docs/architecture.md §12):
# < -0.5 | -0.5..0.5 | 0.5..1.5 | 1.5..3.0 | 3.0..6.0 | > 6.0.
# A logit equal to an edge belongs to the bucket above it (lower edge inclusive).
BUCKET_EDGES = (-0.5, 0.5, 1.5, 3.0, 6.0)
NUM_BUCKETS = len(BUCKET_EDGES) + 1
# Cold-start prior: one optimistic pseudo-observation (mean 1.0) per bucket, never decayed, so a
# bucket the gate has not observed estimates 1.0 and a cold gate drafts the full block.
PRIOR_MEAN = 1.0
DEFAULT_PRIOR_WEIGHT = 1.0

ENV_PREFIX = "DEEPSEEK_DSPARK_GATE"
# GateConfig field -> env var (docs/gate.md §8 lists names, defaults and valid values).
ENV_VARS = {
    "enabled": ENV_PREFIX,
    "margin_threshold": f"{ENV_PREFIX}_MARGIN_THRESHOLD",
    "margin": f"{ENV_PREFIX}_MARGIN",
    "min_draft": f"{ENV_PREFIX}_MIN_DRAFT",
    "decay": f"{ENV_PREFIX}_DECAY",
    "draft_ms": f"{ENV_PREFIX}_DRAFT_MS",
    "verify_base_ms": f"{ENV_PREFIX}_VERIFY_BASE_MS",
    "verify_slope_ms": f"{ENV_PREFIX}_VERIFY_SLOPE_MS",
    "plain_ms": f"{ENV_PREFIX}_PLAIN_MS",
}


def _logit(value: object, where: str) -> float:
    """A confidence logit as a float: ±inf allowed (huge integers become ±inf), NaN raises."""
    if type(value) is float and value == value:  # fast path (the replay calls this per position)
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{where}={short_repr(value)} must be a number")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf if value > 0 else -math.inf
    if math.isnan(number):
        raise ValueError(f"{where} is NaN: {value!r}")
    return number


def _logits(confidence_logits: Sequence[float]) -> list[float]:
    """Every confidence logit validated (before any state change); ValueError names the position."""
    try:
        values = None if isinstance(confidence_logits, (str, bytes)) else list(confidence_logits)
    except TypeError:
        values = None
    if values is None:
        raise ValueError(f"confidence_logits={short_repr(confidence_logits)} must be a sequence of numbers")
    return [_logit(c, f"confidence logit [{pos}]") for pos, c in enumerate(values)]


def _check_count(name: str, value: object, upper: int) -> int:
    if not is_integer(value) or not 0 <= value <= upper:
        raise ValueError(f"{name}={short_repr(value)} must be an integer in [0, {upper}]")
    return int(value)


def _check_probs(match_probs: Sequence[float], n: int) -> None:
    for pos, p in enumerate(match_probs[:n]):
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= p <= 1.0:
            raise ValueError(f"match probability [{pos}]={short_repr(p)} outside [0, 1]")


def bucket_index(confidence_logit: float) -> int:
    """Bucket (0..5) of a confidence logit; lower edge inclusive: -0.5 -> 1, 6.0 -> 5.

    Raises ValueError on NaN (a NaN confidence carries no bucket) or a non-number.
    """
    return bisect.bisect_right(BUCKET_EDGES, _logit(confidence_logit, "confidence logit"))


def bucket_label(index: int) -> str:
    """Human-readable range of bucket `index`, e.g. "[-0.5, 0.5)"."""
    if index == 0:
        return f"< {BUCKET_EDGES[0]}"
    if index == NUM_BUCKETS - 1:
        return f">= {BUCKET_EDGES[-1]}"
    return f"[{BUCKET_EDGES[index - 1]}, {BUCKET_EDGES[index]})"


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
        """cost(n) in ms (docs/gate.md §2): draft_ms + verify(n) + commit_ms for n > 0, plain_ms for n = 0.

        This is the cost the decision rule compares; for n = 0 it is the plain step alone.
        Raises ValueError unless n is an integer >= 0.
        """
        if not is_integer(n) or n < 0:
            raise ValueError(f"n={short_repr(n)} must be an integer >= 0")
        return self.draft_ms + self.verify_ms(n) + self.commit_ms if n > 0 else self.plain_ms

    def skipped_after_draft_ms(self) -> float:
        """A round cut to n = 0 after drafting (ms): the draft was paid, then a plain step and
        the drafter commit of its row.

        A post-draft cut saves the verify, never the draft (docs/architecture.md §5).
        """
        return self.draft_ms + self.plain_ms + self.commit_ms

    def rate(self, match_probs: Sequence[float], n: int) -> float:
        """E[tokens(n)] / cost(n), in tokens per ms."""
        return expected_tokens(match_probs, n) / self.round_ms(n)


def _expected_totals(match_probs: Sequence[float], n: int) -> list[float]:
    """E[tokens(k)] for k = 0..n (inputs already validated)."""
    totals, prefix = [1.0], 1.0
    for p in match_probs[:n]:
        prefix *= p
        totals.append(totals[-1] + prefix)
    return totals


def expected_tokens(match_probs: Sequence[float], n: int) -> float:
    """E[tokens(n)] = 1 + sum_{i<n} prod_{j<=i} p_j (docs/gate.md §2), in tokens.

    `match_probs[j]` is P(draft position j matches); the leading 1 is the bonus (or plain) token.
    Raises ValueError unless n is an integer in [0, len(match_probs)] and match_probs[:n] are
    numbers in [0, 1].
    """
    n = _check_count("n", n, len(match_probs))
    _check_probs(match_probs, n)
    return _expected_totals(match_probs, n)[n]


def decide_length(
    match_probs: Sequence[float],
    max_n: int,
    cost: CostModel,
    margin: float = 1.15,
    min_draft: int = 0,
) -> int:
    """Draft tokens to submit: n* = argmax_n E[tokens(n)] / cost(n) (docs/gate.md §2).

    n ranges over [min(min_draft, max_n), max_n]. A truncation (n < max_n, n = 0 included) is
    taken only if its rate exceeds margin * rate(max_n): cost is linear in n but expected tokens
    compound, so an underestimated p costs more than an overestimated one (docs/architecture.md
    §5); ties between truncations go to the longer one. With min_draft > 0 the
    result is never 0 unless max_n is 0. Raises ValueError naming the value on a max_n that is
    not an integer in [0, len(match_probs)], a margin or min_draft GateConfig would reject, or a
    probability outside [0, 1] (NaN included).
    """
    max_n = _check_count("max_n", max_n, len(match_probs))
    margin_value = check_setting("margin", margin, "margin")
    floor = min(check_setting("min_draft", min_draft, "min_draft"), max_n)
    _check_probs(match_probs, max_n)
    if max_n == 0:
        return 0
    totals = _expected_totals(match_probs, max_n)
    rates = [totals[n] / cost.round_ms(n) for n in range(floor, max_n + 1)]
    full_rate = rates[-1]
    best_n, best_rate = max_n, -1.0
    for n in range(floor, max_n):
        if rates[n - floor] >= best_rate:
            best_n, best_rate = n, rates[n - floor]
    if best_n < max_n and best_rate > margin_value * full_rate:
        return best_n
    return max_n


@dataclass(frozen=True)
class GateConfig:
    """Gate settings; `services.settings` fills them from the ENV_VARS variables (docs/gate.md).

    enabled: length choice on (DEEPSEEK_DSPARK_GATE); off = always submit max_n.
    margin_threshold: pre-draft gate on the anchor's top1 - top2 logit margin; 0 = disabled.
    margin: factor a truncation must win by. min_draft: floor on submitted drafts (tokens).
    decay: per-observed-round forgetting. *_ms: cost model (ms). prior_weight: weight of the
    optimistic cold-start pseudo-observation per bucket (not an env var).
    Values are normalised (numpy numbers to int/float, -0.0 to 0.0). Raises ValueError naming
    the field and value on an invalid setting.
    """

    enabled: bool = False
    margin_threshold: float = 0.0
    margin: float = 1.15
    min_draft: int = 0
    decay: float = 0.9
    draft_ms: float = 196.0
    verify_base_ms: float = 300.0
    verify_slope_ms: float = 109.0
    plain_ms: float = 303.0
    prior_weight: float = DEFAULT_PRIOR_WEIGHT

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, check_setting(f.name, getattr(self, f.name), f.name))
        self.cost_model()  # the rule across the costs

    def cost_model(self) -> CostModel:
        """The CostModel of this config's *_ms fields."""
        return CostModel(self.draft_ms, self.verify_base_ms, self.verify_slope_ms, self.plain_ms)


@dataclass(frozen=True)
class Calibration:
    """Frozen per-bucket counts (matched, observed; decayed weights) used to warm-start a Gate."""

    matched: tuple[float, ...]
    observed: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.matched) != NUM_BUCKETS or len(self.observed) != NUM_BUCKETS:
            raise ValueError(f"calibration needs {NUM_BUCKETS} buckets, got {len(self.matched)}/{len(self.observed)}")
        for i, (m, o) in enumerate(zip(self.matched, self.observed)):
            fm, fo = finite_float(m), finite_float(o)
            if fm is None or fo is None or not 0.0 <= fm <= fo:
                shown = f"matched={short_repr(m)} <= observed={short_repr(o)}"
                raise ValueError(f"calibration bucket {i}: need finite 0 <= {shown}")


@dataclass(frozen=True)
class LengthChoice:
    """The gate's post-draft verdict: submit `k` of the drafts (tokens), in [0, max_n], where
    `max_n` is the caller's cap. `cut`: the cost rule chose fewer than the cap."""

    k: int
    max_n: int

    @property
    def cut(self) -> bool:
        """k < max_n: the gate truncated the block (to 0 included)."""
        return self.k < self.max_n


class Gate:
    """The gate of ONE generation: bucket estimates and decisions (docs/architecture.md §5).

    One Gate per generation, never shared, so a generation's draft lengths (and so its output)
    never depend on concurrent generations. `calibration` optionally warm-starts the bucket
    counts from a frozen process-wide snapshot; the snapshot is copied, never written back.
    A round: should_draft(margin) -> [draft] -> choose(confidences, max_n) -> [verify]
    -> observe(confidences, submitted, accepted). The gate keeps only its estimator state (the
    decayed per-bucket counts) and counts no rounds: the caller records each round
    (`services.gateway.record`).
    """

    def __init__(self, config: GateConfig, calibration: Calibration | None = None) -> None:
        self.config = config
        self.cost = config.cost_model()
        self._matched = list(calibration.matched) if calibration else [0.0] * NUM_BUCKETS
        self._observed = list(calibration.observed) if calibration else [0.0] * NUM_BUCKETS

    def estimates(self) -> tuple[float, ...]:
        """Current P(match | bucket): (matched + w0 * 1.0) / (observed + w0), w0 = prior_weight."""
        w0 = self.config.prior_weight
        return tuple((m + w0 * PRIOR_MEAN) / (o + w0) for m, o in zip(self._matched, self._observed))

    def calibration(self) -> Calibration:
        """Frozen copy of the current (decayed) bucket counts."""
        return Calibration(tuple(self._matched), tuple(self._observed))

    def match_probs(self, confidence_logits: Sequence[float]) -> list[float]:
        """P(match) per draft position from its confidence bucket alone.

        Position adds nothing once confidence is known (docs/architecture.md §12). Raises
        ValueError naming the position on a NaN or non-number confidence.
        """
        est = self.estimates()
        return [est[bucket_index(c)] for c in _logits(confidence_logits)]

    def should_draft(self, anchor_margin: float | None) -> bool:
        """Pre-draft margin gate (docs/architecture.md §5, DEEPSEEK_DSPARK_GATE_MARGIN_THRESHOLD).

        False (plain decode, no draft) when the threshold is > 0 and the anchor's top1 - top2
        logit margin is below it. Applies whether or not the length gate is enabled. None
        (margin unknown) drafts. Raises ValueError on NaN or a non-number.
        """
        margin = None if anchor_margin is None else _logit(anchor_margin, "anchor margin")
        threshold = self.config.margin_threshold
        return not (threshold > 0 and margin is not None and margin < threshold)

    def choose(self, confidence_logits: Sequence[float], max_n: int) -> LengthChoice:
        """The post-draft verdict: k drafts to submit, in [0, max_n] (see decide_length).

        `confidence_logits`: one per drafted position. `max_n` (tokens) is the caller's cap:
        min(drafted, remaining max_tokens budget, room before max_seq_len). Disabled gate: k =
        max_n. A cut to k = 0 ages the bucket counts (see `_age`). Raises ValueError, before any
        state changes and whether or not the gate is enabled, when a confidence is NaN or not a
        number, or max_n is not an integer in [0, len(confidence_logits)].
        """
        logits = _logits(confidence_logits)
        max_n = _check_count("max_n", max_n, len(logits))
        n = max_n
        if self.config.enabled:
            est = self.estimates()
            probs = [est[bisect.bisect_right(BUCKET_EDGES, c)] for c in logits[:max_n]]
            n = decide_length(probs, max_n, self.cost, self.config.margin, self.config.min_draft)
        if n == 0 < max_n:
            self._age()  # nothing is verified, so nothing is learned: let the evidence fade instead
        return LengthChoice(n, max_n)

    def choose_length(self, confidence_logits: Sequence[float], max_n: int) -> int:
        """`choose(...).k`: the number of drafts to submit (tokens). Raises as `choose`."""
        return self.choose(confidence_logits, max_n).k

    def observe(self, confidence_logits: Sequence[float], submitted: int, accepted: int) -> None:
        """Feed one verified round: decay all counts, then record the censored observations.

        Positions 0..accepted-1 matched; position `accepted` missed if accepted < submitted;
        later positions are unknown and never recorded (censoring, docs/architecture.md §5).
        submitted == 0 records nothing and does not decay. Raises ValueError, leaving the gate
        untouched, when a confidence is NaN or not a number, or unless submitted and accepted
        are integers with 0 <= accepted <= submitted <= len(confidence_logits).
        """
        logits = _logits(confidence_logits)
        if not (is_integer(submitted) and is_integer(accepted) and 0 <= accepted <= submitted <= len(logits)):
            raise ValueError(
                f"need integers 0 <= accepted={short_repr(accepted)} <= submitted={short_repr(submitted)}"
                f" <= drafted={len(logits)}"
            )
        submitted, accepted = int(submitted), int(accepted)
        if submitted == 0:
            return
        buckets = [bisect.bisect_right(BUCKET_EDGES, c) for c in logits[: min(accepted + 1, submitted)]]
        self._age()
        for pos, b in enumerate(buckets):
            self._observed[b] += 1.0
            self._matched[b] += 1.0 if pos < accepted else 0.0

    def _age(self) -> None:
        """Decay every bucket's counts by `decay` (once per verified round, and once per round
        cut to 0 after drafting). Without the second, a bucket whose estimate fell low enough
        to cut every round to 0 would never be verified again and stay low for good; aged, its
        estimate drifts back toward the optimistic prior until the gate tries it again."""
        decay = self.config.decay
        self._matched = [m * decay for m in self._matched]
        self._observed = [o * decay for o in self._observed]

    def to_dict(self) -> dict:
        """The estimator as plain JSON: per bucket its range, current decayed estimate and weight."""
        return {"buckets": [{"range": bucket_label(i), "estimate": est, "weight": weight}
                            for i, (est, weight) in enumerate(zip(self.estimates(), self._observed))]}
