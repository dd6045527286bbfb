"""Measure how much a forward slows down while another service's forward runs beside it.

`python -m bench.sim_corun`: the verifier's step (bench.sim_cpu_shape's real DSpark blocks, at
`--sessions` sessions x 6 rows) and the drafter's batched draft and commit (`--draft-sessions`
sessions), each timed alone and while a second process runs the other service's forward in a
busy loop (both single-threaded, one torch thread each, as served). Phases alternate alone /
beside several times so the box's drift falls on both. Prints JSON: per side the median ms alone
and beside, and their ratio (the co-run slowdown `bench.validate_simulate` and docs/simulate.md
§5.2 discuss).

    python -m bench.sim_corun [--checkpoint assets/dspark-small] [--sessions 2] [--draft-sessions 4]
                              [--phases 4] [--per-phase 15]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import torch

from bench.sim_cpu_shape import _Served


def _busy(role: str, checkpoint: str, sessions: int, ready, go, stop) -> None:
    """Child: load `role`'s model, set `ready`, then run its forward in a loop while `go` is
    set, until `stop`."""
    torch.set_num_threads(1)
    work = _verifier_work(checkpoint, sessions) if role == "verifier" else _drafter_work(checkpoint, sessions)
    ready.set()
    while not stop.is_set():
        if go.wait(0.05):
            work()


def _verifier_work(checkpoint: str, sessions: int):
    """A callable running one verifier step of `sessions` x 6 rows (returns its ms)."""
    served = _Served(checkpoint, sessions)
    per = served.engine.cfg.dspark_block_size + 1
    return lambda: served.step_ms([per] * sessions)


def _drafter_work(checkpoint: str, sessions: int):
    """A callable running one drafter round at `sessions` sessions (returns (commit, draft) ms)."""
    from services import app
    module = app.load_drafter(checkpoint)
    cfg = module.cfg
    g = torch.Generator().manual_seed(1)
    states = []
    for i in range(sessions):
        st = module.new_state()
        module.write_main_kv(st, torch.randn(32 + i, cfg.tap_width, generator=g), range(32 + i))
        states.append(st)
    ends = [32 + i for i in range(sessions)]

    def once() -> tuple[float, float]:
        """(commit ms, draft ms) of one round: 4 rows committed per session, then a draft."""
        if ends[0] > 400:  # keep the context bounded: start the sessions again
            for i, st in enumerate(states):
                states[i] = module.new_state()
                module.write_main_kv(states[i], torch.randn(32 + i, cfg.tap_width, generator=g), range(32 + i))
                ends[i] = 32 + i
        pos = [list(range(e, e + 4)) for e in ends]
        t0 = time.perf_counter()
        module.write_main_kv_batch(states, [torch.randn(4, cfg.tap_width, generator=g) for _ in states], pos)
        t1 = time.perf_counter()
        module.draft_batch(states, [7] * len(states), [p[-1] for p in pos])
        t2 = time.perf_counter()
        for i in range(len(ends)):
            ends[i] += 4
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3
    return once


def _side(measured: str, other: str, args) -> dict:
    """Time `measured`'s forward alone and beside `other`'s busy loop, alternating phases:
    {name: {alone_ms, beside_ms, ratio}} (medians; the verifier's "step", the drafter's
    "commit" and "draft"). Raises RuntimeError when the child does not load its model within
    300 s."""
    ctx = mp.get_context("spawn")
    ready, go, stop = ctx.Event(), ctx.Event(), ctx.Event()
    other_n = args.sessions if other == "verifier" else args.draft_sessions
    child = ctx.Process(target=_busy, args=(other, args.checkpoint, other_n, ready, go, stop), daemon=True)
    child.start()
    if measured == "verifier":
        served = _Served(args.checkpoint, args.sessions)
        per = served.engine.cfg.dspark_block_size + 1
        work = lambda: (served.step_ms([per] * args.sessions),)
    else:
        work = _drafter_work(args.checkpoint, args.draft_sessions)
    if not ready.wait(300):
        stop.set()
        raise RuntimeError(f"the {other} child did not load {args.checkpoint} within 300 s")
    times = {"alone": [], "beside": []}
    try:
        for phase in range(2 * args.phases):
            beside = phase % 2 == 1
            (go.set if beside else go.clear)()
            time.sleep(0.3)
            work()  # settle
            for _ in range(args.per_phase):
                times["beside" if beside else "alone"].append(work())
    finally:
        go.clear()
        stop.set()
        child.join(10)
    names = ("step",) if measured == "verifier" else ("commit", "draft")
    out = {}
    for i, name in enumerate(names):
        a = statistics.median(t[i] for t in times["alone"])
        b = statistics.median(t[i] for t in times["beside"])
        out[name] = {"alone_ms": round(a, 3), "beside_ms": round(b, 3), "ratio": round(b / a, 3)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--checkpoint", default="assets/dspark-small")
    ap.add_argument("--sessions", type=int, default=2, help="verifier sessions per step (6 rows each)")
    ap.add_argument("--draft-sessions", type=int, default=4, help="drafter sessions per draft")
    ap.add_argument("--phases", type=int, default=4, help="alone / beside phase pairs")
    ap.add_argument("--per-phase", type=int, default=15, help="timings per phase")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(json.dumps({"verifier": _side("verifier", "drafter", args),
                      "drafter": _side("drafter", "verifier", args)}, indent=1))


if __name__ == "__main__":
    main()
