"""The gateway's regime by a throughput model: whether gated rounds draft at this load.

At one generation in flight the gate decides every round, as everywhere before: the verifier
idles while the drafter drafts, so the gate's own single-stream costs are the system's. With
more generations in flight what a round costs is the whole system's, and the gate alone does
not see it. `ModelRegime` then decides for every gated generation of the gateway together:
all of them draft the full block (the gate's length choice and pre-draft skips are bypassed),
or none drafts. It decides from a model of the closed loop's throughput over measured tables,
never from a wall-clock experiment, so the same inputs give the same choice in the services
and in the simulator (docs/gate.md §14).

For N generations in flight, in tokens per ms of the whole gateway:

    plain(N) = N / (step(N) + o)
    draft(N) = N * (1 + sum_j s_j) / (step(N * (k + 1)) + o + leg(N))

step(rows): the verifier's step table (ms at rows; its Info, the simulator's model); o: the
per-round overhead beyond the step (rpc, the gateway's turn), plain_ms - step(1) of the
single-stream cost model; k: the block; s_j: the pooled survival of draft position j (the
share of verified full blocks whose drafts 1..j were all accepted, decayed, with a prior of
PRIOR_BLOCKS blocks that accepts everything, so a cold gateway drafts and measures: outcomes,
not the gates' estimates, which a cold gate sets to 1.0 and which would feed the prior back
into itself; a block cut shorter than the full one, by its gate or the step budget, says
nothing of its later positions and is not pooled); leg(N):
the measured drafter legs of a drafted round (its draft call and its commit), per bucket of
N, else the nearest lower bucket's, else the single-stream draft_ms + commit_ms. Both sides
assume every generation meets in one verifier step, as plain decode's do; a drafted round's
extra legs are added, not overlapped with other generations' steps, which errs towards plain
decode where the two are close.

Revisiting: plain decode verifies no block, so the pooled survival would never move again once
a poor stretch of drafts pulled it under break-even, and the whole gateway would stay plain at
that load for good (on the bundled prose rounds at 2 streams of 4 generations, 0.58x k5). Each
round the model keeps plain moves every s_j REVISIT / N of the way back to the prior (about
REVISIT a verifier step): the gateway drafts again after a while, and the blocks it then
verifies keep it drafting or send it back to plain within a few steps.

Waking costs: a generation that ran plain holds its rows back from the drafter (the link
sleeps), and its first draft re-primes them. It wakes only when the time it would save over
the tokens it has left, left * N * (1 / plain - 1 / draft), exceeds commit_ms per held row:
a burst draining to a lower load does not re-prime every generation for its last tokens.

Non-anticipating: every input is from finished rounds or the tables. Under exact numerics or
the coupled sampling rule what a generation streams does not depend on it (docs/sampling.md).
Event-loop use only (no locking).
"""

from __future__ import annotations

import bisect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.common.budget import StepTimes
from services.gateway.decision import CostModel

# Upper bounds (generations in flight) of the buckets the drafter legs are kept in; the last
# bucket is everything above.
BUCKET_UPPER = (1, 2, 4, 8, 16, 32, 64, 128)
# Blocks of the cold prior (every draft accepted): a cold gateway drafts, and its first
# measured blocks outweigh the prior within a few rounds.
PRIOR_BLOCKS = 4.0
# Weight each drafted block's survivals keep per later block (about the last 50 blocks count).
SURVIVAL_DECAY = 0.98
# Weight of a bucket's earlier drafter legs against a new one.
LEG_DECAY = 0.9
# The share of the way back to the prior the pooled survival goes per verifier step the
# regime keeps plain (each of the N generations' plain rounds takes 1/N of it).
REVISIT = 0.001
# The largest count (generations, rows, tokens) the model takes: exact as a float, and far
# beyond any real gateway's; a larger one is a caller's bug, refused rather than overflowing.
MAX_COUNT = 2**53


