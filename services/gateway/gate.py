"""Confidence gate: one generation's choice of whether to draft and how many drafts to verify.

This module owns the per-generation `Gate` (the pre-draft decision, the length choice and what
it learns from a verified round), the typed `GateConfig`, the confidence buckets, a round's
`Reason` and the warm-start snapshot `Calibration`. It composes the estimate
(`services.gateway.survival`), the scoring rule (`services.gateway.decision`) and the probe
schedule (`services.gateway.probe`). It must not count rounds (the `services.gateway.record`
fold does), read the environment (`services.settings` does, at the entry point), time anything
or talk to a backend: it is pure arithmetic on the confidences and counts it is handed.

docs/architecture.md §5 summarises the gate; docs/gate.md states every formula, the bucket
edges, the prior and the decisions taken where the reference measurements are silent.
Units: costs in ms, expected tokens in tokens, rates in tokens per ms.
"""

from __future__ import annotations

import bisect
import enum
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, fields

from services.gateway.decision import (DEFAULT_WIN_FACTOR, CostModel, _check_count,  # noqa: F401 (re-exported)
                                      draft_advantage, length_decision)
from services.gateway.probe import (DEAR_PROBE_TOKENS, PROBE_FIRST, PROBE_LOSS_SHARE, PROBE_PERIOD,  # noqa: F401
                                   ProbeSchedule, Streak, probe_loss)
from services.gateway.survival import DEFAULT_POSITION_CLASSES, GREEDY_BAND, SurvivalEstimator, survival_from_hazards
from services.gateway.values import check_setting, finite_float, is_integer, short_repr

# The reference calibration table's buckets (docs/architecture.md §12):
# < -0.5 | -0.5..0.5 | 0.5..1.5 | 1.5..3.0 | 3.0..6.0 | > 6.0.
# A logit equal to an edge belongs to the bucket above it (lower edge inclusive).
BUCKET_EDGES = (-0.5, 0.5, 1.5, 3.0, 6.0)
NUM_BUCKETS = len(BUCKET_EDGES) + 1
# Weight (pseudo-observations) of each bucket's pooled prior (services.gateway.estimator): weak,
# so a bucket's own evidence decides as soon as it has a few observations.
PRIOR_WEIGHT = 1.0
# Per-round forgetting of the long-run rate estimate lambda (tokens / ms): about 20 rounds.
RATE_DECAY = 0.95
# Drafted rounds whose confidences the pre-draft decision re-prices with the current estimates.
RECENT_ROUNDS = 16

ENV_PREFIX = "DSPARK_GATE"
# GateConfig field -> env var (docs/gate.md §8 lists names, defaults and valid values).
ENV_VARS = {
    "enabled": ENV_PREFIX,
    "margin_threshold": f"{ENV_PREFIX}_MARGIN_THRESHOLD",
    "win_factor": f"{ENV_PREFIX}_MARGIN",  # the variable keeps its published name
    "decay": f"{ENV_PREFIX}_DECAY",
    "draft_ms": f"{ENV_PREFIX}_DRAFT_MS",
    "verify_base_ms": f"{ENV_PREFIX}_VERIFY_BASE_MS",
    "verify_slope_ms": f"{ENV_PREFIX}_VERIFY_SLOPE_MS",
    "plain_ms": f"{ENV_PREFIX}_PLAIN_MS",
}


class Reason(enum.Enum):
    """Why a round submitted what it did; `RoundRecord.decision` is the coarser public word."""

    FULL = "full"                      # every drafted token was submitted
    NO_DRAFTER = "no_drafter"          # speculation off, or no drafter session left: plain step
    DRAFTER_FAILED = "drafter_failed"  # the draft call failed (or gave nothing): plain step
    NO_ROOM = "no_room"                # max_tokens / max_seq_len leave no draft to submit: not drafted
    ANCHOR_MARGIN = "anchor_margin"    # pre-draft: the anchor's logit margin is below MARGIN_THRESHOLD
    RECENT_LOSS = "recent_loss"        # pre-draft: the recent drafted rounds, re-priced, lost to plain decode
    STEP_PRICE = "step_price"          # pre-draft: at the verifier step's price no draft would be admitted
    REGIME = "regime"                  # the gateway ran gated rounds plain at this concurrency (not drafted)
    BUDGET = "budget"                  # drafted, then cut by max_tokens / max_seq_len
    COST = "cost"                      # drafted, then cut by the gate's cost rule (to 0 included)


