"""Every service's Prometheus families and the per-request log line, on real in-process
services (random tiny model, port 0, real channels, real HTTP scrapes)."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dspark_proto.v1 import gateway_pb2_grpc
from services.app import drafter_engine, start_drafter, start_gateway, start_verifier, verifier_engine
from verifier_fixtures import StepVerifier
from services.common.logs import FIELDS, JsonFormatter, TextFormatter, formatter
from services.common.metrics import DrafterMetrics, VerifierMetrics, served_model_name
from services.common.server import channel_options
from services.common.settings import GatewaySettings
from services.gateway.metrics import GatewayMetrics
from services.settings import log_format, read_settings
from services_fixtures import collect, gen_request, service_loop, tiny_draft_module, tiny_trunk

HTTP_TIMEOUT_S = 10.0


def scrape(endpoint) -> tuple[str, dict]:
    with urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=HTTP_TIMEOUT_S) as r:
        text = r.read().decode()
    return text, {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict, family: str, sample: str, **labels) -> float:
    return sum(s.value for s in families[family].samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


class Stack:
    """Verifier, DSpark drafter and gateway, each with its metrics endpoint on port 0."""

    def __init__(self):
        self.loop = service_loop()
        trunk = tiny_trunk()
        self.v_engine = verifier_engine(trunk)
        self.d_engine = drafter_engine(tiny_draft_module())
        self.vm, self.dm = VerifierMetrics(self.v_engine), DrafterMetrics(self.d_engine)
        self.gm = GatewayMetrics()
        for m in (self.vm, self.dm, self.gm):
            m.serve(0)

        async def start():
            v = await start_verifier(self.v_engine, metrics=self.vm)
            d = await start_drafter(self.d_engine, metrics=self.dm)
            settings = GatewaySettings(verifier_target=f"127.0.0.1:{v.port}", drafter_target=f"127.0.0.1:{d.port}",
                                       verify_mode="batched")
            g, _, backends = await start_gateway(settings, metrics=self.gm)
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{g.port}", options=channel_options())
            return v, d, g, backends, channel

        self.v, self.d, self.g, self.backends, self.channel = self.loop.run(start())
        self.target = f"127.0.0.1:{self.g.port}"
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    def generate(self, prompt: str, max_tokens: int, spec: str):
        return self.loop.run(collect(self.stub, gen_request(prompt, max_tokens=max_tokens, spec=spec)))

    def close(self) -> None:
        async def stop():
            await self.channel.close()
            for server in (self.g, self.d, self.v):
                await server.stop(0)
            await self.backends.close()

        self.loop.run(stop())
        for m in (self.vm, self.dm, self.gm):
            m.close()


@pytest.fixture(scope="module")
def stack():
    s = Stack()
    yield s
    s.close()


@pytest.fixture(scope="module")
def runs(stack):
    return {"gated": stack.generate("def fib(n):", 24, "gated"), "off": stack.generate("count: 1 2 3", 8, "off")}


def test_verifier_metrics_count_every_forward_with_its_rows(stack, runs):
    text, fam = scrape(stack.vm)
    gated, off = runs["gated"].stats, runs["off"].stats
    prompt_rows = sum(g.final.usage.prompt_tokens for g in runs.values())
    assert value(fam, "dspark_verifier_forward_rows", "dspark_verifier_forward_rows_count", op="prefill") == 2
    assert value(fam, "dspark_verifier_forward_rows", "dspark_verifier_forward_rows_sum", op="prefill") == prompt_rows
    # a verify forwards [anchor, d1..dk] (batched): k + 1 rows; every other round is one decode
    assert value(fam, "dspark_verifier_forward_rows", "dspark_verifier_forward_rows_count",
                 op="verify") == gated.rounds - gated.plain_rounds
    assert value(fam, "dspark_verifier_forward_rows", "dspark_verifier_forward_rows_sum",
                 op="verify") == gated.submitted + gated.rounds - gated.plain_rounds
    assert value(fam, "dspark_verifier_forward_rows", "dspark_verifier_forward_rows_count",
                 op="decode") == gated.plain_rounds + off.rounds
    forwards = value(fam, "dspark_verifier_forward_duration_seconds", "dspark_verifier_forward_duration_seconds_count")
    assert forwards == 2 + gated.rounds + off.rounds
    assert value(fam, "dspark_verifier_queue_wait_seconds", "dspark_verifier_queue_wait_seconds_count") == forwards
    assert value(fam, "dspark_verifier_forward_duration_seconds", "dspark_verifier_forward_duration_seconds_sum") > 0
    assert value(fam, "dspark_verifier_open_sessions", "dspark_verifier_open_sessions") == 0
    assert value(fam, "dspark_verifier_max_sessions", "dspark_verifier_max_sessions") == 16
    assert "otel_scope" not in text


def test_verifier_state_bytes_sum_the_open_sessions(stack):
    engine = stack.v_engine
    sid = engine.open_session()
    try:
        StepVerifier(engine).prefill(sid, [1, 2, 3])
        _, fam = scrape(stack.vm)
        held = value(fam, "dspark_verifier_state_bytes", "dspark_verifier_state_bytes")
        assert held == engine.session_bytes(sid) == engine.state_bytes() > 0
        assert value(fam, "dspark_verifier_open_sessions", "dspark_verifier_open_sessions") == 1
    finally:
        engine.close_session(sid)
    assert engine.state_bytes() == 0


def test_drafter_metrics_count_drafts_and_their_tokens(stack, runs):
    text, fam = scrape(stack.dm)
    gated = runs["gated"].stats
    assert value(fam, "dspark_drafter_draft_tokens", "dspark_drafter_draft_tokens_total") == gated.drafted
    drafts = value(fam, "dspark_drafter_drafts", "dspark_drafter_drafts_total")
    assert drafts == value(fam, "dspark_drafter_draft_duration_seconds", "dspark_drafter_draft_duration_seconds_count")
    assert 0 < drafts <= gated.rounds
    assert gated.drafted == drafts * stack.d_engine.identity()["block_size"]  # every draft is a full block
    assert value(fam, "dspark_drafter_commit_duration_seconds", "dspark_drafter_commit_duration_seconds_count") > 0
    assert value(fam, "dspark_drafter_open_sessions", "dspark_drafter_open_sessions") == 0
    assert "otel_scope" not in text


def test_gateway_families_are_labelled_by_model_and_spec_mode_without_scope_labels(stack, runs):
    text, fam = scrape(stack.gm)
    assert "otel_scope" not in text
    model = served_model_name(None)
    for spec, gen in runs.items():
        labels = {"model": model, "spec_mode": spec}
        assert value(fam, "dspark_gateway_requests", "dspark_gateway_requests_total", finish_reason="length",
                     **labels) == 1
        assert value(fam, "dspark_gateway_prompt_tokens", "dspark_gateway_prompt_tokens_total",
                     **labels) == gen.final.usage.prompt_tokens
        assert value(fam, "dspark_gateway_generation_tokens", "dspark_gateway_generation_tokens_total",
                     **labels) == gen.final.usage.completion_tokens
        assert value(fam, "spec_decode_rounds", "spec_decode_rounds_total", **labels) == gen.stats.rounds
        for gauge in ("dspark_gateway_requests_waiting", "dspark_gateway_requests_running"):
            assert value(fam, gauge, gauge, **labels) == 0
    assert value(fam, "spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens_total", spec_mode="off") == 0
    assert value(fam, "dspark_gateway_requests", "dspark_gateway_requests_total", spec_mode="always") == 0


def test_a_cancelled_generation_counts_as_abort_and_leaves_the_running_gauge(stack):
    async def cancel_after_first_message():
        call = stack.stub.Generate(gen_request("abc", max_tokens=40, spec="always"), timeout=30)
        async for _ in call:
            call.cancel()
            break

    _, before = scrape(stack.gm)
    stack.loop.run(cancel_after_first_message())
    labels = {"spec_mode": "always", "finish_reason": "abort"}
    want = value(before, "dspark_gateway_requests", "dspark_gateway_requests_total", **labels) + 1
    for _ in range(100):  # the gateway sees the cancel just after the client
        _, fam = scrape(stack.gm)
        if value(fam, "dspark_gateway_requests", "dspark_gateway_requests_total", **labels) == want:
            break
        stack.loop.run(asyncio.sleep(0.05))
    assert value(fam, "dspark_gateway_requests", "dspark_gateway_requests_total", **labels) == want
    assert value(fam, "dspark_gateway_requests_running", "dspark_gateway_requests_running", spec_mode="always") == 0


def test_one_log_line_per_finished_request_with_its_fields(stack, caplog):
    with caplog.at_level(logging.INFO, logger="dspark.requests"):
        off = stack.generate("hello", 6, "off")
        gated = stack.generate("hello", 12, "gated")
    # only these two: a generation an earlier test cancelled may log its end while these run
    ours = {off.final.request_id, gated.final.request_id}
    lines = [getattr(r, FIELDS) for r in caplog.records if r.name == "dspark.requests"]
    lines = [line for line in lines if line["request_id"] in ours]
    assert len(lines) == 2
    a, b = lines
    assert (a["spec_mode"], a["finish_reason"], a["completion_tokens"]) == ("off", "length", 6)
    assert a["prompt_tokens"] == off.final.usage.prompt_tokens and a["acceptance"] is None and a["submitted"] == 0
    assert a["ttft_ms"] == pytest.approx(off.final.time_to_first_token_ms, abs=1e-3)
    assert a["duration_ms"] >= a["ttft_ms"]
    s = gated.stats
    assert (b["spec_mode"], b["rounds"], b["submitted"], b["accepted"]) == ("gated", s.rounds, s.submitted, s.accepted)
    assert b["acceptance"] == pytest.approx(s.accepted / s.submitted, abs=1e-4)
    assert len(a["request_id"]) == 32 and a["request_id"] != b["request_id"]


def test_json_log_format_writes_one_object_per_line_with_the_fields():
    record = logging.LogRecord("dspark.requests", logging.INFO, __file__, 1, "request finished", None, None)
    setattr(record, FIELDS, {"request_id": "r1", "acceptance": None, "ttft_ms": float("nan")})
    line = JsonFormatter().format(record)
    assert json.loads(line) == {"time": json.loads(line)["time"], "level": "INFO", "logger": "dspark.requests",
                                "message": "request finished", "request_id": "r1", "acceptance": None,
                                "ttft_ms": None}
    assert TextFormatter().format(record).endswith("request finished request_id=r1 acceptance=- ttft_ms=nan")
    assert isinstance(formatter("json"), JsonFormatter)


@pytest.mark.parametrize("raw, want", [(None, "text"), ("", "text"), ("json", "json"), (" JSON ", "json"),
                                       ("text", "text")])
def test_log_format_setting(raw, want):
    assert log_format({} if raw is None else {"DSPARK_LOG_FORMAT": raw}) == want


def test_bad_log_format_is_refused_naming_the_value():
    with pytest.raises(ValueError, match="DSPARK_LOG_FORMAT='yaml'"):
        log_format({"DSPARK_LOG_FORMAT": "yaml"})


@pytest.mark.parametrize("service", ["verifier", "drafter", "gateway"])
def test_every_service_reads_the_metrics_port_and_the_log_format(service):
    s = read_settings({"DSPARK_METRICS_PORT": "9464", "DSPARK_LOG_FORMAT": "json"}, service)
    assert (s.metrics_port, s.log_format) == (9464, "json")


@pytest.mark.parametrize("checkpoint, name", [(None, "dspark-random-tiny"), ("assets/dspark-small", "dspark-small"),
                                              ("/models/dsv4/", "dsv4")])
def test_served_model_name(checkpoint, name):
    assert served_model_name(checkpoint) == name
