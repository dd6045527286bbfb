"""Load-aware pricing of drafts: the verifier's step-time table and rate, as the gate uses them.

A verify shares its verifier step with every other session's rows, so what one more draft
costs is the step time it adds, table(R + k + 1) - table(R + 1) for R rows of other sessions,
and that time delays every session in the step, so it is worth lambda_sys (the verifier's
committed tokens per wall ms) per ms rather than one generation's own rate. The rest of a
drafted round (the draft, the drafter commit, the verify's own overhead) only keeps its own
generation away from the verifier; while other generations keep the verifier busy meanwhile,
that wait costs the system nothing, so it is charged only for the share of rounds in which
the verifier had no other work (the generation's `cover`, docs/gate.md §13).

This module owns the gateway's copy of the step table (`StepTimes`, `VerifierLoad`, refreshed
from the verifier's Info with a deadline), the count of this gateway's generations inside a
verifier call (`VerifierOccupancy`), what one generation has seen of the load (`LoadSeen`,
from each reply's step rows and rate and from that count before each round) and the
re-priced cost model (`priced_at_load`). It never decides a length (the gate does, with the
model it is handed) and never reads the environment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from dataclasses import dataclass

import grpc

from dspark_proto.v1 import common_pb2
from services.common.budget import StepTimes
from services.gateway.decision import CostModel
from services.gateway.values import MIN_COST_MS

log = logging.getLogger("dspark.gateway.load")
OTHER_ROWS_ALPHA = 0.5  # moving average of the other sessions' rows: follows load within a few rounds
# Moving average of the 0/1 cover samples (one per round): a single round moves the price of
# the generation's own wait by at most 30 %, and a change of load shows within 3-4 rounds.
COVER_ALPHA = 0.3


class VerifierOccupancy:
    """How many of one gateway's generations are inside a verifier call (prefill, decode or
    verify) right now. Process-wide and used from the event loop's thread only (no lock).
    Generations of other gateways sharing the verifier are not counted, so with several
    gateways the cover it gives is too low and the pricing errs towards the alone rule."""

    def __init__(self) -> None:
        self.inside = 0

    @contextlib.contextmanager
    def call(self):
        """Count the caller inside the verifier for the `with` block (exceptions included)."""
        self.inside += 1
        try:
            yield
        finally:
            self.inside -= 1


@dataclass
class LoadSeen:
    """What one generation has seen of the verifier's load, only from what happened before
    its current round (so it never anticipates a draft not yet verified): a moving average of
    the rows other sessions put in its steps (tokens), the last reported lambda_sys (tokens
    per ms; 0 = none) and `cover`, a moving average in [0, 1] of whether other generations
    were inside the verifier when this one left it to decide a round (0 = never seen any)."""

    other_rows: float = 0.0
    tokens_per_ms: float = 0.0
    replies: int = 0
    cover: float = 0.0
    cover_samples: int = 0

    def observe_cover(self, others_inside: int) -> None:
        """Before a round's decision: `others_inside` (>= 0) other generations of this gateway
        are inside a verifier call, so the verifier has work while this one drafts (1) or
        would idle (0). Raises ValueError on a negative count."""
        if others_inside < 0:
            raise ValueError(f"others_inside={others_inside}: a count of generations must be >= 0")
        busy = 1.0 if others_inside > 0 else 0.0
        self.cover = busy if self.cover_samples == 0 else self.cover + COVER_ALPHA * (busy - self.cover)
        self.cover_samples += 1

    def observe(self, step_rows: int, own_rows: int, tokens_per_ms: float) -> None:
        """One decode / verify reply: its step forwarded `step_rows` tokens, `own_rows` of them
        this generation's; a reply without a step (step_rows 0) changes nothing."""
        if step_rows <= 0:
            return
        other = float(max(0, step_rows - own_rows))
        self.other_rows = other if self.replies == 0 else self.other_rows + OTHER_ROWS_ALPHA * (other - self.other_rows)
        if math.isfinite(tokens_per_ms) and tokens_per_ms > 0:
            self.tokens_per_ms = tokens_per_ms
        self.replies += 1


