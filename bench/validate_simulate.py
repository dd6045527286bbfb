"""Validate `dspark simulate` against the real services: `python -m bench.validate_simulate`.

Owns the comparison docs/simulate.md §5 reports: the simulator at a measured CPU shape with
`--shared-compute` against `bench_serving` on the same box, for the same arms, concurrencies,
prompts and lengths. It prints one side-by-side table (and writes `--json`); it asserts
nothing, as every benchmark here.

Three stages, each a child process of its own (the services' own command lines):

1. **Shape**: `bench.sim_cpu_shape` on the checkpoint, one torch thread, as the services run
   here, measured in this run so that the simulator prices the box the bench runs on (a
   shared box's speed moves 12-25 % over hours; `--shape FILE` runs a given shape instead):
   once before the real cells and once after them, the pointwise faster of the two
   (`fastest_shape`: another job only ever slows a timing).
2. **Rounds**: `bench_serving --arms k5 --streams 1 --per-stream 4 --repeats 1 --warmup 0
   --record-rounds FILE`: what bench_serving's own four prompts draft and accept, each round
   labelled with its prompt's workload (the start-up warm-up generations, labelled `warmup`,
   are dropped).
3. **Bench**: `bench_serving --numerics fast --arms ... --streams ... --repeats R
   --fresh-gateway --warmup 0 --json`, the real figures (medians over R interleaved
   repetitions). The gateway restarts before every gated cell, so the gated arm starts cold
   in every cell, as the simulator runs it (a long-lived gateway carries its regime and warm
   start from cell to cell, which the simulator's cells do not model).

After 3, a **calibration** cell: plain at `--calibrate-streams` (8, a load the
comparison does not use) through bench_serving. Two costs the in-process shape cannot see are
read from it and written into the shape the simulator runs (`shape-calibrated.json`):
`session_ms`, what each session adds to a served verifier step beyond the bare forward (the
served step's ms from the verifier's Info minus the shape's step at the same rows, per
session: serialising replies in the same process takes the forward's core and GIL), and
`gateway_ms`, the gateway's and client's work per reply, done one at a time (the inter-token
gap beyond the served step and the network, per session in the step; the simulator charges it
on the drafter's replies too, docs/simulate.md §5).

Then `dspark simulate --costs SHAPE --shared-compute --rounds FILE --order cycle` runs the same
cells: the same closed loop (each stream runs `--per-stream` generations back to back), each
stream's generations replaying bench_serving's prompts in bench_serving's order from their
first recorded round (every stream runs code, prose, math, repeat in turn: greedy, so the
streams' generations are the same text and accept the same drafts in the same rounds), each
prompt's own token length, `--max-tokens` tokens out, the bench's session limit and rpc cost
from the shape. The table gives, per arm and concurrency, aggregate tok/s
and verifier sessions per step, real (median [min-max]) and simulated, and their ratio.

    python -m bench.validate_simulate [--port-base 50400] [--repeats 3] [--streams 1 4 16]
        [--arms plain k5 gated] [--workdir DIR] [--json FILE] [--nice N]

`--nice N` runs the bench children at that niceness (negative needs root): on a machine
shared with other work it keeps the measured services from being starved.
`--workdir` holds every stage's output (default: a new folder under the system's temporary
folder, so every stage is measured in this run); a stage whose output is already there is
not run again, so `--workdir` of an earlier run re-simulates its real figures (after a change
to the simulator) without measuring anything.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.bench_serving import WORKLOADS
from services.gateway.rounds import RoundLog, load_rounds, save_rounds

REPO_ROOT = Path(__file__).resolve().parents[1]
STAGE_TIMEOUT_S = 3600.0


def _run(cmd: list[str], nice: int, out: Path | None = None) -> None:
    """Run a stage as a child at niceness `nice`, stdout to `out` (or the terminal).
    Raises RuntimeError naming the command when it fails."""
    full = (["nice", "-n", str(nice)] if nice else []) + [sys.executable, "-m", *cmd]
    print("$", " ".join(full), flush=True)
    with open(out, "w") if out else open(os.devnull, "w") as sink:
        rc = subprocess.run(full, cwd=REPO_ROOT, stdout=sink if out else None, timeout=STAGE_TIMEOUT_S).returncode
    if rc != 0:
        if out:  # a half-written output would be taken as done by the next run in this workdir
            out.unlink(missing_ok=True)
        raise RuntimeError(f"stage failed with status {rc}: {' '.join(full)}")


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
    _run(["bench.bench_serving", "--numerics", "fast", "--arms", "k5", "--streams", "1", "--per-stream", "4",
          "--repeats", "1", "--warmup", "0", "--max-tokens", str(args.max_tokens), "--port-base", str(args.port_base),
          "--checkpoint", args.checkpoint, "--record-rounds", str(raw)], args.nice)
    log = load_rounds(raw)
    save_rounds(RoundLog(tuple(r for r in log.rounds if r.workload != "warmup"),
                         {**log.metadata, "source": "bench.validate_simulate: bench_serving k5, 1 stream"}), kept)
    return kept


def stage_bench(args, work: Path) -> dict:
    """Stage 3: bench_serving's figures {streams: {arm: {figure: {median, low, high}}}}."""
    out = work / "bench.json"
    if not out.exists():
        _run(["bench.bench_serving", "--numerics", "fast", "--arms", *args.arms, "--streams", *map(str, args.streams),
              "--repeats", str(args.repeats), "--fresh-gateway", "--warmup", "0",
              "--per-stream", str(args.per_stream), "--max-tokens",
              str(args.max_tokens), "--port-base", str(args.port_base), "--checkpoint", args.checkpoint,
              "--json", str(out)], args.nice)
    return json.loads(out.read_text())["medians"]["fast"]


