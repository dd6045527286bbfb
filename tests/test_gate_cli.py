"""`dspark replay` as a subprocess: table and JSON carry the pinned numbers; bad input exits 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SYNTHETIC = ROOT / "tests" / "data" / "synthetic_rounds.json"
DSPARK = Path(sys.executable).parent / "dspark"


def run_cli(*args, env=None, command=(sys.executable, "-m", "services.cli")):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DEEPSEEK_DSPARK_GATE")}
    return subprocess.run(
        [*command, *args], cwd=ROOT, env={**clean, **(env or {})}, capture_output=True, text=True, timeout=120
    )


def table_rows(stdout):
    """workload -> cells of the rich table's body rows."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) > 6 and cells[0] in {"repeat", "code", "prose", "math", "overall"}:
            rows[cells[0]] = cells
    return rows


def test_replay_synthetic_prints_the_pinned_table():
    result = run_cli("replay", "--synthetic")
    assert result.returncode == 0, result.stderr
    rows = table_rows(result.stdout)
    # workload, rounds, accept, plain, always-k, threshold (t), gated, vs plain, vs always-k, recovered ...
    assert rows["repeat"][1:7] == ["200", "100.0%", "3.30", "5.76", "5.76 (t=-0.389)", "5.76"]
    assert rows["code"][3:7] == ["3.30", "5.01", "5.02 (t=0.0154)", "5.01"]
    assert rows["prose"][3:10] == ["3.30", "2.84", "3.56 (t=-0.0187)", "3.22", "0.97x", "1.13x", "82%"]
    assert rows["math"][3:10] == ["3.30", "1.76", "2.51 (t=0.0194)", "2.19", "0.66x", "1.24x", "28%"]
    assert rows["overall"][1:7] == ["800", "60.0%", "3.30", "3.84", "4.51", "4.36"]


def test_replay_json_of_file_equals_synthetic():
    from_file = run_cli("replay", str(SYNTHETIC), "--json")
    synthetic = run_cli("replay", "--synthetic", "--json")
    assert from_file.returncode == synthetic.returncode == 0, from_file.stderr + synthetic.stderr
    doc, other = json.loads(from_file.stdout), json.loads(synthetic.stdout)
    assert doc["workloads"] == other["workloads"]
    tok_s = {w["workload"]: round(w["policies"]["gated"]["tok_s"], 2) for w in doc["workloads"]}
    assert tok_s == {"repeat": 5.76, "code": 5.01, "prose": 3.22, "math": 2.19}
    assert round(doc["overall"]["policies"]["always-k"]["tok_s"], 2) == 3.84


def test_cost_overrides_and_env_reach_the_replay():
    # plain 1000 ms -> plain 1.00 tok/s; the override flag beats the env var.
    result = run_cli("replay", "--synthetic", "--json", "--plain-ms", "1000", "--policy", "gated",
                     env={"DEEPSEEK_DSPARK_GATE_PLAIN_MS": "500", "DEEPSEEK_DSPARK_GATE_DECAY": "0.8"})
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["config"]["plain_ms"] == 1000.0 and doc["config"]["decay"] == 0.8
    assert doc["policies"] == ["plain", "always-k", "gated"]
    assert doc["overall"]["policies"]["plain"]["tok_s"] == pytest.approx(1.0)


def test_invalid_env_exits_2_naming_the_variable():
    result = run_cli("replay", "--synthetic", env={"DEEPSEEK_DSPARK_GATE_DECAY": "2"})
    assert result.returncode == 2
    assert "DEEPSEEK_DSPARK_GATE_DECAY='2'" in result.stderr


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
    assert round(json.loads(result.stdout)["overall"]["policies"]["gated"]["tok_s"], 2) == 4.36
