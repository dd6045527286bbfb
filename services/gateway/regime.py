"""The gateway's speculation regime per concurrency bucket, chosen by measured throughput.

A gated generation's gate prices a draft by what the round costs (draft, verify, commit, at the
verifier's load: docs/gate.md §13). What no single generation sees is the rate of the whole
system. Where drafter and verifier share compute (every service on one CPU box), or where
drafting splits the verifier's batch steps, the tokens all generations commit per ms can fall
while each generation's own drafted rounds still look profitable. This module measures that
rate instead of modelling it (docs/gate.md §14).

Per bucket of generations in flight at the gateway, `RegimePolicy` runs the gated generations
in one regime for a window of wall time: "gate" (each gate decides as usual) or "plain" (gated
rounds do not draft). It counts the tokens every generation commits in the window, whatever its
spec mode, and keeps per regime a decayed tokens-per-ms rate. It then runs the regime with the
higher rate, and now and then a probe window of the other one, so both rates stay current.
One generation alone is always left to its gate: then the verifier idles while the drafter
drafts, so the gate's own costs are the system's.

Windows are coherent: one window is open at a time, every gated round asks the open window's
regime, and the first rounds after a change of regime (those that may have started under the
previous one) are not measured. The policy decides only whether a gated round may draft, from
finished rounds: it is non-anticipating, and under exact numerics or sequential verify the
tokens a generation streams do not depend on it. Event-loop use only (no locking).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from services.common.settings import check_count
from services.gateway.values import finite_float, is_integer, short_repr

# Upper bounds (generations in flight) of the buckets; the last bucket is everything above.
BUCKET_UPPER = (1, 2, 4, 8, 16, 32)
REGIMES = ("gate", "plain")


def bucket_of(in_flight: int) -> int:
    """The bucket index (0..len(BUCKET_UPPER)) of `in_flight` generations (an int >= 1).
    Raises ValueError naming the value when it is not an int >= 1."""
    if not is_integer(in_flight) or in_flight < 1:
        raise ValueError(f"in_flight={short_repr(in_flight)}: must be an int >= 1")
    return bisect.bisect_left(BUCKET_UPPER, in_flight)


def bucket_name(index: int) -> str:
    """The label of bucket `index`: "1", "2", "3-4", "5-8", "9-16", "17-32", "33+"."""
    if index >= len(BUCKET_UPPER):
        return f"{BUCKET_UPPER[-1] + 1}+"
    low = BUCKET_UPPER[index - 1] + 1 if index else 1
    high = BUCKET_UPPER[index]
    return str(high) if low == high else f"{low}-{high}"


def _other(regime: str) -> str:
    """The regime that is not `regime`."""
    return REGIMES[1 - REGIMES.index(regime)]


def _settle(previous: "_Window | None", bucket: int, regime: str, in_flight: int, waking: bool) -> int:
    """Finished rounds a new window leaves unmeasured: none when the same regime continues in
    the same bucket; else the `in_flight` rounds that may have started under the old regime or
    load, and, when `waking` (gate follows a plain window, so generations are asleep),
    `in_flight` more: each sleeping generation's first round then opens and primes a drafter
    session (`DrafterLink.wake`: a verifier call for the kept rows, a drafter commit of them),
    a switch cost that a gate regime running on does not pay. Measured with those rounds, a
    gate window would read the transition, not the regime."""
    if previous is not None and previous.regime == regime and previous.bucket == bucket:
        return 0
    return 2 * in_flight if waking else in_flight


def _positive(name: str, value, low_ok: bool = False) -> None:
    """Raises ValueError naming `name` unless `value` is a finite number > 0 (>= 0 with low_ok)."""
    number = finite_float(value)
    if number is None or number < 0 or (number == 0 and not low_ok):
        raise ValueError(f"{name}={short_repr(value)}: must be a finite number {'>=' if low_ok else '>'} 0")


# A bound on the window counts of RegimeConfig: a week of 1-s windows. More would make a
# bucket never explore or probe in any run, which is a configuration mistake, not a choice.
MAX_WINDOWS = 604_800


@dataclass(frozen=True)
class RegimeConfig:
    """How windows are measured and regimes chosen.

    window_ms: measured wall ms per window (> 0); a window also needs as many measured rounds
        as generations were in flight when it opened.
    decay: each new window of a regime multiplies that regime's earlier sums by it (in (0, 1]).
    hysteresis: a bucket's choice changes only when the other regime's rate beats the chosen
        one's by this fraction (>= 0), and its first choice is "plain" only when plain beats
        gate by it: a switch costs (drafter sessions let go and primed again), so noise must
        not flip it, and on a tie the generations' own gates decide.
    explore: windows of each regime a bucket measures before its first choice (an int >= 1),
        in the order prior, other, other, prior, ...: one window can be unlucky (a burst of
        long prompts, a noisy neighbour), and the mirrored order cancels a steady drift of
        the load across the exploration with two switches of regime instead of three.
    probe_min, probe_max: windows between probes of the other regime (ints, 1 <= min <= max);
        the interval doubles from probe_min after every probe that confirms the choice, up to
        probe_max, and falls back to probe_min when a probe changes it. A probe window that
        is dropped (the load left its bucket, the gateway went idle) is run again the next
        time the bucket opens a window.
    probe_budget: the share of a bucket's throughput its probes may cost (in (0, 1]): a probe
        window gives up the measured gap g between the regimes (1 - other / chosen rate), so
        the interval is never shorter than g / probe_budget windows (capped at probe_max).
        Where the other regime is far behind, a probe costs much and is unlikely to change
        the choice, so it comes rarely; a near tie is probed at the doubling schedule.
    Raises ValueError naming the field and value when one is out of range.
    """

    window_ms: float = 1000.0
    decay: float = 0.8
    hysteresis: float = 0.05
    explore: int = 2
    probe_min: int = 16
    probe_max: int = 64
    probe_budget: float = 0.02

    def __post_init__(self) -> None:
        _positive("window_ms", self.window_ms)
        _positive("hysteresis", self.hysteresis, low_ok=True)
        decay = finite_float(self.decay)
        if decay is None or not 0 < decay <= 1:
            raise ValueError(f"decay={short_repr(self.decay)}: must be in (0, 1]")
        for name in ("explore", "probe_min", "probe_max"):
            check_count(name, getattr(self, name), 1)
            if getattr(self, name) > MAX_WINDOWS:
                raise ValueError(f"{name}={getattr(self, name)}: must be <= {MAX_WINDOWS}")
        budget = finite_float(self.probe_budget)
        if budget is None or not 0 < budget <= 1:
            raise ValueError(f"probe_budget={short_repr(self.probe_budget)}: must be in (0, 1]")
        if self.probe_max < self.probe_min:
            raise ValueError(f"probe_max={self.probe_max}: must be >= probe_min={self.probe_min}")
        # Plain floats from here on: a numpy or Fraction value would pass the checks above but
        # reach Stats, whose JSON has no encoding for it.
        for name in ("window_ms", "decay", "hysteresis", "probe_budget"):
            object.__setattr__(self, name, finite_float(getattr(self, name)))


@dataclass
class _Rate:
    """Decayed sums of one regime in one bucket (tokens, wall ms) and its raw window count."""

    tokens: float = 0.0
    ms: float = 0.0
    windows: int = 0

    def add(self, tokens: int, ms: float, decay: float) -> None:
        self.tokens, self.ms = self.tokens * decay + tokens, self.ms * decay + ms
        self.windows += 1

    @property
    def tok_per_ms(self) -> float | None:
        """Committed tokens per wall ms (None before any window)."""
        return self.tokens / self.ms if self.windows else None


@dataclass
class _Bucket:
    """One concurrency bucket: both regimes' rates, the choice (None until both are measured)
    and the probe schedule."""

    rates: dict[str, _Rate] = field(default_factory=lambda: {r: _Rate() for r in REGIMES})
    chosen: str | None = None
    since_probe: int = 0
    probe_every: int = 0  # set from the config on first use
    probes: int = 0


@dataclass
class _Window:
    """The open window: its bucket and regime, whether it probes, whether it is a drain's
    transit window (`RegimePolicy._open`), the rounds still to settle,
    the measured rounds it needs, when measuring began and ended (s, the caller's clock), the
    rounds recorded and how many of them ran outside its bucket (a change of load), and the
    tokens, rounds, off-bucket rounds and gated rounds it measured."""

    bucket: int
    regime: str
    settle: int
    probe: bool = False
    transit: bool = False
    min_rounds: int = 1
    t_start: float | None = None
    t_end: float | None = None
    recorded: int = 0
    off_bucket: int = 0
    tokens: int = 0
    rounds: int = 0
    off_measured: int = 0
    gated_measured: int = 0


class RegimePolicy:
    """The regime gated rounds run in, per bucket of generations in flight (one per gateway).

    The scheduler asks `may_draft` before each gated round's pre-draft decision, reports every
    finished round of every generation to `record`, and calls `idle` when its last generation
    leaves (an idle gap is no throughput). Times are the caller's monotonic clock in seconds.

    Args:
        config: the windows and the choice rule (default `RegimeConfig()`).
    """

    def __init__(self, config: RegimeConfig | None = None):
        if config is not None and not isinstance(config, RegimeConfig):
            raise TypeError(f"config={short_repr(config)}: must be a RegimeConfig or None")
        self.config = RegimeConfig() if config is None else config
        self.buckets = [_Bucket(probe_every=self.config.probe_min) for _ in range(len(BUCKET_UPPER) + 1)]
        self.window: _Window | None = None
        self.discarded = 0  # windows dropped: the load left their bucket, or the gateway went idle
        # The regime of the last window opened (None after idleness): a plain one leaves the
        # generations still in flight with their drafter sessions let go.
        self.last_regime: str | None = None

    def may_draft(self, in_flight: int) -> bool:
        """Whether a gated round starting with `in_flight` generations in flight (>= 1) may
        draft: True for a generation alone, else True when the open window's regime is
        "gate" (its gate then decides as usual) and False in a "plain" window. Opens a window
        when none is, or when the open one was a lone generation's and others have arrived (it
        measures nothing, and a burst after an idle spell must not draft on its say-so).
        Raises ValueError for a bad in_flight."""
        bucket = bucket_of(in_flight)
        if self.window is None or (self.window.bucket == 0 and bucket > 0):
            self._open(bucket, in_flight, None)
        return bucket == 0 or self.window.regime == "gate"

    def record(self, in_flight: int, committed: int, now_s: float, gated: bool = True) -> None:
        """One finished round of any generation: `committed` tokens (an int >= 1) at time
        `now_s` (s), with `in_flight` generations in flight (>= 1); `gated`: the round's
        generation is gated (the regime decides its rounds). Settles, measures or closes the
        open window; without one it only checks its arguments, since windows open when a
        gated round asks (`may_draft`): traffic the regime does not decide must not spend
        windows, or the probe schedule. Raises ValueError naming a bad value."""
        bucket = bucket_of(in_flight)
        if not is_integer(committed) or committed < 1:
            raise ValueError(f"committed={short_repr(committed)}: must be an int >= 1")
        _positive("now_s", now_s, low_ok=True)
        w = self.window
        if w is None:
            return
        off = bucket != w.bucket
        w.recorded += 1
        w.off_bucket += off
        if w.off_bucket > w.recorded - w.off_bucket + w.min_rounds:  # the load moved on: measure its bucket
            self._drop()
            transit = bucket < w.bucket
            if gated or transit:  # a transit window measures nothing and spends no probe
                self._open(bucket, in_flight, None, transit=transit)
            else:  # other traffic: the next gated round opens the next window
                self.window = None
            return
        if w.settle > 0:
            w.settle -= 1
            if w.settle == 0:
                w.t_start = now_s  # rounds finishing from here on ran in this window's regime
            return
        w.tokens += committed
        w.rounds += 1
        w.off_measured += off
        w.gated_measured += bool(gated)
        if (now_s - w.t_start) * 1e3 >= self.config.window_ms and w.rounds >= w.min_rounds:
            self._close((now_s - w.t_start) * 1e3)
            if 2 * w.gated_measured >= w.rounds:
                # A window that closes as the load drains into a lower bucket opens a transit
                # window there, as a window given up for the drain does: the drain's rounds
                # must not become that bucket's evidence.
                self._open(bucket, in_flight, w, transit=bucket < w.bucket)
            else:  # mostly other traffic: the next gated round opens the next window
                self.window = None

    def idle(self) -> None:
        """No generation is in flight: drop the open window, whose wall time would count the
        idle gap as if the regime had produced nothing in it."""
        if self.window is not None:
            self._drop()
            self.window = None
        self.last_regime = None

    def choice(self, bucket: int) -> str:
        """The regime bucket `bucket` exploits: its choice once both regimes have a window
        there (`_choose`); before that, the choice of the nearest lower bucket that has one
        (more load never favours drafting on its own); else "gate". Raises ValueError naming
        `bucket` unless it is an int in [0, len(BUCKET_UPPER)] (a `bucket_of` result)."""
        check_count("bucket", bucket, 0)
        if bucket >= len(self.buckets):
            raise ValueError(f"bucket={bucket}: must be <= {len(self.buckets) - 1}")
        for index in range(bucket, 0, -1):
            chosen = self._choose(index)
            if chosen is not None:
                return chosen
        return "gate"

    def _choose(self, index: int) -> str | None:
        """Bucket `index`'s choice from its rates: None until both regimes have `explore`
        windows; the first is "plain" when plain beats gate by the hysteresis, else "gate"; later
        the other regime takes over only when it beats the chosen one by the hysteresis."""
        b = self.buckets[index]
        if min(b.rates[r].windows for r in REGIMES) < self.config.explore:
            return None
        rates = {r: b.rates[r].tok_per_ms for r in REGIMES}
        current = b.chosen or "gate"
        other = _other(current)
        return other if rates[other] > rates[current] * (1.0 + self.config.hysteresis) else current

    def _open(self, bucket: int, in_flight: int, previous: _Window | None, transit: bool = False) -> None:
        """Open the next window of `bucket`. `transit`: the load fell into it from a higher
        bucket (a burst draining): the window runs the bucket's choice and measures nothing,
        and only if the load then holds for a whole window does the next one measure. A
        drain's rounds say little about a steady load of that size (the generations left are
        ending, nothing replaces them), and measuring them let the tails of large bursts
        decide the small buckets."""
        regime, probe = (self.choice(bucket), False) if transit else self._next(bucket)
        waking = self.last_regime == "plain" and regime == "gate"
        self.last_regime = regime
        self.window = _Window(bucket, regime, settle=_settle(previous, bucket, regime, in_flight, waking),
                              probe=probe, min_rounds=in_flight, t_start=previous and previous.t_end,
                              transit=transit)

    def _next(self, bucket: int) -> tuple[str, bool]:
        """The next window's regime in `bucket` and whether it is a probe."""
        if bucket == 0:
            return "gate", False
        b = self.buckets[bucket]
        if self._choose(bucket) is None:
            prior = self.choice(bucket)  # the nearest lower bucket's choice, else "gate"
            # A lower bucket chose plain, and more load never favours drafting: no gate window
            # here (at 16 streams one cost 43 % of a plain window's tokens) until that choice
            # turns to gate.
            return (prior if prior == "plain" else self._explore(bucket, prior)), False
        choice = self.choice(bucket)
        b.since_probe += 1
        if b.since_probe < max(b.probe_every, self._gap_windows(b, choice)):
            return choice, False
        b.since_probe, b.probes = 0, b.probes + 1
        return _other(choice), True

    def _gap_windows(self, b: _Bucket, choice: str) -> int:
        """The fewest windows between probes that keep their cost within `probe_budget`:
        ceil(gap / probe_budget), gap = 1 - other / chosen rate (0 on a tie or reversal),
        capped at probe_max."""
        chosen, other = b.rates[choice].tok_per_ms, b.rates[_other(choice)].tok_per_ms
        if not chosen or other is None or other >= chosen:
            return 0
        return min(self.config.probe_max, math.ceil((1.0 - other / chosen) / self.config.probe_budget))

    def _explore(self, bucket: int, prior: str) -> str:
        """The regime of an exploring bucket's next window: prior, other, other, prior, ...,
        the regime behind on windows first, so a dropped window is measured again."""
        b = self.buckets[bucket]
        counts = {r: b.rates[r].windows for r in REGIMES}
        if counts[prior] != counts[_other(prior)]:
            return min(REGIMES, key=counts.__getitem__)
        return prior if counts[prior] % 2 == 0 else _other(prior)

    def _drop(self) -> None:
        """Count the open window as discarded; a probe's bucket probes again at its next window."""
        w = self.window
        self.discarded += w.bucket != 0
        if w.probe:
            b = self.buckets[w.bucket]
            b.since_probe = self.config.probe_max  # past any interval: the next window probes

    def _close(self, ms: float) -> None:
        """Add the open window's tokens over `ms` to its regime's rate, unless more than a
        quarter of its rounds ran outside its bucket or fewer than half were gated (the
        regime decided too little of the traffic for the window to say what it does); after
        a probe, double the probe interval when the choice held, else go back to probe_min."""
        w, cfg = self.window, self.config
        w.t_end = w.t_start + ms / 1e3
        if w.transit:  # the load held for a whole window: the next one measures
            return
        if w.bucket == 0 or 4 * w.off_measured > w.rounds or 2 * w.gated_measured < w.rounds:
            self._drop()
            return
        b = self.buckets[w.bucket]
        before = b.chosen
        b.rates[w.regime].add(w.tokens, ms, cfg.decay)
        b.chosen = self._choose(w.bucket)
        if w.probe:
            held = b.chosen == before
            b.probe_every = min(2 * b.probe_every, cfg.probe_max) if held else cfg.probe_min

    def to_dict(self) -> dict:
        """Plain-JSON view (the Stats RPC's `regime`): the config, the open window (bucket
        label, regime, probe, transit, settling) or None, windows discarded, and per bucket with any
        window its label, choice, probes, probe interval (the doubling schedule's, or the gap's
        floor when longer) and per regime windows and
        tok_per_ms (None before any)."""
        c, w = self.config, self.window
        # "margin": the Stats RPC's published key for the hysteresis
        out = {"window_ms": c.window_ms, "decay": c.decay, "margin": c.hysteresis, "explore": c.explore,
               "probe_min": c.probe_min, "probe_max": c.probe_max, "probe_budget": c.probe_budget,
               "discarded_windows": self.discarded, "buckets": [],
               "window": None if w is None else {"in_flight": bucket_name(w.bucket), "regime": w.regime,
                                                 "probe": w.probe, "transit": w.transit,
                                                 "settling": w.settle > 0}}
        for i, b in enumerate(self.buckets):
            if any(r.windows for r in b.rates.values()):
                choice = self.choice(i)
                out["buckets"].append({
                    "in_flight": bucket_name(i), "choice": choice, "probes": b.probes,
                    "probe_every": max(b.probe_every, self._gap_windows(b, choice)),
                    **{r: {"windows": rate.windows, "tok_per_ms": rate.tok_per_ms} for r, rate in b.rates.items()}})
        return out
