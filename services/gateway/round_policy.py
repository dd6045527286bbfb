"""One generation's round decisions, apart from any I/O: what the scheduler and the simulator both run.

The live scheduler (`services.gateway.scheduler`) and the serving simulator
(`services.simulate`) hold one `RoundPolicy` per generation and ask it the same questions in
the same order each round; only the forwards, the network and the clock differ between them.
It owns nothing new: it sequences the gateway's regime (`ModelRegime.may_draft`), the gate's
pre-draft decision (with the step budget, its price check at the load seen so far, `LoadSeen`),
the cap of a round by the token budget and max_seq_len, the gate's length choice and its
censored observation.
Where the regime decides lengths (more than one generation in flight, docs/gate.md §14) a
drafting round submits its cap without asking the gate, and the regime learns each drafted
block's outcome (which drafts survived) and drafter legs, and ages its estimate on each round
its model kept plain (`ModelRegime.observe_plain`).
It never talks to a backend, never reads a clock and never records a round (the caller folds
its `RoundRecord`).

A round, as both callers run it:

    policy.regime_drafts(in_flight, pos, emitted)  # False: a plain round (Reason.REGIME)
    policy.max_drafts(block, pos, emitted)     # 0: no room (Reason.NO_ROOM)
    policy.pre_draft(margin)                   # a reason: skipped (e.g. Reason.ANCHOR_MARGIN)
    ... draft ...
    reason, k = policy.choose(confidences, drafted, pos, emitted)
    survival = policy.survival(confidences, k)  # None unless the verifier's step budget runs
    ... verify k drafts (with survival) or decode; the verifier judged `admitted` <= k ...
    policy.observe(confidences, admitted, accepted, step_rows, own_rows, tokens_per_ms, leg_ms, reason)

With the step budget (`budget`, services.common.budget): "trim" sends the gate's chosen k with
the survival of each draft, so the verifier's step may cut the block further; "full" submits
the cap (the gate keeps only the pre-draft decision) and the step alone chooses the length.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.gateway.gate import Gate, LengthChoice
from services.common.budget import StepTimes, admit_drafts
from services.gateway.load_regime import Goodput, ModelRegime
from services.gateway.record import Reason, drafted_reason

BUDGETS = ("off", "trim", "full")
RECENT_BLOCKS = 8  # the budgeted blocks the pre-draft price check averages
OTHER_ROWS_ALPHA = 0.5  # moving average of the other sessions' rows: follows load within a few rounds


@dataclass
class LoadSeen:
    """What one generation has seen of the verifier's load, only from replies before its
    current round (so it never anticipates a draft not yet verified): a moving average of the
    rows other sessions put in its steps (tokens), the last reported lambda_sys (the
    verifier's committed tokens per ms; 0 = none yet) and the replies that reported a step."""

    other_rows: float = 0.0
    tokens_per_ms: float = 0.0
    replies: int = 0

    def observe(self, step_rows: int, own_rows: int, tokens_per_ms: float) -> None:
        """One decode / verify reply: its step forwarded `step_rows` tokens, `own_rows` of them
        this generation's; a reply without a step (step_rows <= 0) changes nothing, and a rate
        that is not a positive finite number keeps the last one."""
        if step_rows <= 0:
            return
        other = float(max(0, step_rows - own_rows))
        self.other_rows = other if self.replies == 0 else self.other_rows + OTHER_ROWS_ALPHA * (other - self.other_rows)
        if math.isfinite(tokens_per_ms) and tokens_per_ms > 0:
            self.tokens_per_ms = tokens_per_ms
        self.replies += 1


class RoundPolicy:
    """The decisions of one generation's rounds (module docstring).

    Args:
        spec: "off" | "always" | "gated" (the generation's spec mode).
        gate: the generation's `Gate` (cost model and enabled flag already set for `spec`).
        regime: the gateway's `ModelRegime` (shared by its generations; consulted for gated
            generations only), or None.
        step_table: the verifier's step table (ms against rows), what the step budget's
            pre-draft price check reads (None: no table yet, so no check).
        max_seq_len, max_tokens, max_drafts: the request's limits (tokens; max_drafts 0 = the
            block size).
        budget: "off" | "trim" | "full", how a gated generation uses the verifier's step budget
            (module docstring); other spec modes never send estimates.
    Raises ValueError on another budget.
    """

    def __init__(self, spec: str, gate: Gate, regime: ModelRegime | None, step_table: StepTimes | None,
                 max_seq_len: int, max_tokens: int, max_drafts: int = 0, budget: str = "off"):
        if budget not in BUDGETS:
            raise ValueError(f"budget={budget!r}: must be one of {BUDGETS}")
        self.budget = budget if spec == "gated" else "off"
        self.spec, self.gate, self.step_table = spec, gate, step_table
        self.regime = regime if spec == "gated" else None
        self.max_seq_len = max_seq_len
        self.max_tokens, self.request_max_drafts = max_tokens, max_drafts
        self.seen = LoadSeen()
        self.recent: list[tuple[float, ...]] = []  # survivals of the last RECENT_BLOCKS budgeted blocks
        self.choice: LengthChoice | None = None  # the last length decision, with its inputs
        self.in_flight = 1  # generations in flight at the last regime decision
        self.drafted_pos = 0  # anchor position of the last drafted round (rows the drafter holds)
        self.drafted_last = False  # the last round drafted
        self.goodput: Goodput | None = None  # what the model regime weighed for this round

    def regime_drafts(self, in_flight: int, pos: int = 0, emitted: int = 0, primed: bool = False) -> bool:
        """Whether the gateway's regime lets this generation draft with `in_flight` (>= 0)
        generations in flight, at anchor position `pos` after `emitted` completion tokens:
        always, unless it is gated and the regime at that concurrency is plain (docs/gate.md
        §14; the model regime also prices re-priming the rows held since the last draft).
        `primed`: the generation's drafter session is live and holds its rows (the gate's
        skips only defer commits): nothing is re-primed, so no rows are priced as held."""
        self.in_flight = max(in_flight, 1)
        self.goodput = self.regime.goodput(self.in_flight) if self.regime is not None and in_flight > 1 else None
        if self.regime is None:
            return True
        held = 0 if primed else max(pos - self.drafted_pos, 0)
        return self.regime.may_draft(self.in_flight, held, self.max_tokens - emitted)

    def regime_inputs(self) -> tuple[int, float, float] | None:
        """What the model regime weighed for the round just decided, (generations in flight,
        plain tok/ms, draft tok/ms), when it decided it (more than one in flight, with a step
        table); None when the gate did (the round record's and span's `regime`)."""
        g = self.goodput
        return None if g is None else (g.in_flight, g.plain, g.draft)

    def _regime_lengths(self) -> bool:
        """The model regime submits the cap for this round, not the gate (module docstring)."""
        return self.budget == "off" and self.regime is not None and self.regime.decides_length(self.in_flight)

    def max_drafts(self, drafted: int, pos: int, emitted: int) -> int:
        """Drafts a round at anchor position `pos` may submit after `emitted` completion tokens:
        `drafted` capped by the request's max_drafts, the remaining budget (the round adds at
        most k + 1 tokens) and the room before max_seq_len (the bonus token must stay a valid
        position). 0: the round cannot submit a draft."""
        remaining = self.max_tokens - emitted
        room = self.max_seq_len - 2 - pos
        return max(0, min(drafted, self.request_max_drafts or drafted, remaining - 1, room))

    def pre_draft(self, anchor_margin: float | None) -> Reason | None:
        """The pre-draft decision: None drafts; a reason (one of `PRE_DRAFT_SKIPS`, or
        STEP_PRICE with the step budget) decodes plain, nothing drafted. Where the regime
        submits the cap (`_regime_lengths`) the gate is not asked. Raises ValueError on a NaN
        margin (`Gate.pre_draft`)."""
        if self._regime_lengths():
            return None
        skip = self.gate.pre_draft(anchor_margin)
        return self._step_price() if skip is None and self.budget != "off" else skip

    def _step_price(self) -> Reason | None:
        """With the step budget: STEP_PRICE when, at the verifier's last reported step (its
        rows beside this generation's, lambda_sys and the step table), the budget would admit
        no draft of a block like the recent drafted rounds' (their mean survivals): the draft
        would be paid and then cut whole. None drafts (no table, rate or recent round yet)."""
        blocks = self.recent
        if self.step_table is None or self.seen.tokens_per_ms <= 0 or not blocks:
            return None
        width = min(len(b) for b in blocks)
        mean = tuple(sum(b[j] for b in blocks) / len(blocks) for j in range(width))
        base = self.seen.other_rows + 1
        admitted = admit_drafts([mean], round(base), self.step_table, self.seen.tokens_per_ms)[0]
        return Reason.STEP_PRICE if admitted == 0 else None

    def choose(self, confidences: Sequence[float] | None, drafted: int, pos: int, emitted: int
               ) -> tuple[Reason, int]:
        """After a draft of `drafted` tokens: (why, k drafts to submit). Without confidences
        the cap is submitted; with them the gate chooses under the cap."""
        max_n = self.max_drafts(drafted, pos, emitted)
        self.drafted_pos = pos
        full = confidences is None or self.budget == "full" or self._regime_lengths()
        self.choice = LengthChoice(max_n, max_n) if full else self.gate.choose(confidences, max_n)
        return drafted_reason(drafted, self.choice), self.choice.k

    def survival(self, confidences: Sequence[float] | None, k: int) -> tuple[float, ...] | None:
        """The estimates a verify of the first k drafts carries for the step's budget: per
        draft j, P(drafts 1..j all accepted), the gate's survival estimate (`Gate.survival`,
        the same curve its length choice priced; None without the budget, confidences or
        drafts). Call once per verify: the block is kept for the pre-draft step-price check
        and the round's record."""
        if self.budget == "off" or confidences is None or k == 0:
            return None
        estimates = tuple(self.gate.survival(confidences[:k]))
        self.recent = [*self.recent[-(RECENT_BLOCKS - 1):], estimates]
        if self.choice is not None and not self.choice.survival:  # the step chooses the length
            self.choice = dataclasses.replace(self.choice, survival=estimates)
        return estimates

    def observe(self, confidences: Sequence[float] | None, k: int, accepted: int,
                step_rows: int, own_rows: int, tokens_per_ms: float, leg_ms: float | None = None,
                reason: Reason | None = None) -> None:
        """A verify (k > 0) or decode reply: the model regime learns a drafted round's outcome
        (which of its k verified drafts survived) and its drafter legs (`leg_ms`: the draft
        call and the commit before it, ms; None when unmeasured), or that its model kept the
        round plain (`reason` REGIME, the round's own decision, and its rates chose plain, not
        the wake price);
        the gate learns the censored outcome of the submitted drafts; the load seen (what the
        step budget's price check reads) learns the step's rows (`step_rows` tokens forwarded, `own_rows` of them this generation's; 0 =
        no step) and the verifier's committed tokens per ms."""
        if self.regime is not None and confidences:
            # a round after one that did not draft also re-primed the rows held back: a wake,
            # not what drafting every round costs
            steady = leg_ms if self.drafted_last else None
            self.regime.observe(self.in_flight, tuple(float(j < accepted) for j in range(k)), steady)
        elif reason is Reason.REGIME and self.goodput is not None and not self.goodput.drafts:
            self.regime.observe_plain(self.in_flight)
        self.drafted_last = bool(confidences)
        if k > 0 and confidences is not None:
            self.gate.observe(confidences, k, accepted)
        self.seen.observe(step_rows, own_rows, tokens_per_ms)
