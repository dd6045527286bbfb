"""Telemetry of the services (docs/architecture.md §7): spans in memory, the JSON-lines exporter,
and the gate's measured costs in `Gateway.Stats`.

The three services run in process on port 0 with real channels, each with its own
TracerProvider (service.name = verifier | drafter | gateway) feeding one in-memory exporter.
The drafter is the live oracle drafter with a corrupted slot every 4 positions, so gated runs
see full, truncated and rejected blocks.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from collections import defaultdict

import grpc
import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dspark_proto.v1 import gateway_pb2, gateway_pb2_grpc
from services.app import drafter_engine, start_drafter, start_gateway, start_verifier, verifier_engine
from services.common.settings import BackendSettings, GatewaySettings
from services.common.telemetry import tracer_provider
from services.gateway.gate import GateConfig
from services.settings import telemetry_settings
from services_fixtures import collect, service_loop, spec_counts, tiny_trunk

PROMPT = "def fibonacci(n):"
SPAN_WAIT_S = 10.0  # backend Session spans end just after the client sees the final message
SERVICES = ("verifier", "drafter", "gateway")
GENERATE = "/dspark.v1.Gateway/Generate"
SESSIONS = {"verifier": "/dspark.v1.Verifier/Session", "drafter": "/dspark.v1.Drafter/Session"}


def request(max_tokens: int, spec: str, prompt: str = PROMPT) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True,
                                       spec=getattr(gateway_pb2, f"SPEC_MODE_{spec.upper()}"))


# A verify that costs 200 ms per draft makes every draft the oracle corrupts (confidence -2.0)
# worth cutting once the gate has seen a few: the gated runs below then make choices to record.
GATE = GateConfig(verify_slope_ms=200.0)


class Stack:
    """Verifier, oracle drafter and one gateway per verify mode, with the given providers."""

    def __init__(self, providers: dict[str, TracerProvider | None], cost_mode: str = "configured",
                 verifier_sessions: int | None = None):
        self.providers, self.cost_mode, self.verifier_sessions = providers, cost_mode, verifier_sessions
        self.gateways: dict[str, tuple] = {}

    async def start(self, verify_modes=("sequential",)) -> "Stack":
        trunk = tiny_trunk()
        self.verifier = await start_verifier(verifier_engine(trunk, BackendSettings(max_sessions=self.verifier_sessions)),
                                             provider=self.providers["verifier"])
        self.drafter = await start_drafter(drafter_engine(trunk, oracle=True, settings=BackendSettings(),
                                                          corrupt_every=4), provider=self.providers["drafter"])
        for mode in verify_modes:
            settings = GatewaySettings(verifier_target=f"127.0.0.1:{self.verifier.port}",
                                       drafter_target=f"127.0.0.1:{self.drafter.port}", verify_mode=mode,
                                       cost_mode=self.cost_mode)
            server, scheduler, backends = await start_gateway(settings, GATE,
                                                              provider=self.providers["gateway"])
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
            self.gateways[mode] = (server, scheduler, backends, channel, gateway_pb2_grpc.GatewayStub(channel))
        return self

    def stub(self, mode: str = "sequential") -> gateway_pb2_grpc.GatewayStub:
        return self.gateways[mode][4]

    def scheduler(self, mode: str = "sequential"):
        return self.gateways[mode][1]

    async def stop(self) -> None:
        for server, _, backends, channel, _ in self.gateways.values():
            await channel.close()
            await server.stop(0)
            await backends.close()
        await self.drafter.stop(0)
        await self.verifier.stop(0)


def _providers(exporter: InMemorySpanExporter) -> dict[str, TracerProvider]:
    out = {}
    for name in SERVICES:
        out[name] = TracerProvider(resource=Resource.create({"service.name": name}))
        out[name].add_span_processor(SimpleSpanProcessor(exporter))
    return out


def _service(span) -> str:
    return span.resource.attributes["service.name"]


def _traces(exporter: InMemorySpanExporter) -> dict[int, list]:
    """Spans of the Generate calls, by trace id (startup Info calls are traces of their own)."""
    by_trace = defaultdict(list)
    for s in exporter.get_finished_spans():
        by_trace[s.context.trace_id].append(s)
    return {t: spans for t, spans in by_trace.items() if any(s.name == GENERATE for s in spans)}


def _complete(spans) -> bool:
    """The backend streams ended on both sides (client span on the gateway, server span on the
    backend); the drafter's only when the generation speculated."""
    seen = {(_service(s), s.name) for s in spans}
    backends = ("verifier", "drafter") if any(s.name == "drafter.commit" for s in spans) else ("verifier",)
    return all((side, SESSIONS[b]) in seen for b in backends for side in ("gateway", b))