# The reasons `Gate.pre_draft` gives for not drafting.
PRE_DRAFT_SKIPS = (Reason.ANCHOR_MARGIN, Reason.RECENT_LOSS, Reason.STEP_PRICE)


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
class GateConfig:
    """Gate settings; `services.settings` fills them from the ENV_VARS variables (docs/gate.md).

    enabled: length choice on (DSPARK_GATE); off = always submit max_n.
    margin_threshold: pre-draft gate on the anchor's top1 - top2 logit margin; 0 = disabled.
    win_factor: factor a truncation must win by (>= 1).
    decay: forgetting per observation in a bucket (and per drafted round of a margin bin).
    *_ms: cost model (ms). position_classes: position classes of the survival estimate (an integer
    in [1, 16]; 1 = the pooled per-bucket rate at every position, docs/gate.md §4; not an env var).
    Values are normalised (numpy numbers to int/float, -0.0 to 0.0). Raises ValueError naming
    the field and value on an invalid setting.
    """

    enabled: bool = False
    margin_threshold: float = 0.0
    win_factor: float = DEFAULT_WIN_FACTOR
    decay: float = 0.9
    draft_ms: float = 196.0
    verify_base_ms: float = 300.0
    verify_slope_ms: float = 109.0
    plain_ms: float = 303.0
    position_classes: int = DEFAULT_POSITION_CLASSES

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, check_setting(f.name, getattr(self, f.name), f.name))
        self.cost_model()  # the rule across the costs

    def cost_model(self) -> CostModel:
        """The CostModel of this config's *_ms fields."""
        return CostModel(self.draft_ms, self.verify_base_ms, self.verify_slope_ms, self.plain_ms)


@dataclass(frozen=True)
class Calibration:
    """Frozen state used to warm-start a Gate (docs/gate.md §6).

    matched, observed: per-bucket counts (NUM_BUCKETS floats each, decayed or scaled weights
    in observations, 0 <= matched <= observed). recent: confidence logits of up to
    RECENT_ROUNDS recently drafted rounds (one tuple of floats per round, oldest first), which
    the new gate's first pre-draft decisions re-price as if it had drafted them itself (lent
    with a losing band's streak; empty: the gate drafts its first round). streak: the losing
    streak the new gate continues (docs/gate.md §6), or None. Raises ValueError naming the bucket, round or streak when a
    count is not finite, matched > observed, a bucket is missing, a recent logit is NaN or not
    a number, or the streak is not a `Streak`.
    """

    matched: tuple[float, ...]
    observed: tuple[float, ...]
    recent: tuple[tuple[float, ...], ...] = ()
    streak: Streak | None = None

    def __post_init__(self) -> None:
        if self.streak is not None and not isinstance(self.streak, Streak):
            raise ValueError(f"calibration streak={short_repr(self.streak)} must be a Streak or None")
        if len(self.matched) != NUM_BUCKETS or len(self.observed) != NUM_BUCKETS:
            raise ValueError(f"calibration needs {NUM_BUCKETS} buckets, got {len(self.matched)}/{len(self.observed)}")
        for i, (m, o) in enumerate(zip(self.matched, self.observed)):
            fm, fo = finite_float(m), finite_float(o)
            if fm is None or fo is None or not 0.0 <= fm <= fo:
                shown = f"matched={short_repr(m)} <= observed={short_repr(o)}"
                raise ValueError(f"calibration bucket {i}: need finite 0 <= {shown}")
        if isinstance(self.recent, (str, bytes)):
            raise ValueError(f"calibration recent={short_repr(self.recent)} must be a sequence of rounds")
        # Only the rounds the gate will re-price are kept, as plain float tuples.
        rounds = tuple(self.recent)[-RECENT_ROUNDS:]
        checked = tuple(tuple(_logits(conf)) for conf in rounds)
        object.__setattr__(self, "recent", checked)


