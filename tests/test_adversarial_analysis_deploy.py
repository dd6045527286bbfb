"""Adversarial input for the analysis commands, the deployment settings and the kernel / top-k
selection: each case is one that used to crash with a traceback (or silently mis-report), now a
one-line error naming the value (CLI: exit 2) or a correct result."""

from __future__ import annotations

import asyncio
import functools
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.analysis.traces import Span, load_spans, span_to_json
from services.common.server import start_server
from services.common.settings import MAX_CONNECTION_AGE_S, MAX_TIMEOUT_S
from services.gateway.metrics import GatewayMetrics
from services.settings import gateway_settings, model_settings, serve_settings
from services.verifier.topk_diag import TopKDiagSettings, maybe_wrap

REPO = Path(__file__).resolve().parents[1]
TRACE = "a" * 32
T0 = 1_800_000_000 * 10**9  # ns
MS = 1_000_000
ROUND = {"spec_decode.round": 1, "spec_decode.drafted": 3, "spec_decode.submitted": 3, "spec_decode.accepted": 2,
         "spec_decode.gate_decision": "full", "spec_decode.verify_ms": 10.0, "spec_decode.draft_ms": 5.0}


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSPARK_", "OTEL_", "DEEPSEEK_DSPARK_"))}
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=env, stdin=subprocess.DEVNULL)


def _span(name: str, span_id: str, parent: str | None, attrs: dict, start: int = T0, end: int = T0 + MS) -> dict:
    return span_to_json(Span(name, TRACE, span_id, parent, start, end, attrs))


def _write(path: Path, values: list) -> str:
    path.write_text("".join(json.dumps(v) + "\n" for v in values))
    return str(path)


def _one_line_error(out: subprocess.CompletedProcess, command: str) -> str:
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr and out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dspark {command}: error: ")
    return lines[0][len(f"dspark {command}: error: "):]


# ---------------------------------------------------------------------------- trace-report / calibrate
R = "1" * 16
G = "2" * 16
BAD_ROUNDS = [  # (round attributes, message after "FILE:1: span 'spec_decode.round' 1111111111111111: ")
    ({**ROUND, "spec_decode.submitted": "abc"}, "spec_decode.submitted='abc' is not a count (an integer >= 0)"),
    ({**ROUND, "spec_decode.submitted": [1, 2]}, "spec_decode.submitted=[1, 2] is not a count (an integer >= 0)"),
    ({**ROUND, "spec_decode.submitted": 2.5}, "spec_decode.submitted=2.5 is not a count (an integer >= 0)"),
    ({**ROUND, "spec_decode.submitted": -3}, "spec_decode.submitted=-3 is not a count (an integer >= 0)"),
    ({**ROUND, "spec_decode.accepted": 10}, "spec_decode.accepted=10 is not at most spec_decode.submitted=3"),
    ({**ROUND, "spec_decode.verify_ms": math.nan},
     "spec_decode.verify_ms=nan is not a duration (a finite number >= 0 ms)"),
    ({**ROUND, "spec_decode.verify_ms": 1e308},
     "spec_decode.verify_ms=1e+308 is not a duration (a finite number >= 0 ms)"),
    ({**ROUND, "spec_decode.draft_ms": -1.0}, "spec_decode.draft_ms=-1.0 is not a duration (a finite number >= 0 ms)"),
    ({**ROUND, "spec_decode.confidence_logits": [1.0]},
     "spec_decode.confidence_logits=[1.0] is not one logit per decided draft (the round submitted 3, accepted 2)"),
    ({**ROUND, "spec_decode.confidence_logits": "abc"},
     "spec_decode.confidence_logits='abc' is not a list of numbers (not NaN)"),
]


def _in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """`dspark ARGS` run by `services.cli.main` in this process (no interpreter start-up), as
    the CompletedProcess `_cli` gives; exit statuses from argparse's SystemExit included."""
    from services.cli import main
    try:
        code = main(list(args))
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["dspark", *args], code, out.out, out.err)


@pytest.mark.parametrize("attrs, message", BAD_ROUNDS)
def test_trace_report_names_file_line_span_and_attribute_of_a_bad_round_value(tmp_path, capsys, attrs, message):
    # before: TypeError / IndexError tracebacks, or a bare "invalid literal for int()" without a file.
    # In process: the command's own code path; the first case also runs the real command line.
    path = _write(tmp_path / "t.jsonl", [_span("spec_decode.round", R, G, attrs)])
    for command in ("trace-report", "calibrate"):
        run = _cli if attrs is BAD_ROUNDS[0][0] else functools.partial(_in_process, capsys)
        got = _one_line_error(run(command, path), command)
        assert got == f"{path}:1: span 'spec_decode.round' {R}: {message}"