def _speculated(gen) -> bool:
    return gen.stats.rounds != gen.stats.plain_rounds or gen.stats.drafter_failed


async def _await_traces(exporter: InMemorySpanExporter, n: int) -> dict[int, list]:
    deadline = time.monotonic() + SPAN_WAIT_S
    while True:
        traces = _traces(exporter)
        if (len(traces) >= n and all(_complete(s) for s in traces.values())) or time.monotonic() > deadline:
            return traces
        await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
def traced():
    """Two gated generations (sequential verify), one always (batched verify) and one with
    speculation off (no drafter session at all), with every span they made."""
    exporter = InMemorySpanExporter()
    stack = Stack(_providers(exporter))

    async def scenario():
        await stack.start(("sequential", "batched"))
        try:
            exporter.clear()  # drop the startup Info spans
            gens = [await collect(stack.stub(), request(48, "gated")),
                    await collect(stack.stub(), request(16, "gated", "1 2 3 4 5 6 7")),
                    await collect(stack.stub("batched"), request(20, "always")),
                    await collect(stack.stub(), request(6, "off"))]
            return gens, await _await_traces(exporter, len(gens))
        finally:
            await stack.stop()

    return service_loop().run(scenario())


def _trace_of(traces: dict[int, list], gen_index: int) -> list:
    """The trace of the gen_index-th generation (traces in start order)."""
    ordered = sorted(traces.values(), key=lambda spans: min(s.start_time for s in spans))
    return ordered[gen_index]


def _children(spans, parent) -> list:
    return [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]


# ---------------------------------------------------------------------------- traces
def test_each_generation_is_one_trace_across_the_three_services(traced):
    gens, traces = traced
    assert len(traces) == len(gens)  # distinct trace ids, one per generation
    for i, gen in enumerate(gens):
        spans = _trace_of(traces, i)
        ids = {s.context.span_id for s in spans}
        roots = [s for s in spans if s.parent is None or s.parent.span_id not in ids]
        assert [r.name for r in roots] == [GENERATE]  # every other span's parent is in the trace
        backends = ("verifier", "drafter") if _speculated(gen) else ("verifier",)  # off: no drafter session
        assert {_service(s) for s in spans} == {"gateway", *backends}
        for backend in backends:  # one stream per backend per generation, seen from both sides
            assert sorted(_service(s) for s in spans if s.name == SESSIONS[backend]) == sorted(["gateway", backend])
        names = {s.name for s in spans}
        assert {"gateway.generate", "gateway.prefill", "spec_decode.round", "verifier.prefill"} <= names
        assert {"drafter.commit", "drafter.draft"} <= names or not _speculated(gen)


def test_round_spans_have_one_drafter_and_one_verifier_child_matching_the_final_stats(traced):
    gens, traces = traced
    for i, gen in enumerate(gens):
        spans = _trace_of(traces, i)
        stats = gen.stats
        rounds = sorted((s for s in spans if s.name == "spec_decode.round"),
                        key=lambda s: s.attributes["spec_decode.round"])
        assert [r.attributes["spec_decode.round"] for r in rounds] == list(range(1, stats.rounds + 1))
        for r in rounds:
            a = r.attributes
            kids = _children(spans, r)
            verifier_kids = [k for k in kids if _service(k) == "verifier"]
            drafts = [k for k in kids if k.name == "drafter.draft"]
            assert len(verifier_kids) == 1
            assert verifier_kids[0].name == ("verifier.verify" if a["spec_decode.submitted"] else "verifier.decode")
            assert [k.name for k in kids if k.name == "drafter.commit"] == ["drafter.commit"] * _speculated(gen)
            assert len(drafts) == (1 if a["spec_decode.drafted"] else 0)
            if drafts:
                assert drafts[0].attributes["spec_decode.drafted"] == a["spec_decode.drafted"]
            if a["spec_decode.submitted"]:
                v = verifier_kids[0].attributes
                assert (v["spec_decode.submitted"], v["spec_decode.accepted"]) == \
                    (a["spec_decode.submitted"], a["spec_decode.accepted"])
            assert "spec_decode.anchor_margin" in a and a["spec_decode.verify_ms"] > 0
            assert ("spec_decode.draft_ms" in a) == bool(a["spec_decode.drafted"])

        def total(key):
            return sum(r.attributes[f"spec_decode.{key}"] for r in rounds)

        def decisions(name):
            return sum(r.attributes["spec_decode.gate_decision"] == name for r in rounds)

        assert (total("drafted"), total("submitted"), total("accepted")) == \
            (stats.drafted, stats.submitted, stats.accepted)
        assert sum(r.attributes["spec_decode.submitted"] == 0 for r in rounds) == stats.plain_rounds
        assert decisions("truncated") == stats.truncated_rounds
        assert decisions("skipped_after_draft") == stats.skipped_after_draft
        assert decisions("margin_skipped") == stats.margin_skipped_rounds
        assert stats.accepted > 0 or not _speculated(gen)


