"""`dspark replay` (subprocess and in-process): the pinned numbers; bad input exits 2 with one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.cli import main

ROOT = Path(__file__).resolve().parent.parent
SYNTHETIC = ROOT / "tests" / "data" / "synthetic_rounds.json"
DSPARK = Path(sys.executable).parent / "dspark"


def run_cli(*args, env=None, command=(sys.executable, "-m", "services.cli")):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DSPARK_GATE")}
    return subprocess.run(
        [*command, *args], cwd=ROOT, env={**clean, **(env or {})}, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def dspark(capsys, monkeypatch):
    """Run `dspark` in-process (faster than a subprocess): returns (exit code, stdout, stderr)."""
    for var in [v for v in os.environ if v.startswith("DSPARK_GATE")]:
        monkeypatch.delenv(var)

    def call(*args, env=None):
        for var, value in (env or {}).items():
            monkeypatch.setenv(var, value)
        code = main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    return call


def table_rows(stdout):
    """workload -> its cells across the printed tables, in order (the workload cell once)."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) > 1 and cells[0] in {"repeat", "code", "prose", "math", "overall"}:
            rows.setdefault(cells[0], [cells[0]]).extend(cells[1:])
    return rows


def test_replay_synthetic_prints_the_pinned_table():
    result = run_cli("replay", "--synthetic")
    assert result.returncode == 0, result.stderr
    rows = table_rows(result.stdout)
    # workload, rounds, accept, plain, always-k, threshold (t), gated, vs plain, vs always-k, recovered ...
    assert rows["repeat"][1:7] == ["200", "100.0%", "3.30", "5.76", "5.76 (t=-0.389)", "5.76"]
    assert rows["code"][3:7] == ["3.30", "5.01", "5.02 (t=0.0154)", "5.01"]
    assert rows["prose"][3:10] == ["3.30", "2.84", "3.56 (t=-0.0187)", "3.33", "1.01x", "1.17x", "106%"]
    assert rows["math"][3:10] == ["3.30", "1.76", "2.51 (t=0.0194)", "3.19", "0.97x", "1.81x", "93%"]
    assert rows["overall"][1:7] == ["800", "60.0%", "3.30", "3.84", "4.51", "4.78"]


def test_replay_json_of_file_equals_synthetic():
    from_file = run_cli("replay", str(SYNTHETIC), "--json")
    synthetic = run_cli("replay", "--synthetic", "--json")
    assert from_file.returncode == synthetic.returncode == 0, from_file.stderr + synthetic.stderr
    doc, other = json.loads(from_file.stdout), json.loads(synthetic.stdout)
    assert doc["workloads"] == other["workloads"]
    tok_s = {w["workload"]: round(w["policies"]["gated"]["tok_s"], 2) for w in doc["workloads"]}
    assert tok_s == {"repeat": 5.76, "code": 5.01, "prose": 3.33, "math": 3.19}
    assert round(doc["overall"]["policies"]["always-k"]["tok_s"], 2) == 3.84


def test_cost_overrides_and_env_reach_the_replay():
    # plain 1000 ms -> plain 1.00 tok/s; the override flag beats the env var.
    result = run_cli("replay", "--synthetic", "--json", "--plain-ms", "1000", "--policy", "gated",
                     env={"DSPARK_GATE_PLAIN_MS": "500", "DSPARK_GATE_DECAY": "0.8"})
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["config"]["plain_ms"] == 1000.0 and doc["config"]["decay"] == 0.8
    assert doc["policies"] == ["plain", "always-k", "gated"]
    assert doc["overall"]["policies"]["plain"]["tok_s"] == pytest.approx(1.0)


def test_position_classes_flag_replays_the_pooled_product():
    # One position class is the pooled per-bucket rate at every position (the model before the
    # survival estimate, docs/gate.md §4): its synthetic prose figure is 3.43, the survival gate's 3.33.
    result = run_cli("replay", "--synthetic", "--json", "--policy", "gated", "--position-classes", "1")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["config"]["position_classes"] == 1
    tok_s = {w["workload"]: round(w["policies"]["gated"]["tok_s"], 2) for w in doc["workloads"]}
    assert tok_s == {"repeat": 5.76, "code": 5.00, "prose": 3.43, "math": 3.19}
    bad = run_cli("replay", "--synthetic", "--position-classes", "17")
    assert bad.returncode == 2 and "--position-classes='17' must be an integer in [1, 16]" in bad.stderr


