"""`dspark simulate`: arguments, the table, `--json` and `--png` (docs/simulate.md §1).

Owns the command's flags, output and exit codes; every figure comes from `services.simulate.run`.
Bad input (a cost file with a negative or non-monotone time, an empty or unreadable rounds
file, 0 streams, a rate below 0.001 per second, a negative seed, an unknown arm, a
per-workload length without a replayed workload, a value past one of the limits below, a
`--png` path that cannot be written) exits 2 with one line on stderr naming the value, before
anything is simulated. A simulation that exceeds its event budget (a stall: a simulator bug)
exits 1 with one line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

ALIGNMENTS = ("free", "gather", "lockstep", "pingpong", "rate")  # services.common.alignment, by name

DEFAULT_STREAMS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Limits (docs/simulate.md §1): a run past them would take hours or all the memory, never a
# figure anyone needs. MAX_STREAMS also bounds --drafters and --cores (more than one per stream
# changes nothing) and is the widest step the single-stream cost sources are extended to.
MAX_STREAMS = 4096
MAX_BLOCK = 64  # draft slots per round (the arms run k1..k<block>)
MAX_RPC_MS = 1e6
# Simulated work of one run: arms x generations x (output tokens + prompt chunks), at the
# largest lengths. The default grid (10 arms, 1..256 streams, 256 tokens) is ~1.3 M; this one
# is ~6x that, about 10-15 minutes and under 2 GB on a CPU core (docs/simulate.md §1).
MAX_WORK = 1 << 23
# The plain numeric options: flag, type, default, help.
NUMBERS = (
    ("--per-stream", int, 1, "generations each closed-loop stream runs back to back"),
    ("--requests", int, 64, "open loop: generations per cell"),
    ("--drafters", int, 1, "drafter replicas (sessions placed round robin)"),
    ("--cores", int, 1, "--shared-compute: cores of the shared pool (each step or gateway turn uses at most one)"),
    ("--background", float, 0.0, "--shared-compute: other programs' jobs always runnable on the pool's cores "
     "(a busy machine the cost model was measured on; docs/simulate.md §5.2)"),
    ("--max-sessions", int, 256, "the verifier's session limit (DSPARK_MAX_SESSIONS)"),
    ("--gather-ms", float, 50.0, "the step loops' gather window (DSPARK_STEP_GATHER_MS)"),
    ("--prefill-chunk", int, 64, "prompt tokens per verifier step (DSPARK_PREFILL_CHUNK)"),
    ("--block-size", int, 5, "draft slots per round"),
    ("--seed", int, 0, "seed of every random draw"),
)


def add_command(sub: argparse._SubParsersAction) -> None:
    """Register `simulate` on the `dspark` parser's subcommands."""
    p = sub.add_parser("simulate", help="discrete-event serving simulator: speculation policies at 1..N streams "
                       "under a step-time model, with the services' own policy code",
                       description="Simulate the gateway, verifier and drafter in virtual time: each arm at each "
                       "load, acceptance replayed from recorded rounds, step times from a cost model "
                       "(docs/simulate.md). Deterministic for a given --seed.")
    p.add_argument("--costs", default="cpu", metavar="SOURCE",
                   help="step-time model: cpu | seed | gpu, a .json/.toml shape file, `dspark calibrate` output, "
                   "or info:HOST:PORT (a verifier's profiled step table)")
    p.add_argument("--rounds", nargs="+", default=None, metavar="FILE",
                   help="recorded-rounds files (replay format, e.g. --record-rounds output); default: the "
                   "synthetic rounds (services.analysis.synthetic)")
    p.add_argument("--workload", default=None, help="replay only this workload (default: each stream draws one)")
    p.add_argument("--order", choices=("random", "cycle"), default="random",
                   help="random: each generation draws its workload and start round; cycle: stream s's "
                   "generation j replays workload s*per-stream+j (rounds-file order) from its first round, "
                   "as bench_serving's streams run its prompts")
    p.add_argument("--arms", nargs="+", default=None, metavar="ARM",
                   help="arms to run (default: all): plain, k1..k<block>, gated, gate-only, "
                   "budget-trim, budget (the step budget, docs/gate.md §15)")
    p.add_argument("--streams", nargs="+", type=int, default=None, metavar="N",
                   help=f"closed-loop concurrencies, 1..{MAX_STREAMS} (default: "
                   f"{' '.join(map(str, DEFAULT_STREAMS))})")
    p.add_argument("--rate", nargs="+", type=float, default=None, metavar="R",
                   help="open loop instead of --streams: Poisson arrivals at R generations per second (one "
                   "cell per R)")
    p.add_argument("--prompt", default="64", help="prompt tokens: N, uniform:A:B, or per workload NAME=N,NAME=N...")
    p.add_argument("--output", default="256", help="completion tokens per generation: N, uniform:A:B, or per "
                   "workload NAME=N,...")
    p.add_argument("--shared-compute", action="store_true",
                   help="drafter and verifier take turns on one pool of compute (default: separate hardware)")
    p.add_argument("--rpc-ms", type=float, default=None,
                   help="one gateway <-> service round trip (ms; default: the cost source's, 0 for shapes without one)")
    for flag, kind, default, text in NUMBERS:
        p.add_argument(flag, type=kind, default=default, help=f"{text} (default: {default})")
    p.add_argument("--alignment", choices=ALIGNMENTS, default="gather",
                   help="how the verifier's steps gather sessions (services.common.alignment, DSPARK_STEP_ALIGNMENT; "
                   "served, `auto` is rate on a GPU, gather on a CPU; the simulator runs gather whatever --costs)")
    p.add_argument("--json", action="store_true", help="print the results as JSON (byte-identical for one --seed)")
    p.add_argument("--png", default=None, metavar="FILE", help="also plot aggregate tok/s against load per arm")
    p.set_defaults(func=run_simulate)


