"""Validate `dspark simulate` against the real services: `python -m bench.validate_simulate`.

Owns the comparison docs/simulate.md §5 reports: the simulator at a measured CPU shape with
`--shared-compute` against `bench_serving` on the same box, for the same arms, concurrencies,
prompts and lengths. It prints one side-by-side table (and writes `--json`); it asserts
nothing, as every benchmark here.

The run is **paired by repetition**. This box is shared: its speed moves 30 % between two
repetitions a minute apart (plain at one stream: 37.9-49.6 tok/s over one run's five), and
a shape measured once prices every repetition at one moment's speed. So every repetition
is measured, and simulated, on its own (each a child process, the services' own command
lines):

1. **Rounds** (once): `bench_serving --arms k5 --streams 1 --per-stream 4 --repeats 1
   --warmup 0 --record-rounds FILE`: what bench_serving's own four prompts draft and accept,
   each round labelled with its prompt's workload (the start-up warm-up generations, labelled
   `warmup`, are dropped).
2. **Shapes** at the boundaries of the repetitions: `bench.sim_cpu_shape` on the checkpoint,
   one torch thread, as the services run here. Repetition r is priced at the pointwise mean
   of the shapes measured just before and just after it (`mean_shape`: its cells ran at the
   box's speed in between). `--shape FILE` prices every repetition at a given shape instead.
3. **Repetition r** (`--repeats` of them): `bench_serving --numerics fast --arms ...
   --streams ... --repeats 1 --fresh-gateway --warmup 0 --rotate r --json`, the arms in
   bench_serving's order rotated by r, then two **calibration cells**: plain and k5 at
   `--calibrate-streams` (8, a load the comparison does not use). The gateway restarts
   before every gated cell, so the gated arm starts cold in every cell, as the simulator
   runs it.

Costs the in-process shape cannot see are read from the calibration cells and written into
the repetition's shape (`shape-calibrated.json`): `session_ms`, what each session adds to a
served verifier step beyond the bare forward (the served step's ms from the verifier's Info
minus the shape's step at the same rows, per session); the services' `event_loop` costs,
their CPU outside their step threads per call (`event_loop_costs`: the verifier's per call
and per row from both cells, the drafter's per call from k5's); and `gateway_ms`, the
gateway's and client's work per reply, done one at a time (the inter-token gap beyond the
served step, the network and the verifier's event loop, per session in the step; the
simulator charges it on the drafter's replies too, docs/simulate.md §5).

Then, per repetition, `dspark simulate --costs SHAPE --shared-compute --rounds FILE --order
cycle` runs the same cells: the same closed loop (each stream runs `--per-stream`
generations back to back), each stream's generations replaying bench_serving's prompts in
bench_serving's order from their first recorded round (every stream runs code, prose, math,
repeat in turn: greedy, so the streams' generations are the same text and accept the same
drafts in the same rounds), each prompt's own token length, `--max-tokens` tokens out, the
bench's session limit and rpc cost from the shape. The table gives, per arm and
concurrency, aggregate tok/s and verifier sessions per step, real and simulated (median
[min-max] over the repetitions), and the **paired ratio**: sim ÷ real within each
repetition, then the median [min-max] over repetitions; the tolerances apply to its median.

    python -m bench.validate_simulate [--port-base 50400] [--repeats 3] [--streams 1 4 16]
        [--arms plain k5 gated] [--workdir DIR] [--json FILE] [--nice N]

`--nice N` runs the bench children at that niceness (negative needs root): on a machine
shared with other work it keeps the measured services from being starved.
`--workdir` holds every stage's output (default: a new folder under the system's temporary
folder, so every stage is measured in this run); a stage whose output is already there is
not run again, so `--workdir` of an earlier run re-simulates its real figures (after a change
to the simulator) without measuring anything. Layout: `rounds.json`, `shape-0.json` ..
`shape-R.json` (the boundaries), `rep-r/` (`bench.json`, `calibration.json`, `shape.json`,
`shape-calibrated.json`, `sim.json`).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import statistics
import tempfile
from pathlib import Path

from bench.bench_serving import WORKLOADS
from bench.service_procs import may_lower_nice, set_session_nice
from services.gateway.rounds import RoundLog, load_rounds, save_rounds

REPO_ROOT = Path(__file__).resolve().parents[1]
STAGE_TIMEOUT_S = 3600.0


class StageError(RuntimeError):
    """A stage failed or its output (in the workdir, or --shape) cannot be used: the message
    names the file or the command. `main` prints it as one line and exits 1."""


def _load_json(path: Path, what: str, *keys: str) -> object:
    """The JSON object in `path` (a stage's output or --shape) and, followed down `keys`, the
    part a stage reads. Raises StageError naming the file and `what` it should hold when it is
    unreadable, truncated or foreign (a key missing), so a re-run over a workdir says which
    file to delete rather than printing a traceback."""
    try:
        obj = json.loads(path.read_text())
        for key in keys:
            obj = obj[key]
        return obj
    except OSError as exc:
        raise StageError(f"{path}: cannot read it ({exc.__class__.__name__}); it should hold {what}") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both
        raise StageError(f"{path}: not JSON ({exc}); it should hold {what} (a truncated run? delete it to "
                         f"measure it again)") from None
    except (KeyError, IndexError, TypeError) as exc:
        raise StageError(f"{path}: no {'.'.join(keys)} ({exc.__class__.__name__}: {exc}); it should hold "
                         f"{what}") from None


def _run(cmd: list[str], nice: int, out: Path | None = None) -> None:
    """Run a stage as a child at niceness `nice`, stdout to `out` (or the terminal).
    Raises StageError naming the command when it fails."""
    full = (["nice", "-n", str(nice)] if nice else []) + [sys.executable, "-m", *cmd]
    print("$", " ".join(full), flush=True)
    with open(out, "w") if out else open(os.devnull, "w") as sink:
        # A session of its own at the same niceness (`set_session_nice`): with autogroups a
        # process's nice orders it only within its session, so `--nice` alone left the
        # measured stages sharing the cores fairly with other sessions' work.
        child = subprocess.Popen(full, cwd=REPO_ROOT, stdout=sink if out else None, start_new_session=True)
        if nice:
            set_session_nice(child.pid, nice)
        try:
            rc = child.wait(timeout=STAGE_TIMEOUT_S)
        except BaseException:
            child.kill()
            child.wait()
            raise
    if rc != 0:
        if out:  # a half-written output would be taken as done by the next run in this workdir
            out.unlink(missing_ok=True)
        raise StageError(f"stage failed with status {rc}: {' '.join(full)}")


def _bench_serving(args, arms: list[str], streams: list[int], per_stream: int, *extra: str) -> None:
    """One repetition of bench_serving's fast cells (no warm-up) on this run's checkpoint,
    lengths and ports, at this run's niceness; `extra`: its output flags."""
    _run(["bench.bench_serving", "--numerics", "fast", "--arms", *arms, "--streams", *map(str, streams),
          "--repeats", "1", "--warmup", "0", "--per-stream", str(per_stream), "--max-tokens", str(args.max_tokens),
          "--port-base", str(args.port_base), "--checkpoint", args.checkpoint, *extra], args.nice)


def prompt_tokens(checkpoint: str) -> dict[str, int]:
    """Each of bench_serving's prompts' token length under the checkpoint's tokenizer, by
    workload (the simulator's per-workload `--prompt`)."""
    from services.gateway.tokenizer import HFTokenizer
    tok = HFTokenizer(Path(checkpoint) / "tokenizer.json")
    return {name: len(tok.encode(text)) for name, text in WORKLOADS.items()}


def stage_rounds(args, work: Path) -> Path:
    """Stage 2: the k5 rounds of bench_serving's prompts, warm-up dropped."""
    kept = work / "rounds.json"
    if kept.exists():
        return kept
    raw = work / "rounds-raw.json"
    _bench_serving(args, ["k5"], [1], 4, "--record-rounds", str(raw))
    log = load_rounds(raw)
    save_rounds(RoundLog(tuple(r for r in log.rounds if r.workload != "warmup"),
                         {**log.metadata, "source": "bench.validate_simulate: bench_serving k5, 1 stream"}), kept)
    return kept


def stage_bench(args, rep_dir: Path, rep: int) -> dict:
    """Repetition `rep` (0-based) of the real cells, arms rotated by `rep`:
    {streams: {arm: {figure: {median, low, high}}}} (one cell each)."""
    out = rep_dir / "bench.json"
    if out.exists():
        _check_reused(out, {"streams": sorted(set(args.streams)), "arms": sorted(args.arms),
                            "max_tokens": args.max_tokens, "per_stream": args.per_stream})
    else:
        _bench_serving(args, args.arms, args.streams, args.per_stream, "--rotate", str(rep), "--fresh-gateway",
                       "--json", str(out))
    real = _load_json(out, "bench_serving --json output", "medians", "fast")
    for s in args.streams:
        for a in args.arms:
            try:  # what `compare` reads of each cell
                ok = all(isinstance(real[str(s)][a][key]["median"], (int, float)) for key, _, _ in FIGURES)
            except (KeyError, TypeError):
                ok = False
            if not ok:
                raise StageError(f"{out}: no {a} cell at {s} streams with {' and '.join(k for k, _, _ in FIGURES)} "
                                 f"medians (a bench of other --streams or --arms? delete it to measure it again)")
    return real


def _check_reused(out: Path, want: dict) -> None:
    """A stage output of an earlier run (a reused --workdir) must have measured what this run
    compares: its bench_serving `args` must hold `want`. Raises ValueError naming the file and
    the first figure that differs; StageError when it is unreadable. A file without `args`
    is left to the stage's own checks of the cells it reads."""
    obj = _load_json(out, "bench_serving --json output")
    got = obj.get("args") if isinstance(obj, dict) else None
    if not isinstance(got, dict):
        return
    for key, value in want.items():
        have = sorted(got.get(key, [])) if key == "arms" else got.get(key)
        if have != value:
            raise ValueError(f"{out}: measured {key}={have!r}, this run asks for {value!r}; give a new --workdir "
                             f"(or the earlier run's arguments)")


def mean_shape(before: dict, after: dict) -> dict:
    """The pointwise mean of two measurements of one shape (`bench.sim_cpu_shape` objects, the
    same points), taken just before and just after a repetition: the box's speed while its
    cells ran, when the speed moves between measurements (this shared box's one-row step read
    32.1 ms and 15.7 ms thirteen minutes apart). Raises ValueError naming a table whose points
    differ."""
    out = copy.deepcopy(before)
    tables = [("verifier", "rows")] + [(f"drafter.{t}", "sessions" if t == "draft" else "rows")
                                       for t in before.get("drafter", {})]
    for name, key in tables:
        x, y, o = (_at(v, name) for v in (before, after, out))
        if x[key] != y[key]:
            raise ValueError(f"shape table {name}: points {x[key]} and {y[key]} differ")
        o["ms"] = [round((u + v) / 2, 3) for u, v in zip(x["ms"], y["ms"])]
    return out


def _at(obj: dict, dotted: str) -> dict:
    for part in dotted.split("."):
        obj = obj[part]
    return obj


def stage_shape(args, work: Path, boundary: int) -> dict:
    """The shape measured at repetition boundary `boundary` (0: before the first repetition,
    r: after repetition r), or `--shape` when given."""
    if args.shape:
        return _load_json(Path(args.shape), "a cpu shape (bench.sim_cpu_shape output)")
    out = work / f"shape-{boundary}.json"
    if not out.exists():
        _run(["bench.sim_cpu_shape", "--checkpoint", args.checkpoint, "--repeats", str(args.shape_repeats)],
             args.nice, out=out)
    return _load_json(out, "a cpu shape (bench.sim_cpu_shape output)")


def stage_calibrate_cell(args, rep_dir: Path) -> Path:
    """The repetition's served calibration cells, plain and k5 at args.calibrate_streams
    streams (bench_serving's JSON, rep_dir/calibration.json)."""
    out = rep_dir / "calibration.json"
    if out.exists():
        _check_reused(out, {"streams": [args.calibrate_streams], "max_tokens": args.max_tokens,
                            "per_stream": args.per_stream})
    else:
        _bench_serving(args, ["plain", "k5"], [args.calibrate_streams], args.per_stream, "--json", str(out))
    return out


def event_loop_costs(plain: dict, k5: dict, prompt_rows: float) -> dict[str, dict[str, float]]:
    """The services' event-loop work per call outside their steps (`ServiceModel.verifier_loop`
    and `drafter_loop`, ms) from two served cells' raw figures (bench_serving's `run_cell`:
    `off_step_cpu_s_by_service`, `rounds`, `drafts_submitted`, `generations`, and
    `plain_round_share`), `prompt_rows` the mean prompt's tokens.

    The verifier answers a prefill per generation (its reply carries the prompt's rows for the
    drafter's prime) and a decode or verify per round (1 + the drafts submitted rows): its
    off-step CPU is call_ms x calls + row_ms x rows, two unknowns from the plain and the k5
    cell (a negative root is set to 0 and the other refitted to both cells' totals). The
    drafter answers a commit and a draft per drafted round and a prime per generation:
    call_ms alone, from the k5 cell. Raises KeyError on a cell without those figures."""
    def verifier(cell: dict) -> tuple[float, float, float]:
        calls = cell["rounds"] + cell["generations"]
        rows = cell["rounds"] + cell["drafts_submitted"] + cell["generations"] * prompt_rows
        return calls, rows, cell["off_step_cpu_s_by_service"]["verifier"] * 1e3

    (c1, r1, t1), (c2, r2, t2) = verifier(plain), verifier(k5)
    det = c1 * r2 - c2 * r1
    call_ms, row_ms = ((t1 * r2 - t2 * r1) / det, (c1 * t2 - c2 * t1) / det) if det else (-1.0, -1.0)
    if row_ms < 0 or call_ms < 0:
        call_ms, row_ms = ((t1 + t2) / (c1 + c2), 0.0) if row_ms < 0 else (0.0, (t1 + t2) / (r1 + r2))
    drafted = k5["rounds"] * (1.0 - k5["plain_round_share"])
    drafter_ms = k5["off_step_cpu_s_by_service"]["drafter"] * 1e3 / max(2 * drafted + k5["generations"], 1)
    return {"verifier": {"call_ms": round(call_ms, 3), "row_ms": round(row_ms, 4)},
            "drafter": {"call_ms": round(drafter_ms, 3), "row_ms": 0.0}}


def stage_calibrate(args, rep_dir: Path, shape: Path) -> Path:
    """The repetition's calibration (module docstring): `shape` with session_ms and gateway_ms
    from the served plain cell at args.calibrate_streams streams and the services' event-loop
    costs from it and the k5 cell (`event_loop_costs`), written to
    rep_dir/shape-calibrated.json. Raises ValueError on a shape file `load_model` refuses."""
    out = stage_calibrate_cell(args, rep_dir)
    runs = _load_json(out, "the calibration cells' bench_serving --json output", "raw", "fast",
                      str(args.calibrate_streams))
    try:
        cells = {arm: runs[0] for arm, runs in runs.items()}
        cell = cells["plain"]
        sessions, step_ms, itl_ms = cell["sessions_per_step"], cell["verifier_step_ms"], cell["itl_p50_ms"]
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        raise StageError(f"{out}: no plain cell with sessions_per_step, verifier_step_ms and itl_p50_ms at "
                         f"{args.calibrate_streams} streams ({exc.__class__.__name__}: {exc})") from None
    if not sessions > 0:  # a cell whose verifier reported no step: nothing to divide by
        raise StageError(f"{out}: plain cell at {args.calibrate_streams} streams: sessions_per_step={sessions!r}")
    from services.simulate.models import load_model
    verifier = load_model(str(shape)).verifier
    prompts = prompt_tokens(args.checkpoint)
    # a workdir measured before the k5 cell and the off-step CPU were recorded has no event loops
    loops = event_loop_costs(cells["plain"], cells["k5"], sum(prompts.values()) / len(prompts)) \
        if "off_step_cpu_s_by_service" in cells.get("k5", {}) else {"verifier": {"call_ms": 0.0, "row_ms": 0.0}}
    session_ms = max(step_ms - verifier.ms_at(sessions), 0.0) / sessions
    # the inter-token gap beyond the step and the network, per session: the verifier's event
    # loop (now its own term) and the gateway's, both one reply at a time
    per_reply = loops["verifier"]["call_ms"] + loops["verifier"]["row_ms"]
    gateway_ms = max((itl_ms - step_ms - args.rpc_ms) / sessions - per_reply, 0.0)
    obj = json.loads(shape.read_text())
    obj["verifier"]["session_ms"] = round(session_ms, 3)
    obj["gateway_ms"] = round(gateway_ms, 3)
    obj["rpc_ms"] = args.rpc_ms
    if "drafter" in loops:
        obj["event_loop"] = loops
    obj["notes"] = (f"{obj.get('notes', '')} calibrated by bench.validate_simulate from served plain and k5 at "
                    f"{args.calibrate_streams} streams: plain step {step_ms:.1f} ms over {sessions:.2f} sessions, "
                    f"ITL p50 {itl_ms:.1f} ms").strip()
    calibrated = rep_dir / "shape-calibrated.json"
    calibrated.write_text(json.dumps(obj, indent=1) + "\n")
    print(f"{rep_dir.name} calibration: one-row step {verifier.ms_at(1):.1f} ms, session_ms {session_ms:.3f}, "
          f"gateway_ms {gateway_ms:.3f}, event loops {loops} (plain, {args.calibrate_streams} streams: step "
          f"{step_ms:.1f} ms, {sessions:.2f} sessions)", flush=True)
    return calibrated


def stage_simulate(args, shape: Path, rounds: Path) -> dict:
    """The simulator's cells {streams: {arm: figures}} at `shape`, shared compute."""
    prompts = ",".join(f"{name}={n}" for name, n in prompt_tokens(args.checkpoint).items())
    cmd = [sys.executable, "-m", "services.cli", "simulate", "--costs", str(shape), "--shared-compute",
           "--cores", str(args.cores), "--background", str(args.background), "--order", "cycle",
           "--rounds", str(rounds), "--arms", *args.arms, "--streams", *map(str, args.streams),
           "--per-stream", str(args.per_stream), "--prompt", prompts, "--output", str(args.max_tokens),
           "--max-sessions", str(max(args.streams) + 8), "--seed", str(args.seed), "--json"]
    print("$", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=STAGE_TIMEOUT_S)
    if done.returncode != 0:  # its one-line error names the bad value; check=True would drop it
        raise StageError(f"the simulator refused {shape} (status {done.returncode}): "
                         f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else 'no message'}")
    return {int(load): row for load, row in json.loads(done.stdout)["cells"].items()}


FIGURES = (("aggregate_tok_s", "tok/s", 0.15), ("sessions_per_step", "sessions/step", 0.20))


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def compare(reps: list[tuple[dict, dict]], streams: list[int], arms: list[str]) -> list[dict]:
    """One row per (streams, arm) from the repetitions' (real, sim) cells: per figure, the real
    and simulated values' median [min, max] over repetitions, the paired ratio (sim ÷ real in
    each repetition; its median [min, max]) and whether the median ratio is within the issue's
    tolerance (15 % tok/s, 20 % sessions per step). A real figure of 0 pairs as NaN."""
    rows = []
    for s in streams:
        for arm in arms:
            row = {"streams": s, "arm": arm}
            for key, _, tol in FIGURES:
                real = [r[str(s)][arm][key]["median"] for r, _ in reps]
                sim = [m[s][arm][key] for _, m in reps]
                ratios = [v / r if r else float("nan") for v, r in zip(sim, real)]
                paired = _spread(ratios)
                row[key] = {"real": _spread(real), "sim": _spread(sim), "ratio": paired,
                            "within": abs(paired["median"] - 1) <= tol}
            rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    """The side-by-side table as Markdown (bench/README.md's form): median [min-max] over the
    repetitions; a ✗ marks a paired ratio outside its tolerance."""
    head = ("| streams | arm | real tok/s | sim tok/s | sim ÷ real (paired) | real sessions/step | "
            "sim sessions/step | sim ÷ real (paired) |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for row in rows:
        cells = []
        for key, _, _ in FIGURES:
            f = row[key]
            mark = "" if f["within"] else " ✗"
            cells += [_fmt(f["real"]), _fmt(f["sim"]), _fmt(f["ratio"]) + mark]
        lines.append(f"| {row['streams']} | {row['arm']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(s: dict) -> str:
    return f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"


def _bad_shape(path: str) -> str | None:
    """Why --shape `path` cannot price a repetition (missing, not a .json shape file, or one
    `load_model` refuses), naming it; None when it can. Checked up front: the stages that read
    it run after the first repetition's bench, minutes in."""
    from services.simulate.models import load_model
    if not Path(path).is_file():
        return f"--shape {path!r}: no such file (leave it out to measure a shape)"
    if Path(path).suffix != ".json":  # mean_shape and the calibration edit the JSON object
        return f"--shape {path!r}: must be a .json shape file (bench.sim_cpu_shape output)"
    try:
        load_model(path)
    except ValueError as exc:
        return f"--shape {path!r}: {exc}"
    return None


def _bad_argument(args) -> str | None:
    """The first argument no stage could run with, as a message naming the value; None when
    all are good. Checked before the first stage, which takes minutes."""
    from bench.bench_serving import ARMS
    from services.simulate.cli import MAX_RPC_MS, MAX_STREAMS

    for name in ("repeats", "shape_repeats", "per_stream", "max_tokens", "calibrate_streams", "cores"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1"
    out = [n for n in args.streams if not 1 <= n <= MAX_STREAMS]
    if out:
        return f"--streams {out[0]}: a concurrency must be in 1..{MAX_STREAMS}"
    if args.calibrate_streams in args.streams:
        return f"--calibrate-streams={args.calibrate_streams}: is one of --streams; keep the calibration cells out"
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        return f"--arms {unknown[0]!r}: bench_serving runs only {', '.join(ARMS)}"
    if not 0 <= args.rpc_ms <= MAX_RPC_MS:
        return f"--rpc-ms={args.rpc_ms}: must be a finite number of ms in [0, {MAX_RPC_MS:g}]"
    if args.seed < 0:
        return f"--seed={args.seed}: must be >= 0"
    if not 0 <= args.background <= MAX_STREAMS:
        return f"--background={args.background}: must be a number of jobs in [0, {MAX_STREAMS}]"
    if not may_lower_nice(args.nice):
        return f"--nice={args.nice}: this process may not lower niceness (needs root or CAP_SYS_NICE)"
    if not 1024 <= args.port_base <= 65000:
        return f"--port-base={args.port_base}: must be in 1024..65000 (the services take ports above it)"
    if not (Path(args.checkpoint) / "tokenizer.json").is_file():  # the last stage reads it, after the bench
        return f"--checkpoint {args.checkpoint!r}: holds no tokenizer.json"
    if args.shape is not None:
        bad_shape = _bad_shape(args.shape)
        if bad_shape:
            return bad_shape
    if args.json is not None:
        parent = Path(args.json).resolve().parent
        if Path(args.json).is_dir() or not parent.is_dir() or not os.access(parent, os.W_OK):
            return f"--json {args.json!r}: cannot be written (a directory, or its folder is missing or read-only)"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--checkpoint", default="assets/dspark-small", help="the model the real services serve")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16], help="concurrencies compared")
    ap.add_argument("--arms", nargs="+", default=["plain", "k5", "gated"], help="arms compared")
    ap.add_argument("--repeats", type=int, default=3,
                    help="repetitions, each measured and simulated on its own (paired ratios, median)")
    ap.add_argument("--shape-repeats", type=int, default=3,
                    help="timings per point of each shape measurement (bench.sim_cpu_shape --repeats)")
    ap.add_argument("--per-stream", type=int, default=4, help="generations per stream and cell")
    ap.add_argument("--max-tokens", type=int, default=32, help="completion tokens per generation")
    ap.add_argument("--port-base", type=int, default=50400, help="first port of the real services")
    ap.add_argument("--calibrate-streams", type=int, default=8,
                    help="the calibration cells' concurrency (plain and k5; keep it out of --streams)")
    ap.add_argument("--seed", type=int, default=0, help="the simulator's seed")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                    help="cores of the simulator's shared pool (this machine's)")
    ap.add_argument("--background", type=float, default=0.0,
                    help="the simulator's --background: other programs' jobs always runnable on this machine's "
                    "cores while the real cells ran (0: the bench had the cores to itself, which --nice gives it)")
    ap.add_argument("--rpc-ms", type=float, default=0.7,
                    help="one gateway <-> service call in the simulator (ms: bench_services' 2.07 ms of gRPC per "
                         "round over its three calls)")
    ap.add_argument("--nice", type=int, default=0, help="niceness of the measuring children (negative: root)")
    ap.add_argument("--shape", default=None,
                    help="a cpu shape file to price every repetition at (None: measured before the first "
                    "repetition and after each, WORKDIR/shape-R.json, unless WORKDIR already holds them)")
    ap.add_argument("--workdir", default=None,
                    help="every stage's output; a stage whose output is there is not run again (None: a new "
                    "folder, so everything is measured in this run)")
    ap.add_argument("--json", default=None, help="write the comparison rows to this file")
    args = ap.parse_args(argv)
    bad = _bad_argument(args)
    if bad:
        ap.error(bad)  # exit 2 before any stage runs: a stage takes minutes
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="dspark-validate-"))
    work.mkdir(parents=True, exist_ok=True)
    args.workdir = str(work)
    print(f"stages in {work}", flush=True)
    try:
        rounds = stage_rounds(args, work)
        reps = [run_repetition(args, work, rounds, rep) for rep in range(args.repeats)]
    except StageError as exc:  # a stage's own message names the file or command
        print(f"validate_simulate: error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a reused workdir that measured another load, a shape refused
        print(f"validate_simulate: error: {exc}", file=sys.stderr)
        return 2
    rows = compare(reps, args.streams, args.arms)
    print(markdown(rows))
    within = sum(row[k]["within"] for row in rows for k, _, _ in FIGURES)
    print(f"{within} of {len(rows) * len(FIGURES)} figures within tolerance (paired medians: tok/s 15 %, "
          f"sessions/step 20 %)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


def run_repetition(args, work: Path, rounds: Path, rep: int) -> tuple[dict, dict]:
    """Repetition `rep` (0-based): its real cells, priced at the mean of the shapes at its two
    boundaries, then simulated: (real {streams: {arm: figures}}, sim {streams: {arm: figures}})."""
    rep_dir = work / f"rep-{rep + 1}"
    rep_dir.mkdir(exist_ok=True)
    before = stage_shape(args, work, rep)
    real = stage_bench(args, rep_dir, rep)
    stage_calibrate_cell(args, rep_dir)  # measured inside the repetition, priced at its shape
    after = stage_shape(args, work, rep + 1)
    one_row = [x["verifier"]["ms"][0] for x in (before, after)]
    if max(one_row) > 1.5 * min(one_row):
        print(f"warning: {rep_dir.name}'s boundary shapes read a one-row step of {one_row[0]:.1f} and "
              f"{one_row[1]:.1f} ms: the box's speed moved more than 1.5x across it, so its pairing "
              f"is weak (is another job running?)", flush=True)
    shape = rep_dir / "shape.json"
    shape.write_text(json.dumps(mean_shape(before, after), indent=1) + "\n")
    calibrated = stage_calibrate(args, rep_dir, shape)
    sim = stage_simulate(args, calibrated, rounds)
    (rep_dir / "sim.json").write_text(json.dumps({str(k): v for k, v in sim.items()}, indent=1) + "\n")
    return real, sim


if __name__ == "__main__":
    sys.exit(main())
