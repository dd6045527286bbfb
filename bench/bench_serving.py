"""The serving benchmark through the three services: `python -m bench.bench_serving`.

Owns the end-to-end throughput and latency figures of the served model under 1..32
concurrent streams; it prints them (and writes `--json`) and never asserts them.

Setup: for each verify numerics (`--numerics`, default fast and exact) one stack of three
`dspark serve` processes (bench/service_procs.py; gateway on port-base + 10 i, verifier and
drafter on the next two ports) on `--checkpoint` (default the bundled assets/dspark-small
with its DSpark drafter), each process with `--threads` torch threads. All traffic goes
through the gateway's streaming Generate, the public API a client uses.

The drafter (`--drafter`): the checkpoint's DSpark drafter, or the live oracle (`DRAFTERS`):
every draft accepted, or none (every slot corrupted), with doubtful or confident logits on the
corrupted slots, the gate's hardest case (a drafter that costs drafts and never pays).

Arms (`--arms`): plain (spec off), k1..k5 (spec always with `max_draft_tokens` = k: every
round submits k drafts, fewer only at the token budget's end) and gated (spec gated: the
confidence gate picks k per round, up to the block size). Prompts: four workloads (code,
prose, math, repeat); a cell at concurrency c runs c streams, and each stream runs
max(`--per-stream`, ceil(4 / c)) generations one after another, so every cell covers all
four workloads. Generations ignore eos, so each yields exactly `--max-tokens` tokens.
Aggregate tok/s is a cell's tokens over its wall time, first request to last token. With one
generation per stream (`--per-stream 1`) that is the makespan of a closed batch, whose slowest
stream sets the figure; the default, 4 per stream, brings it towards the steady rate of a
server with a queue of requests (a stream that finishes early starts its next one), as serving
benchmarks run many more requests than the concurrency.

Order: each repetition runs every concurrency, and within it every numerics and every arm,
the arms in an order rotated per repetition, so all arms see the same machine load. The
figures (services/analysis/serving_stats.py has their definitions) are the medians over `--repeats`
repetitions, with min-max. Summary, as paired ratios (each repetition's own ratio, then the
median [min-max] of those, so load that drifts between repetitions cancels): gated / the best
fixed arm (the other arm with the highest median, `best_fixed_arm`; gated / each repetition's
maximum beside it) and exact / fast per concurrency, and the issue's three aims (plain 16
streams >= 6x 1 stream; gated >= 0.97x the best fixed arm everywhere; exact within 1.3x of
fast at 16 streams). `--from-json FILE` prints the tables of an earlier run's `--json` again. `--warmup` (default
1) first runs the gated arm once over every concurrency, unmeasured (`run_warmup` says why).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import grpc
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from bench.service_procs import ServiceProcesses, StackSpec, run_bench
from services.analysis.serving_stats import GenerationTrace, Spread, cell_figures
from dspark_proto.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, verifier_pb2_grpc
from services.common.server import channel_options
from services.drafter.live_oracle import DEFAULT_CONFIDENT

WORKLOADS = {
    "code": "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "prose": "The old lighthouse keeper walked slowly along the shore, watching",
    "math": "Solve for x: 3x + 7 = 22. Subtract 7 from both sides: 3x =",
    "repeat": "0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
}
# arm name -> (spec mode, max_draft_tokens); 0 = the block size
ARMS = {"plain": (gateway_pb2.SPEC_MODE_OFF, 0), **{f"k{k}": (gateway_pb2.SPEC_MODE_ALWAYS, k) for k in range(1, 6)},
        "gated": (gateway_pb2.SPEC_MODE_GATED, 0)}
STREAMS = (1, 2, 4, 8, 16, 32)
QUICK = {"streams": [1, 4], "arms": ["plain", "k5", "gated"], "max_tokens": 16, "repeats": 1, "per_stream": 1,
         "warmup": 0}
# --drafter choice -> the `dspark serve drafter` flags that serve it. "dspark": the checkpoint's
# DSpark drafter. The live oracle drafts the verifier's own continuation: "oracle" keeps every
# slot (every draft accepted); "oracle-never" corrupts every slot (no draft is ever accepted),
# with the doubtful confidence logit a gate can learn apart, and "oracle-never-confident" gives
# the corrupted slots the kept slots' confidence: a drafter that is confidently wrong.
DRAFTERS = {"dspark": (), "oracle": ("--oracle",),
            "oracle-never": ("--oracle", "--oracle-corrupt-every", "1"),
            "oracle-never-confident": ("--oracle", "--oracle-corrupt-every", "1",
                                       "--oracle-doubtful", str(DEFAULT_CONFIDENT))}
CALL_TIMEOUT_S = 900.0   # deadline of one Generate (s): a hang guard for the slowest cell
INFO_TIMEOUT_S = 10.0


async def generate(stub, prompt: str, arm: str, max_tokens: int,
                   rounds: list[tuple[int, int, int]] | None = None, label: str | None = None) -> GenerationTrace:
    """One Generate call of `arm`; the arrival time and token count of every message. With
    `rounds`, appends the final message's (rounds, drafts submitted, plain rounds). `label`:
    the workload its recorded rounds carry (default: the prompt's workload name).
    Raises grpc.aio.AioRpcError on a failed call."""
    spec, k = ARMS[arm]
    label = label or next((name for name, text in WORKLOADS.items() if text == prompt), "live")
    req = gateway_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, spec=spec, max_draft_tokens=k,
                                      ignore_eos=True, label=label)
    trace = GenerationTrace(time.perf_counter())
    async for msg in stub.Generate(req, timeout=CALL_TIMEOUT_S):
        if msg.token_ids:
            trace.arrivals.append((time.perf_counter(), len(msg.token_ids)))
        if msg.finished and rounds is not None:
            st = msg.spec_stats
            rounds.append((st.rounds, st.submitted, st.plain_rounds))
    return trace


def _flag(value) -> str:
    """A QUICK value as it would be typed on the command line."""
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def stream_prompts(streams: int, index: int, per_stream: int = 1) -> list[str]:
    """The prompts stream `index` of `streams` runs in turn: max(per_stream, ceil(4 /
    streams)) of them, consecutive in the workload cycle, so that the cell's streams
    together cover every workload and a stream of four or more runs every workload."""
    names = list(WORKLOADS)
    per = max(per_stream, math.ceil(len(names) / streams))
    return [WORKLOADS[names[(index * per + j) % len(names)]] for j in range(per)]


async def run_stream(stub, prompts: list[str], arm: str, max_tokens: int,
                     rounds: list[tuple[int, int, int]]) -> list[GenerationTrace]:
    return [await generate(stub, p, arm, max_tokens, rounds) for p in prompts]


async def verifier_steps(stub) -> tuple[int, float, float]:
    """(batch steps so far, sessions summed over them, their ms summed) from the verifier's Info."""
    info = await stub.Info(common_pb2.InfoRequest(), timeout=INFO_TIMEOUT_S)
    return info.steps, info.batch_size_mean * info.steps, info.step_ms_mean * info.steps


def _stat_ticks(path: str) -> tuple[str, int]:
    """(name, utime + stime clock ticks) of a /proc stat file (a process's or a thread's)."""
    with open(path, encoding="ascii", errors="replace") as f:
        comm, rest = f.read().split(" (", 1)[1].rsplit(")", 1)
    fields = rest.split()
    return comm, int(fields[11]) + int(fields[12])  # utime, stime (stat fields 14, 15)


def cpu_s(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) each service process has used so far, from
    /proc/<pid>/stat (Linux). Raises OSError when a process is gone."""
    tick = os.sysconf("SC_CLK_TCK")
    return {name: _stat_ticks(f"/proc/{pid}/stat")[1] / tick for name, pid in pids.items()}


def off_step_cpu_s(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds each service process has used so far outside its step loop's thread (the
    thread named "<role>-steps", `services.common.step_queue`): its event loop's gRPC and
    protobuf work, the rest of its threads. The process's own total (/proc/<pid>/stat, which
    keeps the time of threads that have ended) less the step threads' (/proc/<pid>/task/*/stat,
    Linux): summing the live threads instead lost an ended thread's time, so the figure could
    fall between a cell's two readings. A thread that ends between the listing and its read is
    skipped (it is no step thread: those live as long as their service). Raises OSError when a
    process is gone."""
    tick = os.sysconf("SC_CLK_TCK")
    steps_s = {}
    for name, pid in pids.items():
        steps = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                comm, ticks = _stat_ticks(f"/proc/{pid}/task/{tid}/stat")
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):  # ended while read
                continue
            if comm.endswith("-steps"):
                steps += ticks
        steps_s[name] = steps / tick
    # the total read after the step threads: what they ran in between counts here as off-step
    # (a tick at most), never the other way, which could make a quiet cell's figure negative
    total = cpu_s(pids)
    return {name: max(total[name] - steps_s[name], 0.0) for name in pids}


