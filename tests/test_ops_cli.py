"""The operator's command line: `dspark stats`, `--help` defaults, Ctrl-C, port clashes, the
`up` ready line and its console-span files, and the summary line of `--spec off`. Each case
was a rough edge a new user met; the CLI runs as a real process where the case is about one."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from dspark_proto.v1 import gateway_pb2
from services import client_cli, serve_cli
from services.cli import main
from services.common.server import start_server
from services.common.settings import GatewaySettings
from services.gateway.backends import BackendError, Backends
from services.gateway.servicer import connect_backends
from services_fixtures import gen_request, service_loop, start_stack

REPO = Path(__file__).resolve().parents[1]
CLI_TIMEOUT_S = 60


def _env(**extra: str) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DSPARK_", "OTEL_", "DEEPSEEK_DSPARK_", "DSV4_"))}
    return {**base, "PYTHONPATH": str(REPO), **extra}


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=CLI_TIMEOUT_S, env=_env(**env), stdin=subprocess.DEVNULL)


def _ctrl_c_reaches_it() -> None:
    """Popen preexec_fn: SIGINT's default disposition in the child. A shell that starts a job
    in the background without job control (`make test &`, CI runners) makes it ignore SIGINT,
    and Python then keeps ignoring it, so the Ctrl-C these tests send would never arrive."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _listening() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


# ---------------------------------------------------------------------------- --help
@pytest.mark.parametrize("command, shown", [
    ("generate", ["(default: 64)", "(default: 127.0.0.1:50050)", "(default: 300.0)", "(default: default)"]),
    ("up", ["(default: 50050)", "--metrics-port", "checkpoint folder all three load", "--spans-dir"]),
    ("serve", ["(default: 127.0.0.1)", "(default: 1)", "(default: $DSPARK_DEVICE, else cpu"]),
    ("stats", ["(default: 127.0.0.1:50050)", "(default: 10.0)", "--json"]),
])
def test_help_shows_the_defaults(command, shown, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines at the terminal width
    for text in shown:
        assert text in out, (text, out)
    assert "(default: None)" not in out and "(default: False)" not in out


# ---------------------------------------------------------------------------- generate
def test_ctrl_c_in_generate_prints_one_line_and_no_traceback():
    with _listening() as silent:  # accepts, never answers: the call waits until the interrupt
        port = silent.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "generate", "hi", "--target",
                                 f"127.0.0.1:{port}"], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, preexec_fn=_ctrl_c_reaches_it)
        silent.settimeout(CLI_TIMEOUT_S)
        conn, _ = silent.accept()  # the client connected: past its imports, inside the call
        with conn:
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=CLI_TIMEOUT_S)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.strip().splitlines()[-1] == "dspark generate: interrupted"


def _final(submitted: int, accepted: int, rounds: int) -> gateway_pb2.GenerateResponse:
    rate = accepted / submitted if submitted else 0.0
    return gateway_pb2.GenerateResponse(
        finished=True, finish_reason="length", usage=gateway_pb2.Usage(prompt_tokens=3, completion_tokens=8),
        spec_stats=gateway_pb2.SpecStats(rounds=rounds, submitted=submitted, accepted=accepted, acceptance_rate=rate,
                                         mean_acceptance_length=1.5 if submitted else 0.0),
        time_to_first_token_ms=12.0)


def test_summary_line_without_verified_drafts_reports_no_acceptance():
    line = client_cli.final_line(_final(0, 0, 7))
    assert "acceptance" not in line and "no drafts verified" in line
    assert line.startswith("[length] 8 tokens, 7 rounds")
    assert "acceptance 50%, mean acceptance length 1.50" in client_cli.final_line(_final(4, 2, 3))


def test_summary_line_gives_the_seed_of_a_sampled_generation_only():
    final = _final(4, 2, 3)
    final.seed = 1234
    assert client_cli.final_line(final, sampled=True).endswith("TTFT 12 ms, seed 1234")
    assert client_cli.final_line(final, sampled=False).endswith("TTFT 12 ms")  # greedy: no seed in use


def test_logprobs_without_json_is_refused_before_any_call(capsys):
    # nothing listens on the target: the refusal must come before the client connects
    assert main(["generate", "hi", "--logprobs", "3", "--target", "127.0.0.1:9"]) == 2
    assert capsys.readouterr().err.strip() == "dspark generate: --logprobs prints with --json only; add --json"


# ---------------------------------------------------------------------------- ports
def test_serve_on_a_taken_port_says_one_line_without_grpc_logs():
    with _listening() as taken:
        port = taken.getsockname()[1]
        out = _cli("serve", "drafter", "--port", str(port))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"dspark serve drafter: the --port port 127.0.0.1:{port} is in use (Address already in use): "
        "another process holds it"]


def test_serve_refuses_a_metrics_port_equal_to_its_grpc_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = _cli("serve", "verifier", "--port", str(port), "--metrics-port", str(port))
    assert out.returncode == 2 and "metrics port" in out.stderr and "also the --port port" in out.stderr


def test_up_with_an_overlapping_port_base_names_the_taken_port_at_once():
    with _listening() as taken:
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        out = _cli("up", "--port-base", str(port - 1))
        took = time.monotonic() - t0
    assert out.returncode == 2 and out.stdout == ""  # no child started
    assert out.stderr.strip().splitlines() == [
        f"dspark up: the verifier (--port-base + 1) port 127.0.0.1:{port} is in use (Address already in use): "
        "another process holds it"]
    assert took < 30  # it never waits for a backend's start-up deadline