def test_trace_report_names_bad_generation_and_child_span_values(tmp_path):
    gen = _write(tmp_path / "g.jsonl", [_span("gateway.generate", G, None, {"gen_ai.usage.output_tokens": "5",
                                                                            "gen_ai.server.time_to_first_token": 0.1})])
    assert _one_line_error(_cli("trace-report", "--json", gen), "trace-report") == \
        f"{gen}:1: span 'gateway.generate' {G}: gen_ai.usage.output_tokens='5' is not a count (an integer >= 0)"
    child = _write(tmp_path / "c.jsonl", [_span("spec_decode.round", R, G, ROUND),
                                          _span("verifier.verify", "3" * 16, R, {"verifier.forward_ms": "fast"})])
    assert _one_line_error(_cli("trace-report", child), "trace-report") == \
        f"{child}:2: span 'verifier.verify' {'3' * 16}: verifier.forward_ms='fast' is not a duration " \
        "(a finite number >= 0 ms)"


def test_malformed_spans_and_json_are_one_line_errors(tmp_path, capsys):
    good = _span("spec_decode.round", R, G, ROUND)
    cases = [
        ({**good, "name": 5}, "span name 5 is not a string"),
        (_span("spec_decode.round", R, G, ROUND, start=T0 + MS, end=T0), "span 'spec_decode.round': ends 1 ms before "
                                                                         "it starts"),
        ({**good, "attributes": [1, 2]}, "attributes=[1, 2] is not a JSON object"),
        ({**good, "events": [1]}, "event=1 is not a JSON object"),
        ({"resourceSpans": [{"scopeSpans": [{"spans": [
            {"traceId": TRACE, "spanId": R, "name": "x", "startTimeUnixNano": "-5", "endTimeUnixNano": "10"}]}]}]},
         "startTimeUnixNano='-5' is not a time in ns since 1970"),
        ({"resourceSpans": [{"scopeSpans": [{"spans": [
            {"traceId": TRACE, "spanId": R, "name": "x", "startTimeUnixNano": "1", "endTimeUnixNano": "10",
             "attributes": [{"key": "spec_decode.submitted", "value": {"intValue": "x"}}]}]}]}]},
         "intValue='x' is not an integer"),
    ]
    for i, (value, message) in enumerate(cases):
        path = _write(tmp_path / f"bad{i}.jsonl", [value])
        assert _one_line_error(_in_process(capsys, "trace-report", path), "trace-report") == f"{path}:1: {message}"
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "]" * 100_000 + "\n")  # before: RecursionError traceback
    assert _one_line_error(_cli("trace-report", str(deep)), "trace-report") == f"{deep}:1: JSON nested too deeply"
    digits = tmp_path / "digits.jsonl"
    digits.write_text(json.dumps(good) + "\n" + "1" * 5000 + "\n")  # before: no file named
    got = _one_line_error(_cli("trace-report", str(digits)), "trace-report")
    assert got.startswith(f"{digits}:2: not readable as JSON (Exceeds the limit (4300 digits)")


def test_a_file_passed_twice_counts_once_and_a_reused_span_id_is_an_error(tmp_path):
    spans = [_span("gateway.generate", G, None, {"spec_decode.rounds": 1, "spec_decode.submitted": 3}),
             _span("spec_decode.round", R, G, ROUND)]
    path = _write(tmp_path / "t.jsonl", spans)
    out = _cli("trace-report", "--json", path, path)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    # before: 4 spans, 2 rounds and "stats match" False for a generation whose counters were right
    assert report["spans"] == 2 and len(report["rounds"]) == 1
    assert report["generations"][0]["consistent"] is True and report["generations"][0]["counts"]["submitted"] == 3
    other = _write(tmp_path / "other.jsonl", [_span("spec_decode.round", R, G, {**ROUND, "spec_decode.accepted": 1})])
    assert _one_line_error(_cli("calibrate", path, other), "calibrate") == \
        f"{other}:1: span id {R} of trace {TRACE} is also the id of a different span at {path}:2"
    assert load_spans([path, path]) == load_spans([path])


def test_extreme_confidence_logits_give_a_report_json_and_plots(tmp_path):
    # before: OverflowError in math.exp while drawing reliability.png
    attrs = {**ROUND, "spec_decode.accepted": 0, "spec_decode.confidence_logits": [-1000.0, -1000.0, -1000.0]}
    path = _write(tmp_path / "t.jsonl", [_span("spec_decode.round", R, G, attrs)])
    out = _cli("trace-report", "--json", "--png", str(tmp_path / "png"), path)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["reliability"][0]["observed"] == 1 and report["reliability"][0]["mean_logit"] == -1000.0
    assert sorted(p.name for p in (tmp_path / "png").iterdir()) == ["acceptance.png", "reliability.png",
                                                                    "timeline.png", "verify_vs_k.png"]


