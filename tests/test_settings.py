"""`services.settings`: one reader of the environment, a typed tree per service, and a
`common` package that depends on no service package."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.settings import BackendSettings, GatewaySettings, ServeSettings
from services.settings import read_settings

REPO = Path(__file__).resolve().parents[1]


def test_each_service_reads_only_its_own_sections():
    # a gateway-only variable with a bad value does not stop a verifier, and the other way round
    verifier = read_settings({"DSPARK_ROUND_TIMEOUT_S": "-1", "DSPARK_KERNELS": "triton"}, "verifier")
    assert verifier.model.kernels == "triton" and verifier.tp.call_timeout_s == 120.0
    assert verifier.gateway is None and verifier.gate is None and verifier.metrics_port is None
    gateway = read_settings({"DSPARK_MAX_SESSIONS": "abc", "DSPARK_GATE": "1"}, "gateway")
    assert gateway.gate.enabled is True and gateway.gateway.round_timeout_s == 30.0
    assert gateway.model is None and gateway.backend is None and gateway.tp is None
    drafter = read_settings({"DSPARK_MAX_SESSIONS": "3"}, "drafter")
    assert drafter.backend.max_sessions == 3 and drafter.tp is None and drafter.topk is None
    with pytest.raises(ValueError, match="DSPARK_ROUND_TIMEOUT_S='-1'"):
        read_settings({"DSPARK_ROUND_TIMEOUT_S": "-1"}, "gateway")
    with pytest.raises(ValueError, match="DSPARK_STEP_BUDGET.*DSPARK_VERIFY_MODE"):
        read_settings({"DSPARK_STEP_BUDGET": "trim", "DSPARK_VERIFY_MODE": "sequential"}, "gateway")
    with pytest.raises(ValueError, match="service='router'"):
        read_settings({}, "router")


def test_flags_win_over_variables():
    env = {"DSPARK_CHECKPOINT": "/from/env", "DSPARK_METRICS_PORT": "9000"}
    assert read_settings(env, "gateway").checkpoint == "/from/env"
    assert read_settings(env, "gateway").metrics_port == 9000
    flagged = read_settings(env, "gateway", checkpoint_flag="/from/flag", metrics_port_flag=0)
    assert flagged.checkpoint == "/from/flag" and flagged.metrics_port == 0
    assert read_settings({"DSPARK_CHECKPOINT": ""}, "drafter").checkpoint is None


@pytest.mark.parametrize("build, message", [
    (lambda: GatewaySettings(round_timeout_s=0.0), "round_timeout_s=0.0: must be a number of seconds >= 0.001"),
    (lambda: GatewaySettings(verify_mode="fast"), "verify_mode='fast': must be one of ('sequential', 'batched')"),
    (lambda: GatewaySettings(drafter_failovers=-1), "drafter_failovers=-1: must be an integer >= 0"),
    # the verifier's step cuts batched blocks only: a budget over sequential verifies would do nothing
    (lambda: GatewaySettings(step_budget="full", verify_mode="sequential"),
     "step_budget='full' (DSPARK_STEP_BUDGET) needs verify_mode='batched' (DSPARK_VERIFY_MODE), not 'sequential'"),
    (lambda: GatewaySettings(token="two words"), "token: must be printable ASCII without spaces (value not shown)"),
    (lambda: BackendSettings(max_sessions=0), "max_sessions=0: must be an integer >= 1"),
    (lambda: BackendSettings(verify_numerics="bitwise"), "verify_numerics='bitwise': must be one of"),
    (lambda: BackendSettings(torch_threads=0), "torch_threads=0: must be an integer >= 1"),
    (lambda: BackendSettings(torch_threads=1025), "torch_threads=1025: must be <= 1024"),
    (lambda: ServeSettings(health_port=70000), "health_port=70000: must be a port in 1..65535"),
    (lambda: ServeSettings(max_connection_age_s=1e7), "max_connection_age_s=10000000.0: must be a number"),
])
def test_settings_objects_validate_themselves_naming_the_field(build, message):
    with pytest.raises(ValueError) as err:
        build()
    assert str(err.value).startswith(message)


def test_common_imports_no_service_package():
    code = ("import sys, services.common.settings, services.common.server, services.common.tls, "
            "services.common.telemetry, services.common.sessions, services.common.tensors, services.common.errors; "
            "print(sorted(m for m in sys.modules if m.split('.')[:2] in "
            "(['services', 'gateway'], ['services', 'verifier'], ['services', 'drafter'], ['services', 'settings'])))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_only_the_settings_module_and_the_entry_points_read_the_environment():
    allowed = {"services/settings.py", "services/serve_cli.py", "services/client_cli.py", "services/cli.py"}
    readers = sorted(str(p.relative_to(REPO)) for folder in ("services", "dsv4") for p in (REPO / folder).rglob("*.py")
                     if re.search(r"os\.environ|os\.getenv", p.read_text(encoding="utf-8")))
    assert [r for r in readers if r not in allowed] == []


def test_torch_threads_come_from_the_environment_naming_a_bad_value():
    assert read_settings({}, "verifier").backend.torch_threads == 1
    assert read_settings({"DSPARK_TORCH_THREADS": "4"}, "drafter").backend.torch_threads == 4
    with pytest.raises(ValueError, match=r"DSPARK_TORCH_THREADS='two': must be an integer >= 1 and <= 1024"):
        read_settings({"DSPARK_TORCH_THREADS": "two"}, "verifier")


@pytest.mark.parametrize("raw", ["1_0", "\u0661\u0660", "infinity", "inf", "nan", "0x10", "", " ",
                                 "5\x1c", "\u30005", "\xa05"])
def test_seconds_take_only_a_plain_decimal_spelling(raw):
    # float() accepts the first five and the last three (str.strip() treats \x1c and U+3000 as space);
    # an operator would not read them as the deadline in force
    with pytest.raises(ValueError, match="DSPARK_ROUND_TIMEOUT_S=.*: not a number"):
        read_settings({"DSPARK_ROUND_TIMEOUT_S": raw}, "gateway")


def test_seconds_in_decimal_and_exponent_form_are_read():
    for raw, value in [("2.5", 2.5), (" 30 ", 30.0), ("1e3", 1000.0), (".5", 0.5)]:
        assert read_settings({"DSPARK_ROUND_TIMEOUT_S": raw}, "gateway").gateway.round_timeout_s == value
    for raw in ("-1", "0.0005", "1e-320"):  # under 1 ms: a whole-ms channel argument would read 0
        with pytest.raises(ValueError, match=rf"DSPARK_MAX_CONNECTION_AGE_S='{raw}': must be a number >= 0.001"):
            read_settings({"DSPARK_MAX_CONNECTION_AGE_S": raw}, "gateway")


def test_tp_deadlines_have_the_same_upper_bound_as_the_other_timeouts():
    assert read_settings({"DSPARK_TP_CALL_TIMEOUT_S": ""}, "verifier").tp.call_timeout_s == 120.0
    with pytest.raises(ValueError, match=r"DSPARK_TP_CALL_TIMEOUT_S='1e300': must be a number >= 0.001 and <= 100000000$"):
        read_settings({"DSPARK_TP_CALL_TIMEOUT_S": "1e300"}, "verifier")
    with pytest.raises(ValueError, match=r"DSPARK_TP_INIT_TIMEOUT_S='1_0': not a number"):
        read_settings({"DSPARK_TP_INIT_TIMEOUT_S": "1_0"}, "verifier")


def test_the_http_body_limit_is_a_positive_byte_count_read_by_the_gateway_only():
    assert read_settings({}, "gateway").http_max_body_bytes == 4 * 2**20
    assert read_settings({"DSPARK_HTTP_MAX_BODY_BYTES": "65536"}, "gateway").http_max_body_bytes == 65536
    assert read_settings({"DSPARK_HTTP_MAX_BODY_BYTES": "0"}, "verifier").service == "verifier"
    for raw in ("0", "-5", "4MiB"):
        with pytest.raises(ValueError, match=f"DSPARK_HTTP_MAX_BODY_BYTES='{raw}'"):
            read_settings({"DSPARK_HTTP_MAX_BODY_BYTES": raw}, "gateway")
