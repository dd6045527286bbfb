"""The gateway's OpenTelemetry metrics, served on a Prometheus endpoint (`--metrics-port`, `DSPARK_METRICS_PORT`).

This module owns the gateway's instruments and their names; the endpoint and registry are
`services.common.metrics.MetricsEndpoint` (no `otel_scope_*` labels). Every speculation
counter is read from one `RoundRecord` (`record_round`) and every histogram from values the
scheduler hands over; it must not keep counts of its own, decide anything, or read the
environment (the port comes from the entry point).

Every gateway sample carries `model` (the served model: `served_model_name`) and `spec_mode`
(off | always | gated: the generation's speculation mode), so dashboards split by both.

Requests (vLLM's families under a dspark_gateway_ prefix):
  dspark_gateway_requests                   {finish_reason = stop | length | abort | error}: generations ended
  dspark_gateway_prompt_tokens              prompt tokens of finished generations
  dspark_gateway_generation_tokens          completion tokens of finished generations
  dspark_gateway_requests_waiting           gauge: generations admitted whose first token is not out yet
                                            (opening backend sessions, prefill)
  dspark_gateway_requests_running           gauge: generations past their first token, still streaming
Speculative decoding, with vLLM's names (counters; Prometheus adds `_total`):
  spec_decode_num_drafts                    verify rounds (a draft block of k >= 1 sent to verify)
  spec_decode_num_draft_tokens              drafts submitted to verify (sum of k)
  spec_decode_num_accepted_tokens           drafts accepted (bonus tokens not counted)
  spec_decode_num_accepted_tokens_per_pos   {position = 0..B-1}: rounds whose draft at that position was accepted
The gate and the rounds (names of `SpecStats`):
  spec_decode_rounds, spec_decode_drafted_tokens (drafts produced, before the gate),
  spec_decode_margin_skipped_rounds, spec_decode_truncated_rounds,
  spec_decode_skipped_after_draft_rounds, spec_decode_plain_rounds (k = 0),
  spec_decode_drafter_failures (generations that fell back to plain decode).
Drafter faults (each failed drafter call or rejected reply once; `docs/services.md` §3):
  spec_decode_drafter_faults                {reason = dead | timeout | invalid_reply | full | error,
                                             check = the failed `DRAFT_CHECKS` rule, or none}
  spec_decode_drafter_failovers             new drafter sessions that took over after a fault
GenAI server histograms (semantic conventions, seconds, their ExplicitBucketBoundaries),
recorded for each generation that finishes, with `gen_ai.operation.name` = text_completion
and `gen_ai.provider.name` = dspark:
  gen_ai.server.time_to_first_token, gen_ai.server.time_per_output_token (after the first
  token; only when there are at least two), gen_ai.server.request.duration.
Prometheus names: dots become underscores and the unit is appended (`..._seconds`).
Each `GatewayMetrics` has its own registry, so several gateways in one process do not mix.
"""

from __future__ import annotations

from services.common.metrics import RANDOM_TINY_MODEL, MetricsEndpoint
from services.gateway.backends import DRAFT_CHECKS
from services.gateway.drafters import FAILURE_REASONS
from services.gateway.record import RoundRecord

# OpenTelemetry GenAI semantic conventions, "Generative AI model server metrics".
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
GENAI_ATTRIBUTES = {"gen_ai.operation.name": "text_completion", "gen_ai.provider.name": "dspark"}
# The scheduler's spec modes (services.gateway.scheduler.SPEC_MODES; not imported: it imports us).
SPEC_MODES = ("off", "always", "gated")
# finish_reason of a generation that ended without its final message: the client went away
# (abort) or a backend failed (error).
END_REASONS = ("stop", "length", "abort", "error")
_DECISION_COUNTERS = {"margin_skipped": "margin_skipped", "truncated": "truncated",
                      "skipped_after_draft": "skipped_after_draft"}