def test_invalid_env_exits_2_naming_the_variable():
    result = run_cli("replay", "--synthetic", env={"DSPARK_GATE_DECAY": "2"})
    assert result.returncode == 2
    assert "DSPARK_GATE_DECAY='2'" in result.stderr


def test_invalid_file_exits_2_naming_round_and_field(tmp_path):
    doc = json.loads(SYNTHETIC.read_text())
    doc["rounds"][3]["accepted"] = 7
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    result = run_cli("replay", str(bad))
    assert result.returncode == 2
    assert "round 3: field 'accepted'=7" in result.stderr


@pytest.mark.skipif(not DSPARK.exists(), reason=f"console script not installed at {DSPARK}")
def test_console_script_runs_replay():
    result = run_cli("replay", "--synthetic", "--json", command=(str(DSPARK),))
    assert result.returncode == 0, result.stderr
    assert round(json.loads(result.stdout)["overall"]["policies"]["gated"]["tok_s"], 2) == 4.78


def reject_constant(name):
    raise AssertionError(f"non-finite {name} in --json output")


def rounds_file(tmp_path, workloads, name="rounds.json"):
    rounds = [{"workload": w, "confidence_logits": [8.0, 8.0, -2.0], "submitted": 3, "accepted": 2} for w in workloads]
    path = tmp_path / name
    path.write_text(json.dumps({"format": "dspark-rounds", "version": 1, "rounds": rounds}))
    return path


def assert_one_line_error(result, *fragments):
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("dspark replay: error: ")
    for fragment in fragments:
        assert fragment in result.stderr


def test_json_output_is_strict_json_with_finite_numbers(dspark):
    result = dspark("replay", "--synthetic", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout, parse_constant=reject_constant)
    assert doc["overall"]["policies"]["threshold"]["tok_s"] > 0


def test_json_config_shows_the_env_switch_apart_from_the_gated_policy(dspark):
    result = dspark("replay", "--synthetic", "--json", "--policy", "gated", env={"DSPARK_GATE": "0"})
    doc = json.loads(result.stdout)
    assert "enabled" not in doc["config"]
    assert doc["config"]["gate_env_enabled"] is False
    assert doc["gated_policies_gate_enabled"] is True
    assert "always run the gate enabled" in doc["note"]


def test_missing_file_exits_2_naming_it(dspark, tmp_path):
    assert_one_line_error(dspark("replay", str(tmp_path / "missing.json")), "missing.json")


def test_directory_exits_2_naming_it(dspark, tmp_path):
    assert_one_line_error(dspark("replay", str(tmp_path)), f"{tmp_path}: is a directory")


def test_empty_path_exits_2_naming_the_argument(dspark):
    assert_one_line_error(dspark("replay", ""), "argument FILE is an empty path ('')")


@pytest.mark.parametrize(("text", "fragment"), [
    ("{not json", "bad.json: not JSON"),
    ("[" * 200_000, "bad.json: not JSON this reader accepts: nested too deeply"),
    ('{"format": "dspark-rounds", "version": 1, "rounds": [], "rounds": []}', "bad.json: not JSON this reader "
     "accepts: duplicate key 'rounds'"),
])
def test_non_json_exits_2_naming_the_file(dspark, tmp_path, text, fragment):
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    assert_one_line_error(dspark("replay", str(bad)), fragment)


def test_non_utf8_file_exits_2_naming_it(dspark, tmp_path):
    bad = tmp_path / "bytes.json"
    bad.write_bytes(b"\xff\xfe{}")
    assert_one_line_error(dspark("replay", str(bad)), "bytes.json: not UTF-8 text")