async def run_cell(stack: dict, streams: int, arm: str, max_tokens: int, per_stream: int = 1) -> dict:
    """One cell: `streams` concurrent streams of `arm`; its figures, the verifier's mean
    sessions per batch step over the cell, and the generations' drafts submitted per round
    and share of plain rounds (from each final message's SpecStats), the three services'
    CPU ms per completion token (summed, and per service under `cpu_ms_per_token_by_service`),
    and, for the simulator's event-loop costs (bench.validate_simulate), each service's CPU
    seconds outside its step loop (`off_step_cpu_s_by_service`) with the cell's `rounds`,
    `drafts_submitted` and `generations`."""
    steps0, sessions0, ms0 = await verifier_steps(stack["verifier"])
    cpu0, off0 = cpu_s(stack["procs"].pids), off_step_cpu_s(stack["procs"].pids)
    rounds: list[tuple[int, int, int]] = []
    traces = await asyncio.gather(*(run_stream(stack["gateway"], stream_prompts(streams, i, per_stream), arm, max_tokens,
                                               rounds) for i in range(streams)))
    cpu1, off1 = cpu_s(stack["procs"].pids), off_step_cpu_s(stack["procs"].pids)
    steps1, sessions1, ms1 = await verifier_steps(stack["verifier"])
    out = cell_figures(traces).as_dict()
    # The services' CPU per token: what a policy costs the shared cores, whatever else runs on the machine.
    per_token = 1e3 / max(out["tokens"], 1)
    out["cpu_ms_per_token"] = (sum(cpu1.values()) - sum(cpu0.values())) * per_token
    out["cpu_ms_per_token_by_service"] = {name: (cpu1[name] - cpu0[name]) * per_token for name in cpu1}
    out["sessions_per_step"] = (sessions1 - sessions0) / max(steps1 - steps0, 1)
    out["verifier_step_ms"] = (ms1 - ms0) / max(steps1 - steps0, 1)  # the mean step's forward wall time
    out["verifier_util"] = (ms1 - ms0) / 1e3 / max(out["wall_s"], 1e-9)  # share of the cell's wall time in steps
    total = max(sum(r for r, _, _ in rounds), 1)
    out["drafts_per_round"] = sum(s for _, s, _ in rounds) / total
    out["plain_round_share"] = sum(p for _, _, p in rounds) / total
    out["off_step_cpu_s_by_service"] = {name: off1[name] - off0[name] for name in off1}
    out["rounds"], out["generations"] = sum(r for r, _, _ in rounds), len(rounds)
    out["drafts_submitted"] = sum(s for _, s, _ in rounds)
    return out


