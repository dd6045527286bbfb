"""`dspark serve`, `dspark up` and `dspark generate` end bad settings and start-up failures with
one line naming the variable (or flag) and its value, exit 2, never a traceback. Each case here
used to end in a traceback (or, for a token with a newline, "INTERNAL: Invalid metadata").
The settings cases fail before any model loads, so each run takes about a second."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from services import client_cli, serve_cli
from services.common.settings import MAX_TIMEOUT_S

REPO = Path(__file__).resolve().parents[1]
CLI_TIMEOUT_S = 60
TOKEN = "s3cret-Token_0123456789"


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("DSPARK_", "OTEL_", "DEEPSEEK_DSPARK_", "DSV4_"))}
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=CLI_TIMEOUT_S, env={**base, **(env or {})}, stdin=subprocess.DEVNULL)


def _error(out: subprocess.CompletedProcess, prefix: str) -> str:
    """The last stderr line (the error) after `prefix`; asserts exit 2 and no traceback."""
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(prefix), out.stderr
    return last[len(prefix):]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- dspark serve: settings
BAD_SETTINGS = [  # (service, extra args, environment, what the line names)
    ("verifier", [], {"DSPARK_MAX_SESSIONS": "abc"}, "DSPARK_MAX_SESSIONS='abc'"),
    ("drafter", [], {"DSPARK_MAX_SESSIONS": "0"}, "DSPARK_MAX_SESSIONS='0'"),
    ("verifier", [], {"DSPARK_VERIFY_NUMERICS": "EXACT"}, "DSPARK_VERIFY_NUMERICS='EXACT'"),
    ("verifier", [], {"DSPARK_VERIFY_MODE": "fast"}, "DSPARK_VERIFY_MODE='fast'"),
    ("gateway", [], {"DSPARK_ROUND_TIMEOUT_S": "-1"}, "DSPARK_ROUND_TIMEOUT_S='-1'"),
    ("gateway", [], {"DSPARK_GENERATION_TIMEOUT_S": "nan"}, "DSPARK_GENERATION_TIMEOUT_S='nan'"),
    ("gateway", [], {"DSPARK_STARTUP_TIMEOUT_S": "1e300"}, "DSPARK_STARTUP_TIMEOUT_S='1e300'"),
    ("gateway", [], {"DSPARK_VERIFIER_TARGET": "127.0.0.1:99999"}, "DSPARK_VERIFIER_TARGET='127.0.0.1:99999'"),
    ("gateway", [], {"DSPARK_DRAFTER_FAILOVERS": "-2"}, "DSPARK_DRAFTER_FAILOVERS='-2'"),
    ("drafter", [], {"DSPARK_DRAIN_TIMEOUT_S": "0"}, "DSPARK_DRAIN_TIMEOUT_S='0'"),
    ("verifier", [], {"DSPARK_KERNELS": "bogus"}, "DSPARK_KERNELS='bogus'"),
    ("drafter", [], {"DSPARK_MOE_DETERMINISTIC_REDUCE": "2"}, "DSPARK_MOE_DETERMINISTIC_REDUCE='2'"),
    ("verifier", [], {"DSPARK_TOPK_DIAG": "abc"}, "DSPARK_TOPK_DIAG='abc'"),
    ("verifier", ["--tp", "2"], {"DSPARK_VERIFY_NUMERICS": "exact"}, "DSPARK_VERIFY_NUMERICS='exact' needs --tp 1"),
    ("verifier", ["--tp", "0"], {}, "--tp=0"),
    ("drafter", ["--port", "70000"], {}, "--port=70000"),
    ("gateway", [], {"DSPARK_GATE_MARGIN": "abc"}, "DSPARK_GATE_MARGIN"),
    ("drafter", [], {"OTEL_TRACES_EXPORTER": "bogus"}, "OTEL_TRACES_EXPORTER='bogus'"),
    ("gateway", ["--record-rounds", str(REPO / "no-such-dir" / "r.json")], {},
     f"--record-rounds='{REPO / 'no-such-dir' / 'r.json'}': folder '{REPO / 'no-such-dir'}' does not exist"),
    ("gateway", ["--record-rounds", str(REPO / "tests")], {}, f"--record-rounds='{REPO / 'tests'}': is a directory"),
    ("verifier", [], {"DSPARK_TRACES_JSONL": str(REPO / "no-such-dir" / "t.jsonl")},
     f"DSPARK_TRACES_JSONL='{REPO / 'no-such-dir' / 't.jsonl'}': cannot open"),
]


@pytest.mark.parametrize("service, extra, env, named", BAD_SETTINGS, ids=[b[3] for b in BAD_SETTINGS])
def test_serve_with_a_bad_setting_exits_2_with_one_line_naming_it_before_loading_a_model(service, extra, env, named):
    out = _cli("serve", service, *(["--port", "0"] if "--port" not in extra else []), *extra, env=env)
    message = _error(out, f"dspark serve {service}: ")
    assert named in message
    assert len(out.stderr.strip().splitlines()) == 1 and out.stdout == ""  # failed before any model loaded


# ---------------------------------------------------------------------------- dspark serve: start-up
def test_serve_on_a_port_in_use_exits_2_naming_the_address():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _cli("serve", "drafter", "--port", str(port))
    assert f"127.0.0.1:{port}" in _error(out, "dspark serve drafter: ")


def test_a_second_grpc_server_on_a_taken_port_is_refused_not_sharing_it():
    # gRPC's default SO_REUSEPORT would let two services bind one port and split its clients.
    import asyncio

    from services.common.server import start_server

    async def scenario() -> str:
        first = await start_server("first", lambda server: None)
        try:
            with pytest.raises(RuntimeError) as err:
                await start_server("second", lambda server: None, port=first.port)
            return str(err.value)
        finally:
            await first.server.stop(0)

    assert asyncio.run(scenario()).startswith("could not bind 127.0.0.1:")


def test_serve_with_a_missing_checkpoint_exits_2_naming_it():
    missing = REPO / "no-such-checkpoint"
    assert not missing.exists()
    out = _cli("serve", "verifier", "--port", "0", "--checkpoint", str(missing))
    assert str(missing) in _error(out, "dspark serve verifier: ")


def test_gateway_whose_verifier_is_unreachable_at_start_exits_2_naming_the_target_and_the_deadline():
    target = f"127.0.0.1:{_free_port()}"  # nothing listens there
    out = _cli("serve", "gateway", "--port", "0",
               env={"DSPARK_VERIFIER_TARGET": target, "DSPARK_DRAFTER_TARGET": "", "DSPARK_STARTUP_TIMEOUT_S": "0.5"})
    message = _error(out, "dspark serve gateway: ")
    assert f"DSPARK_VERIFIER_TARGET='{target}'" in message and "DSPARK_STARTUP_TIMEOUT_S=0.5" in message


def test_unexpected_exception_types_still_propagate(monkeypatch):
    async def broken(*args, **kwargs):
        raise TypeError("a bug")

    monkeypatch.setattr(serve_cli, "_serve_async", broken)
    for name in [k for k in os.environ if k.startswith(("DSPARK_", "DSV4_"))]:
        monkeypatch.delenv(name)
    args = argparse.Namespace(service="drafter", port=0, tp=1, metrics_port=None)
    with pytest.raises(TypeError, match="a bug"):
        serve_cli._serve(args)


# ---------------------------------------------------------------------------- dspark up
def test_up_with_a_bad_setting_exits_2_before_starting_anything():
    out = _cli("up", env={"DSPARK_MAX_SESSIONS": "abc"})
    assert "DSPARK_MAX_SESSIONS='abc'" in _error(out, "dspark up: ")
    assert len(out.stderr.strip().splitlines()) == 1 and out.stdout == ""  # no child was started


# ---------------------------------------------------------------------------- dspark generate
def test_generate_timeout_limit_is_the_settings_one():
    assert client_cli.MAX_TIMEOUT_S == MAX_TIMEOUT_S


@pytest.mark.parametrize("value, shown", [("-1", "-1"), ("0", "0"), ("1e300", "1e+300"), ("nan", "nan"),
                                          ("inf", "inf")])
def test_generate_refuses_a_timeout_outside_0_to_1e8(value, shown):
    out = _cli("generate", "abc", "--target", f"127.0.0.1:{_free_port()}", "--timeout", value)
    assert _error(out, "dspark generate: ") == f"--timeout={shown} must be > 0 and <= 100000000 s"


@pytest.mark.parametrize("where", ["env", "flag"])
@pytest.mark.parametrize("token", [TOKEN + "\n", "two words", TOKEN + "\x1b[2J", "tökén"])
def test_generate_refuses_a_token_that_cannot_be_sent_naming_its_source_but_not_its_value(where, token):
    target = ["--target", f"127.0.0.1:{_free_port()}", "--timeout", "5"]
    if where == "env":
        out, source = _cli("generate", "abc", *target, env={"DSPARK_GATEWAY_TOKEN": token}), "DSPARK_GATEWAY_TOKEN"
    else:
        out, source = _cli("generate", "abc", *target, "--token", token), "--token"
    message = _error(out, "dspark generate: ")
    assert message == f"{source}: the token must be printable ASCII without spaces (value not shown)"
    assert "s3cret" not in out.stderr and "two" not in out.stderr and "t\u00f6k" not in out.stderr


@pytest.mark.parametrize("flag, value, words", [
    ("--repetition-penalty", "0", "--repetition-penalty=0 must be > 0 (1 is off)"),  # the wire's 0 is "unset"
    ("--repetition-penalty", "-1", "--repetition-penalty=-1 must be > 0"),
    ("--repetition-penalty", "1e-50", "--repetition-penalty=1e-50: outside the float32 range"),  # would arrive as 0
    ("--top-p", "1e-50", "--top-p=1e-50: outside the float32 range"),
    ("--top-p", "0", "--top-p=0 must lie in (0, 1]"),
    ("--temperature", "1e39", "--temperature=1e+39: outside the float32 range"),  # would arrive as inf
    ("--presence-penalty", "-1e-46", "--presence-penalty=-1e-46: outside the float32 range"),
])
def test_generate_refuses_a_float_flag_the_wire_would_turn_into_unset_or_inf(flag, value, words, capsys):
    from services.cli import main
    assert main(["generate", "abc", "--target", f"127.0.0.1:{_free_port()}", "--timeout", "5", f"{flag}={value}"]) == 2
    assert words in capsys.readouterr().err  # refused before connecting: nothing listens on the port


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "x"])
def test_serve_drafter_refuses_a_doubtful_logit_that_is_not_a_finite_number(value, capsys):
    from services.cli import main
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "drafter", "--oracle", f"--oracle-doubtful={value}"])
    assert exit_.value.code == 2  # argparse's usage error, before any setting is read or model loaded
    assert f"argument --oracle-doubtful: {value!r} must be a finite number" in capsys.readouterr().err


def test_serve_drafter_parses_a_confidently_wrong_oracle():
    from services.cli import build_parser
    args = build_parser().parse_args(["serve", "drafter", "--oracle", "--oracle-corrupt-every", "1",
                                      "--oracle-doubtful", "6.5"])
    assert (args.oracle, args.oracle_corrupt_every, args.oracle_doubtful) == (True, 1, 6.5)