def test_zero_rounds_exit_2_naming_the_file(dspark, tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text('{"format": "dspark-rounds", "version": 1, "rounds": []}')
    assert_one_line_error(dspark("replay", str(empty)), "empty.json: no rounds to replay")


def test_huge_integer_in_a_round_exits_2_naming_file_and_field(dspark, tmp_path):
    path = rounds_file(tmp_path, ["a"])
    path.write_text(path.read_text().replace("8.0", "1" * 400, 1))
    assert_one_line_error(dspark("replay", str(path)), "rounds.json: round 0: field 'confidence_logits'[0]=")


@pytest.mark.parametrize(("flag", "value", "fragment"), [
    ("--decay", "0", "--decay='0' must be in (0, 1]"),
    ("--position-classes", "1" * 400, "--position-classes='1111"),
    ("--position-classes", "٣", "--position-classes='٣' is not an integer"),
    ("--plain-ms", "5e-324", "--plain-ms='5e-324' must be in [0.001, 1e+07]"),
    ("--draft-ms", "1e306", "--draft-ms='1e306' must be in [0, 1e+07]"),
    ("--win-factor", "0.5", "--win-factor='0.5' must be >= 1"),
    ("--margin", "nan", "--margin='nan' is not a number"),  # the former spelling of --win-factor
])
def test_bad_flag_value_exits_2_naming_the_flag(dspark, flag, value, fragment):
    assert_one_line_error(dspark("replay", "--synthetic", flag, value), fragment)


def test_huge_env_integer_exits_2_naming_the_variable(dspark):
    result = dspark("replay", "--synthetic", env={"DSPARK_GATE_DECAY": "1" * 400})
    assert_one_line_error(result, "DSPARK_GATE_DECAY='1111")


def test_markup_and_control_characters_in_labels_and_file_name_are_shown_literally(dspark, tmp_path):
    labels = ["[/]", "[bold red]code", "\x1b[31mred", ":smile:"]
    path = rounds_file(tmp_path, labels, name="[bold]x.json")
    result = dspark("replay", str(path))
    assert result.returncode == 0, result.stderr
    for shown in ("[/]", "[bold red]code", "\\x1b[31mred", ":smile:", "Replay of " + str(path)):
        assert shown in result.stdout
    assert "\x1b" not in result.stdout


def test_repeated_policy_is_replayed_once(dspark):
    once = json.loads(dspark("replay", "--synthetic", "--json", "--policy", "gated").stdout)
    twice = json.loads(dspark("replay", "--synthetic", "--json", "--policy", "gated", "--policy", "gated").stdout)
    assert twice["policies"] == ["plain", "always-k", "gated"]
    assert twice["overall"] == once["overall"]
    assert twice["overall"]["policies"]["gated"]["rounds"] == 800


@pytest.mark.parametrize(("labels", "policy", "reason"), [
    (["a", "b"], "gated+margin", "needs rounds with anchor_margin"),
    (["only"], "threshold", "needs >= 2 workloads"),
])
def test_requested_policy_that_cannot_run_exits_2_saying_why(dspark, tmp_path, labels, policy, reason):
    result = dspark("replay", str(rounds_file(tmp_path, labels)), "--policy", policy)
    assert_one_line_error(result, f"policy '{policy}' cannot run: {reason}")


def test_skipped_default_policies_get_a_one_line_note(dspark, tmp_path):
    result = dspark("replay", str(rounds_file(tmp_path, ["only"])), "--json")
    assert result.returncode == 0
    assert result.stderr.splitlines() == [
        "dspark replay: note: skipped threshold: needs >= 2 workloads, t is chosen leave-one-workload-out; "
        "gated+margin: needs rounds with anchor_margin"
    ]
    assert json.loads(result.stdout)["policies"] == ["plain", "always-k", "gated"]


def test_closed_stdout_exits_quietly():
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DSPARK_GATE")}
    command = [sys.executable, "-m", "services.cli", "replay", "--synthetic", "--json", "--policy", "gated"]
    proc = subprocess.Popen(command, cwd=ROOT, env=clean, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first write, like `dspark replay --json | true`
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1  # Python's documented exit status for a closed stdout
    assert stderr == ""  # no BrokenPipeError traceback


def test_synthetic_help_says_it_regenerates_the_committed_file():
    result = run_cli("replay", "--help")
    assert "regenerate the committed synthetic rounds" in " ".join(result.stdout.split())
    assert "tests/data/synthetic_rounds.json" in result.stdout


@pytest.mark.parametrize(("args", "fragment"), [
    (["replay"], "dspark replay: error: one of the arguments FILE --synthetic is required"),
    (["replay", "--synthetic", "--policy", "bogus"], "argument --policy: invalid choice: 'bogus'"),
    (["replay", "x.json", "--synthetic"], "not allowed with argument FILE"),
])
def test_usage_errors_are_one_line_exit_2(capsys, args, fragment):
    with pytest.raises(SystemExit) as info:
        main(args)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.count("\n") == 1 and fragment in err


@pytest.mark.parametrize(("shape", "costs"), [("seed", (196.0, 300.0, 109.0, 303.0)), ("cheap", (24.0, 71.0, 16.0, 73.0))])
def test_costs_names_a_shape(dspark, shape, costs):
    doc = json.loads(dspark("replay", "--synthetic", "--json", "--costs", shape,
                            env={"DSPARK_GATE_DRAFT_MS": "1"}).stdout)
    assert doc["costs"] == shape
    assert tuple(doc["config"][k] for k in ("draft_ms", "verify_base_ms", "verify_slope_ms", "plain_ms")) == costs
    assert doc["overall"]["policies"]["plain"]["tok_s"] == pytest.approx(1000 / costs[3])


def test_costs_file_and_flags_over_it(dspark, tmp_path):
    path = tmp_path / "measured.json"
    path.write_text(json.dumps({"draft_ms": 12.5, "verify_base_ms": 44.0, "verify_slope_ms": 3.5, "plain_ms": 40.0}))
    doc = json.loads(dspark("replay", "--synthetic", "--json", "--costs", str(path), "--plain-ms", "50").stdout)
    assert doc["costs"] == str(path)
    assert (doc["config"]["draft_ms"], doc["config"]["verify_slope_ms"], doc["config"]["plain_ms"]) == (12.5, 3.5, 50.0)


def test_several_costs_give_one_report_each(dspark):
    result = dspark("replay", "--synthetic", "--json", "--costs", "seed", "--costs", "cheap", "--policy", "gated")
    reports = json.loads(result.stdout)["reports"]
    assert [r["costs"] for r in reports] == ["seed", "cheap"]
    assert reports[0]["overall"]["policies"]["gated"]["tok_s"] == pytest.approx(4.78, abs=0.005)
    text = dspark("replay", "--synthetic", "--costs", "seed", "--costs", "cheap").stdout
    assert "costs seed: draft 196 ms" in text and "costs cheap: draft 24 ms" in text


@pytest.mark.parametrize(("content", "fragments"), [
    (None, ["--costs 'bogus'", "not one of seed, cheap nor a JSON cost file"]),
    ('{"draft_ms": 1, "verify_base_ms": 2, "verify_slope_ms": 3, "plain_ms": 4, "oops": 5}', ["unknown keys ['oops']"]),
    ('{"draft_ms": 1, "verify_base_ms": 2}', ["missing keys ['verify_slope_ms', 'plain_ms']"]),
    ('{"draft_ms": -1, "verify_base_ms": 2, "verify_slope_ms": 3, "plain_ms": 4}', ["draft_ms", "-1"]),
    ('[1, 2]', ["must be a JSON object of CostModel fields"]),
    ('{"draft_ms": NaN}', ["not a JSON cost file"]),
])
def test_bad_costs_exit_2_naming_the_value(dspark, tmp_path, content, fragments):
    value = "bogus"
    if content is not None:
        value = str(tmp_path / "costs.json")
        Path(value).write_text(content)
    result = dspark("replay", "--synthetic", "--costs", value)
    assert_one_line_error(result, *fragments, *([] if content is None else [f"--costs {value!r}"]))


def test_tables_fit_80_columns_without_cutting_a_figure():
    from rich.console import Console

    from services.cli import render_report
    from services.gateway.gate import GateConfig
    from services.analysis.replay import replay_log
    from services.gateway.rounds import load_rounds

    console = Console(width=80, emoji=False)
    with console.capture() as capture:
        render_report(replay_log(load_rounds(SYNTHETIC), GateConfig(), source="s.json"), console)
    text = capture.get()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text
    rows = table_rows(text)
    # tok/s, the gated comparisons, then best fixed k, calibrated, oracle, calib. gain, the headline, of oracle, ECE
    assert rows["prose"][1:7] == ["200", "39.1%", "3.30", "2.84", "3.56 (t=-0.0187)", "3.33"]
    assert rows["prose"][13:20] == ["3.30 k=0", "3.37", "4.66", "+18.8%", "92%", "27%", "0.043"]


def test_the_policy_table_explains_only_the_columns_it_shows(dspark):
    shown = dspark("replay", "--synthetic", "--policy", "plain", "--policy", "gated").stdout
    assert "gated: the gate always enabled here" in shown and "threshold" not in shown
    every = dspark("replay", "--synthetic").stdout
    assert "threshold: leave-one-workload-out, t chosen on the other workloads." in " ".join(every.split())