def rotated(arms: list[str], rep: int) -> list[str]:
    r = rep % len(arms)
    return arms[r:] + arms[:r]


async def run_warmup(args, stacks: dict[str, dict], console: Console) -> dict:
    """`--warmup` unmeasured passes of the gated arm over every concurrency, before the grid:
    {numerics: {streams: [cell dict per pass]}} ({} without a gated arm or with --warmup 0).

    A gateway's regime (docs/gate.md §14) starts from a prior (every draft accepted, the
    single-stream drafter legs) and learns the pooled survival and the legs per concurrency
    bucket from its drafted rounds; its gates learn too (§6). A served gateway has long passed
    that; a benchmark cell of 5-30 s has not, so without a warm-up the gated figures would
    charge a one-time cold start to every repetition's first pass. The warm-up's own figures
    are printed and kept (`--json` key "warmup"): they are the cold cost.
    """
    if "gated" not in args.arms or args.warmup == 0:
        return {}
    out = {n: {s: [] for s in args.streams} for n in stacks}
    for rep in range(args.warmup):
        for streams in args.streams:
            for numerics, stack in stacks.items():
                cell = await run_cell(stack, streams, "gated", args.max_tokens, args.per_stream)
                out[numerics][streams].append(cell)
                console.print(f"warm-up {rep + 1}/{args.warmup} streams {streams:>2} {numerics:<5} gated "
                              f"{cell['aggregate_tok_s']:7.1f} tok/s  ({cell['wall_s']:.1f} s)", highlight=False)
    return out