def test_single_round_and_empty_input_fit_what_they_can(tmp_path):
    single = _write(tmp_path / "one.jsonl", [_span("spec_decode.round", R, G, ROUND)])
    out = _cli("calibrate", single)
    assert out.returncode == 1 and out.stdout == "DSPARK_GATE_DRAFT_MS=5.000\n"
    assert "not fitted: needs timed verify rounds over at least two distinct k (have 1 timed verify rounds, 1 distinct k)" in out.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert _one_line_error(_cli("calibrate", str(empty)), "calibrate").startswith("no costs could be fitted: needs ")


# ---------------------------------------------------------------------------- parity
HEADER = {"format": "dspark-topk", "version": 1, "k": 3, "rank": 0, "pid": 1, "config_hash": "x"}


def _record(ids, logits, session=0, token=9) -> dict:
    return {"session": session, "op": "prefill", "positions": [3], "tokens": [token], "ids": [ids],
            "logits": [logits], "prompt_len": 4, "prompt_sha256": "p"}


@pytest.mark.parametrize("line, message", [
    ('{"session": 0, "op": "prefill", "positions": [3], "tokens": [9], "ids": [[4, 5, 6]], '
     '"logits": [[NaN, 7.0, 1.0]]}', "position 3: logit nan is not a finite float32 number"),
    (json.dumps(_record([4, 5, 6], [1e308, 7.0, 1.0])), "position 3: logit 1e+308 is not a finite float32 number"),
    (json.dumps(_record([4, 5, 6], [1.0, 7.0, 9.0])),
     "position 3: logits [1.0, 7.0, 9.0] are not in descending order"),
    (json.dumps(_record([4, 4, 4], [9.0, 7.0, 1.0])), "position 3: ids [4, 4, 4] repeat a token"),
    (json.dumps(_record([4.5, 5, 6], [9.0, 7.0, 1.0])), "position 3: id=4.5 is not an integer"),
    ('{"session": 1e400, "op": "decode", "positions": [3], "tokens": [9], "ids": [[4]], "logits": [[1.0]]}',
     "session=inf is not an integer"),
    ("[1, 2]", "a list, not a JSON object"),
    (json.dumps({**_record([4, 5, 6], [9.0, 7.0, 1.0]), "positions": 3}), "positions=3 is not a list"),
    (json.dumps({**_record([4, 5, 6], [9.0, 7.0, 1.0]), "prompt_sha256": ["p"]}),
     "prompt_sha256=['p'] is not a string"),
    ('{"session": 0, "op": "prefill", "positions": [3', "not JSON (Expecting ',' delimiter)"),
])
def test_parity_refuses_malformed_dumps_naming_file_and_line(tmp_path, line, message):
    # before: JSON-encoder tracebacks (NaN / inf), AttributeError / OverflowError tracebacks, or a
    # silently wrong argmax (ids not best first)
    good = _write(tmp_path / "a.jsonl", [HEADER, _record([4, 5, 6], [9.0, 7.0, 1.0])])
    bad = tmp_path / "b.jsonl"
    bad.write_text(json.dumps(HEADER) + "\n" + line + "\n")
    assert _one_line_error(_cli("parity", good, str(bad), "--json"), "parity") == f"{bad}:2: {message}"


def test_parity_refuses_an_infinite_tolerance_and_a_non_utf8_dump(tmp_path):
    good = _write(tmp_path / "a.jsonl", [HEADER, _record([4, 5, 6], [9.0, 7.0, 1.0])])
    for value in ("inf", "1e400"):  # before: a traceback from the JSON encoder (δ = inf)
        assert _one_line_error(_cli("parity", good, good, "--json", f"--tolerance={value}"), "parity") == \
            "tolerance=inf: must be a finite number >= 0"
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(json.dumps(HEADER).encode() + b"\n\xff\xfe\n")  # before: no file named
    assert _one_line_error(_cli("parity", good, str(binary)), "parity") == \
        f"{binary}:2: not UTF-8 text (invalid start byte)"
    out = _cli("parity", good, good, "--json", "--tolerance=1e30")
    assert out.returncode == 0 and json.loads(out.stdout)["delta"] == 1e30


