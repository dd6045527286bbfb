"""OpenTelemetry setup: tracer providers, exporters, gRPC interceptors, trace context in messages.

Owns how spans are produced and exported and how a span's context crosses the wire; it sets no
attribute of the spans the servicers and the scheduler open, and reads no environment (the
settings arrive parsed as `TelemetrySettings`).

A session is one long gRPC stream, so the interceptors alone give one span per generation on
each backend (docs/architecture.md §7). Every stream message therefore carries the W3C trace
context of the gateway span that sent it (`dspark.v1.TraceContext`), and the backend opens a child span
per message from it (`message_span`).

Exporters (`tracer_provider`, from a `TelemetrySettings` that `services.settings` parses out
of `OTEL_TRACES_EXPORTER`, `OTEL_SERVICE_NAME` and `DSPARK_TRACES_JSONL`): `otlp`, `console`,
none, and independently a JSON-lines file of every span for offline analysis. Tests pass their
own provider with an in-memory exporter.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from typing import Iterator, Mapping, Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor, filters
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (BatchSpanProcessor, ConsoleSpanExporter, SpanExporter,
                                            SpanExportResult, SimpleSpanProcessor)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from dspark_proto.v1 import common_pb2
from services.common.settings import TelemetrySettings

TRACER_NAME = "dspark"
_PROPAGATOR = TraceContextTextMapPropagator()


class JsonLinesSpanExporter(SpanExporter):
    """Appends each finished span as one JSON object per line to `path` (thread-safe)."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._file = open(path, "a", encoding="utf-8")

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(json.loads(s.to_json()), separators=(",", ":")) + "\n" for s in spans)
        with self._lock:
            self._file.write(lines)
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()


class ForeignContextDetachFilter(logging.Filter):
    """Drops the "Failed to detach context" error that OpenTelemetry's context module logs, with
    its traceback, when a span's context token is reset from another contextvars Context, and
    only then. The gRPC instrumentation's streaming interceptors keep a span current across a
    generator's yields; a cancelled stream closes that generator from another task, whose
    Context did not make the token (open-telemetry/opentelemetry-python-contrib issue 2357).
    The span still ends and the task is ending, so the line is noise: one traceback per cancelled
    stream in a traced gateway's log. Any other record of that logger passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        foreign = isinstance(exc, ValueError) and "was created in a different Context" in str(exc)
        return not (foreign and record.getMessage() == "Failed to detach context")


_DETACH_FILTER = ForeignContextDetachFilter()


def tracer_provider(service_name: str, settings: TelemetrySettings) -> TracerProvider:
    """A provider for `service_name` (unless `settings.service_name` overrides it) with the
    exporters `settings` asks for. Call `shutdown()` on it to flush and close them.

    Raises:
        ValueError: `settings.jsonl_path` cannot be opened for appending (DSPARK_TRACES_JSONL,
            the variable that sets it, and the path are named).
    """
    logging.getLogger("opentelemetry.context").addFilter(_DETACH_FILTER)  # once: a filter is a set member
    resource = Resource.create({"service.name": settings.service_name or service_name})
    provider = TracerProvider(resource=resource)
    for name in settings.exporters:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    if settings.jsonl_path:
        try:
            exporter = JsonLinesSpanExporter(settings.jsonl_path)
        except OSError as exc:
            raise ValueError(f"DSPARK_TRACES_JSONL={settings.jsonl_path!r}: cannot open: "
                             f"{exc.strerror or exc}") from None
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def server_interceptors(provider: TracerProvider | None) -> list:
    """OTel server interceptor (health checks filtered out), or none without a provider."""
    if provider is None:
        return []
    return [aio_server_interceptor(tracer_provider=provider, filter_=filters.negate(filters.health_check()))]


def client_interceptors(provider: TracerProvider | None) -> list:
    """OTel client interceptors for a channel, or none without a provider."""
    if provider is None:
        return []
    return list(aio_client_interceptors(tracer_provider=provider, filter_=filters.negate(filters.health_check())))


def trace_context(span: trace.Span | None = None) -> common_pb2.TraceContext:
    """The W3C context of `span` (default: the current span) as a message field."""
    carrier: dict[str, str] = {}
    ctx = trace.set_span_in_context(span) if span is not None else None
    _PROPAGATOR.inject(carrier, context=ctx)
    return common_pb2.TraceContext(traceparent=carrier.get("traceparent", ""),
                                   tracestate=carrier.get("tracestate", ""))


@contextlib.contextmanager
def message_span(provider: TracerProvider | None, name: str, tc: common_pb2.TraceContext,
                 attributes: Mapping[str, object] | None = None) -> Iterator[trace.Span]:
    """A span `name` whose parent is the message's trace context (a no-op span without a provider)."""
    tracer = (provider or trace.NoOpTracerProvider()).get_tracer(TRACER_NAME)
    parent = _PROPAGATOR.extract({"traceparent": tc.traceparent, "tracestate": tc.tracestate}) \
        if tc.traceparent else otel_context.Context()
    with tracer.start_as_current_span(name, context=parent, attributes=dict(attributes or {})) as span:
        yield span