class GatewayMetrics(MetricsEndpoint):
    """Instruments of one gateway; `serve(port)` starts the Prometheus HTTP endpoint.

    model: the `model` label of every sample (`services.common.metrics.served_model_name`).
    `generation(spec_mode)` gives the per-generation view the scheduler records into;
    `record_round` / `record_drafter_*` take the generation's spec mode. Thread-safe (the
    SDK's instruments are).
    """

    def __init__(self, service_name: str = "dspark-gateway", model: str = RANDOM_TINY_MODEL):
        super().__init__(service_name)
        self.model = model
        meter = self.meter
        c = meter.create_counter
        self.requests = c("dspark_gateway_requests", description="Generations ended, by finish reason")
        self.prompt_tokens = c("dspark_gateway_prompt_tokens", description="Prompt tokens of finished generations")
        self.generation_tokens = c("dspark_gateway_generation_tokens",
                                   description="Completion tokens of finished generations")
        self.waiting = meter.create_up_down_counter("dspark_gateway_requests_waiting",
                                                    description="Generations admitted, first token not out yet")
        self.running = meter.create_up_down_counter("dspark_gateway_requests_running",
                                                    description="Generations past their first token, streaming")
        self.num_drafts = c("spec_decode_num_drafts", description="Verify rounds (draft blocks of k >= 1 verified)")
        self.num_draft_tokens = c("spec_decode_num_draft_tokens", description="Draft tokens submitted to verify")
        self.num_accepted_tokens = c("spec_decode_num_accepted_tokens", description="Draft tokens accepted")
        self.accepted_per_pos = c("spec_decode_num_accepted_tokens_per_pos",
                                  description="Verify rounds whose draft at `position` (0-based) was accepted")
        self.rounds = c("spec_decode_rounds", description="Speculative rounds (one verify or decode call each)")
        self.drafted_tokens = c("spec_decode_drafted_tokens", description="Draft tokens produced, before the gate")
        self.decisions = {d: c(f"spec_decode_{name}_rounds", description=f"Rounds with gate decision {d}")
                          for d, name in _DECISION_COUNTERS.items()}
        self.plain_rounds = c("spec_decode_plain_rounds", description="Rounds that decoded one token (k = 0)")
        self.drafter_failures = c("spec_decode_drafter_failures",
                                  description="Generations whose drafter failed (continued with plain decode)")
        self.drafter_faults = c("spec_decode_drafter_faults",
                                description="Failed drafter calls and rejected drafter replies, by reason and check")
        self.drafter_failovers = c("spec_decode_drafter_failovers",
                                   description="New drafter sessions that took over after a drafter fault")
        h = meter.create_histogram
        self.ttft = h("gen_ai.server.time_to_first_token", unit="s",
                      description="Time to generate first token for successful responses",
                      explicit_bucket_boundaries_advisory=TTFT_BUCKETS)
        self.tpot = h("gen_ai.server.time_per_output_token", unit="s",
                      description="Time per output token generated after the first token for successful responses",
                      explicit_bucket_boundaries_advisory=TPOT_BUCKETS)
        self.duration = h("gen_ai.server.request.duration", unit="s",
                          description="Generative AI server request duration",
                          explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
        for spec in SPEC_MODES:
            self._zero(spec)

    def _zero(self, spec_mode: str) -> None:
        """Export every counter and gauge series of `spec_mode` (as 0) from the start, not only
        once something happened."""
        labels = self.labels(spec_mode)
        for counter in (self.prompt_tokens, self.generation_tokens, self.waiting, self.running, self.num_drafts,
                        self.num_draft_tokens, self.num_accepted_tokens, self.rounds, self.drafted_tokens,
                        *self.decisions.values(), self.plain_rounds, self.drafter_failures, self.drafter_failovers):
            counter.add(0, labels)
        for reason in END_REASONS:
            self.requests.add(0, {**labels, "finish_reason": reason})
        for reason in FAILURE_REASONS:  # every (reason, check) series exists from the start
            for check in (DRAFT_CHECKS if reason == "invalid_reply" else ("none",)):
                self.drafter_faults.add(0, {**labels, "reason": reason, "check": check})

    def labels(self, spec_mode: str) -> dict[str, str]:
        """The labels every sample of a `spec_mode` generation carries.

        Raises:
            ValueError: `spec_mode` not in SPEC_MODES (named).
        """
        if spec_mode not in SPEC_MODES:
            raise ValueError(f"spec_mode={spec_mode!r}: must be one of {SPEC_MODES}")
        return {"model": self.model, "spec_mode": spec_mode}

    def generation(self, spec_mode: str) -> GenerationMetrics:
        """A new generation of `spec_mode` was admitted: counted as waiting until its first token."""
        return GenerationMetrics(self, spec_mode)

    def record_round(self, r: RoundRecord, spec_mode: str) -> None:
        """Count one round of a `spec_mode` generation from its record (`services.gateway.record`)."""
        labels = self.labels(spec_mode)
        self.rounds.add(1, labels)
        if r.drafted:
            self.drafted_tokens.add(r.drafted, labels)
        if r.submitted > 0:
            self.num_drafts.add(1, labels)
            self.num_draft_tokens.add(r.submitted, labels)
            self.num_accepted_tokens.add(r.accepted, labels)
            for pos in range(r.accepted):
                self.accepted_per_pos.add(1, {**labels, "position": pos})
        else:
            self.plain_rounds.add(1, labels)
        counter = self.decisions.get(r.decision)
        if counter is not None:
            counter.add(1, labels)

    def record_drafter_failure(self, reason: str, check: str | None, spec_mode: str) -> None:
        """One failed drafter call or rejected reply: `reason` in FAILURE_REASONS, `check` the
        failed rule of an invalid reply (None otherwise; exported as "none")."""
        self.drafter_faults.add(1, {**self.labels(spec_mode), "reason": reason, "check": check or "none"})

    def record_drafter_failover(self, spec_mode: str) -> None:
        """A new drafter session of a `spec_mode` generation took over after a fault."""
        self.drafter_failovers.add(1, self.labels(spec_mode))


class GenerationMetrics:
    """One generation's view of `GatewayMetrics`: its labels bound, its waiting / running state.

    Life cycle: made when the generation is admitted (waiting), `first_token()` when its first
    token goes out (running), `finished(...)` with its final counts, `close(reason)` always
    last (idempotent); a generation closed without `finished` counts as `reason` (abort or
    error). Not thread-safe: one generation runs on one event loop.
    """

    def __init__(self, metrics: GatewayMetrics, spec_mode: str):
        self.m, self.spec_mode = metrics, spec_mode
        self.labels = metrics.labels(spec_mode)
        self._state = "waiting"
        self.m.waiting.add(1, self.labels)

    def first_token(self) -> None:
        """The first token is out: waiting -> running (later calls do nothing)."""
        if self._state == "waiting":
            self.m.waiting.add(-1, self.labels)
            self.m.running.add(1, self.labels)
            self._state = "running"

    def record_round(self, r: RoundRecord) -> None:
        self.m.record_round(r, self.spec_mode)

    def record_drafter_failure(self, reason: str, check: str | None = None) -> None:
        self.m.record_drafter_failure(reason, check, self.spec_mode)

    def record_drafter_failover(self) -> None:
        self.m.record_drafter_failover(self.spec_mode)

    def finished(self, finish_reason: str, prompt_tokens: int, completion_tokens: int, ttft_s: float,
                 duration_s: float, drafter_failed: bool) -> None:
        """The final message: the request and token counters and the GenAI histograms (s)."""
        m, labels = self.m, self.labels
        m.requests.add(1, {**labels, "finish_reason": finish_reason})
        m.prompt_tokens.add(prompt_tokens, labels)
        m.generation_tokens.add(completion_tokens, labels)
        genai = {**GENAI_ATTRIBUTES, **labels}
        m.ttft.record(ttft_s, genai)
        m.duration.record(duration_s, genai)
        if completion_tokens > 1:
            m.tpot.record(max(0.0, duration_s - ttft_s) / (completion_tokens - 1), genai)
        if drafter_failed:
            m.drafter_failures.add(1, labels)
        self.close("done")

    def close(self, reason: str = "abort") -> None:
        """The generation ended: leave the waiting / running gauge; without `finished`, count
        it as `reason` ("abort": the client went away, "error": a backend failed)."""
        if self._state == "closed":
            return
        (self.m.waiting if self._state == "waiting" else self.m.running).add(-1, self.labels)
        if reason != "done":
            self.m.requests.add(1, {**self.labels, "finish_reason": reason})
        self._state = "closed"


class NoGenerationMetrics:
    """The `GenerationMetrics` interface recording nothing (a gateway without metrics)."""

    def first_token(self) -> None: ...
    def record_round(self, r: RoundRecord) -> None: ...
    def record_drafter_failure(self, reason: str, check: str | None = None) -> None: ...
    def record_drafter_failover(self) -> None: ...
    def finished(self, *args, **kwargs) -> None: ...
    def close(self, reason: str = "abort") -> None: ...