def _error(message: str) -> int:
    from services.common.terminal import printable
    print(f"dspark simulate: error: {printable(message)}", file=sys.stderr)
    return 2


def _inputs(args):
    """The validated inputs of a run; raises ValueError naming the first bad value."""
    import dataclasses

    from services.simulate.engine import RunConfig
    from services.simulate.models import load_model
    from services.simulate.run import Load, arm_registry, parse_lengths

    _check_numbers(args)
    if args.rate is not None and args.streams is not None:
        raise ValueError(f"--rate {' '.join(map(repr, args.rate))} with --streams "
                         f"{' '.join(map(str, args.streams))}: a run is open loop (--rate) or closed loop "
                         f"(--streams), not both")
    if args.rate is not None:
        loads = [Load(rate=r, requests=args.requests) for r in dict.fromkeys(args.rate)]
        labels = [ld.label for ld in loads]
        for i, label in enumerate(labels):
            if label in labels[:i]:
                raise ValueError(f"--rate {loads[labels.index(label)].rate!r} and {loads[i].rate!r}: two rates "
                                 f"that print as one cell ({label}); give distinct rates")
    else:
        loads = [Load(streams=n, per_stream=args.per_stream) for n in dict.fromkeys(args.streams or DEFAULT_STREAMS)]
    lengths = parse_lengths(args.prompt, "--prompt"), parse_lengths(args.output, "--output")
    model = load_model(args.costs)
    if args.rpc_ms is not None:
        model = dataclasses.replace(model, rpc_ms=args.rpc_ms)
    try:  # every arm's gateway prices with these (a step of 0 ms at one row and no rpc gives none)
        model.single_stream(args.block_size)
    except ValueError as exc:
        raise ValueError(f"--costs {args.costs!r}: no one-stream costs for the gate: {exc}") from None
    groups = _replayed(args, lengths)
    registry = arm_registry(args.block_size)
    unknown = [a for a in args.arms or [] if a not in registry]
    if unknown:
        raise ValueError(f"--arms {unknown[0]!r}: unknown; known: {', '.join(registry)}")
    arms = [registry[a] for a in dict.fromkeys(args.arms or registry)]
    _check_work(arms, loads, lengths, args.prefill_chunk)
    if args.png is not None:
        _check_writable(args.png)
    config = RunConfig(block_size=args.block_size, max_sessions=args.max_sessions, gather_s=args.gather_ms / 1e3,
                       prefill_chunk=args.prefill_chunk, shared_compute=args.shared_compute, cores=args.cores,
                       background=args.background, drafters=args.drafters, alignment=args.alignment)
    return model, config, arms, loads, groups, lengths


def _replayed(args, lengths) -> dict:
    """The workloads to replay ({name: rounds}) from --rounds / --workload, each with a
    length in every per-workload --prompt / --output and no length for a workload no rounds
    file holds. Raises ValueError naming the file, workload or flag value."""
    from services.analysis import synthetic
    from services.gateway.rounds import load_rounds
    from services.simulate.run import workloads

    logs = [load_rounds(p) for p in args.rounds] if args.rounds else [synthetic.generate()]
    for path, log in zip(args.rounds or [], logs):
        if not log.rounds:
            raise ValueError(f"{path}: the rounds file holds no round")
    groups = workloads(logs, args.workload)
    for flag, spec in zip(("--prompt", "--output"), lengths):
        missing = spec.missing(groups)
        if missing:
            raise ValueError(f"{flag}={str(spec)!r}: no length for workload {missing[0]!r}")
    recorded = {r.workload for log in logs for r in log.rounds}
    for flag, spec in zip(("--prompt", "--output"), lengths):
        stray = [name for name, _ in getattr(spec, "lengths", ()) if name not in recorded]
        if stray:  # a typo would otherwise pass silently next to the right names
            raise ValueError(f"{flag}={str(spec)!r}: workload {stray[0]!r} is in no rounds file "
                             f"(they hold {', '.join(sorted(recorded))})")
    return groups