async def run_grid(args, stacks: dict[str, dict], console: Console) -> dict:
    """{numerics: {streams: {arm: [cell dict per repetition]}}} over the whole grid."""
    raw = {n: {s: {a: [] for a in args.arms} for s in args.streams} for n in stacks}
    for rep in range(args.repeats):
        for streams in args.streams:
            for numerics, stack in stacks.items():
                for arm in rotated(args.arms, rep + args.rotate):
                    if args.fresh_gateway and arm == "gated":
                        stack["procs"].restart_gateway()
                        await stack["procs"].wait_serving()
                    cell = await run_cell(stack, streams, arm, args.max_tokens, args.per_stream)
                    raw[numerics][streams][arm].append(cell)
                    console.print(f"rep {rep + 1}/{args.repeats} streams {streams:>2} {numerics:<5} {arm:<5} "
                                  f"{cell['aggregate_tok_s']:7.1f} tok/s  ({cell['wall_s']:.1f} s)", highlight=False)
    return raw


def medians(raw: dict) -> dict:
    """{numerics: {streams: {arm: {figure: Spread}}}} from the raw cells."""
    out = {}
    for numerics, by_streams in raw.items():
        out[numerics] = {}
        for streams, by_arm in by_streams.items():
            out[numerics][streams] = {}
            for arm, cells in by_arm.items():
                figs = {k: Spread.of(c[k] for c in cells) for k, v in cells[0].items() if not isinstance(v, dict)}
                for service in cells[0].get("cpu_ms_per_token_by_service", {}):
                    figs[f"cpu_ms_per_token_{service}"] = Spread.of(c["cpu_ms_per_token_by_service"][service]
                                                                    for c in cells)
                out[numerics][streams][arm] = figs
    return out


def fmt(s: Spread, digits: int = 1) -> str:
    return f"{s.median:.{digits}f} [{s.low:.{digits}f}-{s.high:.{digits}f}]"


def cell_table(numerics: str, med: dict, args) -> Table:
    t = Table(title=escape(f"{numerics} numerics: median [min-max] of {args.repeats}, "
                           f"{args.max_tokens} tokens per generation, {args.per_stream} per stream"))
    for col in ("streams", "arm", "aggregate tok/s", "per-stream tok/s", "TTFT p50 ms", "TTFT p99 ms",
                "ITL p50 ms", "ITL p99 ms", "sessions/step", "drafts/round", "plain rounds", "CPU ms/token"):
        t.add_column(col, justify="right")
    for streams in args.streams:
        for arm in args.arms:
            f = med[streams][arm]
            t.add_row(str(streams), arm, fmt(f["aggregate_tok_s"]), fmt(f["per_stream_tok_s"]),
                      f"{f['ttft_p50_ms'].median:.0f}", f"{f['ttft_p99_ms'].median:.0f}",
                      f"{f['itl_p50_ms'].median:.1f}", f"{f['itl_p99_ms'].median:.1f}",
                      f"{f['sessions_per_step'].median:.2f}", _median(f, "drafts_per_round", "{:.2f}"),
                      _median(f, "plain_round_share", "{:.0%}"), _median(f, "cpu_ms_per_token", "{:.1f}"))
    return t


