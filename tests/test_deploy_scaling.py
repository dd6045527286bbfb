"""Per-service scaling on localhost (docs/deployment.md §3-§4): one verifier, two drafter replicas, a gateway.

* Load balancing: the gateway's drafter target names both replicas (`ipv4:a,b`, or a plain
  comma-separated list); its round_robin channel puts each generation's Session stream on one
  replica, so eight generations held open at once show up in both drafters' `Info`.
* Failover: a drafter replica (a real `dspark serve drafter --oracle` subprocess) is SIGKILLed
  while generations are in flight; each of its generations is re-primed on the other replica
  from the verifier's kept rows (the `rows` op) and drafts again, and every output equals its
  `off` run under sequential verify. With no replica left the generations finish plain.
* The verifier's `rows` op itself, and the target-list settings.

Generations are held in flight deterministically: `HoldingVerifier` is the real step loop
whose first verify of each session waits (bounded) until the test releases it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dspark_proto.v1 import common_pb2, drafter_pb2_grpc, gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from services.app import drafter_engine, start_drafter, start_gateway, start_verifier
from services.common.server import RunningServer, channel_options, start_server
from services.common.settings import BackendSettings, GatewaySettings, backend_target
from services.common.tensors import from_proto
from services.gateway.gate import GateConfig
from services.settings import gateway_settings
from services.verifier.batcher import StepLoop
from services.verifier.engine import VerifierEngine
from services.verifier.servicer import VerifierServicer
from services.verifier.step_table import LoadTracker
from services_fixtures import RPC_TIMEOUT_S, collect, gen_request, service_loop, tiny_trunk

REPO = Path(__file__).resolve().parents[1]
HOLD_S = 60.0        # longest a held verify waits for the release
STARTUP_S = 60.0     # deadline for a drafter subprocess to report its port
PROMPTS = [f"request {i}: the quick brown fox" for i in range(8)]
MAX_TOKENS = 20


class HoldingVerifier(StepLoop):
    """The real step loop over a real `VerifierEngine`, whose first verify of each session
    waits (at most HOLD_S) until `release` is set before it is queued: the test then knows
    every generation is mid-flight, its drafter session open, while the other sessions'
    requests keep flowing through the loop's steps."""

    def __init__(self, model, **kwargs):
        super().__init__(VerifierEngine(model, **kwargs))
        self.release = threading.Event()
        self._lock = threading.Lock()
        self._seen: set[int] = set()
        self._held: set[int] = set()

    def submit(self, record):
        with self._lock:
            first = record.op == "verify" and record.sid not in self._seen
            if record.op == "verify":
                self._seen.add(record.sid)
            if first:
                self._held.add(record.sid)
        if not first:
            return super().submit(record)
        outer = concurrent.futures.Future()

        def hold() -> None:
            self.release.wait(HOLD_S)
            with self._lock:
                self._held.discard(record.sid)
            try:
                inner = super(HoldingVerifier, self).submit(record)
            except Exception as exc:
                outer.set_exception(exc)
                return
            inner.add_done_callback(lambda f: outer.set_exception(f.exception()) if f.exception()
                                    else outer.set_result(f.result()))

        threading.Thread(target=hold, daemon=True).start()
        return outer

    @property
    def held(self) -> int:
        with self._lock:
            return len(self._held)

    @property
    def num_sessions(self) -> int:
        return self.engine.num_sessions


async def serve_holding(steps: HoldingVerifier) -> RunningServer:
    """Serve the Verifier over the holding step loop (it stops with the server)."""
    servicer = VerifierServicer(steps.engine, "batched", steps=steps, load=LoadTracker())
    running = await start_server("dspark.v1.Verifier",
                                 lambda s: verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, s))
    running.on_stop.append(steps.close)
    return running


class DrafterProcess:
    """`python -m services.cli serve drafter --port 0 --oracle` (random tiny model, one torch
    thread); the port is read from its "serving on HOST:PORT" log line."""

    def __init__(self):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DSPARK_", "OTEL_", "DEEPSEEK_DSPARK_"))}
        env.update(OMP_NUM_THREADS="1", GRPC_VERBOSITY="ERROR")
        self.proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "drafter", "--port", "0",
                                      "--oracle"], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.port: int | None = None
        self.log: list[str] = []
        self._bound = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stderr:  # to EOF, so the child never blocks on a full pipe
            self.log.append(line.rstrip())
            m = re.search(r"serving on [\d.]+:(\d+)", line)
            if m and self.port is None:
                self.port = int(m.group(1))
                self._bound.set()
        self._bound.set()

    def wait_port(self) -> int:
        if not self._bound.wait(STARTUP_S) or self.port is None:
            self.kill()
            raise RuntimeError(f"drafter did not report a port within {STARTUP_S:g} s: {self.log[-10:]}")
        return self.port

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(STARTUP_S)