# ---------------------------------------------------------------------------- deployment settings
@pytest.mark.parametrize("env, message", [
    ({"DSPARK_VERIFIER_TARGET": ""},
     "DSPARK_VERIFIER_TARGET='': empty (a host:port or a gRPC target such as dns:///name:port)"),
    ({"DSPARK_VERIFIER_TARGET": "127.0.0.1:99999"},
     "DSPARK_VERIFIER_TARGET='127.0.0.1:99999': port 99999 is not in 1..65535"),
    ({"DSPARK_DRAFTER_TARGET": "dns:///drafter:0"},
     "DSPARK_DRAFTER_TARGET='dns:///drafter:0': port 0 is not in 1..65535"),
    ({"DSPARK_GENERATION_TIMEOUT_S": "1e10"},
     "DSPARK_GENERATION_TIMEOUT_S='1e10': must be a number >= 0.001 and <= 100000000"),
    ({"DSPARK_ROUND_TIMEOUT_S": "-1"}, "DSPARK_ROUND_TIMEOUT_S='-1': must be a number >= 0.001 and <= 100000000"),
    ({"DSPARK_STARTUP_TIMEOUT_S": ""}, "DSPARK_STARTUP_TIMEOUT_S='': not a number"),
])
def test_bad_gateway_settings_name_the_variable_and_value(env, message):
    # before: an empty or port-99999 target failed only at start-up ("DEADLINE_EXCEEDED"); a
    # 1e10 s timeout made every backend call fail at once with DEADLINE_EXCEEDED
    with pytest.raises(ValueError) as err:
        gateway_settings(env)
    assert str(err.value) == message


def test_connection_age_past_grpcs_int_milliseconds_is_refused_and_the_largest_allowed_serves():
    # before: DSPARK_MAX_CONNECTION_AGE_S=1e7 crashed start_server with OverflowError inside grpc
    with pytest.raises(ValueError) as err:
        serve_settings({"DSPARK_MAX_CONNECTION_AGE_S": "1e7"})
    assert str(err.value) == "DSPARK_MAX_CONNECTION_AGE_S='1e7': must be a number >= 0.001 and <= 2147483.647"
    serve = serve_settings({"DSPARK_MAX_CONNECTION_AGE_S": repr(MAX_CONNECTION_AGE_S),
                            "DSPARK_DRAIN_TIMEOUT_S": repr(MAX_TIMEOUT_S)})
    assert serve.drain_timeout_s == MAX_TIMEOUT_S

    async def scenario():
        running = await start_server("dspark.test", lambda s: None, 0,
                                     max_connection_age_s=serve.max_connection_age_s)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                # the longest timeout the settings accept is a working gRPC deadline
                return (await stub.Check(health_pb2.HealthCheckRequest(), timeout=MAX_TIMEOUT_S)).status
        finally:
            await running.stop(0)

    assert asyncio.run(scenario()) == health_pb2.HealthCheckResponse.SERVING


def test_metrics_port_in_use_names_host_and_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        metrics = GatewayMetrics()
        try:
            with pytest.raises(RuntimeError) as err:
                metrics.serve(port)
        finally:
            metrics.close()
    assert str(err.value) == f"could not bind the metrics port 127.0.0.1:{port}: Address already in use"


# ---------------------------------------------------------------------------- kernels / top-k dumps
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a CUDA device the triton backend can run")
def test_triton_backend_without_a_device_or_interpreter_fails_at_construction_naming_dsv4_kernels(monkeypatch):
    # before: the trunk built fine and the first forward died inside triton ("0 active drivers")
    from dsv4.trunk import Trunk
    from kernels.select import KernelConfig
    from services.app import random_tiny_config
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    message = ("{}=triton: no CUDA device here and TRITON_INTERPRET is not 1 (the CPU interpreter), "
               "so the triton kernels cannot run; use {}=torch")
    with pytest.raises(ValueError) as err:
        KernelConfig("triton").op("sparse_attn")  # kernels/ alone knows no setting: names the argument
    assert str(err.value) == message.format("backend", "backend")
    with pytest.raises(ValueError) as err:
        Trunk(random_tiny_config(), kernels=model_settings({"DSPARK_KERNELS": "triton"}).kernel_config())
    assert str(err.value) == message.format("DSPARK_KERNELS", "DSPARK_KERNELS")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert KernelConfig("triton").op("sparse_attn").__name__ == "sparse_attn"


@pytest.mark.skipif(not Path("/proc/self").is_dir(),
                    reason="needs /proc (an existing folder nobody can create files in)")
def test_topk_dump_folder_that_refuses_files_names_the_variable():
    # before: FileNotFoundError from open() after the model had loaded, naming no variable
    with pytest.raises(ValueError) as err:
        maybe_wrap("model", TopKDiagSettings(4, Path("/proc")))
    assert str(err.value).startswith("DSPARK_TOPK_DIAG_DIR='/proc': cannot create the dump topk-rank0-pid")