@dataclass
class PricingStats:
    """Process-wide figures of the rounds priced at load (the gateway's Stats RPC): how many,
    and the mean cover (0..1) and other rows (tokens) they were priced with."""

    rounds: int = 0
    cover_sum: float = 0.0
    other_rows_sum: float = 0.0

    def add(self, seen: LoadSeen) -> None:
        """One round priced with what `seen` holds."""
        self.rounds += 1
        self.cover_sum += seen.cover
        self.other_rows_sum += seen.other_rows

    def to_dict(self) -> dict:
        """{"rounds", "cover_mean", "other_rows_mean"} (means 0.0 before any round)."""
        n = max(self.rounds, 1)
        return {"rounds": self.rounds, "cover_mean": self.cover_sum / n, "other_rows_mean": self.other_rows_sum / n}


def priced_at_load(cost: CostModel, table: StepTimes, seen: LoadSeen, own_rate: float, max_k: int) -> CostModel:
    """`cost` re-priced for the load `seen` (docs/gate.md §13), for decisions only (ms).

    verify'(n) = plain + w * own(n) + ratio * shared(n) for n = 1..max_k, clamped >= 0 and
    made non-decreasing in n; draft' = w * draft and commit' = w * commit. Here shared(n) =
    table(R+n+1) - table(R+1) is the step time n drafts add beside the R other rows seen,
    own(n) = verify(n) - plain - (table(n+1) - table(1)) is the rest of the round's measured
    extra time alone in its step (its rows over the wire, the rollback), ratio = max(1,
    lambda_sys / own_rate) and w = 1 - cover. The decision charges every ms at own_rate
    (tokens per ms); the shared ms delay every session of the step, so ratio prices them at
    lambda_sys instead; the draft, the commit and own(n) only keep this generation away from
    the verifier, which costs anything only in the rounds where no other generation had work
    for it (w). With R = 0, lambda_sys <= own_rate and cover 0 it returns `cost` unchanged
    (the alone rule). own_rate must be > 0 and max_k >= 1 (the gate's own values).
    """
    ratio = max(1.0, seen.tokens_per_ms / own_rate)
    r, w = seen.other_rows, 1.0 - seen.cover
    if r == 0.0 and ratio == 1.0 and w == 1.0:
        return cost
    table_ms, running = [], 0.0
    for n in range(1, max_k + 1):
        own = cost.verify_ms(n) - cost.plain_ms - table.marginal_ms(0.0, n)
        running = max(running, cost.plain_ms + w * own + ratio * table.marginal_ms(r, n), 0.0)
        table_ms.append(running)
    # CostModel needs a draft of at least MIN_COST_MS when its verify line is zero; that floor
    # is a millionth of any real draft and never moves a choice.
    return dataclasses.replace(cost, draft_ms=max(w * cost.draft_ms, MIN_COST_MS), commit_ms=w * cost.commit_ms,
                               verify_table=tuple(table_ms),
                               source=f"{cost.source}; at load R={r:.1f} rows, x{ratio:.2f}, cover {seen.cover:.2f}")


class VerifierLoad:
    """The gateway-wide step table, refreshed from the verifier's Info at most every
    `refresh_s` (s), each call with `timeout_s` (s). `table` is None until a verifier reports
    one. A failed refresh keeps the last table and logs at debug level (the round's own
    replies still carry the rate and rows)."""

    def __init__(self, stub, timeout_s: float, refresh_s: float = 2.0):
        self.stub, self.timeout_s, self.refresh_s = stub, timeout_s, refresh_s
        self.table: StepTimes | None = None
        self._last = -math.inf
        self._busy = False

    def update(self, identity: common_pb2.ModelIdentity) -> None:
        """Take the table of an Info reply (a malformed one is logged and ignored)."""
        try:
            table = StepTimes.from_identity(identity)
        except ValueError as exc:
            log.warning("verifier step table ignored: %s", exc)
            return
        if table is not None:
            self.table = table

    async def refresh(self) -> None:
        """Fetch Info when the table is older than `refresh_s` and no fetch is running."""
        now = time.monotonic()
        if self._busy or now - self._last < self.refresh_s:
            return
        self._busy, self._last = True, now
        try:
            self.update(await self.stub.Info(common_pb2.InfoRequest(), timeout=self.timeout_s))
        except grpc.aio.AioRpcError as exc:
            log.debug("verifier Info for the step table failed: %s", exc.code().name)
        finally:
            self._busy = False