async def wait_until(predicate, what: str, timeout_s: float = HOLD_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not reached within {timeout_s:g} s")
        await asyncio.sleep(0.02)


async def open_sessions(stub) -> int:
    return (await stub.Info(common_pb2.InfoRequest(), timeout=5)).open_sessions


def big_executor() -> None:
    """Held verifies each occupy a worker thread of the loop's default executor (asyncio.to_thread)."""
    loop = service_loop()

    async def set_it():
        asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(32))
    loop.run(set_it())


def settings(verifier_port: int, drafter_target: str) -> GatewaySettings:
    return GatewaySettings(verifier_target=f"127.0.0.1:{verifier_port}", drafter_target=drafter_target,
                           verify_mode="sequential", cost_mode="configured", startup_timeout_s=20.0)


# ---------------------------------------------------------------------------- load balancing
def test_eight_generations_spread_over_both_drafter_replicas_one_stream_each():
    big_executor()
    trunk = tiny_trunk()
    engine = HoldingVerifier(trunk)
    drafters = [drafter_engine(trunk, oracle=True, settings=BackendSettings()) for _ in range(2)]

    async def scenario():
        verifier = await serve_holding(engine)
        servers = [await start_drafter(d) for d in drafters]
        target = ",".join(f"127.0.0.1:{s.port}" for s in servers)  # a plain list becomes ipv4:a,b
        gw, scheduler, backends = await start_gateway(settings(verifier.port, target), GateConfig())
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") for s in servers]
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}", options=channel_options()) as ch:
                stub = gateway_pb2_grpc.GatewayStub(ch)
                engine.release.set()
                off = [await collect(stub, gen_request(p, max_tokens=MAX_TOKENS, spec="off")) for p in PROMPTS]
                engine.release.clear()
                tasks = [asyncio.create_task(collect(stub, gen_request(p, max_tokens=MAX_TOKENS, spec="always")))
                         for p in PROMPTS]
                try:
                    await wait_until(lambda: engine.held == len(PROMPTS), "all generations in their first verify")
                    during = [await open_sessions(drafter_pb2_grpc.DrafterStub(c)) for c in channels]
                    engines_during = [d.num_sessions for d in drafters]
                finally:
                    engine.release.set()
                spec = await asyncio.gather(*tasks)
                await wait_until(lambda: not any(d.num_sessions for d in drafters) and not engine.num_sessions,
                                 "sessions freed", 15)
                after = [await open_sessions(drafter_pb2_grpc.DrafterStub(c)) for c in channels]
                return off, spec, during, engines_during, after, json.loads(
                    (await stub.Stats(gateway_pb2.StatsRequest(), timeout=5)).json)
        finally:
            for c in channels:
                await c.close()
            await gw.stop(0)
            await backends.close()
            for s in servers:
                await s.stop(0)
            await verifier.stop(0)

    off, spec, during, engines_during, after, stats = service_loop().run(scenario())
    assert backend_target(",".join(["127.0.0.1:1", "127.0.0.1:2"])) == "ipv4:127.0.0.1:1,127.0.0.1:2"
    assert during == engines_during  # Info reports the engine's count
    assert sum(during) == len(PROMPTS) and min(during) >= 1, during  # every generation on exactly one replica
    assert after == [0, 0]
    for o, s in zip(off, spec):
        assert s.token_ids == o.token_ids
        assert s.stats.accepted > 0 and not s.stats.drafter_failed
    assert stats["speculation"]["drafter_failovers"] == 0


# ---------------------------------------------------------------------------- failover
def _generations(exporter: InMemorySpanExporter) -> dict[int, dict]:
    """Per trace: the gateway.generate span's attributes and its rounds in order."""
    spans = exporter.get_finished_spans()
    out = {s.context.trace_id: {"attrs": dict(s.attributes), "rounds": []}
           for s in spans if s.name == "gateway.generate"}
    for s in spans:
        if s.name == "spec_decode.round" and s.context.trace_id in out:
            out[s.context.trace_id]["rounds"].append(s)
    for g in out.values():
        g["rounds"].sort(key=lambda s: s.attributes["spec_decode.round"])
    return out


def _events(span) -> set[str]:
    return {e.name for e in span.events}


