"""Hostile and careless input to `dspark simulate` and `bench.validate_simulate` (issue #33).

Every case is refused before anything is simulated or measured: exit 2, nothing on stdout, one
line on stderr naming the value. Each of these ran for hours, ate memory, wrote elsewhere than
asked, silently dropped a cell or died with a traceback before the limits in docs/simulate.md §1.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from bench import validate_simulate
from services.cli import main
from services.simulate.loops import Clock

SHAPE = {"verifier": {"rows": [1], "ms": [10]}, "drafter": {"draft": {"sessions": [1], "ms": [3]}}}
SMALL = ["--arms", "plain", "--output", "1"]  # were any case to run, it would run briefly


def _run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["simulate", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _refused(capsys, args, named: str) -> None:
    code, out, err = _run(capsys, *args)
    assert code == 2 and out == "", (code, err)
    assert err.startswith("dspark simulate: error:") and err.count("\n") == 1 and named in err, err


@pytest.mark.parametrize("args, named", [
    (["--streams", "5000"], "--streams 5000"),
    (["--streams", "1", "--drafters", "5000"], "--drafters=5000"),
    (["--streams", "1", "--cores", "5000", "--shared-compute"], "--cores=5000"),
    (["--streams", "1", "--background", "-1", "--shared-compute"], "--background=-1.0"),
    (["--streams", "1", "--background", "nan", "--shared-compute"], "--background=nan"),
    (["--streams", "1", "--background", "1"], "--background=1.0: needs --shared-compute"),
    (["--streams", "1", "--block-size", "65"], "--block-size=65"),
    (["--streams", "1", "--rpc-ms", "2e6"], "--rpc-ms=2000000.0"),
    (["--streams", "1", "--prompt", "1048576", "--prefill-chunk", "2000000"], "--prompt 1048576"),
    (["--streams", "9", "--prompt", "1048000", "--prefill-chunk", "1"], "steps of work"),
    (["--rate", "5", "--streams", "2"], "--rate 5.0 with --streams 2"),
    (["--rate", "1.0000001", "1.0000002"], "--rate 1.0000001 and 1.0000002"),
])
def test_unbounded_or_contradictory_flags_are_refused(capsys, args, named):
    _refused(capsys, [*SMALL, *args], named)


def _shape_file(tmp_path, **over) -> str:
    path = tmp_path / "shape.json"
    path.write_text(json.dumps({**SHAPE, **over}))
    return str(path)


@pytest.mark.parametrize("over, named", [
    ({"gateway_ms": 1e300}, "gateway_ms=1e+300"),  # was a ZeroDivisionError traceback
    ({"rpc_ms": 2e7}, "shape.json: rpc_ms=20000000.0"),
    ({"name": ["x"]}, "name=['x']"),
    ({"event_loop": {"verifier": {"call_ms": -1}}}, "verifier event_loop call_ms=-1"),
    ({"event_loop": {"verifier": {"row_ms": float("nan")}}}, "row_ms=nan"),
    ({"event_loop": {"gateway": {"call_ms": 1}}}, "event_loop: unknown key(s) ['gateway']"),
    ({"event_loop": {"drafter": {"reply_ms": 1}}}, "event_loop.drafter: unknown key(s) ['reply_ms']"),
])
def test_out_of_range_shape_fields_are_refused(tmp_path, capsys, over, named):
    _refused(capsys, [*SMALL, "--streams", "1", "--costs", _shape_file(tmp_path, **over)], named)


def test_a_calibrate_fit_past_the_table_bound_names_its_file(tmp_path, capsys):
    path = tmp_path / "fit.txt"
    path.write_text("DSPARK_GATE_DRAFT_MS=5\nDSPARK_GATE_VERIFY_SLOPE_MS=1\nDSPARK_GATE_PLAIN_MS=1e308\n")
    _refused(capsys, [*SMALL, "--streams", "1", "--costs", str(path)], "fit.txt:")


def test_a_cost_source_that_is_not_a_file_is_refused_unread(tmp_path, capsys):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # read whole, it would block forever (as /dev/zero would read forever)
    _refused(capsys, [*SMALL, "--streams", "1", "--costs", str(fifo)], "not a regular file")


def test_a_png_path_that_is_a_folder_is_refused_before_simulating(tmp_path, capsys):
    _refused(capsys, [*SMALL, "--streams", "1", "--png", str(tmp_path)], "is a directory")
    assert not os.path.exists(f"{tmp_path}.png")  # matplotlib appended .png and wrote there


def test_a_png_path_without_a_suffix_is_written_as_given(tmp_path, capsys):
    path = tmp_path / "plot"
    code, out, err = _run(capsys, *SMALL, "--streams", "1", "--png", str(path), "--json")
    assert code == 0 and err == ""
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "plot.png").exists()


def test_a_run_that_cannot_finish_ends_with_an_error():
    clock = Clock()

    def spin() -> None:  # an event that reschedules itself at the same instant: no progress
        clock.at(clock.now, spin)
    clock.at(0.0, spin)
    with pytest.raises(RuntimeError, match="after 1000 events"):
        clock.run(max_events=1000)


@pytest.mark.parametrize("args, named", [
    (["--streams", "0"], "--streams 0"),
    (["--repeats", "0"], "--repeats=0"),
    (["--arms", "budget"], "'budget'"),
    (["--calibrate-streams", "4"], "--calibrate-streams=4"),
    (["--rpc-ms", "nan"], "--rpc-ms=nan"),
    (["--background", "-0.5"], "--background=-0.5"),
    (["--port-base", "80"], "--port-base=80"),
    (["--checkpoint", "/nonexistent"], "'/nonexistent'"),
    (["--shape", "/nonexistent/shape.json"], "/nonexistent/shape.json"),
    (["--json", "/nonexistent/out.json"], "/nonexistent/out.json"),
])
def test_validate_simulate_refuses_bad_arguments_before_any_stage(capsys, args, named):
    with pytest.raises(SystemExit) as exit_:
        validate_simulate.main(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and named in err.splitlines()[-1], err
    assert "stages in" not in capsys.readouterr().out


def test_a_per_workload_length_for_no_recorded_workload_is_refused(capsys):
    _refused(capsys, [*SMALL, "--streams", "1", "--rounds", "tests/data/bundled_rounds.json", "--prompt",
                      "code=5,math=5,prose=5,repeat=5,cdoe=4"], "workload 'cdoe' is in no rounds file")


def test_a_rounds_file_or_a_service_that_is_no_verifier_as_costs_says_what_was_meant(capsys):
    """Two mistakes a new user made: a round-record file passed as `--costs` (it belongs to
    `--rounds`), and `info:` pointed at a server without the verifier's Info (a real gRPC
    server on port 0 that serves nothing: UNIMPLEMENTED, as a gateway or drafter answers)."""
    import grpc

    _refused(capsys, [*SMALL, "--streams", "1", "--costs", "tests/data/bundled_rounds.json"], "goes to --rounds")
    server = grpc.server(ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        _refused(capsys, [*SMALL, "--streams", "1", "--costs", f"info:127.0.0.1:{port}"], "the verifier's address")
    finally:
        server.stop(0)


def test_the_validation_prices_a_repetition_at_the_mean_of_its_boundary_shapes():
    """validate_simulate measures the cpu shape before and after each repetition and prices the
    repetition at their pointwise mean (the box's speed while its cells ran), leaving both
    inputs alone; two measurements of different points are refused, naming the table."""
    before = {"name": "cpu", "verifier": {"rows": [1, 8], "ms": [32.1, 53.5]},
              "drafter": {"draft": {"sessions": [1], "ms": [12.0]}, "commit": {"rows": [1, 4], "ms": [1.0, 1.7]}}}
    after = {"name": "cpu", "verifier": {"rows": [1, 8], "ms": [15.7, 60.0]},
             "drafter": {"draft": {"sessions": [1], "ms": [11.4]}, "commit": {"rows": [1, 4], "ms": [1.2, 1.5]}}}
    mean = validate_simulate.mean_shape(before, after)
    assert mean["verifier"]["ms"] == [23.9, 56.75] and mean["drafter"]["draft"]["ms"] == [11.7]
    assert mean["drafter"]["commit"]["ms"] == [1.1, 1.6] and before["verifier"]["ms"] == [32.1, 53.5]
    assert after["verifier"]["ms"] == [15.7, 60.0]
    after["drafter"]["commit"]["rows"] = [1, 2]
    with pytest.raises(ValueError, match="drafter.commit"):
        validate_simulate.mean_shape(before, after)


def test_the_validation_pairs_sim_and_real_within_each_repetition():
    """The paired ratio is sim ÷ real per repetition, then the median: a box twice as fast in
    the second repetition, simulated at that repetition's speed, pairs at 1.0 both times,
    where the ratio of the medians would read 0.75."""
    cell = lambda tok, sessions: {"aggregate_tok_s": {"median": tok}, "sessions_per_step": {"median": sessions}}
    reps = [({"1": {"plain": cell(40.0, 1.0)}}, {1: {"plain": {"aggregate_tok_s": 40.0, "sessions_per_step": 1.0}}}),
            ({"1": {"plain": cell(80.0, 1.0)}}, {1: {"plain": {"aggregate_tok_s": 80.0, "sessions_per_step": 1.0}}}),
            ({"1": {"plain": cell(80.0, 1.0)}}, {1: {"plain": {"aggregate_tok_s": 40.0, "sessions_per_step": 1.0}}})]
    (row,) = validate_simulate.compare(reps, [1], ["plain"])
    tok = row["aggregate_tok_s"]
    assert tok["ratio"] == {"median": 1.0, "min": 0.5, "max": 1.0} and tok["within"]
    assert tok["real"] == {"median": 80.0, "min": 40.0, "max": 80.0} and tok["sim"]["median"] == 40.0
    (row,) = validate_simulate.compare(reps[2:], [1], ["plain"])
    assert not row["aggregate_tok_s"]["within"] and row["sessions_per_step"]["within"]


def test_the_validation_fits_the_services_event_loops_from_two_served_cells():
    """event_loop_costs recovers call_ms and row_ms from a plain and a k5 cell whose off-step
    CPU was made from them (verifier: 1.0 ms a call, 0.5 a row; drafter 0.8 a call), and sets
    a negative root to 0, refitting the other to both cells' totals."""
    def cell(rounds, drafts, gens, plain_share, verifier_ms, drafter_ms):
        return {"rounds": rounds, "drafts_submitted": drafts, "generations": gens, "plain_round_share": plain_share,
                "off_step_cpu_s_by_service": {"verifier": verifier_ms / 1e3, "drafter": drafter_ms / 1e3}}
    prompt = 20.0
    plain = cell(100, 0, 4, 1.0, 1.0 * 104 + 0.5 * (100 + 4 * prompt), 0.0)
    k5 = cell(40, 180, 4, 0.1, 1.0 * 44 + 0.5 * (40 + 180 + 4 * prompt), 0.8 * (2 * 36 + 4))
    loops = validate_simulate.event_loop_costs(plain, k5, prompt)
    assert loops["verifier"] == {"call_ms": 1.0, "row_ms": 0.5}
    assert loops["drafter"] == {"call_ms": 0.8, "row_ms": 0.0}
    k5["off_step_cpu_s_by_service"]["verifier"] = 0.001  # far less per row than plain: row_ms < 0
    loops = validate_simulate.event_loop_costs(plain, k5, prompt)
    assert loops["verifier"]["row_ms"] == 0.0
    assert loops["verifier"]["call_ms"] == pytest.approx((plain["off_step_cpu_s_by_service"]["verifier"] * 1e3 + 1)
                                                         / 148, abs=1e-3)


def test_a_reused_workdir_that_measured_another_load_is_refused(tmp_path, capsys):
    """Re-simulating an earlier run's stages with other --streams or --max-tokens would compare
    unlike cells (a KeyError traceback, or silently a 64-token simulation against 32-token real
    cells): the stage is refused, exit 2, naming the file and the figure."""
    work = tmp_path / "w"
    (work / "rep-1").mkdir(parents=True)
    (work / "rounds.json").write_text("{}")
    bench = {"args": {"streams": [1], "arms": ["plain", "k5"], "max_tokens": 32, "per_stream": 4}}
    (work / "rep-1" / "bench.json").write_text(json.dumps(bench))
    shape = tmp_path / "shape.json"
    shape.write_text(json.dumps(SHAPE))
    base = ["--repeats", "1", "--workdir", str(work), "--shape", str(shape), "--arms", "plain", "k5"]
    assert validate_simulate.main([*base, "--streams", "1", "4"]) == 2
    assert "bench.json: measured streams=[1], this run asks for [1, 4]" in capsys.readouterr().err
    assert validate_simulate.main([*base, "--streams", "1", "--max-tokens", "64"]) == 2
    assert "measured max_tokens=32, this run asks for 64" in capsys.readouterr().err


def test_simulate_refuses_cores_without_a_shared_pool_and_names_unknown_workloads(capsys):
    _refused(capsys, [*SMALL, "--streams", "1", "--cores", "2"], "--cores=2: needs --shared-compute")
    _refused(capsys, [*SMALL, "--streams", "1", "--workload", "nope"], "--workload 'nope': unknown; the rounds hold")