def _median(figures: dict, name: str, form: str) -> str:
    """A figure's median in `form`, or "-" for runs saved before the figure existed."""
    return form.format(figures[name].median) if name in figures else "-"


def paired(reps: int, numerator, denominator) -> Spread:
    """Median [min-max] over repetitions 0..reps-1 of numerator(rep) / denominator(rep), each
    mapping a repetition index to an aggregate tok/s. Both sides of a ratio come from the same
    repetition, run minutes apart at most, so a drift in the machine's load between
    repetitions cancels out of it."""
    return Spread.of(numerator(r) / denominator(r) for r in range(reps))


def best_fixed_arm(cells: dict[str, list[dict]], arms: list[str]) -> str:
    """The arm among `arms` with the highest median aggregate tok/s over its repetitions
    (`cells`: arm -> the repetitions' figures): the one fixed policy a user would pick from
    the table. Raises ValueError when `arms` is empty."""
    if not arms:
        raise ValueError("best_fixed_arm: no arms to choose from")
    return max(arms, key=lambda a: Spread.of(c["aggregate_tok_s"] for c in cells[a]).median)


def summary(raw: dict, args) -> dict:
    """Per concurrency, as paired ratios of aggregate tok/s (`paired`): gated / the best fixed
    arm (`best_fixed_arm`, per numerics; which one in "best_arm"), gated / the best other arm
    of each repetition (an upper bound: see below), and exact / fast of plain, gated and each
    side's best arm; then the issue's aims.
    {"rows": {streams: {name: Spread}}, "best_arm": {streams: {numerics: arm}}, "aims": {...}}.

    The aim compares gated with the best of the fixed arms, one policy. The maximum over
    arms taken afresh in each repetition instead picks whichever arm was lucky in that
    repetition: with six arms whose cells scatter by +-10 % (this 2-core box) that maximum
    sits about 1.3 standard deviations above the best arm's own rate, so even an arm equal to
    the best scores below 1 against it. It is kept as `gated/rep-max` for comparison."""
    agg = lambda n, s, a, r: raw[n][s][a][r]["aggregate_tok_s"]  # noqa: E731
    rows, best_arm = {}, {}
    for streams in args.streams:
        row = {}
        for n in raw:
            if "gated" in args.arms and len(args.arms) > 1:
                others = [a for a in args.arms if a != "gated"]
                fixed = best_fixed_arm(raw[n][streams], others)
                best_arm.setdefault(streams, {})[n] = fixed
                row[f"gated/best {n}"] = paired(args.repeats, lambda r: agg(n, streams, "gated", r),
                                                lambda r: agg(n, streams, fixed, r))
                row[f"gated/rep-max {n}"] = paired(args.repeats, lambda r: agg(n, streams, "gated", r), lambda r: max(
                    agg(n, streams, a, r) for a in others))
        if "fast" in raw and "exact" in raw:
            for arm in ("plain", "gated"):
                if arm in args.arms:
                    row[f"exact/fast {arm}"] = paired(args.repeats, lambda r: agg("exact", streams, arm, r),
                                                      lambda r: agg("fast", streams, arm, r))
            best = lambda n, r: max(agg(n, streams, a, r) for a in args.arms)  # noqa: E731
            row["exact/fast best"] = paired(args.repeats, lambda r: best("exact", r), lambda r: best("fast", r))
        rows[streams] = row
    return {"rows": rows, "best_arm": best_arm, "aims": aims(raw, rows, args, agg)}