@dataclass(frozen=True)
class LengthChoice:
    """The gate's post-draft verdict: submit `k` of the drafts (tokens), in [0, max_n], where
    `max_n` is the caller's cap. `cut`: the cost rule chose fewer than the cap. What the
    decision read and weighed, for the round's record and span (empty when no rule ran: a
    disabled gate, or the step budget choosing the length): `survival`, S_j per position up to
    the cap; `rate`, lambda (tokens per ms); `values`, value(k) = E[tokens(k)] - lambda *
    cost(k) for k = 0..max_n (tokens); `probe`, a probe round (at least one draft); `probe_loss`,
    a probe's priced loss against a plain step (tokens, `services.gateway.probe.probe_loss`;
    None unless `probe`)."""

    k: int
    max_n: int
    survival: tuple[float, ...] = ()
    rate: float | None = None
    values: tuple[float, ...] = ()
    probe: bool = False
    probe_loss: float | None = None

    @property
    def cut(self) -> bool:
        """k < max_n: the gate truncated the block (to 0 included)."""
        return self.k < self.max_n


class Gate:
    """The gate of ONE generation: bucket estimates and decisions (docs/architecture.md §5).

    One Gate per generation, never shared, so a generation's draft lengths (and so its output)
    never depend on concurrent generations. `calibration` optionally warm-starts the bucket
    counts (and, from a losing band, its streak) from a frozen snapshot; copied, never written
    back. A round: pre_draft(margin) -> [draft] -> choose(confidences, max_n) -> [verify] ->
    observe(confidences, submitted, accepted). Every decision prices a block by its
    `survival(confidences)` (services.gateway.survival); `band` names the sampling band the
    generation's estimates belong to (docs/gate.md §6a). Besides the estimator (`learn`), the
    gate keeps the long-run rate estimate `rate()` (decayed tokens over decayed modelled ms of
    the rounds it decided), its recent drafted confidences for the pre-draft decision and its
    losing streak's probe schedule (`probing`, services.gateway.probe). It counts no rounds:
    the caller records each round (`services.gateway.record`).
    """

    def __init__(self, config: GateConfig, calibration: Calibration | None = None, band: str = GREEDY_BAND) -> None:
        self.config, self.band = config, band
        self.cost = config.cost_model()
        warm = {band: (calibration.matched, calibration.observed)} if calibration else None
        self.survival_estimator = SurvivalEstimator(BUCKET_EDGES, config.position_classes, config.decay,
                                                    PRIOR_WEIGHT, warm)
        # The band's pooled per-bucket counts (the warm start lends and borrows these).
        self.estimator = self.survival_estimator.band(band).pooled
        self._tokens = self._ms = 0.0  # decayed sums behind rate()
        # Confidences of the last RECENT_ROUNDS drafted rounds; a losing band lends its own, so
        # the first pre-draft decision already prices what the band drafts.
        self._recent: list[list[float]] = [list(c) for c in calibration.recent] if calibration else []
        self.probing = ProbeSchedule(calibration.streak if calibration else None)

    def estimates(self) -> tuple[float, ...]:
        """Current P(match | bucket), one float in [0, 1] per bucket, non-decreasing in the bucket
        (`services.gateway.estimator.BucketEstimator`; 1.0 everywhere when cold)."""
        return self.estimator.estimates()

    def hazards(self) -> tuple[tuple[float, ...], ...]:
        """h[class][bucket] = P(accepted | every earlier position accepted), per position class
        (`GateConfig.position_classes`) a tuple of NUM_BUCKETS floats in [0, 1]."""
        return self.survival_estimator.hazards(self.band)

    def survival(self, confidence_logits: Sequence[float]) -> tuple[float, ...]:
        """S_j = P(draft position j accepted AND every position before it) for each drafted
        position (floats in [0, 1], non-increasing in j; 1.0 everywhere when cold), from the
        confidences alone: E[tokens(k)] = 1 + sum_{j<k} S_j. Raises ValueError naming the
        position on a NaN or non-number confidence."""
        return self._survival(_logits(confidence_logits))

    def _survival(self, logits: Sequence[float]) -> tuple[float, ...]:
        """`survival` of validated logits."""
        # Through hazards(), so a gate given fixed hazards (references.HindsightGate) prices alike.
        return survival_from_hazards(self.hazards(), self.survival_estimator.buckets(logits))

    def rate(self) -> float:
        """lambda, the long-run rate estimate (tokens per ms): decayed tokens / decayed modelled
        ms of this gate's rounds, never below the plain rate 1 / plain_ms (plain decode is always
        available, so the best long-run rate is at least that)."""
        floor = 1.0 / self.cost.plain_ms
        return max(floor, self._tokens / self._ms) if self._ms > 0 else floor

    def calibration(self) -> Calibration:
        """Frozen copy of the current (decayed) bucket counts and recent drafted confidences."""
        return Calibration(tuple(self.estimator.matched), tuple(self.estimator.observed), self.recent_confidences())

    def recent_confidences(self) -> tuple[tuple[float, ...], ...]:
        """Confidence logits of the last RECENT_ROUNDS drafted rounds (oldest first), one tuple
        of floats per round: what the pre-draft decision re-prices."""
        return tuple(tuple(c) for c in self._recent)

    def pre_draft(self, anchor_margin: float | None) -> Reason | None:
        """The pre-draft decision (docs/gate.md §5b): None drafts; otherwise the `Reason` of a
        plain decode instead (one of `PRE_DRAFT_SKIPS`).

        Skips when (1) the margin threshold is > 0 and the anchor's top1 - top2 logit margin is
        below it (ANCHOR_MARGIN; whether or not the gate is enabled; None passes), or (2) the
        length gate is enabled and `losing()` (RECENT_LOSS), except on the losing streak's
        probe rounds (`probing`), which draft and verify at least one draft. Raises
        ValueError on a NaN or non-number margin.
        """
        margin = None if anchor_margin is None else _logit(anchor_margin, "anchor margin")
        threshold = self.config.margin_threshold
        if threshold > 0 and margin is not None and margin < threshold:
            self._skip()
            return Reason.ANCHOR_MARGIN
        losing = self.losing()
        if losing and not self.probing.due():
            self._skip()
            return Reason.RECENT_LOSS
        self.probing.pending = losing
        return None

    def losing(self) -> bool:
        """Whether the length gate is on and its recent drafted rounds, re-priced with the
        current estimates and lambda, lose to a plain step (mean `draft_advantage` < 0; +inf,
        not losing, before any round drafted): the generation is in a losing streak, so its
        drafter need not be fed until the next probe (docs/gate.md §5b)."""
        if not self.config.enabled or not self._recent:
            return False
        lam, cost = self.rate(), self.cost
        total = sum(draft_advantage(self._survival(conf), cost, lam) for conf in self._recent)
        return total / len(self._recent) < 0.0

    def streak(self) -> Streak | None:
        """The losing streak a later generation of the band should continue
        (`Calibration.streak`): this gate's when it is `losing()` and its probes are dear;
        None otherwise."""
        return self.probing.streak() if self.losing() and self.probes_dear() else None

    def probes_dear(self) -> bool:
        """Whether a probe costs more than DEAR_PROBE_TOKENS (`probe_loss`): its gaps are then
        priced, its streak lent (`streak`), and a losing streak lets the drafter session go
        rather than feed it (the scheduler)."""
        return self.probe_loss() > DEAR_PROBE_TOKENS

    def probe_gap(self) -> int:
        """The gap after a probe that failed now (rounds; `ProbeSchedule.next_gap`)."""
        return self.probing.next_gap(self.probe_loss())

    def probe_loss(self) -> float:
        """One probe's priced loss against a plain step (tokens, `services.gateway.probe.probe_loss`),
        its first draft's acceptance the recent rounds' mean S_0 (1.0 before any round drafted)."""
        first = (sum(self._survival(conf[:1])[0] for conf in self._recent if conf) / len(self._recent)
                 if self._recent else 1.0)
        return probe_loss(self.cost, first)

    def _skip(self) -> None:
        """A round the gate kept from drafting: one plain step (1 token, plain_ms)."""
        self.probing.skipped()
        self._account(1, self.cost.plain_ms)

    def choose(self, confidence_logits: Sequence[float], max_n: int) -> LengthChoice:
        """The post-draft verdict: k drafts to submit, in [0, max_n] (see length_decision).

        `confidence_logits`: one per drafted position. `max_n` (tokens) is the caller's cap:
        min(drafted, remaining max_tokens budget, room before max_seq_len). Disabled gate: k =
        max_n. A probe round (see pre_draft; also due when every draft of a losing streak
        was cut to 0) submits at least one draft. Raises ValueError, before any state changes and
        whether or not the gate is enabled, when a confidence is NaN or not a number, or max_n
        is not an integer in [0, len(confidence_logits)].
        """
        logits = _logits(confidence_logits)
        max_n = _check_count("max_n", max_n, len(logits))
        n, probe, loss, inputs = max_n, False, 0.0, {}
        if self.config.enabled:
            survival = self._survival(logits[:max_n])
            probe = self.probing.pending or self.probing.due()
            loss = self.probe_loss() if probe or self.probing.pending else 0.0
            # A probe verifies at least one draft, the cheapest test of whether the drafter came
            # back: where verify is dear per draft, a whole block would cost most of the probe.
            floor = min(1, max_n) if probe else 0
            cost, rate = self.cost, self.rate()
            n, values = length_decision(survival, max_n, cost, self.config.win_factor, floor, rate)
            inputs = {"survival": tuple(survival), "rate": rate, "values": values, "probe": probe,
                      "probe_loss": loss if probe else None}
        self.probing.chose(n, probe, loss)
        if max_n > 0:
            self._recent = [*self._recent[-(RECENT_ROUNDS - 1):], logits[:max_n]]
        if n == 0:  # the draft was paid and a plain step follows: draft + plain for one token
            self._account(1, self.cost.skipped_after_draft_ms())
        return LengthChoice(n, max_n, **inputs)

    def observe(self, confidence_logits: Sequence[float], submitted: int, accepted: int) -> None:
        """Feed one verified round: `learn` from it and count its tokens and modelled cost
        (draft + verify(submitted)) into `rate()`.

        submitted == 0 changes nothing. Raises ValueError, leaving the gate untouched, when a
        confidence is NaN or not a number, or unless submitted and accepted are integers with
        0 <= accepted <= submitted <= len(confidence_logits).
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
        self.learn(logits, submitted, accepted)
        self._account(accepted + 1, self.cost.drafted_round_ms(submitted))

    def learn(self, confidence_logits: Sequence[float], submitted: int, accepted: int) -> None:
        """Record a verified round's censored observations in the estimator (inputs validated
        by `observe`): positions 0..accepted-1 matched; position `accepted` missed if accepted <
        submitted; later positions are unknown and never recorded (docs/architecture.md §5)."""
        observed = confidence_logits[: min(accepted + 1, submitted)]
        self.survival_estimator.observe(observed, accepted, self.band)

    def _account(self, tokens: int, ms: float) -> None:
        """One round's tokens and modelled ms into rate()'s decayed sums."""
        self._tokens = self._tokens * RATE_DECAY + tokens
        self._ms = self._ms * RATE_DECAY + ms

    def to_dict(self) -> dict:
        """The gate's state as plain JSON: per bucket its range, current estimate and decayed
        weight; `rate_tok_per_ms` (lambda); `rounds_since_verified`."""
        return {"buckets": [{"range": bucket_label(i), "estimate": est, "weight": weight}
                            for i, (est, weight) in enumerate(zip(self.estimates(), self.estimator.observed))],
                "rate_tok_per_ms": self.rate(), "rounds_since_verified": self.probing.since}
