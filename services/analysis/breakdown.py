"""One round's breakdown for `dspark trace-report` / `dspark calibrate`: `RoundBreakdown`.

Owns the record only: `services.analysis.report` builds it from spans or recorded rounds and
summarises it, `services.analysis.calibration` fits the gate's costs from it. It sits below
both so neither imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.analysis.traces import Span


@dataclass
class RoundBreakdown:
    """One round as the trace report sees it: the gateway's attributes and where its time went
    (ms; None where a span is missing). Built by `services.analysis.report` from a
    `spec_decode.round` span and its children, or from a recorded round.

    A round read from a recorded-rounds file (`report.recorded_round`) has no span: no ids, no start
    or end (start_ns = end_ns = None, so no wall time), and its `workload` label.
    """

    trace_id: str
    span_id: str
    generation_id: str | None
    index: int
    start_ns: int | None
    end_ns: int | None
    decision: str
    drafted: int
    submitted: int
    accepted: int
    anchor_margin: float | None
    verify_ms: float | None
    draft_ms: float | None
    confidence_logits: tuple[float, ...] | None
    drafter_failures: int  # `drafter_failed` events of the round
    drafter_failovers: int  # `drafter_failover` events: a new drafter session took over
    drafter_ms: float | None
    verifier_ms: float | None
    verifier_overhead_ms: float | None
    children: list[Span] = field(default_factory=list, repr=False)
    workload: str | None = None  # recorded rounds only

    @property
    def wall_ms(self) -> float | None:
        """The gateway's wall time of the round (ms); None for a recorded round (no span)."""
        if self.start_ns is None or self.end_ns is None:
            return None
        return (self.end_ns - self.start_ns) / 1e6

    @property
    def residual_ms(self) -> float | None:
        """wall - drafter compute - verifier compute (network + serialisation + overheads)."""
        if self.drafter_ms is None or self.verifier_ms is None or self.wall_ms is None:
            return None
        return self.wall_ms - self.drafter_ms - self.verifier_ms
