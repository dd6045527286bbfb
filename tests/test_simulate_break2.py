"""Findings of the second attack on the simulator's event loops and the paired validation
(issue #33): a workdir holding a truncated or foreign stage output, a simulator that refuses
the calibrated shape, and a service thread that ends inside a bench cell. Each failed before
its fix with a traceback, a lost message or a wrong figure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench import validate_simulate
from bench.bench_serving import off_step_cpu_s

DATA = Path(__file__).resolve().parent / "data"
CPU_SHAPE = Path(__file__).resolve().parents[1] / "services" / "simulate" / "shapes" / "cpu.json"
CELL = {"aggregate_tok_s": 50.0, "sessions_per_step": 1.0}


def _workdir(tmp_path: Path, bench: str, calibration: str | None = None, rounds: Path = DATA / "bundled_rounds.json"):
    """A re-simulation workdir of one repetition, plain at one stream: every stage's output
    present, so main measures nothing (no service starts)."""
    work = tmp_path / "wd"
    (work / "rep-1").mkdir(parents=True)
    shutil.copy(rounds, work / "rounds.json")
    (work / "rep-1" / "bench.json").write_text(bench)
    (work / "rep-1" / "calibration.json").write_text(calibration or json.dumps(
        {"raw": {"fast": {"8": {"plain": [{"sessions_per_step": 7.5, "verifier_step_ms": 40.0,
                                          "itl_p50_ms": 60.0}]}}}}))
    return work


def _validate(capsys, work: Path, *extra: str) -> tuple[int, str]:
    code = validate_simulate.main(["--workdir", str(work), "--repeats", "1", "--streams", "1", "--arms", "plain",
                                   "--shape", str(CPU_SHAPE), "--port-base", "52500", *extra])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("bench, named", [
    ('{"medians": {"fa', "not JSON"),  # a run killed while writing
    ('{"medians": {"fast": {"4": {"plain": {}}}}}', "no plain cell at 1 streams"),  # a run of other --streams
    ('{"cells": []}', "no medians.fast"),  # some other program's JSON
    ('{"medians": {"fast": [1]}}', "no plain cell at 1 streams"),
    ('{"medians": {"fast": {"1": {"plain": {"aggregate_tok_s": 5}}}}}', "no plain cell at 1 streams"),
])
def test_a_truncated_or_foreign_bench_json_in_the_workdir_names_the_file(tmp_path, capsys, bench, named):
    work = _workdir(tmp_path, bench)
    code, err = _validate(capsys, work)
    assert code == 1 and f"{work / 'rep-1' / 'bench.json'}:" in err and named in err, err
    assert "Traceback" not in err and err.count("\n") == 1, err


@pytest.mark.parametrize("calibration, named", [
    ('{"raw": {"fast": {"8": {"plain": [{"sessions', "not JSON"),
    ('{"raw": {"fast": {"16": {}}}}', "no raw.fast.8"),  # calibrated at another --calibrate-streams
    ('{"raw": {"fast": {"8": {"k5": [{}]}}}}', "no plain cell"),
    ('{"raw": {"fast": {"8": {"plain": [{"sessions_per_step": 0, "verifier_step_ms": 0, "itl_p50_ms": 1}]}}}}',
     "sessions_per_step=0"),  # was a ZeroDivisionError
])
def test_a_truncated_or_foreign_calibration_json_names_the_file(tmp_path, capsys, calibration, named):
    bench = json.dumps({"medians": {"fast": {"1": {"plain": {k: {"median": v} for k, v in CELL.items()}}}}})
    work = _workdir(tmp_path, bench, calibration)
    code, err = _validate(capsys, work)
    assert code == 1 and f"{work / 'rep-1' / 'calibration.json'}:" in err and named in err, err
    assert "Traceback" not in err, err


def test_a_truncated_shape_in_the_workdir_names_the_file(tmp_path, capsys):
    bench = json.dumps({"medians": {"fast": {"1": {"plain": {k: {"median": v} for k, v in CELL.items()}}}}})
    work = _workdir(tmp_path, bench)
    (work / "shape-0.json").write_text('{"verifier": {"rows": [1')  # a measurement killed while written
    code = validate_simulate.main(["--workdir", str(work), "--repeats", "1", "--streams", "1", "--arms", "plain",
                                   "--port-base", "52500"])
    err = capsys.readouterr().err
    assert code == 1 and f"{work / 'shape-0.json'}: not JSON" in err and "Traceback" not in err, err


@pytest.mark.slow  # a simulator process and the tokenizer: ~3 s
def test_the_simulators_own_refusal_reaches_the_user(tmp_path, capsys):
    """The simulator exits 2 with one line naming the value; validate_simulate ran it with
    check=True and capture_output, so the user saw a CalledProcessError and not the line."""
    log = json.loads((DATA / "bundled_rounds.json").read_text())
    log["rounds"] = [r for r in log["rounds"] if r["workload"] == "code"]  # no prose, math, repeat
    rounds = tmp_path / "code-only.json"
    rounds.write_text(json.dumps(log))
    bench = json.dumps({"medians": {"fast": {"1": {"plain": {k: {"median": v} for k, v in CELL.items()}}}}})
    code, err = _validate(capsys, _workdir(tmp_path, bench, rounds=rounds))
    assert code == 1 and "the simulator refused" in err and "is in no rounds file" in err, err


def test_off_step_cpu_never_falls_when_a_thread_ends():
    """A service thread that burns CPU and ends between a cell's two readings took its CPU out
    of the sum over /proc/PID/task: the off-step CPU fell, and the fitted event-loop cost with
    it. The process's own counters keep an ended thread's time."""
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, sys, threading, time
        release = threading.Event()
        def burn():
            while time.thread_time() < 0.3:
                pass
            print("ready", flush=True)
            release.wait()  # alive, its CPU counted, until the parent has read it
        t = threading.Thread(target=burn, name="grpc-worker"); t.start()
        sys.stdin.readline()
        release.set(); t.join()
        while len(os.listdir("/proc/self/task")) > 1:  # join returns a moment before the OS thread ends
            time.sleep(0.01)
        print("ended", flush=True); sys.stdin.readline()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        before = off_step_cpu_s({"svc": child.pid})["svc"]
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline() == "ended\n"
        after = off_step_cpu_s({"svc": child.pid})["svc"]
        assert before >= 0.2 and after >= before, (before, after)
    finally:
        child.kill()
        child.wait()


DROP_SYS_NICE = ["setpriv", "--inh-caps=-sys_nice", "--bounding-set=-sys_nice"]
needs_setpriv = pytest.mark.skipif(shutil.which("setpriv") is None or os.geteuid() != 0,
                                   reason="needs setpriv and root, to drop CAP_SYS_NICE")


@needs_setpriv
def test_the_right_to_lower_niceness_is_read_from_the_capabilities():
    """Root without CAP_SYS_NICE (a container's root, here setpriv's) may not lower niceness:
    `nice -n -20` only warns and set_session_nice is refused."""
    cmd = [sys.executable, "-c", "from bench.service_procs import may_lower_nice as m; print(m(-20), m(0))"]
    kw = dict(cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=30)
    assert subprocess.run(DROP_SYS_NICE + cmd, **kw).stdout == "False True\n"
    assert subprocess.run(cmd, **kw).stdout == "True True\n"


@pytest.mark.slow
@needs_setpriv
def test_nice_without_the_right_to_lower_it_is_refused_before_any_stage(tmp_path):
    """`--nice -20` without CAP_SYS_NICE: `nice` warned and ran the stage at 0 and
    set_session_nice's refusal was ignored, so the run measured unprotected (docs/simulate.md
    §5.2) as if protected. Refused before any stage now."""
    # a missing checkpoint, checked after --nice: were --nice let through, the run still ends here
    cmd = [*DROP_SYS_NICE, sys.executable, "-m", "bench.validate_simulate", "--nice", "-20", "--workdir",
           str(tmp_path), "--port-base", "52500", "--checkpoint", str(tmp_path / "none")]
    done = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--nice=-20: this process may not lower niceness" in done.stderr, done.stderr


@pytest.mark.parametrize("text, named", [
    ('{"a": 1}', "unknown key(s) ['a']"),  # was a KeyError traceback after the first bench
    ('{"verifier": {"rows": [1], "ms": [10]}, "drafter": {"draft": {"sessions": [1], "ms": [3]}}, '
     '"event_loop": {"gateway": {}}}', "unknown key(s) ['gateway']"),  # named only after the bench
    ('{"verifier": {"rows": [1', "not JSON"),
])
def test_a_shape_that_cannot_price_a_repetition_is_refused_before_any_stage(tmp_path, capsys, text, named):
    shape = tmp_path / "foreign.json"
    shape.write_text(text)
    with pytest.raises(SystemExit) as exit_:
        validate_simulate.main(["--shape", str(shape), "--workdir", str(tmp_path / "wd"), "--port-base", "52500"])
    err = capsys.readouterr().err.splitlines()[-1]
    assert exit_.value.code == 2 and str(shape) in err and named in err, err
    assert not (tmp_path / "wd").exists()