def aims(raw: dict, rows: dict, args, agg) -> dict[str, str]:
    """The issue's three aims on the median paired ratios, each "met (figure)" or "missed (figure)"."""
    out = {}
    for n in raw:
        if {1, 16} <= set(args.streams) and "plain" in args.arms:
            r = paired(args.repeats, lambda i: agg(n, 16, "plain", i), lambda i: agg(n, 1, "plain", i)).median
            out[f"plain 16 streams >= 6x 1 stream ({n})"] = f"{'met' if r >= 6 else 'missed'} ({r:.2f}x)"
        gb = [rows[s].get(f"gated/best {n}") for s in args.streams]
        if all(g is not None for g in gb):
            worst = min(g.median for g in gb)
            out[f"gated >= 0.97x best fixed arm at every concurrency ({n})"] = \
                f"{'met' if worst >= 0.97 else 'missed'} (lowest {worst:.2f}x)"
    if 16 in rows and "exact/fast best" in rows[16]:
        r = rows[16]["exact/fast best"].median
        out["exact within 1.3x of fast at 16 streams (best arms)"] = \
            f"{'met' if r >= 1 / 1.3 else 'missed'} (exact/fast {r:.2f})"
    return out or {"(aims)": "not measured: needs streams 1 and 16, plain and gated"}


def summary_table(summ: dict) -> Table:
    t = Table(title=escape("paired ratios of aggregate tok/s: median [min-max] over repetitions"))
    keys = sorted({k for r in summ["rows"].values() for k in r})
    t.add_column("streams", justify="right")
    for k in keys:
        t.add_column(k, justify="right")
    best = summ.get("best_arm", {})  # absent from runs saved before it existed
    numerics = sorted({n for arms in best.values() for n in arms})
    for n in numerics:
        t.add_column(f"best fixed arm {n}", justify="right")
    for streams, r in summ["rows"].items():
        chosen = best.get(streams, best.get(str(streams), {}))
        t.add_row(str(streams), *(fmt(r[k], 2) if r.get(k) is not None else "-" for k in keys),
                  *(chosen.get(n, "-") for n in numerics))
    return t


async def start_stacks(args, env: dict[str, str], console: Console, stacks: dict[str, dict]) -> None:
    """Start one stack per numerics into `stacks` (all at once: they load in parallel), wait
    until each serves, open its channels and warm every arm up with one short generation.
    `stacks` is filled as processes start, so the caller can stop them if this raises."""
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench_serving_"))
    for i, numerics in enumerate(args.numerics):
        record = None
        if args.record_rounds:
            path = Path(args.record_rounds)
            record = path if len(args.numerics) == 1 else path.with_name(f"{path.stem}-{numerics}{path.suffix}")
        spec = StackSpec(args.checkpoint, args.port_base + 10 * i, log_dir, numerics,
                         max_sessions=max(args.streams) + 8, threads=args.threads, record_rounds=record,
                         drafter_args=DRAFTERS[args.drafter])
        stacks[numerics] = {"procs": ServiceProcesses(spec, env)}
    console.print(f"services starting (logs in {log_dir})")
    started = time.perf_counter()  # the stacks start side by side: report each one's time from here
    for numerics, st in stacks.items():
        await st["procs"].wait_serving()
        waited = time.perf_counter() - started
        spec = st["procs"].spec
        st["channels"] = [grpc.aio.insecure_channel(t, options=channel_options())
                          for t in (spec.gateway_target, spec.verifier_target)]
        st["gateway"] = gateway_pb2_grpc.GatewayStub(st["channels"][0])
        st["verifier"] = verifier_pb2_grpc.VerifierStub(st["channels"][1])
        console.print(f"{numerics}: serving after {waited:.0f} s on port-base {spec.port_base}")
        for arm in args.arms:
            await generate(st["gateway"], WORKLOADS["code"], arm, 8, label="warmup")