def fastest_shape(before: dict, after: dict) -> dict:
    """The pointwise minimum of two measurements of one shape (`bench.sim_cpu_shape` objects,
    the same points): another job on a shared box only ever slows a timing, so the faster of
    two, taken before and after the real cells, is the box's own speed (a single measurement
    at the start once read a step 2x slower than the same script a quarter hour later).
    Raises ValueError naming a table whose points differ."""
    out = copy.deepcopy(before)
    tables = [("verifier", "rows")] + [(f"drafter.{t}", "sessions" if t == "draft" else "rows")
                                       for t in before.get("drafter", {})]
    for name, key in tables:
        a, b, o = (_at(x, name) for x in (before, after, out))
        if a[key] != b[key]:
            raise ValueError(f"shape table {name}: points {a[key]} and {b[key]} differ")
        o["ms"] = [min(x, y) for x, y in zip(a["ms"], b["ms"])]
    return out


def _at(obj: dict, dotted: str) -> dict:
    for part in dotted.split("."):
        obj = obj[part]
    return obj


def stage_calibrate(args, work: Path, shape: Path) -> Path:
    """The calibration cell (module docstring): `shape` with session_ms and gateway_ms from a
    served plain cell at args.calibrate_streams streams. Raises ValueError on a shape without
    a verifier table."""
    out = work / "calibration.json"
    if not out.exists():
        _run(["bench.bench_serving", "--numerics", "fast", "--arms", "plain", "--streams", str(args.calibrate_streams),
              "--repeats", "1", "--warmup", "0", "--per-stream", str(args.per_stream), "--max-tokens",
              str(args.max_tokens), "--port-base", str(args.port_base), "--checkpoint", args.checkpoint,
              "--json", str(out)], args.nice)
    cell = json.loads(out.read_text())["medians"]["fast"][str(args.calibrate_streams)]["plain"]
    sessions, step_ms = cell["sessions_per_step"]["median"], cell["verifier_step_ms"]["median"]
    from services.simulate.models import load_model
    model = load_model(str(shape))
    session_ms = max(step_ms - model.verifier.ms_at(sessions), 0.0) / sessions
    gateway_ms = max(cell["itl_p50_ms"]["median"] - step_ms - args.rpc_ms, 0.0) / sessions
    calibrated = work / "shape-calibrated.json"
    obj = json.loads(Path(shape).read_text())
    obj["verifier"]["session_ms"] = round(session_ms, 3)
    obj["gateway_ms"] = round(gateway_ms, 3)
    obj["rpc_ms"] = args.rpc_ms
    obj["notes"] = (f"{obj.get('notes', '')} calibrated by bench.validate_simulate from served plain at "
                    f"{args.calibrate_streams} streams: step {step_ms:.1f} ms over {sessions:.2f} sessions, "
                    f"ITL p50 {cell['itl_p50_ms']['median']:.1f} ms").strip()
    calibrated.write_text(json.dumps(obj, indent=1))
    print(f"calibration: session_ms {session_ms:.3f}, gateway_ms {gateway_ms:.3f} (plain, "
          f"{args.calibrate_streams} streams: step {step_ms:.1f} ms, {sessions:.2f} sessions)")
    return calibrated


def stage_simulate(args, shape: Path, rounds: Path) -> dict:
    """The simulator's cells {streams: {arm: figures}} at `shape`, shared compute."""
    prompts = ",".join(f"{name}={n}" for name, n in prompt_tokens(args.checkpoint).items())
    cmd = [sys.executable, "-m", "services.cli", "simulate", "--costs", str(shape), "--shared-compute",
           "--cores", str(args.cores), "--order", "cycle",
           "--rounds", str(rounds), "--arms", *args.arms, "--streams", *map(str, args.streams),
           "--per-stream", str(args.per_stream), "--prompt", prompts, "--output", str(args.max_tokens),
           "--max-sessions", str(max(args.streams) + 8), "--seed", str(args.seed), "--json"]
    print("$", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=STAGE_TIMEOUT_S, check=True)
    return {int(load): row for load, row in json.loads(done.stdout)["cells"].items()}


FIGURES = (("aggregate_tok_s", "tok/s", 0.15), ("sessions_per_step", "sessions/step", 0.20))