def test_gated_rounds_record_gate_decisions(traced):
    gens, traces = traced
    decisions = {r.attributes["spec_decode.gate_decision"] for i in (0, 1)
                 for r in _trace_of(traces, i) if r.name == "spec_decode.round"}
    off = {r.attributes["spec_decode.gate_decision"] for r in _trace_of(traces, 3) if r.name == "spec_decode.round"}
    assert "full" in decisions and off == {"plain"}
    assert decisions <= {"full", "truncated", "skipped_after_draft", "capped", "margin_skipped", "plain"}
    reasons = {(r.attributes["spec_decode.gate_decision"], r.attributes["spec_decode.gate_reason"]) for i in (0, 1, 3)
               for r in _trace_of(traces, i) if r.name == "spec_decode.round"}
    assert ("full", "full") in reasons and ("plain", "no_drafter") in reasons  # spec off: no drafter session
    assert {reason for d, reason in reasons if d == "margin_skipped"} <= {"anchor_margin", "recent_loss"}
    assert sum(gens[i].stats.truncated_rounds + gens[i].stats.skipped_after_draft for i in (0, 1)) > 0


def test_generation_span_has_gen_ai_usage_and_finish_reason(traced):
    gens, traces = traced
    for i, gen in enumerate(gens):
        [span] = [s for s in _trace_of(traces, i) if s.name == "gateway.generate"]
        a = span.attributes
        assert a["gen_ai.usage.input_tokens"] == gen.final.usage.prompt_tokens
        assert a["gen_ai.usage.output_tokens"] == gen.final.usage.completion_tokens == len(gen.token_ids)
        assert tuple(a["gen_ai.response.finish_reasons"]) == (gen.finish_reason,) == ("length",)
        assert a["gen_ai.server.time_to_first_token"] == pytest.approx(gen.final.time_to_first_token_ms / 1e3)
        assert a["gen_ai.request.max_tokens"] == gen.final.usage.completion_tokens
        assert (a["spec_decode.rounds"], a["spec_decode.accepted"]) == (gen.stats.rounds, gen.stats.accepted)


def test_backend_message_spans_carry_compute_timings(traced):
    _, traces = traced
    spans = [s for t in traces.values() for s in t]
    verifier = [s for s in spans if s.name.startswith("verifier.")]
    drafter = [s for s in spans if s.name.startswith("drafter.")]
    assert {s.name for s in verifier} == {"verifier.prefill", "verifier.verify", "verifier.decode"}
    assert {s.name for s in drafter} == {"drafter.commit", "drafter.draft"}
    for s in verifier:
        assert s.attributes["verifier.forward_ms"] > 0 and s.attributes["verifier.queue_ms"] >= 0
    for s in drafter:
        assert s.attributes["drafter.forward_ms"] > 0
    verifies = [s.attributes for s in verifier if s.name == "verifier.verify"]
    sequential = [a for a in verifies if a["verifier.mode"] == "sequential"]
    batched = [a for a in verifies if a["verifier.mode"] == "batched"]
    assert sequential and all(a["verifier.rollback_bytes"] == 0 for a in sequential)
    # a batched verify that rejected drafts restored the state of the rejected positions
    rejected = [a for a in batched if a["spec_decode.accepted"] < a["spec_decode.submitted"]]
    assert rejected and all(a["verifier.rollback_bytes"] > 0 for a in rejected)


# ---------------------------------------------------------------------------- exporters
def test_jsonl_exporter_writes_one_parseable_span_per_line(tmp_path):
    path = tmp_path / "spans.jsonl"
    provider = tracer_provider("dspark-test", telemetry_settings({"DSPARK_TRACES_JSONL": str(path)}))
    stack = Stack({name: provider for name in SERVICES})

    async def scenario():
        await stack.start()
        try:
            return await collect(stack.stub(), request(12, "always"))
        finally:
            await stack.stop()

    gen = service_loop().run(scenario())
    provider.shutdown()  # flushes and closes the file
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    names = {r["name"] for r in records}
    assert {GENERATE, "gateway.generate", "spec_decode.round", "verifier.prefill", "verifier.verify",
            "drafter.commit", "drafter.draft", *SESSIONS.values()} <= names
    [generate] = [r for r in records if r["name"] == "gateway.generate"]
    assert generate["attributes"]["gen_ai.usage.output_tokens"] == len(gen.token_ids)
    trace_id = generate["context"]["trace_id"]
    assert {r["context"]["trace_id"] for r in records if not r["name"].endswith("/Info")} == {trace_id}
    assert all(r["resource"]["attributes"]["service.name"] == "dspark-test" for r in records)


