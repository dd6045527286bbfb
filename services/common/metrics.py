"""Prometheus endpoints of the three services, and the verifier's and drafter's instruments.

This module owns the plumbing every service's metrics share (`MetricsEndpoint`: one
OpenTelemetry meter provider per service, read by a Prometheus reader into its own registry,
served over HTTP on `--metrics-port` / `DSPARK_METRICS_PORT`) and the instruments of the two
backends (`VerifierMetrics`, `DrafterMetrics`). The gateway's instruments live in
`services.gateway.metrics` on the same endpoint. It reads no environment and decides nothing:
the servicers hand over what they measured.

The instruments are OpenTelemetry's so spans and metrics share one API and the GenAI semantic
conventions' histogram buckets travel as advisories; the Prometheus reader runs with
`scope_info_enabled=False`, so no sample carries `otel_scope_name` / `otel_scope_version`
labels (one meter per service: the scope says nothing a `job` label does not).

Verifier (Prometheus names; counters end in `_total`, seconds histograms in `_seconds`):
  dspark_verifier_open_sessions             gauge: sessions open now (one per generation)
  dspark_verifier_max_sessions              gauge: DSPARK_MAX_SESSIONS
  dspark_verifier_state_bytes               gauge: target state held by the open sessions (bytes;
                                            per TP rank under tensor parallelism)
  dspark_verifier_forward_rows              histogram {op}: positions one forward computed (the
                                            batch rows of that step: prompt length, 1, or k + 1)
  dspark_verifier_forward_duration_seconds  histogram {op}: wall time of the model forward(s)
  dspark_verifier_queue_wait_seconds        histogram {op}: from the request's arrival to the end
                                            of its reply minus the forward (the wait for a worker
                                            thread and the session's lock)
  op = prefill | decode | verify.
  dspark_verifier_step_sessions             histogram {kind}: sessions in one step of the step loop
  dspark_verifier_step_rows                 histogram {kind}: rows (tokens) one step forwarded, all
                                            sessions together
  dspark_verifier_step_duration_seconds     histogram {kind}: wall time of one step's forward
  kind = batch (every pending decode / verify) | prefill (one prompt); none without a step loop.
Drafter:
  dspark_drafter_open_sessions, dspark_drafter_max_sessions   gauges, as the verifier's
  dspark_drafter_drafts_total               counter: draft calls answered
  dspark_drafter_draft_tokens_total         counter: tokens proposed by those calls
  dspark_drafter_draft_duration_seconds     histogram: wall time of one draft call
  dspark_drafter_commit_duration_seconds    histogram: wall time of one commit (rows into the rings)
  dspark_drafter_step_sessions              histogram: sessions in one step of the drafter's step loop
  dspark_drafter_step_duration_seconds      histogram: wall time of one step (its commits and drafts);
                                            none without a step loop (oracle drafters)
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Iterable

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger("dspark.metrics")

# Seconds; one CPU decode of the tiny model is ~1 ms, a Flash verify block on GPUs ~100 ms.
FORWARD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
QUEUE_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
# Rows of one forward: 1 (decode), k + 1 <= 17 (verify), a prompt up to max_seq_len.
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536)
VERIFIER_OPS = ("prefill", "decode", "verify")
STEP_KINDS = ("batch", "prefill")
SESSION_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
RANDOM_TINY_MODEL = "dspark-random-tiny"


def served_model_name(checkpoint: str | None) -> str:
    """The `model` label: the checkpoint folder's name, or RANDOM_TINY_MODEL without one."""
    if not checkpoint:
        return RANDOM_TINY_MODEL
    name = checkpoint.rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1]
    if name in ("", ".", ".."):  # "--checkpoint ." names the folder it resolves to
        name = Path(checkpoint).resolve().name
    return name or RANDOM_TINY_MODEL


class MetricsEndpoint:
    """One service's meter (`self.meter`), its own Prometheus registry and its HTTP endpoint.

    Several endpoints in one process (tests) never mix: each has its own registry.
    Args:
        service_name: `service.name` of the resource (exported once, on `target_info`).
    """

    def __init__(self, service_name: str):
        self.registry = CollectorRegistry()
        self.reader = PrometheusMetricReader(scope_info_enabled=False, registry=self.registry)
        self.provider = MeterProvider(resource=Resource.create({"service.name": service_name}),
                                      metric_readers=[self.reader])
        self.meter = self.provider.get_meter("dspark")
        self._server = None
        self._thread = None
        self.port: int | None = None

    def gauge(self, name: str, description: str, read: Callable[[], float], unit: str = "") -> None:
        """An observable gauge whose value `read()` gives at each scrape (no labels)."""
        def callback(_: CallbackOptions) -> Iterable[Observation]:
            return [Observation(read())]
        self.meter.create_observable_gauge(name, callbacks=[callback], unit=unit, description=description)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve `/metrics` on host:port in a daemon thread; returns the bound port (0: a free one).

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