@dataclass(frozen=True)
class Goodput:
    """The model at one load: `in_flight` generations (>= 1); `plain` and `draft`, the
    gateway's committed tokens per ms with every gated generation plain or drafting the
    full block; `leg_ms`, the drafter legs priced (ms)."""

    in_flight: int
    plain: float
    draft: float
    leg_ms: float

    def __post_init__(self) -> None:
        """Raises ValueError naming the field on an in_flight that is not an int in
        [1, MAX_COUNT], a rate that is not finite and > 0 (plain) or >= 0 (draft), or a leg
        that is not finite and >= 0."""
        _count("in_flight", self.in_flight, 1)
        for name, value, low_ok in (("plain", self.plain, False), ("draft", self.draft, True),
                                    ("leg_ms", self.leg_ms, True)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
                    or value < 0 or (value == 0 and not low_ok):
                raise ValueError(f"{name}={value!r}: must be a finite number {'>=' if low_ok else '>'} 0")

    @property
    def drafts(self) -> bool:
        """Whether drafting earns more than plain decode at this load."""
        return self.draft > self.plain


class ModelRegime:
    """Whether gated rounds draft, per load, from the throughput model (module docstring).

    block: drafts per round when drafting (the drafter's block, >= 1).
    table: returns the verifier's step table, or None while there is none (then every gated
        round drafts and its gate decides).
    cost: returns the single-stream cost model in force (plain_ms, draft_ms, commit_ms).
    Raises ValueError on a block < 1.
    """

    def __init__(self, block: int, table: Callable[[], StepTimes | None], cost: Callable[[], CostModel]):
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"block={block!r}: must be an int >= 1")
        self.block, self.table, self.cost = block, table, cost
        self.survival = [1.0] * block  # pooled s_j, the prior to begin with
        self.weight = PRIOR_BLOCKS
        self.legs: dict[int, float] = {}  # bucket -> decayed mean drafter legs (ms)
        self.blocks = 0  # drafted blocks observed

    # ------------------------------------------------------------------ decide
    def goodput(self, in_flight: int) -> Goodput | None:
        """The model at `in_flight` generations (an int >= 0; 0 is priced as 1); None without a
        step table. Raises ValueError naming a bad in_flight (class docstring)."""
        n = max(_count("in_flight", in_flight, 0), 1)
        table = self.table()
        if table is None:
            return None
        cost = self.cost()
        overhead = max(cost.plain_ms - table.ms_at(1), 0.0)
        leg = self._leg(n, cost)
        plain = n / (table.ms_at(n) + overhead)
        draft = n * (1.0 + sum(self.survival)) / (table.ms_at(n * (self.block + 1)) + overhead + leg)
        return Goodput(n, plain, draft, leg)

    def may_draft(self, in_flight: int, held_rows: int = 0, tokens_left: int = 0) -> bool:
        """Whether a gated round starting with `in_flight` generations in flight may draft:
        always alone (its gate decides); else when the model's draft rate beats plain's and,
        for a generation holding `held_rows` rows back from the drafter, waking saves more than
        re-priming them costs over its `tokens_left` tokens (module docstring). Raises
        ValueError naming a bad count (class docstring)."""
        _count("in_flight", in_flight, 0)
        _count("held_rows", held_rows, -MAX_COUNT)
        _count("tokens_left", tokens_left, -MAX_COUNT)
        if in_flight <= 1:
            return True
        g = self.goodput(in_flight)
        if g is None:
            return True
        if not g.drafts:
            return False
        if held_rows <= 0:
            return True
        saving_ms = max(tokens_left, 0) * g.in_flight * (1.0 / g.plain - 1.0 / g.draft)
        return saving_ms > self.cost().commit_ms * held_rows

    def decides_length(self, in_flight: int) -> bool:
        """Whether a drafting round submits the full block without asking its gate: at more
        than one generation in flight (with a table), where the regime prices the system.
        Raises ValueError naming a bad in_flight (class docstring)."""
        return _count("in_flight", in_flight, 0) > 1 and self.table() is not None

    # ------------------------------------------------------------------ learn
    def observe(self, in_flight: int, survival: Sequence[float], leg_ms: float | None) -> None:
        """A drafted round: which of its verified drafts survived (per draft j, 1.0 when
        drafts 1..j were all accepted, else 0.0; a block shorter than `block` is not pooled)
        and its drafter legs (ms: the draft call and the commit before it; None when not
        measured).
        Raises ValueError on a bad in_flight (class docstring), a survival outside [0, 1] or
        not a number, or a negative or non-finite leg."""
        _count("in_flight", in_flight, 0)
        try:
            values = [float(s) for s in survival]
        except (TypeError, ValueError):
            raise ValueError(f"survival={survival!r}: must be a sequence of probabilities") from None
        if any(not 0.0 <= s <= 1.0 for s in values):
            raise ValueError(f"survival={values}: each must be a probability in [0, 1]")
        if leg_ms is not None and not (math.isfinite(leg_ms) and leg_ms >= 0):
            raise ValueError(f"leg_ms={leg_ms!r}: must be a finite number of ms >= 0")
        if len(values) >= self.block:
            self.weight = self.weight * SURVIVAL_DECAY + 1.0
            share = 1.0 / self.weight
            self.survival = [(1.0 - share) * old + share * new for old, new in zip(self.survival, values)]
            self.blocks += 1
        if leg_ms is not None:
            b = _bucket(in_flight)
            old = self.legs.get(b)
            self.legs[b] = leg_ms if old is None else LEG_DECAY * old + (1.0 - LEG_DECAY) * leg_ms

    def observe_plain(self, in_flight: int) -> None:
        """A round the regime kept plain with `in_flight` generations in flight: the pooled
        survival ages towards the prior, REVISIT / in_flight of the way (module docstring).
        Raises ValueError on a bad in_flight (class docstring)."""
        share = REVISIT / max(_count("in_flight", in_flight, 0), 1)
        self.survival = [s + share * (1.0 - s) for s in self.survival]

    def _leg(self, n: int, cost: CostModel) -> float:
        for b in range(_bucket(n), -1, -1):
            if b in self.legs:
                return self.legs[b]
        return cost.draft_ms + cost.commit_ms

    def to_dict(self) -> dict:
        """Plain-JSON view (the Stats RPC's `regime`): the kind, the pooled survival, the
        blocks observed, the legs per bucket and, per bucket upper bound, the model's rates."""
        rates = {}
        for n in (*BUCKET_UPPER, 2 * BUCKET_UPPER[-1]):
            g = self.goodput(n)
            if g is not None:
                rates[str(n)] = {"plain_tok_per_ms": round(g.plain, 6), "draft_tok_per_ms": round(g.draft, 6),
                                 "drafts": g.drafts}
        return {"kind": "model", "survival": [round(s, 4) for s in self.survival], "blocks": self.blocks,
                "leg_ms": {_bucket_name(b): round(ms, 3) for b, ms in sorted(self.legs.items())},
                "in_flight": rates}


def _count(name: str, value: object, low: int) -> int:
    """`value` as a count: an int (not a bool) in [low, MAX_COUNT]; else ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= value <= MAX_COUNT:
        raise ValueError(f"{name}={value!r}: must be an int in [{low}, {MAX_COUNT}]")
    return int(value)


def _bucket(in_flight: int) -> int:
    return bisect.bisect_left(BUCKET_UPPER, max(int(in_flight), 1))


def _bucket_name(index: int) -> str:
    if index >= len(BUCKET_UPPER):
        return f"{BUCKET_UPPER[-1] + 1}+"
    low = BUCKET_UPPER[index - 1] + 1 if index else 1
    high = BUCKET_UPPER[index]
    return str(high) if low == high else f"{low}-{high}"
