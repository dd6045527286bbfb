"""Batched decode across sessions against per-session decodes, on CPU:
`python -m bench.bench_batch [--threads N] [--steps N] [--repeats N] [--sessions 1,4,16]`.

Owns the measurement of what `Trunk.forward_batch` saves over one `decode` call per session.
For each session count n and each verify numerics (fast, exact), two sets of n sessions are
prefilled with the same prompts; then, interleaved so that drift of the shared machine hits
both alike, one set decodes `--steps` tokens per session with one `forward_batch` of n
decodes per step, and the other with n `decode` calls per step. Prints the median over
`--repeats` of ms per step of each, their ratio (per-session / batched; > 1: batching is
faster), and how far the two sets' logits are apart (max abs difference in fast mode;
whether every row is bitwise equal in exact mode). Tiny config (docs/model.md §13), random
weights, fp32. Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dsv4.batch import BatchItem
from dsv4.config import tiny_config
from dsv4.init import random_weights
from dsv4.trunk import Trunk

PROMPT = 24  # tokens per session's prompt: the ring (W = 8) has wrapped, entries exist


def sessions(model: Trunk, n: int) -> tuple[list, list[int]]:
    """n prefilled states (prompts seeded by session) and each one's first decode token."""
    states, first = [], []
    for i in range(n):
        ids = torch.randint(0, model.cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(i))
        st = model.new_state()
        first.append(int(model.prefill(st, ids, taps=False).logits.argmax()))
        states.append(st)
    return states, first


def run(model: Trunk, n: int, steps: int, batched: bool) -> tuple[float, list[torch.Tensor]]:
    """Decode `steps` greedy tokens on n fresh sessions; (ms per step, logits [n, V] per step)."""
    states, tokens = sessions(model, n)
    seen = []
    t0 = time.perf_counter()
    for _ in range(steps):
        if batched:
            outs = model.forward_batch([BatchItem.decode(st, t, st.next_position) for st, t in zip(states, tokens)])
        else:
            outs = [model.decode(st, t, st.next_position) for st, t in zip(states, tokens)]
        logits = torch.stack([o.logits for o in outs])
        tokens = logits.argmax(-1).tolist()
        seen.append(logits)
    return (time.perf_counter() - t0) / steps * 1e3, seen


def measure(model: Trunk, n: int, steps: int, repeats: int) -> dict:
    run(model, n, 1, True)  # warm-up
    times = {True: [], False: []}
    diff, equal = 0.0, True
    for _ in range(repeats):
        for batched in (True, False):
            ms, seen = run(model, n, steps, batched)
            times[batched].append(ms)
            if batched:
                ref = seen
            else:
                diff = max(diff, max(float((a - b).abs().max()) for a, b in zip(ref, seen)))
                equal = equal and all(torch.equal(a, b) for a, b in zip(ref, seen))
    b, s = statistics.median(times[True]), statistics.median(times[False])
    return {"batched_ms": b, "per_session_ms": s, "ratio": s / b, "max_abs_diff": diff, "bitwise": equal}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--steps", type=int, default=4, help="decode steps per timed run (default 4)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per variant; the median is printed")
    ap.add_argument("--sessions", default="1,4,16", help="comma-separated session counts (default 1,4,16)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = tiny_config(max_seq_len=128)
    weights = random_weights(cfg, "trunk", seed=3)
    print(f"{'numerics':8} {'sessions':>8} {'batched ms/step':>16} {'per-session ms/step':>20} "
          f"{'ratio':>6}  agreement")
    for numerics in ("fast", "exact"):
        model = Trunk(cfg, verify_numerics=numerics)
        model.load_weights(weights)
        for n in (int(s) for s in args.sessions.split(",")):
            r = measure(model, n, args.steps, args.repeats)
            agree = f"max |diff| {r['max_abs_diff']:.2e}" if numerics == "fast" else \
                f"bitwise {'equal' if r['bitwise'] else 'DIFFERENT'}"
            print(f"{numerics:8} {n:8d} {r['batched_ms']:16.1f} {r['per_session_ms']:20.1f} {r['ratio']:6.2f}  {agree}")


if __name__ == "__main__":
    main()
