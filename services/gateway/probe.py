"""Probing a losing streak: when a gate whose drafts lose drafts anyway, and what a probe costs.

This module owns the probe schedule of one generation (`ProbeSchedule`), the `Streak` a losing
band lends its next generations (docs/gate.md §6) and the price of one probe (`probe_loss`). It
must not estimate acceptance (`services.gateway.survival` does), choose lengths
(`services.gateway.decision` does) or count rounds (`services.gateway.record` does).

Why probes. A gate that skips (or cuts every draft to 0) learns nothing more of its drafter, so
a workload that turns good would never be drafted again. A probe drafts and verifies at least
one token, the cheapest test of whether the drafter came back: the first comes PROBE_FIRST
rounds into a losing streak and each further one after twice the previous gap, at most
PROBE_PERIOD rounds apart. A probe whose expected loss is over DEAR_PROBE_TOKENS is *dear* (a
draft of several plain steps): after the streak's first probe no gap is shorter than loss /
PROBE_LOSS_SHARE rounds, and the streak outlives the generation. A cheap probe keeps the
doubling schedule: priced at 1 % it replayed worse on workloads that come and go (the
synthetic prose, 40 % accepted, fell from 3.33 to 3.18 tok/s, below plain's 3.30).
Units: costs in ms, losses in tokens, gaps in rounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.gateway.decision import CostModel
from services.gateway.values import finite_float, is_integer, short_repr

PROBE_FIRST = 16
PROBE_PERIOD = 32
# The live oracle on this box: 3-7 tokens a probe; the reference costs: 1.0 - S_0.
DEAR_PROBE_TOKENS = 1.0
PROBE_LOSS_SHARE = 0.01


def probe_loss(cost: CostModel, first: float) -> float:
    """One probe's expected loss against the plain step it replaces, by the scoring rule at the
    plain rate lambda = 1 / plain_ms (tokens): value(plain) - value(probe of one draft) =
    (drafted_round_ms(1) - plain_ms) / plain_ms - first, `first` in [0, 1] the estimate that
    the first draft is accepted. A losing streak earns the plain rate; the generation's own
    lambda still holds its good rounds before the streak and would price a good drafter's
    probe as dear. Inputs are trusted (a valid `CostModel`, a probability)."""
    return (cost.drafted_round_ms(1) - cost.plain_ms) / cost.plain_ms - first


@dataclass(frozen=True)
class Streak:
    """A losing streak, as a later generation of the band continues it (docs/gate.md §6).

    since: rounds since the last verified draft (an integer >= 0). gap: rounds from one probe
    to the next (an integer >= 1). wake_ms: what re-priming the drafter cost the last probe
    that woke it, ms (finite, >= 0; 0 when not measured; reported, not priced: a drafter that
    re-primes dearly but drafts cheaply, the bundled one, would lose its recovery probes to
    it). Raises ValueError naming the field and value.
    """

    since: int = 0
    gap: int = PROBE_FIRST
    wake_ms: float = 0.0

    def __post_init__(self) -> None:
        for name, least in (("since", 0), ("gap", 1)):
            value = getattr(self, name)
            if not is_integer(value) or value < least:
                raise ValueError(f"streak {name}={short_repr(value)} must be an integer >= {least}")
            object.__setattr__(self, name, int(value))
        wake = finite_float(self.wake_ms)
        if isinstance(self.wake_ms, bool) or wake is None or wake < 0:
            raise ValueError(f"streak wake_ms={short_repr(self.wake_ms)} must be a finite number >= 0")
        object.__setattr__(self, "wake_ms", wake)


class ProbeSchedule:
    """One generation's losing-streak counters (module docstring): `since`, rounds since the
    last verified draft; `gap`, rounds from one probe to the next; `pending`, the pre-draft
    decision let a losing round draft as a probe, so its length choice verifies at least one
    draft; `lent`, the streak was lent by the band and no round has drafted on its merits
    since; `wake_ms`, the last re-prime of a drafter let go during the streak (ms, measured
    by the caller, reported with the streak).

    Args:
        streak: the band's streak this generation continues, or None (a fresh start).
    """

    def __init__(self, streak: Streak | None = None) -> None:
        self.lent = streak is not None
        streak = streak or Streak()
        self.since, self.gap, self.wake_ms = streak.since, streak.gap, streak.wake_ms
        self.pending = False

    def due(self) -> bool:
        """This round is the losing streak's next probe."""
        return self.since + 1 >= self.gap

    def skipped(self) -> None:
        """A round kept from drafting (a pre-draft skip)."""
        self.since += 1

    def next_gap(self, loss: float) -> int:
        """The gap after a probe that failed (rounds): twice the last one up to PROBE_PERIOD; for
        a dear probe (`loss`, tokens, over DEAR_PROBE_TOKENS) never shorter than the gap over
        which its loss is PROBE_LOSS_SHARE of the gap's tokens (one per plain round)."""
        doubled = min(PROBE_PERIOD, 2 * self.gap)
        return max(doubled, math.ceil(loss / PROBE_LOSS_SHARE)) if loss > DEAR_PROBE_TOKENS else doubled

    def chose(self, k: int, probe: bool, loss: float) -> None:
        """After a length choice of `k` drafts; `probe`: the round was a probe, priced `loss`
        tokens. A probe (or a round that was let draft as one) pushes the next probe out; a
        round that drafted on its merits ends the streak (a lent one included)."""
        if probe or self.pending:
            self.gap = self.next_gap(loss)  # still losing: the next probe comes later
        elif k > 0:
            self.gap, self.lent = PROBE_FIRST, False
        self.pending = False
        self.since = 0 if k > 0 else self.since + 1

    def streak(self) -> Streak:
        """The streak as it stands, for the band to lend."""
        return Streak(self.since, self.gap, self.wake_ms)