def test_refused_traced_sessions_leave_no_pending_grpc_task(caplog):
    """Traced gateway, verifier full: the refused Session streams end cleanly. grpcio consumes
    a stream's requests in a task; under the OTel client interceptor a write-style call left
    that task waiting for good when the backend refused the stream, and asyncio logged "Task
    was destroyed but it is pending" (and failed closes of its request generator) at GC."""
    stack = Stack(_providers(InMemorySpanExporter()), verifier_sessions=1)

    async def scenario():
        await stack.start()
        try:
            calls = [collect(stack.stub(), request(12, "gated")) for _ in range(4)]
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
        finally:
            await stack.stop()
        gc.collect()
        await asyncio.sleep(0.05)  # let the loop run what GC scheduled (async generator closes)
        return outcomes

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        outcomes = service_loop().run(scenario())
        gc.collect()
    refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    assert refused and all(o.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for o in refused), outcomes
    assert len(refused) < len(outcomes), outcomes  # one generation held the session and finished
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


def test_unknown_traces_exporter_is_rejected_naming_the_value():
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER='zipkin'"):
        telemetry_settings({"OTEL_TRACES_EXPORTER": "zipkin"})


# ---------------------------------------------------------------------------- gate costs
def test_stats_report_measured_gate_costs_beside_the_configured_ones():
    stack = Stack({name: None for name in SERVICES}, cost_mode="measured")

    async def scenario():
        await stack.start()
        try:
            for spec, n in (("off", 8), ("gated", 24), ("always", 15)):
                await collect(stack.stub(), request(n, spec))
            stats = json.loads((await stack.stub().Stats(gateway_pb2.StatsRequest(), timeout=5)).json)
            return stats, stack.scheduler().costs.model("measured")
        finally:
            await stack.stop()

    stats, model = service_loop().run(scenario())
    cfg = GATE
    assert stats["cost_mode"] == "measured"
    assert stats["costs"]["configured"] == {"draft_ms": cfg.draft_ms, "verify_base_ms": cfg.verify_base_ms,
                                            "verify_slope_ms": cfg.verify_slope_ms, "plain_ms": cfg.plain_ms}
    fit = stats["costs"]["measured"]
    assert fit is not None and fit["samples"] >= 5
    assert fit["draft_ms"] > 0 and fit["plain_ms"] > 0
    # the next measured-mode generation gates with the fit, not the configured values
    assert model.draft_ms == pytest.approx(fit["draft_ms"]) and model.plain_ms == pytest.approx(fit["plain_ms"])
    assert model.verify_slope_ms == pytest.approx(max(fit["verify_slope_ms"], 0.0))
    assert stats["generations"] == 3
    assert stats["speculation"]["rounds"] >= stats["speculation"]["plain_rounds"] > 0


def test_configured_costs_keep_gated_decisions_deterministic():
    stack = Stack({name: None for name in SERVICES}, cost_mode="configured")

    async def scenario():
        await stack.start(("batched",))
        try:
            first = await collect(stack.stub("batched"), request(30, "gated"))
            for spec in ("off", "always"):  # timings the measured fit would absorb
                await collect(stack.stub("batched"), request(18, spec, "an unrelated prompt"))
            second = await collect(stack.stub("batched"), request(30, "gated"))
            stats = json.loads((await stack.stub("batched").Stats(gateway_pb2.StatsRequest(), timeout=5)).json)
            return first, second, stats
        finally:
            await stack.stop()

    first, second, stats = service_loop().run(scenario())
    assert stats["cost_mode"] == "configured" and stats["costs"]["measured"] is not None
    assert second.token_ids == first.token_ids
    assert spec_counts(second.stats) == spec_counts(first.stats)
    assert first.stats.truncated_rounds + first.stats.skipped_after_draft > 0  # the gate made choices


def test_a_foreign_context_detach_is_not_logged_but_other_context_errors_are(caplog):
    """A token reset from another contextvars Context (what a cancelled traced stream does) is
    the one "Failed to detach context" the filter drops; a detach failing another way stays."""
    import contextvars
    import logging

    from opentelemetry import context
    from services.common.telemetry import ForeignContextDetachFilter

    log = logging.getLogger("opentelemetry.context")
    log.addFilter(detach_filter := ForeignContextDetachFilter())
    try:
        with caplog.at_level(logging.ERROR, logger="opentelemetry.context"):
            foreign = contextvars.Context().run(lambda: context.attach(context.set_value("k", 1)))
            context.detach(foreign)
            assert caplog.records == []
            context.detach("not a token")
        assert [r.getMessage() for r in caplog.records] == ["Failed to detach context"]
        assert "different Context" not in str(caplog.records[0].exc_info[1])
    finally:
        log.removeFilter(detach_filter)