def test_a_verifier_target_that_is_another_service_is_named_at_once():
    async def scenario() -> str:
        other = await start_server("dspark.v1.Gateway", lambda server: None)  # health only: no Verifier
        backends = Backends(GatewaySettings(verifier_target=f"127.0.0.1:{other.port}", drafter_target="",
                                            startup_timeout_s=60))
        try:
            with pytest.raises(BackendError) as err:
                await connect_backends(backends)
            return str(err.value)
        finally:
            await backends.close()
            await other.server.stop(0)

    message = service_loop().run(scenario())  # grpc.aio: the one loop of the test process
    assert "does not serve dspark.v1.Verifier (UNIMPLEMENTED" in message and "within" not in message


# ---------------------------------------------------------------------------- up: console spans
def test_up_gives_each_service_its_own_console_span_file(tmp_path, monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    args = argparse.Namespace(port_base=1, metrics_port=None, record_rounds=None, checkpoint=None, oracle=False,
                              spans_dir=str(tmp_path))
    with socket.socket() as probe:  # a free block of three ports
        probe.bind(("127.0.0.1", 0))
        args.port_base = min(probe.getsockname()[1], 65000)
    argv, env, spans = serve_cli._up_plan(args)
    assert spans == {n: str(tmp_path / f"dspark-{n}.spans.json") for n in ("gateway", "verifier", "drafter")}
    args.spans_dir = str(tmp_path / "missing")
    with pytest.raises(ValueError, match="--spans-dir="):
        serve_cli._up_plan(args)


def test_up_passes_each_child_its_own_metrics_port():
    assert serve_cli.up_metrics_ports(9000) == {"gateway": 9000, "verifier": 9001, "drafter": 9002}
    with pytest.raises(ValueError, match="--metrics-port=65534"):
        serve_cli.up_metrics_ports(65534)


# ---------------------------------------------------------------------------- stats
@pytest.fixture(scope="module")
def gateway():
    stack = start_stack("oracle")
    gw = stack.gateway("batched")
    stack.generate(gen_request("abc", max_tokens=10, spec="always"), "batched")
    yield gw
    stack.close()


def test_stats_json_is_the_gateways_stats(gateway, capsys):
    assert main(["stats", "--target", gateway.target, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["generations"] == 1 and stats["completion_tokens"] == 10
    assert stats["speculation"]["rounds"] > 0


def test_stats_prints_readable_tables(gateway, capsys):
    assert main(["stats", "--target", gateway.target]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[-1] for line in out.splitlines() if len(line.split()) >= 2}
    assert rows["generations"] == "1" and rows["completion_tokens"] == "10" and rows["verify_mode"] == "batched"
    assert "acceptance_rate" in rows and rows["acceptance_rate"].endswith("%")
    assert "gate.buckets" in out


def test_stats_of_an_unreachable_gateway_fails_within_its_deadline(capsys):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    t0 = time.monotonic()
    assert main(["stats", "--target", f"127.0.0.1:{port}", "--timeout", "1"]) == 1
    assert time.monotonic() - t0 < 10
    assert capsys.readouterr().err.startswith(f"dspark stats: 127.0.0.1:{port}: UNAVAILABLE")


# ---------------------------------------------------------------------------- up, end to end
def test_up_says_ctrl_c_stops_only_once_the_gateway_serves_and_all_three_serve_metrics(tmp_path):
    ports = []
    while len(ports) < 2:  # two free blocks of three ports
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            p = probe.getsockname()[1]
        if p < 65000 and all(abs(p - q) > 3 for q in ports):
            ports.append(p)
    base, metrics = ports
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--port-base", str(base),
                             "--metrics-port", str(metrics)], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, preexec_fn=_ctrl_c_reaches_it)
    try:
        first = proc.stdout.readline()
        assert first.startswith("dspark up: starting") and "Ctrl-C" not in first
        ready = proc.stdout.readline()
        assert ready.startswith("dspark up: ready:") and ready.rstrip().endswith("Ctrl-C stops")
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        with grpc.insecure_channel(f"127.0.0.1:{base}") as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="dspark.v1.Gateway"),
                                                         timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        for offset, family in ((0, "dspark_gateway_requests_total"), (1, "dspark_verifier_open_sessions"),
                               (2, "dspark_drafter_drafts_total")):
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics + offset}/metrics", timeout=10) as r:
                text = r.read().decode()
            assert family in text and "otel_scope" not in text
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    assert proc.returncode == 0


def test_a_port_in_time_wait_is_free_and_a_held_port_is_named():
    """The start-up probe (used by `dspark up`, `dspark serve` and the demo) must treat a port
    left in TIME_WAIT by a previous run's connections as free, as the gRPC server binding it
    with SO_REUSEADDR will, and name a port a live listener holds."""
    import socket

    from services.common.ports import check_ports_free

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    with pytest.raises(ValueError, match=f"the verifier port 127.0.0.1:{port} is in use"):
        check_ports_free("127.0.0.1", {"verifier": port})
    server.close()
    conn.close()  # the server side closes first: its end of the connection enters TIME_WAIT
    client.close()
    check_ports_free("127.0.0.1", {"verifier": port})  # no error: TIME_WAIT is not a holder


def test_stats_view_rounds_every_number_of_a_list_like_a_single_value():
    """`dspark stats` printed a list of floats (the verifier's step table) at full precision
    while every single value is shown to 4 significant digits."""
    import io

    from rich.console import Console

    from services.stats_view import render_stats
    out = io.StringIO()
    render_stats({"costs": {"verify_table": [38.642142833272274, 40.0, None], "plain_ms": 25.123456}},
                 Console(file=out, width=200, emoji=False, highlight=False))
    text = out.getvalue()
    assert "verify_table" in text and "[38.64, 40, -]" in text and "25.12" in text
    assert "38.642" not in text
