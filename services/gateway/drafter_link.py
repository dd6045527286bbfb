"""One generation's link to its drafter: draft calls, committed rows, deferral and failover.

Owns, for one generation, the current drafter session, the committed tokens (what a new
session is primed with), the commits held back while the gate keeps rounds from drafting,
and the failover path: a drafter failure that another replica may cure re-primes a new
session from the generation's `DrafterSupply` with the verifier's kept rows; otherwise the
generation goes on without a drafter (plain decode). Every failure is counted by reason
(process `DrafterFaults`, the generation's metrics and `RoundStats`) and logged once.

It must not choose draft lengths, judge drafts, time rounds or stream tokens (the scheduler,
`services.gateway.scheduler`, does), and never talks gRPC itself (the backend sessions do).

Dimension legend: R = committed rows in one message, V = vocab.
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import torch
from opentelemetry import trace

from dsv4.sampling import SamplingParams
from services.common.telemetry import trace_context
from services.gateway.backends import (BackendError, DraftReply, DrafterSession, VerifierSession, failure_reason,
                                       may_fail_over)
from services.gateway.drafters import DraftCheck, DrafterFaults, DrafterSupply
from services.gateway.metrics import GenerationMetrics, NoGenerationMetrics
from services.gateway.record import RoundStats

log = logging.getLogger("dspark.gateway")
# Rows a generation may hold back from the drafter while the gate keeps it from drafting; the
# bound keeps one commit message small (row_width 12288 bf16 rows: 32 rows = 768 KiB).
MAX_DEFERRED_ROWS = 32
# A drafter at its session limit (RESOURCE_EXHAUSTED) is full, not broken: the generation decodes
# plainly and asks for a session again after FULL_RETRY_FIRST rounds, then after gaps doubling
# up to FULL_RETRY_MAX rounds, so speculation resumes once a slot frees while a drafter that
# stays full costs one refused stream per FULL_RETRY_MAX plain rounds.
FULL_RETRY_FIRST = 4
FULL_RETRY_MAX = 64


class DrafterLink:
    """The drafter side of one generation (see the module docstring).

    Args:
        supply: the generation's `DrafterSupply` (None: never a drafter); its first session
            is opened here.
        verifier: the generation's verifier session (its kept rows prime a new drafter).
        faults: the process-wide failure counts (the Stats RPC).
        metrics: the generation's metrics.
        counters: the generation's `RoundStats` (drafter_failovers, drafter_failed).
        awake: open the first session now; False starts the link asleep (`sleep`), so a
            generation the gateway's regime keeps plain from its start never opens one
            unless it drafts (ignored when the supply cannot open sessions on demand).
    """

    def __init__(self, supply: DrafterSupply | None, verifier: VerifierSession, faults: DrafterFaults,
                 metrics: GenerationMetrics | NoGenerationMetrics, counters: RoundStats, awake: bool = True):
        self.supply, self.verifier, self.faults = supply, verifier, faults
        self.metrics, self.counters = metrics, counters
        # the session was let go (or never opened) while the regime keeps rounds plain (`sleep`)
        self.asleep = not awake and supply is not None and supply.can_reopen
        self.session: DrafterSession | None = supply.open() if supply is not None and not self.asleep else None
        self.committed: list[int] = []  # tokens of the positions the verifier has committed
        # (output constraint, first output position): sent with every priming commit
        self.constraint: tuple | None = None
        # (logits controls, first output position): sent with every priming commit
        self.controls: tuple | None = None
        self._pending: list[tuple] = []  # deferred commits: (rows, first_position, token_ids, token_first)
        self._full_gap = 0  # rounds between asks while the drafter is full (0: it is not)
        self._full_wait = 0  # plain rounds left before the next ask

    async def draft(self, anchor: int, pos: int, tc, sampling: SamplingParams, check: DraftCheck,
                    needs_probs: bool) -> tuple[DraftReply | None, float | None]:
        """The drafter's reply for anchor position `pos` (seed position pos - 1), checked with
        `check`, and the draft call's wall time (ms); (None, None) when it failed and no new
        session took over. A reply that fails the check is discarded whole: its valid prefix
        is not used either.

        Raises:
            BackendError: the verifier failed while a new drafter was being primed.
        """
        while True:
            t0 = time.perf_counter()
            try:
                reply = await self.session.draft(anchor, pos - 1, tc, sampling)
                check(reply, needs_probs)
                break
            except BackendError as exc:
                if not await self.failed(exc):
                    return None, None
        return reply, (time.perf_counter() - t0) * 1e3

    async def commit(self, rows: torch.Tensor, first_position: int, token_ids: Sequence[int], token_first: int,
                     defer: bool = False, sleep_when_full: bool = False) -> None:
        """Send committed rows [R, row_width] of positions first_position.. and the tokens from
        token_first on to the drafter. `defer`: hold them until the next draft (`flush`), up to
        MAX_DEFERRED_ROWS rows: a round the gate kept from drafting then costs a plain step alone,
        not a plain step and a drafter round trip, and the drafter still sees every row before it
        drafts again. `sleep_when_full`: at MAX_DEFERRED_ROWS held rows, let the session go
        (`sleep`) instead of flushing them: a losing streak's next draft is a probe many rounds
        away, which re-primes (`wake`) once instead of the drafter taking every row meanwhile.

        Raises:
            BackendError: the verifier failed while a new drafter was being primed.
        """
        self.committed[token_first:] = token_ids
        if self.session is None:
            return
        self._pending.append((rows, first_position, list(token_ids), token_first))
        full = sum(r.shape[0] for r, *_ in self._pending) >= MAX_DEFERRED_ROWS
        if defer and full and sleep_when_full and self.supply is not None and self.supply.can_reopen:
            await self.sleep()
        elif not defer or full:
            await self.flush()

    async def flush(self) -> None:
        """Commit the held rounds as one message; their positions are contiguous, so their rows
        and tokens concatenate. A drafter failure here fails over as any commit does."""
        pending, self._pending = self._pending, []
        if not pending or self.session is None:
            return
        rows = pending[0][0] if len(pending) == 1 else torch.cat([r for r, *_ in pending])
        tokens = [t for _, _, ids, _ in pending for t in ids]
        try:
            await self.session.commit(rows, pending[0][1], tokens, pending[0][3],
                                      trace_context(trace.get_current_span()),
                                      **self._priming(pending[0][3]))
        except BackendError as exc:
            await self.failed(exc)  # a new session is primed with these rows too

    async def failed(self, exc: BackendError) -> bool:
        """The drafter failed (`exc`: its error or an `InvalidDraftReply`). Re-prime a new
        drafter session from the supply while it has one and the failure is one another
        replica may cure; True when one took over. A full drafter (RESOURCE_EXHAUSTED) is
        asked again later (`retry_full`). Otherwise plain decode for the rest of this
        generation (False). Every failure is counted by reason and logged once.

        Raises:
            BackendError: the verifier failed to return its kept rows (ends the generation).
        """
        await close_quietly(self.session)
        self.session = None
        self._pending.clear()  # a new session is primed from the verifier's rows instead
        span = trace.get_current_span()
        span.add_event("drafter_failed", {"error": str(exc), "reason": failure_reason(exc)})
        if failure_reason(exc) == "full" and self.supply is not None:
            self._full_gap = min(FULL_RETRY_MAX, 2 * self._full_gap) if self._full_gap else FULL_RETRY_FIRST
            self._full_wait = self._full_gap
            self._count_failure(exc, f"plain decode; asking again in {self._full_gap} rounds")
            return False
        while True:
            new = self.supply.open() if self.supply is not None and may_fail_over(exc) else None
            self._count_failure(exc, "trying a new drafter session" if new else "plain decode from here")
            if new is None:
                break
            again = await self._prime(new, span)
            if again is not None:
                await close_quietly(new)
                exc = again
                continue
            self.session = new
            self.counters.drafter_failovers += 1
            self.faults.failover()
            self.metrics.record_drafter_failover()
            return True
        self.counters.drafter_failed = True
        self.faults.fell_back()
        return False

    async def sleep(self) -> None:
        """Let the drafter session go while the gateway's regime keeps this generation's rounds
        plain (docs/gate.md §14): the drafter then spends nothing on it, not even the commits a
        deferral would batch, and its slot is free. `wake` primes a new session from the
        verifier's kept rows. A no-op without a session, or when the supply cannot open
        another (a caller-owned session): then rounds defer their commits as usual."""
        if self.session is None or self.supply is None or not self.supply.can_reopen:
            return
        session, self.session, self.asleep = self.session, None, True
        self._pending.clear()
        await close_quietly(session)

    async def wake(self) -> bool:
        """Before the first draft after `sleep` (or of a link started asleep): open a session
        and prime it with the verifier's kept rows (the last min(W, committed)), not counted
        as a failover (`_adopt`). True when a session took over, or when the link was not
        asleep and has one.

        Raises:
            BackendError: the verifier failed to return its kept rows (ends the generation).
        """
        if not self.asleep:
            return self.session is not None
        self.asleep = False
        return await self._adopt(self.supply.retry() if self.supply.opened else self.supply.open())

    @property
    def backing_off(self) -> bool:
        """The drafter refused a session as full and `retry_full` is waiting to ask again."""
        return self.session is None and self._full_gap > 0

    async def retry_full(self) -> bool:
        """One plain round of a generation whose drafter was full; on the round its wait ends,
        open a new session and prime it with the verifier's kept rows. True when a session
        took over (the next round may draft); a refusal doubles the wait (`failed`).

        Raises:
            BackendError: the verifier failed to return its kept rows (ends the generation).
        """
        if self.session is not None or self._full_gap == 0:
            return self.session is not None
        self._full_wait -= 1
        if self._full_wait > 0:
            return False
        new = self.supply.retry()
        if new is None:
            self._full_gap = 0
            return False
        if not await self._adopt(new):
            return False
        self._full_gap = 0
        trace.get_current_span().add_event("drafter_session_regained", {"first_position": len(self.committed)})
        return True

    async def _adopt(self, new: DrafterSession) -> bool:
        """Prime `new` with the verifier's kept rows and make it the session. True when it took
        over; a refusal is handled as any drafter failure (`failed` closes it, counts it, and
        fails over or backs off) and its answer returned.

        Raises:
            BackendError: the verifier failed to return its kept rows (ends the generation).
        """
        refused = await self._prime(new, trace.get_current_span())
        self.session = new
        if refused is not None:
            return await self.failed(refused)
        return True

    async def _prime(self, new: DrafterSession, span) -> BackendError | None:
        """Commit the verifier's kept rows (the last min(W, committed)) and the committed tokens
        to `new`; returns the drafter's error when that commit failed, else None.

        Raises:
            BackendError: the verifier failed to return its rows (ends the generation).
        """
        tc = trace_context(span)
        kept = await self.verifier.rows(0, tc)
        last = kept.first_position + kept.rows.shape[0]
        try:  # the oracle drafter needs every committed token; the DSpark one ignores them
            await new.commit(kept.rows, kept.first_position, self.committed[:last], 0, tc, **self._priming(0))
        except BackendError as exc:
            return exc
        span.add_event("drafter_failover", {"first_position": kept.first_position, "rows": kept.rows.shape[0]})
        return None

    def _priming(self, token_first: int) -> dict:
        """The constraint and controls keywords of a commit whose tokens start at `token_first`:
        a priming commit (0) of a generation that has them carries them; others carry nothing
        (a plain generation's commits stay as they were)."""
        if token_first != 0:
            return {}
        extra = {"constraint": self.constraint, "controls": self.controls}
        return {k: v for k, v in extra.items() if v is not None}

    def _count_failure(self, exc: BackendError, outcome: str) -> None:
        """Count one drafter failure by reason (process stats, metrics) and log it once."""
        reason = failure_reason(exc)
        check = getattr(exc, "check", None)
        self.faults.failure(reason, check)
        self.metrics.record_drafter_failure(reason, check)
        log.warning("drafter failure (%s%s): %s; %s", reason, f": {check}" if check else "", exc, outcome)


async def close_quietly(session) -> None:
    """Close a drafter session whose stream may already be broken (nothing more to free then)."""
    try:
        await session.close()
    except Exception:
        pass