def regime_lines(numerics: str, view: dict) -> list[str]:
    """The lines `gateway_regimes` prints for one gateway's Stats `regime` (`view`, the model
    regime's `to_dict` plus `enabled`, docs/gate.md §14): per in_flight the modelled plain and
    draft rates (tok/ms) and the choice, then the pooled survival per draft position (with the
    drafted blocks it was learned from) and the measured drafter legs per bucket (ms). A
    gateway with the regime off gives one line; one without a step table gives no rates."""
    if not view.get("enabled"):
        return [f"regime {numerics}: off"]
    lines = [f"regime {numerics} in flight {n:>4}: {'draft' if r['drafts'] else 'plain':<5}  "
             f"plain {r['plain_tok_per_ms']:.3f} tok/ms  draft {r['draft_tok_per_ms']:.3f} tok/ms"
             for n, r in view.get("in_flight", {}).items()]
    if not lines:
        lines.append(f"regime {numerics}: no step table, every gated round left to its gate")
    survival = " ".join(f"{s:.2f}" for s in view.get("survival", []))
    lines.append(f"regime {numerics} survival per draft {survival}  ({view.get('blocks', 0)} blocks)")
    legs = "  ".join(f"{b} {ms:.1f}" for b, ms in view.get("leg_ms", {}).items()) or "none measured"
    lines.append(f"regime {numerics} drafter legs ms per bucket: {legs}")
    return lines


async def gateway_regimes(stacks: dict[str, dict], console: Console) -> dict:
    """{numerics: the gateway's regime (Stats `regime`, docs/gate.md §14)}, printed by
    `regime_lines`: what the gated arm's gateway modelled at each concurrency after the grid."""
    out = {}
    for numerics, st in stacks.items():
        stats = await st["gateway"].Stats(gateway_pb2.StatsRequest(), timeout=INFO_TIMEOUT_S)
        out[numerics] = json.loads(stats.json).get("regime", {"enabled": False})
        for line in regime_lines(numerics, out[numerics]):
            console.print(line, highlight=False)
    return out


async def stop_stacks(stacks: dict[str, dict]) -> None:
    for st in stacks.values():
        for ch in st.get("channels", []):
            await ch.close()
        st["procs"].stop()


def report(raw: dict, args, grid_s: float, console: Console, regimes: dict | None = None,
           warmup: dict | None = None) -> None:
    """Print the tables and the aims of `raw` ({numerics: {streams: {arm: [cell per repetition]}}});
    with `args.json`, write them there too, with the gateways' regimes (`regimes`) and
    the warm-up's gated cells (`warmup`, see `run_warmup`)."""
    med = medians(raw)
    for numerics in raw:
        console.print(cell_table(numerics, med[numerics], args))
    summ = summary(raw, args)
    console.print(summary_table(summ))
    for aim, verdict in summ["aims"].items():
        console.print(f"aim: {aim}: {verdict}", highlight=False)
    console.print(f"grid wall time {grid_s / 60:.1f} min")
    if args.json:
        out = {"args": {k: v for k, v in vars(args).items() if k not in ("json", "from_json")}, "raw": raw,
               "medians": {n: {s: {a: {k: v.as_dict() for k, v in f.items()} for a, f in by_arm.items()}
                               for s, by_arm in v.items()} for n, v in med.items()},
               "summary": {"rows": {st: {k: v.as_dict() for k, v in r.items() if v is not None}
                                    for st, r in summ["rows"].items()}, "aims": summ["aims"]},
               "grid_s": grid_s, "regime": regimes, "warmup": warmup or {}}
        Path(args.json).write_text(json.dumps(out, indent=1))
        console.print(f"wrote {args.json}")


def load_run(path: str, args) -> tuple[dict, float]:
    """The raw cells and grid time of a `--json` file; sets args' grid (streams, arms,
    max_tokens, repeats) to the file's. Raises OSError, ValueError (not such a file)."""
    saved = json.loads(Path(path).read_text())
    if not {"raw", "args", "grid_s"} <= set(saved):
        raise ValueError(f"{path}: not a bench_serving --json file (no raw / args / grid_s)")
    args.per_stream = saved["args"].get("per_stream", 1)
    for key in ("streams", "arms", "max_tokens", "repeats"):
        setattr(args, key, saved["args"][key])
    raw = {n: {int(s): by_arm for s, by_arm in v.items()} for n, v in saved["raw"].items()}
    return raw, saved["grid_s"]