def test_killed_drafter_replica_generations_resume_speculation_on_the_other_then_plain_when_none_left():
    big_executor()
    procs = [DrafterProcess(), DrafterProcess()]  # both start (load torch, the model) in parallel
    try:
        ports = [p.wait_port() for p in procs]
        engine = HoldingVerifier(tiny_trunk())
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))

        async def held_round(stub, prompts, channels, victim: DrafterProcess):
            """Start `prompts`, hold them in their first verify, SIGKILL `victim`, release, collect."""
            engine.release.clear()
            tasks = [asyncio.create_task(collect(stub, gen_request(p, max_tokens=MAX_TOKENS, spec="always")))
                     for p in prompts]
            try:
                await wait_until(lambda: engine.held == len(prompts), "all generations in their first verify")
                counts = [await open_sessions(drafter_pb2_grpc.DrafterStub(c)) if p.proc.poll() is None else 0
                          for c, p in zip(channels, procs)]
                await asyncio.to_thread(victim.kill)
            finally:
                engine.release.set()
            return counts, await asyncio.gather(*tasks)

        async def scenario():
            verifier = await serve_holding(engine)
            target = "ipv4:" + ",".join(f"127.0.0.1:{p}" for p in ports)
            gw, scheduler, backends = await start_gateway(settings(verifier.port, target), GateConfig(),
                                                          provider=provider)
            channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p}") for p in ports]
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}", options=channel_options()) as ch:
                    stub = gateway_pb2_grpc.GatewayStub(ch)
                    engine.release.set()
                    off = {p: await collect(stub, gen_request(p, max_tokens=MAX_TOKENS, spec="off"))
                           for p in PROMPTS[:6]}
                    exporter.clear()
                    # phase 1: six generations over both replicas; replica 0 dies mid-flight
                    counts1, gens1 = await held_round(stub, PROMPTS[:6], channels, procs[0])
                    traces1 = _generations(exporter)
                    exporter.clear()
                    # phase 2: two generations, all on replica 1, which dies too: none left
                    counts2, gens2 = await held_round(stub, PROMPTS[:2], channels, procs[1])
                    traces2 = _generations(exporter)
                    await wait_until(lambda: not engine.num_sessions, "verifier sessions freed", 15)
                    stats = json.loads((await stub.Stats(gateway_pb2.StatsRequest(), timeout=5)).json)
                    return off, (counts1, gens1, traces1), (counts2, gens2, traces2), stats
            finally:
                for c in channels:
                    await c.close()
                await gw.stop(0)
                await backends.close()
                await verifier.stop(0)

        off, phase1, phase2, stats = service_loop().run(scenario(), 150)
    finally:
        for p in procs:
            p.kill()

    _check_failover_phase(off, phase1)
    _check_no_replica_left_phase(off, phase2)
    assert stats["speculation"]["drafter_failovers"] == phase1[0][0]


def _check_failover_phase(off: dict, phase) -> None:
    """Phase 1 of the killed-replica test: both replicas served, the killed one's generations
    failed over once and kept speculating, the others never noticed, no token changed."""
    counts1, gens1, traces1 = phase
    assert sum(counts1) == 6 and min(counts1) >= 1, counts1  # both replicas served generations
    for p, g in zip(PROMPTS, gens1):
        assert g.token_ids == off[p].token_ids  # sequential verify: failover changes no token
        assert not g.stats.drafter_failed        # every one kept speculating
    moved = [t for t in traces1.values() if t["attrs"]["spec_decode.drafter_failovers"] > 0]
    stayed = [t for t in traces1.values() if t["attrs"]["spec_decode.drafter_failovers"] == 0]
    assert len(moved) == counts1[0] and len(stayed) == counts1[1]  # exactly the killed replica's generations
    for t in moved:
        rounds = t["rounds"]
        (at,) = [i for i, r in enumerate(rounds) if "drafter_failover" in _events(r)]
        assert "drafter_failed" in _events(rounds[at])
        after = rounds[at + 1:]
        assert after and any(r.attributes["spec_decode.drafted"] > 0 for r in after)  # speculation resumed
        assert sum(r.attributes["spec_decode.accepted"] for r in after) > 0          # on the oracle: accepted
        assert t["attrs"]["spec_decode.drafter_failovers"] == 1
    for t in stayed:
        assert not any({"drafter_failed", "drafter_failover"} & _events(r) for r in t["rounds"])


def _check_no_replica_left_phase(off: dict, phase) -> None:
    """Phase 2: the last replica dies too; its generations decode plainly to the end."""
    counts2, gens2, traces2 = phase
    assert counts2 == [0, 2]
    for p, g in zip(PROMPTS, gens2):
        assert g.token_ids == off[p].token_ids
        assert g.stats.drafter_failed  # no replica left: plain decode to the end
    for t in traces2.values():
        rounds = t["rounds"]
        (at,) = [i for i, r in enumerate(rounds) if "drafter_failed" in _events(r)]
        assert not any("drafter_failover" in _events(r) for r in rounds)
        assert all(r.attributes["spec_decode.gate_decision"] == "plain" for r in rounds[at + 1:])


# ---------------------------------------------------------------------------- the verifier's rows op
async def _session(stub, requests):
    call = stub.Session(timeout=RPC_TIMEOUT_S)
    replies = []
    try:
        for r in requests:
            await call.write(r)
            replies.append(await call.read())
        await call.done_writing()
        return replies, None
    except grpc.aio.AioRpcError as e:
        return replies, e