def compare(real: dict, sim: dict, streams: list[int], arms: list[str]) -> list[dict]:
    """One row per (streams, arm): each figure's real median [min, max], simulated value,
    sim / real, and whether it is within the issue's tolerance (15 % tok/s, 20 % sessions)."""
    rows = []
    for s in streams:
        for arm in arms:
            row = {"streams": s, "arm": arm}
            for key, _, tol in FIGURES:
                r = real[str(s)][arm][key]
                v = sim[s][arm][key]
                ratio = v / r["median"] if r["median"] else float("nan")
                row[key] = {"real": r, "sim": v, "ratio": ratio, "within": abs(ratio - 1) <= tol}
            rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    """The side-by-side table as Markdown (bench/README.md's form)."""
    head = "| streams | arm | real tok/s (median [min-max]) | sim tok/s | sim ÷ real | real sessions/step | " \
           "sim sessions/step | sim ÷ real |\n|---|---|---|---|---|---|---|---|"
    lines = [head]
    for row in rows:
        cells = []
        for key, _, _ in FIGURES:
            f = row[key]
            r = f["real"]
            mark = "" if f["within"] else " ✗"
            cells += [f"{r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}]", f"{f['sim']:.2f}", f"{f['ratio']:.2f}{mark}"]
        lines.append(f"| {row['streams']} | {row['arm']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _bad_argument(args) -> str | None:
    """The first argument no stage could run with, as a message naming the value; None when
    all are good. Checked before the first stage, which takes minutes."""
    from bench.bench_serving import ARMS
    from services.simulate.cli import MAX_RPC_MS, MAX_STREAMS

    for name in ("repeats", "per_stream", "max_tokens", "calibrate_streams", "cores"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1"
    out = [n for n in args.streams if not 1 <= n <= MAX_STREAMS]
    if out:
        return f"--streams {out[0]}: a concurrency must be in 1..{MAX_STREAMS}"
    if args.calibrate_streams in args.streams:
        return f"--calibrate-streams={args.calibrate_streams}: is one of --streams; keep the calibration cell out"
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        return f"--arms {unknown[0]!r}: bench_serving runs only {', '.join(ARMS)}"
    if not 0 <= args.rpc_ms <= MAX_RPC_MS:
        return f"--rpc-ms={args.rpc_ms}: must be a finite number of ms in [0, {MAX_RPC_MS:g}]"
    if args.seed < 0:
        return f"--seed={args.seed}: must be >= 0"
    if not 1024 <= args.port_base <= 65000:
        return f"--port-base={args.port_base}: must be in 1024..65000 (the services take ports above it)"
    if not (Path(args.checkpoint) / "tokenizer.json").is_file():  # the last stage reads it, after the bench
        return f"--checkpoint {args.checkpoint!r}: holds no tokenizer.json"
    if args.shape is not None and not Path(args.shape).is_file():
        return f"--shape {args.shape!r}: no such file (leave it out to measure a shape)"
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
    ap.add_argument("--repeats", type=int, default=3, help="interleaved real repetitions (median)")
    ap.add_argument("--per-stream", type=int, default=4, help="generations per stream and cell")
    ap.add_argument("--max-tokens", type=int, default=32, help="completion tokens per generation")
    ap.add_argument("--port-base", type=int, default=50400, help="first port of the real services")
    ap.add_argument("--calibrate-streams", type=int, default=8,
                    help="the plain calibration cell's concurrency (keep it out of --streams)")
    ap.add_argument("--seed", type=int, default=0, help="the simulator's seed")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                    help="cores of the simulator's shared pool (default: this machine's)")
    ap.add_argument("--rpc-ms", type=float, default=0.7,
                    help="one gateway <-> service call in the simulator (ms; default: bench_services' 2.07 ms "
                         "of gRPC per round over its three calls)")
    ap.add_argument("--nice", type=int, default=0, help="niceness of the measuring children (negative: root)")
    ap.add_argument("--shape", default=None,
                    help="a cpu shape file to run instead of measuring one (default: WORKDIR/shape.json, measured "
                    "in this run unless WORKDIR already holds it)")
    ap.add_argument("--workdir", default=None,
                    help="every stage's output; a stage whose output is there is not run again (default: a new "
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
    shape = Path(args.shape) if args.shape else work / "shape.json"
    measure = ["bench.sim_cpu_shape", "--checkpoint", args.checkpoint, "--repeats", "5"]
    if not shape.exists():
        before, after = work / "shape-before.json", work / "shape-after.json"
        if not before.exists():
            _run(measure, args.nice, out=before)
        rounds = stage_rounds(args, work)
        real = stage_bench(args, work)
        if not after.exists():
            _run(measure, args.nice, out=after)
        shape.write_text(json.dumps(fastest_shape(json.loads(before.read_text()), json.loads(after.read_text())),
                                    indent=1) + "\n")
    else:
        rounds = stage_rounds(args, work)
        real = stage_bench(args, work)
    calibrated = stage_calibrate(args, work, shape)
    sim = stage_simulate(args, calibrated, rounds)
    rows = compare(real, sim, args.streams, args.arms)
    print(markdown(rows))
    within = sum(row[k]["within"] for row in rows for k, _, _ in FIGURES)
    print(f"{within} of {len(rows) * len(FIGURES)} figures within tolerance (tok/s 15 %, sessions/step 20 %)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