class VerifierMetrics(MetricsEndpoint):
    """The verifier's instruments (module docstring); `record_forward` once per answered
    prefill / decode / verify. `engine`: anything with `num_sessions`, `max_sessions` and
    `state_bytes()` (a `VerifierEngine`), read at each scrape."""

    def __init__(self, engine, service_name: str = "dspark-verifier"):
        super().__init__(service_name)
        self.gauge("dspark_verifier_open_sessions", "Verifier sessions open now", lambda: engine.num_sessions)
        self.gauge("dspark_verifier_max_sessions", "Verifier sessions allowed open at once",
                   lambda: engine.max_sessions)
        self.gauge("dspark_verifier_state_bytes", "Target state held by the open sessions", engine.state_bytes,
                   unit="By")
        h = self.meter.create_histogram
        self.rows = h("dspark_verifier_forward_rows", description="Positions computed by one forward (batch rows)",
                      explicit_bucket_boundaries_advisory=ROW_BUCKETS)
        self.forward = h("dspark_verifier_forward_duration", unit="s", description="Model forward wall time",
                         explicit_bucket_boundaries_advisory=FORWARD_BUCKETS)
        self.queue = h("dspark_verifier_queue_wait", unit="s",
                       description="Time a request waited besides its forward (worker thread, session lock)",
                       explicit_bucket_boundaries_advisory=QUEUE_BUCKETS)
        self.step_sessions = h("dspark_verifier_step_sessions", description="Sessions in one step of the step loop",
                               explicit_bucket_boundaries_advisory=SESSION_BUCKETS)
        self.step_rows = h("dspark_verifier_step_rows", description="Rows one step forwarded, all sessions together",
                           explicit_bucket_boundaries_advisory=ROW_BUCKETS)
        self.step_time = h("dspark_verifier_step_duration", unit="s", description="Wall time of one step's forward",
                           explicit_bucket_boundaries_advisory=FORWARD_BUCKETS)

    def record_forward(self, op: str, rows: int, forward_ms: float, queue_ms: float) -> None:
        """One answered request: `op` in VERIFIER_OPS, `rows` positions forwarded, times in ms.

        Raises:
            ValueError: an op not in VERIFIER_OPS (named).
        """
        if op not in VERIFIER_OPS:
            raise ValueError(f"op={op!r}: must be one of {VERIFIER_OPS}")
        labels = {"op": op}
        self.rows.record(rows, labels)
        self.forward.record(forward_ms / 1e3, labels)
        self.queue.record(queue_ms / 1e3, labels)

    def record_step(self, step) -> None:
        """One step of the step loop: a `services.verifier.batcher.StepRecord` (kind in
        STEP_KINDS, sessions, rows in tokens, ms). An unknown kind is logged, never raised:
        this runs on the loop's thread."""
        if step.kind not in STEP_KINDS:
            log.error("verifier step of unknown kind %r not recorded", step.kind)
            return
        labels = {"kind": step.kind}
        self.step_sessions.record(step.sessions, labels)
        self.step_rows.record(step.rows, labels)
        self.step_time.record(step.ms / 1e3, labels)


class DrafterMetrics(MetricsEndpoint):
    """The drafter's instruments (module docstring). `engine`: anything with `num_sessions`
    and `max_sessions` (every `Drafter`), read at each scrape."""

    def __init__(self, engine, service_name: str = "dspark-drafter"):
        super().__init__(service_name)
        self.gauge("dspark_drafter_open_sessions", "Drafter sessions open now", lambda: engine.num_sessions)
        self.gauge("dspark_drafter_max_sessions", "Drafter sessions allowed open at once",
                   lambda: engine.max_sessions)
        self.drafts = self.meter.create_counter("dspark_drafter_drafts", description="Draft calls answered")
        self.draft_tokens = self.meter.create_counter("dspark_drafter_draft_tokens",
                                                      description="Tokens proposed by the draft calls")
        for counter in (self.drafts, self.draft_tokens):
            counter.add(0)
        h = self.meter.create_histogram
        self.draft_time = h("dspark_drafter_draft_duration", unit="s", description="Wall time of one draft call",
                            explicit_bucket_boundaries_advisory=FORWARD_BUCKETS)
        self.commit_time = h("dspark_drafter_commit_duration", unit="s", description="Wall time of one commit",
                             explicit_bucket_boundaries_advisory=FORWARD_BUCKETS)
        self.step_sessions = h("dspark_drafter_step_sessions", description="Sessions in one step of the step loop",
                               explicit_bucket_boundaries_advisory=SESSION_BUCKETS)
        self.step_time = h("dspark_drafter_step_duration", unit="s", description="Wall time of one step",
                           explicit_bucket_boundaries_advisory=FORWARD_BUCKETS)

    def record_draft(self, tokens: int, ms: float) -> None:
        """One answered draft call that proposed `tokens` tokens in `ms` milliseconds."""
        self.drafts.add(1)
        self.draft_tokens.add(tokens)
        self.draft_time.record(ms / 1e3)

    def record_commit(self, ms: float) -> None:
        """One answered commit that took `ms` milliseconds."""
        self.commit_time.record(ms / 1e3)

    def record_step(self, step) -> None:
        """One step of the drafter's step loop: a `services.drafter.steps.DraftStepRecord`
        (sessions, ms); runs on the loop's thread."""
        self.step_sessions.record(step.sessions)
        self.step_time.record(step.ms / 1e3)
