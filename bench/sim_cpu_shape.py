"""Measure the `cpu` shape of `dspark simulate` on this machine: the bundled model's step times.

Verifier: the start-up step profile (`services.verifier.step_profile`, the same code a served
verifier seeds its step table with) over `--sessions` dummy sessions, so the table reaches
sessions x 6 rows. Drafter: `DrafterEngine`-level batched commits of one row and batched
drafts (`DSparkDraft.write_main_kv_batch` / `draft_batch`, what the drafter's step loop
calls) at 1..N sessions, median of `--repeats`. Prints the shape file (JSON, the format of
docs/simulate.md §2) to stdout.

    python -m bench.sim_cpu_shape [--checkpoint assets/dspark-small] [--sessions 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch

from services import app
from services.verifier.batcher import StepLoop
from services.verifier.step_profile import StepProfileSettings, profile_steps
from services.verifier.step_table import LoadTracker

SIZES = (1, 2, 4, 8, 16, 32, 64)


def verifier_table(checkpoint: str, sessions: int, repeats: int) -> dict:
    """The profiled step table {rows, ms} of the verifier over `sessions` dummy sessions."""
    steps = StepLoop(app.verifier_engine(app.load_trunk(checkpoint)))
    load = LoadTracker()
    try:
        profile_steps(steps, load, StepProfileSettings(sessions=sessions, repeats=repeats, prompt_tokens=16,
                                                       budget_s=600.0))
    finally:
        steps.close()
    snap = load.table.snapshot()
    return {"rows": [float(r) for r in snap.rows], "ms": [round(m, 3) for m in snap.ms]}


def drafter_tables(checkpoint: str, repeats: int) -> dict:
    """Median ms of one batched draft and one batched one-row commit per session count."""
    module = app.load_drafter(checkpoint)
    cfg = module.cfg
    g = torch.Generator().manual_seed(1)
    draft, commit = [], []
    for n in SIZES:
        states = []
        for i in range(n):
            st = module.new_state()
            module.write_main_kv(st, torch.randn(32 + i, cfg.tap_width, generator=g), range(32 + i))
            states.append(st)
        anchors = [(5 + 11 * i) % cfg.vocab_size for i in range(n)]
        d_ms, c_ms = [], []
        for rep in range(repeats + 1):
            rows = [torch.randn(1, cfg.tap_width, generator=g) for _ in range(n)]
            t0 = time.perf_counter()
            module.write_main_kv_batch(states, rows, [[32 + i + rep] for i in range(n)])
            t1 = time.perf_counter()
            module.draft_batch(states, anchors, [32 + i + rep for i in range(n)])
            t2 = time.perf_counter()
            if rep:  # the first pass warms up
                c_ms.append((t1 - t0) * 1e3)
                d_ms.append((t2 - t1) * 1e3)
        draft.append(round(statistics.median(d_ms), 3))
        commit.append(round(statistics.median(c_ms), 3))
    # A batch of more sessions does no less work: a median below the previous size's is noise
    # from the shared machine, and the simulator refuses a falling table.
    draft, commit = list(itertools.accumulate(draft, max)), list(itertools.accumulate(commit, max))
    return {"draft": {"sessions": list(SIZES), "ms": draft}, "commit": {"sessions": list(SIZES), "ms": commit}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="assets/dspark-small")
    ap.add_argument("--sessions", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    shape = {"name": "cpu", "source": f"bench.sim_cpu_shape on {args.checkpoint}",
             "verifier": verifier_table(args.checkpoint, args.sessions, args.repeats),
             "drafter": drafter_tables(args.checkpoint, args.repeats)}
    print(json.dumps(shape, indent=1))


if __name__ == "__main__":
    main()