def test_verifier_rows_op_returns_the_last_committed_rows_as_sent():
    W = tiny_trunk().cfg.window_size
    prompt = list(range(10, 10 + W + 3))  # longer than the window
    engine = VerifierEngine(tiny_trunk())

    async def scenario():
        server = await start_verifier(engine)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                stub = verifier_pb2_grpc.VerifierStub(ch)
                R = verifier_pb2.VerifierRequest
                first, _ = await _session(stub, [R(prefill=verifier_pb2.PrefillRequest(token_ids=prompt))])
                replies, err = await _session(stub, [
                    R(prefill=verifier_pb2.PrefillRequest(token_ids=prompt)),
                    R(decode=verifier_pb2.DecodeRequest(token_id=first[0].next_token, position=len(prompt))),
                    R(rows=verifier_pb2.RowsRequest()),
                    R(rows=verifier_pb2.RowsRequest(count=2)),
                    R(rows=verifier_pb2.RowsRequest(count=10 * W)),
                ])
                assert err is None, err
                _, empty = await _session(stub, [R(rows=verifier_pb2.RowsRequest())])
                _, negative = await _session(stub, [R(prefill=verifier_pb2.PrefillRequest(token_ids=prompt)),
                                                    R(rows=verifier_pb2.RowsRequest(count=-1))])
                return replies, empty, negative
        finally:
            await server.stop(0)

    (prefill, decode, all_rows, two, capped), empty, negative = service_loop().run(scenario())
    n = len(prompt)
    sent = torch.cat([from_proto(prefill.rows), from_proto(decode.rows)])  # positions n-W..n
    assert (prefill.first_position, decode.first_position) == (n - W, n)
    assert all_rows.first_position == n + 1 - W and all_rows.next_position == n + 1
    assert torch.equal(from_proto(all_rows.rows), sent[-W:])  # bitwise what the drafter got first
    assert (all_rows.next_token, all_rows.margin) == (decode.next_token, decode.margin)
    assert two.first_position == n - 1 and torch.equal(from_proto(two.rows), sent[-2:])
    assert capped.first_position == all_rows.first_position and torch.equal(from_proto(capped.rows), sent[-W:])
    assert empty.code() == grpc.StatusCode.INVALID_ARGUMENT and "prefill first" in empty.details()
    assert negative.code() == grpc.StatusCode.INVALID_ARGUMENT and "count=-1" in negative.details()
    assert engine.num_sessions == 0


# ---------------------------------------------------------------------------- settings
@pytest.mark.parametrize("value, expected", [
    ("127.0.0.1:5001,127.0.0.1:5002", "ipv4:127.0.0.1:5001,127.0.0.1:5002"),
    ("[::1]:5001, [::1]:5002", "ipv6:[::1]:5001,[::1]:5002"),
    ("ipv4:127.0.0.1:5001,127.0.0.1:5002", "ipv4:127.0.0.1:5001,127.0.0.1:5002"),
    ("dns:///dspark-drafter.dspark.svc.cluster.local:50052", "dns:///dspark-drafter.dspark.svc.cluster.local:50052"),
    ("drafter:50052", "drafter:50052"),
])
def test_backend_targets_accept_address_lists_and_grpc_targets(value, expected):
    assert gateway_settings({"DSPARK_DRAFTER_TARGET": value}).drafter_target == expected


@pytest.mark.parametrize("env, message", [
    ({"DSPARK_DRAFTER_TARGET": "a:1,b:2"},
     "DSPARK_DRAFTER_TARGET='a:1,b:2': list entry 'a:1' is not an IP address:port"),
    ({"DSPARK_VERIFIER_TARGET": "127.0.0.1:1,[::1]:2"}, "mixes IPv4 and IPv6"),
    ({"DSPARK_DRAFTER_TARGET": "127.0.0.1:1,127.0.0.1:0"}, "'127.0.0.1:0' is not an IP address:port"),
    ({"DSPARK_DRAFTER_FAILOVERS": "-1"}, "DSPARK_DRAFTER_FAILOVERS='-1': must be an integer >= 0"),
    # more digits than int() converts: still the variable, and the value elided
    ({"DSPARK_DRAFTER_FAILOVERS": "7" * 5000}, "DSPARK_DRAFTER_FAILOVERS='777777"),
])
def test_bad_backend_settings_are_refused_naming_the_variable(env, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        gateway_settings(env)


def test_failovers_zero_keeps_the_old_behaviour_and_the_default_is_two():
    assert gateway_settings({}).drafter_failovers == 2
    assert gateway_settings({"DSPARK_DRAFTER_FAILOVERS": "0"}).drafter_failovers == 0
