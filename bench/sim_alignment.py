"""How the verifier's steps should gather sessions, and what the step budget buys, in the
simulator: `python -m bench.sim_alignment`.

For every cost shape (`cpu`, `seed`, `gpu`), separate hardware and shared compute (drafter,
verifier and gateway on one core: on two cores the two single-threaded loops never slow each
other in the model), and every alignment of the verifier's schedule
(`services.common.alignment`: free, gather, lockstep, pingpong, rate), runs the arms plain,
k1..k5, gated and budget (`services.simulate.run.arm_registry`) over the closed-loop loads
and prints, per load, each arm's aggregate tok/s and the best arm-alignment pairs. Asserts
nothing (a benchmark); `--json FILE` keeps every cell. The figures docs/simulate.md §6 quotes
come from this script.

    python -m bench.sim_alignment [--rounds tests/data/bundled_rounds.json] [--loads 1 4 16 64 256]
        [--shapes cpu seed gpu] [--output 256] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time

from services.gateway.rounds import load_rounds
from services.simulate.engine import RunConfig
from services.simulate.models import load_model
from services.simulate.run import Lengths, Load, arm_registry, simulate_grid, workloads

ALIGNMENTS = ("free", "gather", "lockstep", "pingpong", "rate")
ARMS = ("plain", "k1", "k2", "k3", "k4", "k5", "gated", "budget")


def run(args) -> dict:
    """{setup: {alignment: {load: {arm: aggregate tok/s}}}} for every shape and compute setup."""
    groups = workloads([load_rounds(args.rounds)])
    registry = arm_registry(5)
    arms = [registry[a] for a in ARMS]
    loads = [Load(n) for n in args.loads]
    out: dict = {}
    for shape in args.shapes:
        model = load_model(shape)
        for shared in (False, True):
            setup = f"{shape}{', shared 1 core' if shared else ''}"
            out[setup] = {}
            for alignment in ALIGNMENTS:
                config = RunConfig(alignment=alignment, shared_compute=shared, cores=1)
                grid = simulate_grid(model, config, arms, loads, groups, Lengths(64, 64),
                                     Lengths(args.output, args.output), 0)
                out[setup][alignment] = {lab: {a: row[a]["aggregate_tok_s"] for a in ARMS}
                                         for lab, row in grid["cells"].items()}
    return out


def table(res: dict) -> str:
    """Markdown: per setup and load, the best fixed arm (any alignment), gated and budget at
    their best alignment, and plain at gather, each as tok/s (alignment)."""
    lines = ["| setup | load | plain (gather) | best fixed k | gated | budget |", "|---|---|---|---|---|---|"]
    for setup, by_al in res.items():
        for load in next(iter(by_al.values())):
            def best(arms):
                return max(((by_al[al][load][a], a, al) for al in by_al for a in arms))
            plain = by_al["gather"][load]["plain"]
            fixed, gated, budget = best(("k1", "k2", "k3", "k4", "k5")), best(("gated",)), best(("budget",))
            lines.append(f"| {setup} | {load} | {plain:.1f} | {fixed[0]:.1f} ({fixed[1]}, {fixed[2]}) | "
                         f"{gated[0]:.1f} ({gated[2]}) | {budget[0]:.1f} ({budget[2]}) |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--rounds", default="tests/data/bundled_rounds.json", help="recorded-rounds file (replay format)")
    ap.add_argument("--loads", type=int, nargs="+", default=[1, 4, 16, 64, 256], help="closed-loop streams")
    ap.add_argument("--shapes", nargs="+", default=["cpu", "seed", "gpu"], help="`dspark simulate --costs` sources")
    ap.add_argument("--output", type=int, default=256, help="completion tokens per generation")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write every cell to FILE")
    args = ap.parse_args()
    t0 = time.perf_counter()
    res = run(args)
    print(table(res))
    for setup, by_al in res.items():
        print(f"\n{setup}: aggregate tok/s per alignment")
        for al, by_load in by_al.items():
            print(f"  {al:9s} " + "  ".join(f"{load}: " + " ".join(f"{a}={v:.1f}" for a, v in row.items())
                                             for load, row in by_load.items()))
    print(f"\nwall time {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
