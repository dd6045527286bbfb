"""Trace analysis and metrics on a real run through the three services (docs/analysis.md).

Verifier, live oracle drafter (a corrupted slot every 4 positions, so the gate truncates and
batched verify rejects) and a gateway with Prometheus metrics, all in process on port 0 with
real channels; one tracer provider writes every span through `JsonLinesSpanExporter`. The
gate's margin threshold (0.1) makes some rounds skip drafting on the random tiny model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from prometheus_client.parser import text_string_to_metric_families

from services.analysis.plots import write_plots
from services.analysis.report import build_report, gate_env_lines
from services.analysis.traces import load_spans
from services.app import start_gateway
from services.common.server import channel_options
from services.common.telemetry import JsonLinesSpanExporter
from services.gateway.gate import GateConfig
from services.gateway.metrics import DURATION_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS, GatewayMetrics
from services.settings import gate_config, metrics_port
from services_fixtures import collect, gen_request, spec_counts, start_stack

ROOT = Path(__file__).resolve().parents[1]
REQUESTS = (("def fibonacci(n):", "gated", 40), ("The old lighthouse keeper", "always", 32),
            ("Solve for x: 3x + 7 = 22.", "off", 12))
SPAN_WAIT_S = 10.0
HTTP_TIMEOUT_S = 10.0


class Run:
    """The generations of one gateway with metrics, and the span file of all three services."""

    def __init__(self, tmp: Path):
        import grpc

        from dspark_proto.v1 import gateway_pb2_grpc

        self.path = tmp / "spans.jsonl"
        self.provider = TracerProvider(resource=Resource.create({"service.name": "dspark-test"}))
        self.provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(str(self.path))))
        self.stack = start_stack("oracle", corrupt_every=4, provider=self.provider,
                                 gate_config=GateConfig(margin_threshold=0.1))
        self.metrics = GatewayMetrics()
        self.metrics_port = self.metrics.serve(0)
        self.recorded: list = []

        async def start():
            server, scheduler, backends = await start_gateway(
                self.stack.settings("batched"), self.stack.gate_config, provider=self.provider,
                recorder=self.recorded, metrics=self.metrics)
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=channel_options())
            return server, scheduler, backends, channel, gateway_pb2_grpc.GatewayStub(channel)

        self.server, self.scheduler, self.backends, self.channel, stub = self.stack.loop.run(start())
        self.generations = [self.stack.loop.run(collect(stub, gen_request(p, max_tokens=n, spec=spec)))
                            for p, spec, n in REQUESTS]
        deadline = time.monotonic() + SPAN_WAIT_S  # the generate span ends just after the final message
        while sum('"gateway.generate"' in line for line in self.path.read_text().splitlines()) < len(REQUESTS):
            assert time.monotonic() < deadline, "gateway.generate spans did not reach the file"
            time.sleep(0.05)

    def close(self) -> None:
        async def stop():
            await self.channel.close()
            await self.server.stop(0)
            await self.backends.close()

        self.stack.loop.run(stop())
        self.stack.close()
        self.metrics.close()
        self.provider.shutdown()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    r = Run(tmp_path_factory.mktemp("analysis"))
    yield r
    r.close()


@pytest.fixture(scope="module")
def report(run):
    return build_report(load_spans([run.path]), [str(run.path)])


def test_round_parts_add_up_to_the_gateway_round_wall_with_nonnegative_residual(report):
    assert len(report.rounds) > 20 and report.backend_spans
    for r in report.rounds:
        verifier = [c for c in r.children if c.name in ("verifier.verify", "verifier.decode")]
        assert len(verifier) == 1 and verifier[0].name == ("verifier.verify" if r.submitted else "verifier.decode")
        assert r.drafter_ms is not None and r.verifier_ms is not None
        assert r.residual_ms >= 0, (r.index, r.wall_ms, r.drafter_ms, r.verifier_ms)
        assert r.drafter_ms + r.verifier_ms + r.residual_ms == pytest.approx(r.wall_ms)
        assert r.verifier_ms <= r.verify_ms  # the forward lies inside the gateway's wall of the call
        if r.draft_ms is not None:
            draft = [c for c in r.children if c.name == "drafter.draft"]
            assert float(draft[0].attr("drafter.forward_ms")) <= r.draft_ms


def test_report_counts_equal_each_generations_final_stats(run, report):
    assert [g.mode for g in report.generations] == [spec for _, spec, _ in REQUESTS]
    decisions = {r.decision for r in report.rounds}
    assert {"full", "truncated", "margin_skipped", "plain"} <= decisions  # the run exercises the gate
    for g, gen in zip(report.generations, run.generations):
        final = spec_counts(gen.stats)
        counts = g.counts()
        assert {k: counts[k] for k in final} == final
        assert g.output_tokens == gen.final.usage.completion_tokens == len(gen.token_ids)
        assert g.ttft_ms == pytest.approx(gen.final.time_to_first_token_ms, abs=1e-6)
        assert g.consistent is True
        assert 0 < g.tpot_ms < g.duration_ms


def test_reliability_counts_equal_the_gateways_gate_statistics(run, report):
    gate = run.scheduler.stats.totals.gate
    assert [b.observed for b in report.reliability] == gate.bucket_observed
    assert [b.matched for b in report.reliability] == gate.bucket_matched
    assert sum(gate.bucket_observed) > 0


def test_fitted_costs_from_a_real_run_are_usable_gate_settings(report):
    fit = report.fit
    assert fit.missing() == [] and fit.distinct_k >= 2
    lines, _ = gate_env_lines(fit)
    assert [line.split("=")[0] for line in lines] == ["DSPARK_GATE_DRAFT_MS",
                                                      "DSPARK_GATE_VERIFY_BASE_MS",
                                                      "DSPARK_GATE_VERIFY_SLOPE_MS",
                                                      "DSPARK_GATE_PLAIN_MS"]
    gate_config(dict(line.split("=", 1) for line in lines))


def test_plots_are_written_as_nontrivial_pngs(report, tmp_path):
    paths = write_plots(report, tmp_path / "png")
    assert [p.name for p in paths] == ["timeline.png", "verify_vs_k.png", "acceptance.png", "reliability.png"]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 15_000, (p, len(data))


def _scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=HTTP_TIMEOUT_S) as resp:
        text = resp.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families: dict, name: str, sample: str | None = None, **labels) -> float:
    fam = families[name]
    sample = sample or name + "_total"
    return sum(s.value for s in fam.samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def test_prometheus_endpoint_serves_the_named_metrics_equal_to_the_final_stats(run):
    families = _scrape(run.metrics_port)
    stats = [g.stats for g in run.generations]
    total = {k: sum(getattr(s, k) for s in stats) for k in ("rounds", "drafted", "submitted", "accepted",
                                                             "margin_skipped_rounds", "truncated_rounds",
                                                             "skipped_after_draft", "plain_rounds")}
    assert total["margin_skipped_rounds"] > 0 and total["truncated_rounds"] > 0
    assert _value(families, "spec_decode_num_drafts") == total["rounds"] - total["plain_rounds"]
    assert _value(families, "spec_decode_num_draft_tokens") == total["submitted"]
    assert _value(families, "spec_decode_num_accepted_tokens") == total["accepted"]
    assert _value(families, "spec_decode_rounds") == total["rounds"]
    assert _value(families, "spec_decode_drafted_tokens") == total["drafted"]
    assert _value(families, "spec_decode_margin_skipped_rounds") == total["margin_skipped_rounds"]
    assert _value(families, "spec_decode_truncated_rounds") == total["truncated_rounds"]
    assert _value(families, "spec_decode_skipped_after_draft_rounds") == total["skipped_after_draft"]
    assert _value(families, "spec_decode_plain_rounds") == total["plain_rounds"]
    # per position: the recorded rounds (every round; an undrafted one accepts none) accepted drafts 0..a-1
    per_pos = {}
    for r in run.recorded:
        for pos in range(r.accepted):
            per_pos[str(pos)] = per_pos.get(str(pos), 0) + 1
    got = {}  # summed over the spec_mode series
    for s in families["spec_decode_num_accepted_tokens_per_pos"].samples:
        if s.name.endswith("_total"):
            got[s.labels["position"]] = got.get(s.labels["position"], 0) + s.value
    assert got == per_pos and sum(got.values()) == total["accepted"]

    n = len(run.generations)
    ttft = families["gen_ai_server_time_to_first_token_seconds"]
    assert _value(families, "gen_ai_server_time_to_first_token_seconds",
                  "gen_ai_server_time_to_first_token_seconds_count") == n
    assert _value(families, "gen_ai_server_time_to_first_token_seconds",
                  "gen_ai_server_time_to_first_token_seconds_sum") == pytest.approx(
        sum(g.final.time_to_first_token_ms for g in run.generations) / 1e3)
    assert _value(families, "gen_ai_server_request_duration_seconds",
                  "gen_ai_server_request_duration_seconds_count") == n
    assert _value(families, "gen_ai_server_time_per_output_token_seconds",
                  "gen_ai_server_time_per_output_token_seconds_count") == n
    for name, buckets in (("gen_ai_server_time_to_first_token_seconds", TTFT_BUCKETS),
                          ("gen_ai_server_time_per_output_token_seconds", TPOT_BUCKETS),
                          ("gen_ai_server_request_duration_seconds", DURATION_BUCKETS)):
        edges = [s.labels["le"] for s in families[name].samples  # one series: the gated generation's
                 if s.name == name + "_bucket" and s.labels.get("spec_mode") == "gated"]
        assert [float(e) for e in edges] == [*buckets, float("inf")]
    sample = next(s for s in ttft.samples if s.name.endswith("_count"))
    assert sample.labels["gen_ai_operation_name"] == "text_completion"


@pytest.mark.parametrize("flag, env, want", [(None, {}, None), (0, {}, 0), (None, {"DSPARK_METRICS_PORT": "9464"}, 9464),
                                             (9100, {"DSPARK_METRICS_PORT": "9464"}, 9100),
                                             (None, {"DSPARK_METRICS_PORT": " "}, None)])
def test_metrics_port_comes_from_the_flag_then_the_environment(flag, env, want):
    assert metrics_port(flag, env) == want


@pytest.mark.parametrize("flag, env, message", [(70000, {}, "--metrics-port=70000"),
                                                (None, {"DSPARK_METRICS_PORT": "http"}, "DSPARK_METRICS_PORT='http'"),
                                                (None, {"DSPARK_METRICS_PORT": "-1"}, "DSPARK_METRICS_PORT='-1'")])
def test_bad_metrics_port_is_refused_naming_the_value(flag, env, message):
    with pytest.raises(ValueError, match=message):
        metrics_port(flag, env)


def _dspark(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_trace_report_and_calibrate_cli_on_the_real_spans(run, tmp_path):
    out = _dspark("trace-report", str(run.path), "--json", "--png", str(tmp_path / "png"))
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert [g["mode"] for g in data["generations"]] == ["gated", "always", "off"]
    assert all(g["consistent"] for g in data["generations"])
    assert data["parts"]["residual_ms"]["min"] >= 0
    assert len(data["png"]) == 4 and all(Path(p).stat().st_size > 15_000 for p in data["png"])
    assert len(data["gate_env"]) == 4

    text = _dspark("trace-report", str(run.path))
    assert text.returncode == 0 and "Round time split" in text.stdout and "DSPARK_GATE_PLAIN_MS=" in text.stdout

    cal = _dspark("calibrate", str(run.path))
    assert cal.returncode == 0, cal.stderr
    assert cal.stdout.splitlines() == data["gate_env"]

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"name": "x"}\n')
    err = _dspark("trace-report", str(bad))
    assert err.returncode == 2 and err.stdout == ""
    assert err.stderr.strip() == f"dspark trace-report: error: {bad}:1: not a span or an OTLP document (keys ['name'])"
    missing = _dspark("calibrate", str(tmp_path / "missing.jsonl"))
    assert missing.returncode == 2 and "missing.jsonl" in missing.stderr and len(missing.stderr.splitlines()) == 1
