"""Failure behaviour of the services (docs/services.md §3): backends dying, missing or mismatched.

Processes that must die run as real subprocesses (`dspark serve SERVICE --port 0`; the bound
port is read from its log line); the rest runs in process on port 0 with real channels.
Outputs are compared under sequential verify, where a drafter failure must not change a
single token.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dspark_proto.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from dsv4.config import tiny_config
from dsv4.dspark import DSparkDraft
from dsv4.init import random_weights
from services.app import drafter_engine, start_drafter, start_gateway, start_verifier, verifier_engine
from services.common.server import channel_options
from services.common.settings import BackendSettings, GatewaySettings
from services.gateway.gate import GateConfig
from services.gateway.servicer import IdentityMismatch
from services_fixtures import RPC_TIMEOUT_S, Generation, collect, service_loop, spec_counts, tiny_trunk

REPO = Path(__file__).resolve().parents[1]
PROMPT = "The quick brown fox"
STARTUP_S = 60.0   # deadline for a service subprocess to report its port
EXIT_S = 60.0      # deadline for a service subprocess to exit after SIGTERM / SIGKILL


class ServiceProcess:
    """`dspark serve SERVICE [--oracle] --port 0` (the random tiny model, one torch thread);
    `port` is parsed from its "serving on HOST:PORT" log line."""

    def __init__(self, service: str, oracle: bool = False):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DSPARK_", "OTEL_", "DEEPSEEK_DSPARK_"))}
        env["OMP_NUM_THREADS"] = "1"
        cmd = [sys.executable, "-m", "services.cli", "serve", service, "--port", "0"] + (["--oracle"] if oracle else [])
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        self.port: int | None = None
        self._bound = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()
        if not self._bound.wait(STARTUP_S) or self.port is None:
            self.kill()
            raise RuntimeError(f"{service} subprocess did not report a port within {STARTUP_S:g} s; "
                               f"log tail: {self.log[-10:]}")

    def _drain(self) -> None:
        for line in self.proc.stderr:  # read to EOF so the child never blocks on a full pipe
            self.log.append(line.rstrip())
            m = re.search(r"serving on [\d.]+:(\d+)", line)
            if m and self.port is None:
                self.port = int(m.group(1))
                self._bound.set()
        self._bound.set()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(EXIT_S)


def request(prompt: str, max_tokens: int, spec: str) -> gateway_pb2.GenerateRequest:
    """A greedy request that ignores eos (lengths must not depend on where the random model emits it)."""
    return gateway_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True,
                                       spec=getattr(gateway_pb2, f"SPEC_MODE_{spec.upper()}"))


def _gateway_settings(verifier_port: int, drafter_target: str, **overrides) -> GatewaySettings:
    values = dict(verifier_target=f"127.0.0.1:{verifier_port}", drafter_target=drafter_target,
                  verify_mode="sequential", cost_mode="configured", startup_timeout_s=10.0)
    values.update(overrides)
    return GatewaySettings(**values)


async def _stream_killing(stub, req, proc: ServiceProcess, after_tokens: int) -> Generation:
    """Stream `req`; SIGKILL `proc` once `after_tokens` tokens have arrived."""
    gen = Generation()
    async for msg in stub.Generate(req, timeout=RPC_TIMEOUT_S):
        gen.add(msg)
        if proc.proc.poll() is None and len(gen.token_ids) >= after_tokens:
            proc.kill()
    return gen


def _round_spans(exporter: InMemorySpanExporter):
    rounds = [s for s in exporter.get_finished_spans() if s.name == "spec_decode.round"]
    return sorted(rounds, key=lambda s: s.attributes["spec_decode.round"])


# ---------------------------------------------------------------------------- the drafter dies
def test_drafter_killed_mid_generation_completes_plain_with_the_off_output():
    drafter = ServiceProcess("drafter", oracle=True)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    block = tiny_trunk().cfg.dspark_block_size

    async def scenario():
        verifier = await start_verifier(verifier_engine(tiny_trunk(), BackendSettings()))
        gw, _, backends = await start_gateway(_gateway_settings(verifier.port, drafter.target), GateConfig(),
                                              provider=provider)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as ch:
                stub = gateway_pb2_grpc.GatewayStub(ch)
                off = await collect(stub, request(PROMPT, max_tokens=48, spec="off"))
                exporter.clear()
                # kill once the first speculative round (a whole accepted block) has streamed
                spec = await _stream_killing(stub, request(PROMPT, max_tokens=48, spec="always"), drafter,
                                             after_tokens=1 + block + 1)
                return off, spec
        finally:
            await gw.stop(0)
            await backends.close()
            await verifier.stop(0)

    try:
        off, spec = service_loop().run(scenario())
    finally:
        drafter.kill()
    assert spec.token_ids == off.token_ids
    assert spec.final.text == off.final.text
    assert (spec.finish_reason, spec.final.usage.completion_tokens) == ("length", 48)
    stats = spec.stats
    assert stats.drafter_failed
    assert stats.accepted >= block  # the oracle's first block was accepted before the kill
    assert stats.plain_rounds >= 1
    # every round after the one that saw the failure is plain: no draft, nothing submitted
    rounds = _round_spans(exporter)
    assert len(rounds) == stats.rounds
    failed_at = [i for i, s in enumerate(rounds) if any(e.name == "drafter_failed" for e in s.events)]
    assert len(failed_at) == 1, [s.attributes["spec_decode.gate_decision"] for s in rounds]
    after = rounds[failed_at[0] + 1:]
    assert after and all(s.attributes["spec_decode.gate_decision"] == "plain" for s in after)
    assert all(s.attributes["spec_decode.submitted"] == 0 and s.attributes["spec_decode.drafted"] == 0
               for s in after)
    before = rounds[:failed_at[0]]
    assert all(s.attributes["spec_decode.gate_decision"] == "full" for s in before)
    assert stats.plain_rounds >= len(after)


def test_drafter_unreachable_from_the_start_generations_run_plain_equal_to_off():
    hole = socket.socket()  # bound, never listening: connections to it are refused
    hole.bind(("127.0.0.1", 0))

    async def scenario():
        verifier = await start_verifier(verifier_engine(tiny_trunk(), BackendSettings()))
        settings = _gateway_settings(verifier.port, f"127.0.0.1:{hole.getsockname()[1]}", startup_timeout_s=1.0)
        gw, scheduler, backends = await start_gateway(settings, GateConfig())
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as ch:
                stub = gateway_pb2_grpc.GatewayStub(ch)
                return {spec: await collect(stub, request(PROMPT, max_tokens=20, spec=spec))
                        for spec in ("off", "always", "gated")}, scheduler.limits
        finally:
            await gw.stop(0)
            await backends.close()
            await verifier.stop(0)

    try:
        gens, limits = service_loop().run(scenario())
    finally:
        hole.close()
    assert not limits.confidence_head  # no drafter identity was seen
    for spec in ("always", "gated"):
        g = gens[spec]
        assert g.token_ids == gens["off"].token_ids, spec
        assert g.stats.drafter_failed, spec
        assert (g.stats.drafted, g.stats.submitted) == (0, 0), spec
        assert g.stats.plain_rounds == g.stats.rounds == gens["off"].stats.rounds, spec


# ---------------------------------------------------------------------------- the verifier dies
def test_verifier_killed_mid_generation_ends_it_with_unavailable_and_frees_the_drafter_session():
    verifier = ServiceProcess("verifier")
    d_engine = drafter_engine(tiny_trunk(), oracle=True, settings=BackendSettings())

    async def scenario():
        drafter = await start_drafter(d_engine)
        gw, _, backends = await start_gateway(_gateway_settings(verifier.port, f"127.0.0.1:{drafter.port}"),
                                              GateConfig())
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as ch:
                stub = gateway_pb2_grpc.GatewayStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _stream_killing(stub, request(PROMPT, max_tokens=120, spec="always"), verifier,
                                          after_tokens=1)
                deadline = time.monotonic() + 10
                while d_engine.num_sessions and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                return err.value
        finally:
            await gw.stop(0)
            await backends.close()
            await drafter.stop(0)

    try:
        err = service_loop().run(scenario())
    finally:
        verifier.kill()
    # UNAVAILABLE, not DEADLINE_EXCEEDED: the broken stream is noticed at once, not at the round timeout
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
    assert err.details().startswith("verifier:"), err.details()
    assert d_engine.num_sessions == 0


# ---------------------------------------------------------------------------- pairing
@pytest.mark.parametrize("override, field", [
    ({"window_size": 16}, "window_size"),
    ({"dspark_target_layer_ids": [0, 1, 2]}, "target_layer_ids"),
])
def test_gateway_refuses_a_drafter_of_another_config_naming_the_fields(override, field):
    cfg = tiny_config(max_seq_len=tiny_trunk().cfg.max_seq_len, **override)
    module = DSparkDraft(cfg)
    module.load_weights(random_weights(cfg, "drafter", 0))

    async def scenario():
        verifier = await start_verifier(verifier_engine(tiny_trunk(), BackendSettings()))
        drafter = await start_drafter(drafter_engine(module, settings=BackendSettings()))
        try:
            with pytest.raises(IdentityMismatch) as err:
                await start_gateway(_gateway_settings(verifier.port, f"127.0.0.1:{drafter.port}"), GateConfig())
            return str(err.value)
        finally:
            await drafter.stop(0)
            await verifier.stop(0)

    message = service_loop().run(scenario())
    assert f"{field}: verifier " in message
    assert "config_hash: verifier " in message
    assert "row_width" not in message  # same width: only the differing fields are named
    expected = list(cfg.dspark_target_layer_ids) if field == "target_layer_ids" else cfg.window_size
    assert f"!= drafter {expected!r}" in message


def test_gated_without_a_confidence_head_falls_back_to_always_k():
    cfg = tiny_trunk().cfg
    module = DSparkDraft(cfg, confidence_head=False)
    module.load_weights(random_weights(cfg, "drafter", 0, confidence_head=False))

    async def scenario():
        verifier = await start_verifier(verifier_engine(tiny_trunk(), BackendSettings()))
        drafter = await start_drafter(drafter_engine(module, settings=BackendSettings()))
        gw, scheduler, backends = await start_gateway(
            _gateway_settings(verifier.port, f"127.0.0.1:{drafter.port}", verify_mode="batched"), GateConfig())
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}", options=channel_options()) as ch:
                stub = gateway_pb2_grpc.GatewayStub(ch)
                info = await backends.drafter.Info(common_pb2.InfoRequest(), timeout=5)
                gens = {spec: await collect(stub, request(PROMPT, max_tokens=24, spec=spec))
                        for spec in ("always", "gated")}
                return info, scheduler.limits, gens
        finally:
            await gw.stop(0)
            await backends.close()
            await drafter.stop(0)
            await verifier.stop(0)

    info, limits, gens = service_loop().run(scenario())
    assert not info.confidence_head and not limits.confidence_head
    always, gated = gens["always"], gens["gated"]
    assert gated.token_ids == always.token_ids
    assert spec_counts(gated.stats) == spec_counts(always.stats)
    assert gated.stats.submitted > 0
    assert (gated.stats.truncated_rounds, gated.stats.skipped_after_draft) == (0, 0)


# ---------------------------------------------------------------------------- SIGTERM
def test_sigterm_marks_not_serving_drains_the_open_session_and_exits_cleanly():
    svc = ServiceProcess("verifier")
    prompt = [5, 6, 7, 8, 9]

    async def scenario():
        async with grpc.aio.insecure_channel(svc.target, options=channel_options()) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            name = "dspark.v1.Verifier"
            before = [(await health.Check(health_pb2.HealthCheckRequest(service=s), timeout=5)).status
                      for s in ("", name)]
            watch = health.Watch(health_pb2.HealthCheckRequest(service=name), timeout=EXIT_S)
            first = await watch.read()
            session = verifier_pb2_grpc.VerifierStub(ch).Session(timeout=EXIT_S)
            await session.write(verifier_pb2.VerifierRequest(prefill=verifier_pb2.PrefillRequest(token_ids=prompt)))
            prefill = await session.read()

            svc.proc.send_signal(signal.SIGTERM)
            during = await asyncio.wait_for(watch.read(), EXIT_S)
            # the open generation still gets its answers while the server drains
            await session.write(verifier_pb2.VerifierRequest(
                decode=verifier_pb2.DecodeRequest(token_id=prefill.next_token, position=len(prompt))))
            decode = await asyncio.wait_for(session.read(), EXIT_S)
            await session.done_writing()
            end = await asyncio.wait_for(session.read(), EXIT_S)
            watch.cancel()
            return before, first.status, during.status, decode, end

    try:
        before, first, during, decode, end = service_loop().run(scenario())
        code = svc.proc.wait(EXIT_S)
    finally:
        svc.kill()
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert before == [serving, serving] and first == serving
    assert during == not_serving
    assert decode.first_position == len(prompt) and decode.next_position == len(prompt) + 1
    assert end is grpc.aio.EOF
    assert code == 0, svc.log[-10:]
    assert any("signal received, draining" in line for line in svc.log)
