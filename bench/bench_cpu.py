"""CPU time per served token, per process: `python -m bench.bench_cpu`.

Owns the serving path's CPU cost breakdown: how many CPU milliseconds the client, the
gateway, the verifier and the drafter each spend per completion token while `--streams`
concurrent streams of one arm run through the gateway's streaming Generate. It prints the
figures (and writes `--json`) and never asserts them.

Setup: one stack of three `dspark serve` processes (bench/service_procs.py) on
`--checkpoint` (default the bundled assets/dspark-small), the client in this process, with
the prompts and requests of `bench.bench_serving`. Per cell (a concurrency), each stream
runs `--generations` generations of `--max-tokens` tokens (eos ignored) one after another.
CPU time of a service is user + system time of its whole process (every thread) from
/proc/<pid>/stat, read before and after the cell; the client's is this process's
`os.times()`. Figures per cell: wall s, aggregate tok/s, and per process CPU ms per token
and CPU utilisation (CPU s / wall s; 1.0 is one core busy). Cells of every concurrency run
interleaved per repetition; medians [min-max] over `--repeats`.

`--stack NAME[=ROOT][:VAR=VAL,...]` (repeatable) runs several stacks side by side, each on
its own ports, with its cells interleaved with the others' in every repetition: a source
tree ROOT (default this checkout) and settings laid over the environment, so two versions of
the code, or two settings, are compared under the same machine load. Without it: one stack
named "this".

`--profile DIR` runs `py-spy record` (when on PATH or beside this Python) on every service
of every stack during the last repetition's cell at the highest concurrency and writes
DIR/<stack>/<service>.svg (flame graphs), .raw (collapsed stacks) and .txt (the hottest
functions, by own samples).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc

from bench.bench_serving import ARMS, WORKLOADS, generate, stream_prompts, verifier_steps
from bench.service_procs import REPO_ROOT, ServiceProcesses, StackSpec, run_bench
from services.analysis.serving_stats import Spread
from dspark_proto.v1 import gateway_pb2_grpc, verifier_pb2_grpc
from services.common.server import channel_options

PROCESSES = ("client", "gateway", "verifier", "drafter")
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid`, all threads, from /proc/<pid>/stat.

    Raises:
        ProcessLookupError: no such process.
    """
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            stat = f.read()
    except FileNotFoundError:
        raise ProcessLookupError(f"pid {pid}: no such process") from None
    fields = stat[stat.rindex(")") + 2:].split()  # the command name may hold spaces
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime (fields 14, 15)


def cpu_snapshot(pids: dict[str, int]) -> dict[str, float]:
    """{process: CPU s so far} for the client (this process) and every service in `pids`."""
    t = os.times()
    out = {"client": t.user + t.system}
    out.update({name: process_cpu_s(pid) for name, pid in pids.items()})
    return out


async def run_cell(stack: dict, streams: int, arm: str, max_tokens: int, generations: int) -> dict:
    """One cell on `stack` ({"gateway", "verifier": stubs, "procs": ServiceProcesses}):
    `streams` streams of `generations` generations each; wall s, tokens, aggregate tok/s,
    the verifier's mean sessions per batch step, and per process CPU ms per token and CPU
    utilisation."""
    stub, pids = stack["gateway"], stack["procs"].pids
    prompts = [stream_prompts(streams, i) for i in range(streams)]
    per_stream = [[p[j % len(p)] for j in range(generations)] for p in prompts]

    async def one_stream(ps: list[str]) -> int:
        return sum([(await generate(stub, p, arm, max_tokens)).tokens for p in ps])

    steps0, sessions0, _ = await verifier_steps(stack["verifier"])
    cpu0, t0 = cpu_snapshot(pids), time.perf_counter()
    tokens = sum(await asyncio.gather(*(one_stream(ps) for ps in per_stream)))
    wall, cpu1 = time.perf_counter() - t0, cpu_snapshot(pids)
    steps1, sessions1, _ = await verifier_steps(stack["verifier"])
    out = {"wall_s": wall, "tokens": tokens, "aggregate_tok_s": tokens / wall,
           "sessions_per_step": (sessions1 - sessions0) / max(steps1 - steps0, 1)}
    for name in PROCESSES:
        used = cpu1[name] - cpu0[name]
        out[f"{name}_ms_per_token"] = used * 1e3 / tokens
        out[f"{name}_util"] = used / wall
    return out