def _check_numbers(args) -> None:
    """Each numeric flag within its range; raises ValueError naming the flag and value."""
    for name in ("per_stream", "requests", "max_sessions", "prefill_chunk", "block_size", "drafters", "cores"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    for name, top in (("block_size", MAX_BLOCK), ("drafters", MAX_STREAMS), ("cores", MAX_STREAMS)):
        if getattr(args, name) > top:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)}: must be <= {top}")
    if args.seed < 0:
        raise ValueError(f"--seed={args.seed}: must be >= 0")
    bad = [n for n in args.streams or () if not 1 <= n <= MAX_STREAMS]
    if bad:
        raise ValueError(f"--streams {bad[0]}: a concurrency must be in 1..{MAX_STREAMS}")
    for flag, value, top in (("--gather-ms", args.gather_ms, 1e7), ("--rpc-ms", args.rpc_ms, MAX_RPC_MS)):
        if value is not None and not (value >= 0 and value <= top):  # NaN fails both
            raise ValueError(f"{flag}={value}: must be a finite number of ms in [0, {top:g}]")
    if not 0 <= args.background <= MAX_STREAMS:  # NaN fails both
        raise ValueError(f"--background={args.background}: must be a number of jobs in [0, {MAX_STREAMS}]")
    if args.cores != 1 and not args.shared_compute:  # separate hardware: one pool per loop, one core each
        raise ValueError(f"--cores={args.cores}: needs --shared-compute (the pool whose cores it sets)")
    if args.background and not args.shared_compute:  # separate hardware has no other jobs to share with
        raise ValueError(f"--background={args.background}: needs --shared-compute (the pool it shares)")


def _check_work(arms, loads, lengths, prefill_chunk: int) -> None:
    """Refuse a run whose simulated work (MAX_WORK) or lengths (the simulator's max_seq_len)
    would not finish in reasonable time or memory; raises ValueError naming the values."""
    from services.simulate.engine import RunConfig
    prompt, output = (max(sp.high for _, sp in spec.lengths) if hasattr(spec, "lengths") else spec.high
                      for spec in lengths)
    seq = RunConfig().max_seq_len
    if prompt + output > seq:
        raise ValueError(f"--prompt {prompt} + --output {output} tokens: must be <= {seq} (max_seq_len)")
    generations = sum(ld.requests if ld.rate is not None else ld.streams * ld.per_stream for ld in loads)
    work = len(arms) * generations * (output + -(-prompt // prefill_chunk))
    if work > MAX_WORK:
        raise ValueError(f"{len(arms)} arms x {generations} generations x ({output} output tokens + "
                         f"{-(-prompt // prefill_chunk)} prompt chunks) = {work} steps of work: must be <= "
                         f"{MAX_WORK} (fewer arms, loads, --per-stream/--requests or tokens)")


def _check_writable(path: str) -> None:
    """Refuse a --png path that cannot be written, before the simulation runs."""
    import os
    if not path:
        raise ValueError("--png '': an empty path")
    if os.path.isdir(path):
        raise ValueError(f"--png {path!r}: is a directory")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise ValueError(f"--png {path!r}: its folder {parent!r} does not exist or is not writable")


def run_simulate(args: argparse.Namespace) -> int:
    from services.simulate.run import simulate_grid
    try:
        model, config, arms, loads, groups, (prompt, output) = _inputs(args)
    except (ValueError, OSError) as exc:
        return _error(str(exc))
    t0 = time.perf_counter()
    try:
        result = simulate_grid(model, config, arms, loads, groups, prompt, output, args.seed, args.order)
    except RuntimeError as exc:  # a stalled simulation (its event budget spent): a bug, not bad input
        from services.common.terminal import printable
        print(f"dspark simulate: failed: {printable(str(exc))}", file=sys.stderr)
        return 1
    wall_s = time.perf_counter() - t0
    result["inputs"] = {"costs": model.name, "model": model.to_dict(),
                        "workloads": list(groups) if args.order == "cycle" else sorted(groups),
                        "rounds": list(args.rounds) if args.rounds else "synthetic (generated)",
                        "arms": [a.name for a in arms], "loads": [ld.label for ld in loads], "prompt": str(prompt),
                        "output": str(output), "order": args.order, "shared_compute": config.shared_compute,
                        "cores": config.cores, "background": config.background,
                        "max_sessions": config.max_sessions, "drafters": config.drafters,
                        "gather_ms": config.gather_s * 1e3, "alignment": config.alignment,
                        "prefill_chunk": config.prefill_chunk, "seed": args.seed}
    if args.png is not None:
        try:
            from services.simulate.view import write_png
            write_png(result, args.png, f"{model.name}: aggregate tok/s ({', '.join(sorted(groups))})")
        except (ValueError, OSError) as exc:
            return _error(f"--png {args.png!r}: {exc}")
    if args.json:
        print(json.dumps(result, indent=1, allow_nan=False))
    else:
        from services.simulate.view import render
        render(result, wall_s)
    return 0