async def run(args, env: dict[str, str]) -> int:
    console = Console(width=200)  # the cell table's nine columns stay unwrapped in a log file
    if args.from_json:
        raw, grid_s = load_run(args.from_json, args)
        report(raw, args, grid_s, console)
        return 0
    console.print(f"checkpoint {args.checkpoint or 'random tiny'}; drafter {args.drafter}; "
                  f"streams {args.streams}; arms {args.arms}; "
                  f"numerics {args.numerics}; {args.max_tokens} tokens; {args.repeats} repetition(s); "
                  f"{args.threads} torch thread(s) per service")
    stacks: dict[str, dict] = {}
    try:
        await start_stacks(args, env, console, stacks)
        warmup = await run_warmup(args, stacks, console)
        t0 = time.monotonic()
        raw = await run_grid(args, stacks, console)
        grid_s = time.monotonic() - t0
        regimes = await gateway_regimes(stacks, console)
    finally:
        await stop_stacks(stacks)
    report(raw, args, grid_s, console, regimes, warmup)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="assets/dspark-small",
                    help="model folder ('' = the random tiny model; default assets/dspark-small)")
    ap.add_argument("--streams", type=int, nargs="+", default=list(STREAMS), help="concurrencies (default 1..32)")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help="arms (default all)")
    ap.add_argument("--numerics", nargs="+", default=["fast", "exact"], choices=["fast", "exact"],
                    help="verify numerics, one stack of services each (default: fast exact)")
    ap.add_argument("--max-tokens", type=int, default=32, help="completion tokens per generation")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repetitions (median, min-max)")
    ap.add_argument("--per-stream", type=int, default=4,
                    help="generations each stream runs in turn (at least ceil(4 / streams); default 4)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="unmeasured passes of the gated arm over every concurrency first (the regime's and "
                         "the gates' cold start; printed, and kept in --json; default %(default)s)")
    ap.add_argument("--drafter", default="dspark", choices=list(DRAFTERS),
                    help="the drafter served: the checkpoint's DSpark drafter (default), or the live oracle: "
                         "'oracle' (every draft accepted), 'oracle-never' (no draft ever accepted; corrupted "
                         "slots carry a doubtful confidence), 'oracle-never-confident' (the same, confidently "
                         "wrong: the kept slots' confidence)")
    ap.add_argument("--port-base", type=int, default=50250,
                    help="first stack's gateway port (verifier +1, drafter +2; the next stack +10)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per service process")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: " + ", ".join(f"--{k.replace('_', '-')} {_flag(v)}" for k, v in QUICK.items())
                    + " (flags given explicitly still win)")
    ap.add_argument("--rotate", type=int, default=0,
                    help="rotate the first repetition's arm order by this many places (a caller running one "
                    "repetition per process, as bench.validate_simulate does, keeps the arms interleaved)")
    ap.add_argument("--json", default=None, help="write raw cells, medians and ratios to this file")
    ap.add_argument("--log-dir", default=None, help="the services' logs (default: a new temporary folder)")
    ap.add_argument("--record-rounds", default=None, metavar="FILE",
                    help="the gateway records every round to FILE (replay format; FILE-<numerics> with "
                         "several numerics), each generation labelled with its workload, the start-up "
                         "warm-up generations with 'warmup'")
    ap.add_argument("--fresh-gateway", action="store_true",
                    help="restart the gateway before every gated cell, so the arm starts cold (no gate, "
                         "regime or warm start learned from earlier cells), as `dspark simulate` runs it")
    ap.add_argument("--from-json", default=None, metavar="FILE",
                    help="run nothing: print the tables of an earlier run's --json FILE")
    args = ap.parse_args(argv)
    if args.quick:
        given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:])}
        for key, value in QUICK.items():
            if f"--{key.replace('_', '-')}" not in given:
                setattr(args, key, value)
    if args.warmup < 0:
        ap.error(f"--warmup={args.warmup}: must be >= 0")
    for name in ("max_tokens", "repeats", "threads", "per_stream"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if any(s < 1 for s in args.streams):
        ap.error(f"--streams={args.streams}: every concurrency must be >= 1")
    args.checkpoint = args.checkpoint or None
    args.streams, args.arms = sorted(set(args.streams)), [a for a in ARMS if a in args.arms]
    return args


def main() -> None:
    run_bench(run, parse_args())


if __name__ == "__main__":
    main()