def py_spy() -> str | None:
    """The py-spy executable: beside this Python first, then on PATH (None: not installed)."""
    here = Path(sys.executable).with_name("py-spy")
    return str(here) if here.is_file() else shutil.which("py-spy")


def start_profiles(exe: str, pids: dict[str, int], out_dir: Path, duration_s: int) -> list[subprocess.Popen]:
    """One `py-spy record` per service for `duration_s` s: an svg flame graph and raw samples."""
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for name, pid in pids.items():
        for fmt, suffix in (("flamegraph", "svg"), ("raw", "raw")):
            procs.append(subprocess.Popen(
                [exe, "record", "--pid", str(pid), "--duration", str(duration_s), "--rate", "50", "--nonblocking",
                 "--format", fmt, "-o", str(out_dir / f"{name}.{suffix}")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


def hottest(raw_path: Path, top: int = 25) -> list[tuple[str, float]]:
    """(function, share of samples) of the `top` functions by own (leaf) samples of a py-spy
    raw (collapsed stacks) file."""
    own: Counter[str] = Counter()
    total = 0
    for line in raw_path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        own[stack.split(";")[-1]] += int(count)
        total += int(count)
    return [(fn, n / max(total, 1)) for fn, n in own.most_common(top)]


def write_hottest(out_dir: Path, names) -> None:
    for name in names:
        raw = out_dir / f"{name}.raw"
        if raw.is_file():
            lines = [f"{share * 100:5.1f}%  {fn}" for fn, share in hottest(raw)]
            (out_dir / f"{name}.txt").write_text("\n".join(lines) + "\n")


async def run_grid(args, stacks: dict[str, dict]) -> dict[str, dict[int, list[dict]]]:
    """{stack: {streams: [cell per repetition]}}, every stack's cells interleaved per
    concurrency within each repetition (the stack order rotated per repetition)."""
    raw = {name: {s: [] for s in args.streams} for name in stacks}
    names = list(stacks)
    for rep in range(args.repeats):
        for streams in args.streams:
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                last = rep == args.repeats - 1 and streams == max(args.streams)
                cell = await profiled_cell(args, stacks[name], streams,
                                           Path(args.profile, name) if args.profile and last else None)
                raw[name][streams].append(cell)
                print(f"rep {rep + 1}/{args.repeats} {name} streams {streams:>2}: {cell['aggregate_tok_s']:6.1f} tok/s,"
                      f" {cell['sessions_per_step']:.1f} sessions/step, "
                      + ", ".join(f"{n} {cell[f'{n}_ms_per_token']:.2f}" for n in PROCESSES) + " CPU ms/token",
                      flush=True)
    return raw


async def profiled_cell(args, stack: dict, streams: int, profile: Path | None) -> dict:
    """`run_cell`, with every service under py-spy writing into folder `profile` (None: no
    profile; module docstring)."""
    spies = []
    if profile is not None:
        exe = py_spy()
        if exe is None:
            print("--profile: py-spy not found; profiling skipped")
        else:
            spies = start_profiles(exe, stack["procs"].pids, profile, args.profile_s)
    cell = await run_cell(stack, streams, args.arm, args.max_tokens, args.generations)
    for p in spies:
        p.wait(timeout=args.profile_s + 60)
    if spies:
        write_hottest(profile, stack["procs"].pids)
    return cell


def report(name: str, raw: dict[int, list[dict]]) -> dict:
    """Print and return {streams: {figure: Spread as dict}} (medians [min-max]) of stack `name`."""
    med = {s: {k: Spread.of(c[k] for c in cells) for k in cells[0]} for s, cells in raw.items()}
    print(f"stack {name}: median [min-max] of {len(next(iter(raw.values())))}")
    print("| streams | aggregate tok/s | sessions / step | " + " | ".join(f"{n} CPU ms/token" for n in PROCESSES)
          + " | " + " | ".join(f"{n} util" for n in PROCESSES) + " |")
    print("|---" * (3 + 2 * len(PROCESSES)) + "|")
    for s, f in med.items():
        spread = lambda k: f"{f[k].median:.2f} [{f[k].low:.2f}-{f[k].high:.2f}]"  # noqa: E731
        cells = [spread("aggregate_tok_s"), f"{f['sessions_per_step'].median:.1f}"]
        cells += [spread(f"{n}_ms_per_token") for n in PROCESSES]
        cells += [f"{f[f'{n}_util'].median:.2f}" for n in PROCESSES]
        print(f"| {s} | " + " | ".join(cells) + " |")
    return {s: {k: v.as_dict() for k, v in f.items()} for s, f in med.items()}


def parse_stack(text: str) -> tuple[str, Path, tuple[tuple[str, str], ...]]:
    """`NAME[=ROOT][:VAR=VAL,...]` -> (name, source tree, settings).

    Raises:
        ValueError: an empty name, a ROOT that is no folder, or a setting without "=" (named).
    """
    head, _, settings = text.partition(":")
    name, _, root = head.partition("=")
    if not name:
        raise ValueError(f"--stack {text!r}: empty name (NAME[=ROOT][:VAR=VAL,...])")
    path = Path(root).resolve() if root else REPO_ROOT
    if not path.is_dir():
        raise ValueError(f"--stack {text!r}: root {root!r} is not a folder")
    pairs = []
    for item in filter(None, settings.split(",")):
        var, eq, val = item.partition("=")
        if not eq or not var:
            raise ValueError(f"--stack {text!r}: setting {item!r} is not VAR=VALUE")
        pairs.append((var, val))
    return name, path, tuple(pairs)


async def run(args, env: dict[str, str]) -> int:
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench_cpu_"))
    stacks: dict[str, dict] = {}
    try:
        for i, (name, root, settings) in enumerate(args.stack):
            spec = StackSpec(args.checkpoint, args.port_base + 10 * i, log_dir, args.numerics,
                             max_sessions=max(args.streams) + 8, threads=args.threads, root=root, env=settings)
            stacks[name] = {"procs": ServiceProcesses(spec, env)}
        for name, st in stacks.items():
            await st["procs"].wait_serving()
            spec = st["procs"].spec
            st["channels"] = [grpc.aio.insecure_channel(t, options=channel_options())
                              for t in (spec.gateway_target, spec.verifier_target)]
            st["gateway"] = gateway_pb2_grpc.GatewayStub(st["channels"][0])
            st["verifier"] = verifier_pb2_grpc.VerifierStub(st["channels"][1])
            for _ in range(2):  # warm-up: first-call costs (allocations, caches) stay out of the cells
                await generate(st["gateway"], WORKLOADS["code"], args.arm, args.max_tokens)
        raw = await run_grid(args, stacks)
    finally:
        for st in stacks.values():
            for ch in st.get("channels", []):
                await ch.close()
            st["procs"].stop()
    med = {name: report(name, r) for name, r in raw.items()}
    if args.json:
        saved = {k: v for k, v in vars(args).items() if k != "stack"}
        saved["stack"] = [[n, str(r), list(e)] for n, r, e in args.stack]
        Path(args.json).write_text(json.dumps({"args": saved, "raw": raw, "medians": med}, indent=1))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="assets/dspark-small", help="model folder ('' = the random tiny model)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16], help="concurrencies (default 1 16)")
    ap.add_argument("--arm", default="plain", choices=list(ARMS), help="the arm every stream runs (default plain)")
    ap.add_argument("--numerics", default="fast", choices=["fast", "exact"])
    ap.add_argument("--max-tokens", type=int, default=32, help="completion tokens per generation")
    ap.add_argument("--generations", type=int, default=4, help="generations per stream and cell")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repetitions (median, min-max)")
    ap.add_argument("--port-base", type=int, default=57340, help="gateway port (verifier +1, drafter +2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per service process")
    ap.add_argument("--stack", action="append", default=None, metavar="NAME[=ROOT][:VAR=VAL,...]",
                    help="a stack to run (repeatable; cells interleaved): its source tree and settings")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="py-spy every service during the last repetition's highest-concurrency cell")
    ap.add_argument("--profile-s", type=int, default=15, help="seconds each py-spy records (default 15)")
    ap.add_argument("--json", default=None, help="write raw cells and medians to this file")
    ap.add_argument("--log-dir", default=None, help="the services' logs (default: a new temporary folder)")
    args = ap.parse_args(argv)
    for name in ("max_tokens", "generations", "repeats", "threads", "profile_s"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if any(s < 1 for s in args.streams):
        ap.error(f"--streams={args.streams}: every concurrency must be >= 1")
    args.checkpoint = args.checkpoint or None
    args.streams = sorted(set(args.streams))
    try:
        args.stack = [parse_stack(t) for t in (args.stack or ["this"])]
    except ValueError as exc:
        ap.error(str(exc))
    if len({n for n, _, _ in args.stack}) < len(args.stack):
        ap.error(f"--stack names repeat: {[n for n, _, _ in args.stack]}")
    return args


def main() -> None:
    run_bench(run, parse_args())


if __name__ == "__main__":
    main()
