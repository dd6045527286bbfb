"""The gateway's OpenTelemetry metrics, served on a Prometheus endpoint (`--metrics-port`, `DSPARK_METRICS_PORT`).

This module owns the instruments, their names and the endpoint. Every speculation counter is
read from one `RoundRecord` (`record_round`) and every histogram from values the scheduler
hands over; it must not keep counts of its own, decide anything, or read the environment (the
port comes from the entry point).

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
  spec_decode_drafter_faults                {reason = dead | timeout | invalid_reply | error,
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

import logging

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, start_http_server

from services.gateway.backends import DRAFT_CHECKS
from services.gateway.drafters import FAILURE_REASONS
from services.gateway.record import RoundRecord

log = logging.getLogger("dspark.gateway")
# OpenTelemetry GenAI semantic conventions, "Generative AI model server metrics".
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
GENAI_ATTRIBUTES = {"gen_ai.operation.name": "text_completion", "gen_ai.provider.name": "dspark"}
_DECISION_COUNTERS = {"margin_skipped": "margin_skipped", "truncated": "truncated",
                      "skipped_after_draft": "skipped_after_draft"}


class GatewayMetrics:
    """Instruments of one gateway; `serve(port)` starts the Prometheus HTTP endpoint.

    `record_round` is called with each round's record, `record_generation` once per finished
    generation (both from `Scheduler`); thread-safe (the SDK's instruments are).
    """

    def __init__(self, service_name: str = "dspark-gateway"):
        self.registry = CollectorRegistry()
        self.reader = PrometheusMetricReader(registry=self.registry)
        self.provider = MeterProvider(resource=Resource.create({"service.name": service_name}),
                                      metric_readers=[self.reader])
        meter = self.provider.get_meter("dspark")
        c = meter.create_counter
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
        for counter in (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, self.rounds,
                        self.drafted_tokens, *self.decisions.values(), self.plain_rounds, self.drafter_failures,
                        self.drafter_failovers):
            counter.add(0)  # exported (as 0) from the start, not only once something happened
        for reason in FAILURE_REASONS:  # every (reason, check) series exists from the start
            for check in (DRAFT_CHECKS if reason == "invalid_reply" else ("none",)):
                self.drafter_faults.add(0, {"reason": reason, "check": check})
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
        self._server = None
        self._thread = None
        self.port: int | None = None

    def record_round(self, r: RoundRecord) -> None:
        """Count one round from its record (`services.gateway.record`)."""
        self.rounds.add(1)
        if r.drafted:
            self.drafted_tokens.add(r.drafted)
        if r.submitted > 0:
            self.num_drafts.add(1)
            self.num_draft_tokens.add(r.submitted)
            self.num_accepted_tokens.add(r.accepted)
            for pos in range(r.accepted):
                self.accepted_per_pos.add(1, {"position": pos})
        else:
            self.plain_rounds.add(1)
        counter = self.decisions.get(r.decision)
        if counter is not None:
            counter.add(1)

    def record_generation(self, ttft_s: float, duration_s: float, completion_tokens: int,
                          drafter_failed: bool) -> None:
        self.ttft.record(ttft_s, GENAI_ATTRIBUTES)
        self.duration.record(duration_s, GENAI_ATTRIBUTES)
        if completion_tokens > 1:
            self.tpot.record(max(0.0, duration_s - ttft_s) / (completion_tokens - 1), GENAI_ATTRIBUTES)
        if drafter_failed:
            self.drafter_failures.add(1)

    def record_drafter_failure(self, reason: str, check: str | None = None) -> None:
        """One failed drafter call or rejected reply: `reason` in FAILURE_REASONS, `check` the
        failed rule of an invalid reply (None otherwise; exported as "none")."""
        self.drafter_faults.add(1, {"reason": reason, "check": check or "none"})

    def record_drafter_failover(self) -> None:
        """A new drafter session took over after a fault."""
        self.drafter_failovers.add(1)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve `/metrics` on host:port in a daemon thread; returns the bound port (port 0: a free one).

        Raises:
            RuntimeError: the port could not be bound (host, port and the reason named).
        """
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise RuntimeError(f"could not bind the metrics port {host}:{port}: {exc.strerror or exc}") from None
        self.port = self._server.server_port
        log.info("metrics on http://%s:%d/metrics", host, self.port)
        return self.port

    def close(self) -> None:
        """Stop the endpoint and the meter provider."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.provider.shutdown()
