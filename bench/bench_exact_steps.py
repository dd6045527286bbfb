"""Cost of exact numerics per batch step, engine level: `python -m bench.bench_exact_steps
[--checkpoint assets/dspark-small] [--repeats 3] [--threads 1]`.

Owns the measurement of one `Trunk.forward_batch` step in fast vs exact numerics (no
services, no gRPC), for the step shapes the verifier's step loop builds: 1, 4, 16 and 32
decode sessions, 16 sessions' verify blocks of 3..6 rows (`--verify-rows`), and one prompt
of `--prompt` tokens (default 900) prefilled in chunks of `--chunk` (default 64) tokens,
one chunk per step. Each decode / verify session is prefilled with `--context` tokens, plus
0..`--spread` more (session i: (7 i) mod (spread + 1)), so sessions may sit at different
positions with different numbers of compressed entries. It prints figures and never asserts
them (figures of record: bench/README.md, "Exact numerics per step").

`--fast-only` runs the fast arm alone (no exact arm, no breakdown), for comparing fast
numerics across two checkouts. `--per-call` adds a third arm, "per-call": fast numerics with
attention run call by call (`Attention.core` per session, the recipe before
`FastNumerics.attend` joined the decode and verify calls), interleaved with the others, and
prints fast / per-call.

Each workload runs `--repeats` times with the arms interleaved (fast, exact, fast, ...), so
both see the same machine load; printed: the median ms per step [min-max] per arm and the
exact / fast ratio. Exact's time is then broken down by op family from one extra,
instrumented run: dense tiles (projections, mHC, norms, gate, shared expert, taps, head),
attention calls (ring, compressors, indexer, key lists, the reduction), routed experts and
the rest (embedding lookups, concatenation, Python) — and, per family, the rows computed
against the real rows they carry (the padding waste).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Callable

import torch

from dsv4.batch import BatchItem
from dsv4.numerics import EXACT_ROWS, PROMPT_ROWS, ExactNumerics, FastNumerics
from dsv4.trunk import Trunk
from services.app import load_trunk

EXPERT_ROWS = EXACT_ROWS  # rows of a routed-expert tile (`ExactNumerics.route`)
VERIFY_ROWS = (3, 4, 5, 6)  # verify block sizes (anchor + drafts), cycled over the sessions


def padded_rows(n: int, calls: list | None) -> tuple[int, int]:
    """(real rows, rows computed) of a row-wise op over n rows under exact numerics: prompt
    rows (of `calls`' prompt pieces) on PROMPT_ROWS tiles, the rest on EXACT_ROWS tiles."""
    prompt = sum(hi - lo for call, _, (lo, hi) in calls or [] if call.prefill)
    up = lambda k, t: -(-k // t) * t  # noqa: E731
    return n, up(prompt, PROMPT_ROWS) + up(n - prompt, EXACT_ROWS)


class TimedExact(ExactNumerics):
    """ExactNumerics that adds each family's wall time (ms) and rows (real, computed) to `acc`."""

    def __init__(self, threads: int, acc: dict):
        super().__init__(threads)
        self.acc, self.in_attention = acc, False

    def _timed(self, family: str, real: int, computed: int, fn: Callable[[], torch.Tensor]):
        t0 = time.perf_counter()
        out = fn()
        entry = self.acc[family]
        entry[0] += (time.perf_counter() - t0) * 1e3
        entry[1] += real
        entry[2] += computed
        return out

    def dense(self, fn, *rows, calls=None):
        if self.in_attention:  # the key building's projections: counted in attention's time
            return super().dense(fn, *rows, calls=calls)
        real, computed = padded_rows(rows[0].shape[0], calls)
        return self._timed("dense", real, computed,
                           lambda: super(TimedExact, self).dense(fn, *rows, calls=calls))

    def attend(self, attn, x, qr, q, kv, calls):
        real, computed = padded_rows(x.shape[0], calls)
        self.in_attention = True
        try:
            return self._timed("attention", real, computed,
                               lambda: super(TimedExact, self).attend(attn, x, qr, q, kv, calls))
        finally:
            self.in_attention = False

    def route(self, moe, x, weights, experts, small_m):
        counts = torch.bincount(experts.flatten(), minlength=len(moe.experts))
        computed = int((-(-counts // EXPERT_ROWS) * EXPERT_ROWS).sum())
        return self._timed("experts", experts.numel(), computed,
                           lambda: super(TimedExact, self).route(moe, x, weights, experts, small_m))


class PerCallFast(FastNumerics):
    """Fast numerics with attention per call on its own rows and state (`Attention.core`):
    the baseline of the joined fast attention (`FastNumerics.attend`)."""

    def attend(self, attn, x, qr, q, kv, calls):
        return torch.cat([attn.core(x[lo:hi], qr[lo:hi], q[lo:hi], kv[lo:hi], call.start_pos, st, call.undo)
                          for call, st, (lo, hi) in calls])


def prefilled(model: Trunk, n_sessions: int, prompt_len: int, seed: int, spread: int = 0) -> list:
    """n_sessions fresh states, session i prefilled with its own random prompt of prompt_len
    + (7 i) mod (spread + 1) tokens."""
    g = torch.Generator().manual_seed(seed)
    states = []
    for i in range(n_sessions):
        st = model.new_state()
        n = prompt_len + (7 * i) % (spread + 1)
        model.prefill(st, torch.randint(2, model.cfg.vocab_size - 1, (n,), generator=g))
        states.append(st)
    return states


def decode_step(model: Trunk, states: list) -> float:
    """One step of one decode per session (ms); the states advance one position."""
    items = [BatchItem.decode(st, 7, st.next_position) for st in states]
    t0 = time.perf_counter()
    model.forward_batch(items)
    return (time.perf_counter() - t0) * 1e3


def verify_step(model: Trunk, states: list, sizes: tuple[int, ...] = VERIFY_ROWS) -> float:
    """One step of one verify block per session, of `sizes` rows cycled (ms); each block is
    rolled back to its anchor after the step (outside the timing)."""
    items = [BatchItem.block(st, [7] * sizes[i % len(sizes)], st.next_position)
             for i, st in enumerate(states)]
    t0 = time.perf_counter()
    outs = model.forward_batch(items)
    ms = (time.perf_counter() - t0) * 1e3
    for st, out in zip(states, outs):
        model.rollback(st, out.undo, 1)
    return ms


def prefill_steps(model: Trunk, prompt: torch.Tensor, chunk: int) -> float:
    """A fresh state prefilled with `prompt` [P] one chunk per step (ms for all its steps)."""
    st = model.new_state()
    t0 = time.perf_counter()
    for a in range(0, prompt.shape[0], chunk):
        model.forward_batch([BatchItem.prefill_chunk(st, prompt[a:a + chunk], a, 1 if a + chunk >= prompt.shape[0]
                                                     else None)])
    return (time.perf_counter() - t0) * 1e3


def workloads(models: dict, args) -> dict:
    """{name: {arm: () -> ms}}: each call runs one step (or, for the prompt, all its steps)."""
    prompt = torch.randint(2, 4000, (args.prompt,), generator=torch.Generator().manual_seed(5))
    out = {}
    for n in args.decodes:
        states = {arm: prefilled(m, n, args.context, n, args.spread) for arm, m in models.items()}
        out[f"decode x{n}"] = {arm: (lambda m=m, s=states[arm]: decode_step(m, s)) for arm, m in models.items()}
    states = {arm: prefilled(m, args.verify_sessions, args.context, 99, args.spread) for arm, m in models.items()}
    sizes = tuple(args.verify_rows)
    rows = f"{min(sizes)}-{max(sizes)}" if len(set(sizes)) > 1 else f"{sizes[0]}"
    out[f"verify x{args.verify_sessions} ({rows} rows)"] = {
        arm: (lambda m=m, s=states[arm]: verify_step(m, s, sizes)) for arm, m in models.items()}
    if args.prompt:
        out[f"prefill {args.prompt} / {args.chunk}"] = {
            arm: (lambda m=m: prefill_steps(m, prompt, args.chunk)) for arm, m in models.items()}
    return out


def table(work: dict, repeats: int) -> None:
    """Run every workload's arms `repeats` times interleaved (after one warm-up each) and print
    one row per workload: median ms [min-max] per arm, exact / fast and fast / per-call."""
    arms_of = list(next(iter(work.values())))
    head = f"{'workload':<28} {'fast ms':>22}"
    head += f" {'exact ms':>22} {'exact/fast':>10}" if "exact" in arms_of else ""
    head += f" {'per-call ms':>22} {'fast/per-call':>13}" if "per-call" in arms_of else ""
    print(head)
    for name, arms in work.items():
        for fn in arms.values():
            fn()  # warm-up
        times: dict = {arm: [] for arm in arms}
        for _ in range(repeats):
            for arm, fn in arms.items():
                times[arm].append(fn())
        med = {arm: statistics.median(t) for arm, t in times.items()}
        cells = {a: f"{med[a]:9.1f} [{min(times[a]):.1f}-{max(times[a]):.1f}]" for a in arms}
        row = f"{name:<28} {cells['fast']:>22}"
        if "exact" in arms:
            row += f" {cells['exact']:>22} {med['exact'] / med['fast']:9.2f}x"
        if "per-call" in arms:
            row += f" {cells['per-call']:>22} {med['fast'] / med['per-call']:12.2f}x"
        print(row)


def breakdown(model: Trunk, run: Callable[[], float]) -> tuple[float, dict]:
    """One instrumented run of `run` on `model` (exact numerics): (total ms, {family: [ms,
    real rows, computed rows]})."""
    acc: dict = defaultdict(lambda: [0.0, 0, 0])
    plain = model.numerics
    model.numerics = TimedExact(plain.threads, acc)
    try:
        total = run()
    finally:
        model.numerics = plain
    return total, acc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="assets/dspark-small", help="model folder (default: the bundled model)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--decodes", type=int, nargs="+", default=[1, 4, 16, 32], help="decode sessions per step")
    ap.add_argument("--verify-sessions", type=int, default=16)
    ap.add_argument("--context", type=int, default=64, help="prompt tokens of each decode / verify session")
    ap.add_argument("--spread", type=int, default=0,
                    help="session i gets (7 i) mod (spread + 1) more prompt tokens (default 0: all alike)")
    ap.add_argument("--verify-rows", type=int, nargs="+", default=list(VERIFY_ROWS),
                    help="rows of the verify blocks, cycled over the sessions (default 3 4 5 6)")
    ap.add_argument("--prompt", type=int, default=900, help="tokens of the prefilled prompt (0: no prompt workload)")
    ap.add_argument("--chunk", type=int, default=64, help="prompt tokens per step")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the instrumented run by op family")
    ap.add_argument("--per-call", action="store_true", help="add the per-call fast attention arm")
    ap.add_argument("--fast-only", action="store_true", help="skip the exact arm (and its breakdown)")
    args = ap.parse_args()
    if args.spread < 0 or min(args.verify_rows) < 1 or args.prompt < 0:
        ap.error(f"--spread {args.spread} and --prompt {args.prompt} must be >= 0, --verify-rows "
                 f"{args.verify_rows} each >= 1")
    torch.set_num_threads(args.threads)
    arms = ("fast",) if args.fast_only else ("fast", "exact")
    models = {arm: load_trunk(args.checkpoint, verify_numerics=arm) for arm in arms}
    if args.per_call:
        models["per-call"] = load_trunk(args.checkpoint, verify_numerics="fast")
        models["per-call"].numerics = PerCallFast()
    work = workloads(models, args)
    print(f"{args.checkpoint}: {args.threads} thread(s), medians of {args.repeats} interleaved repetitions "
          f"[min-max], ms per step (prefill: all its steps)")
    table(work, args.repeats)
    if args.no_breakdown or args.fast_only:
        return
    print("\nexact, by op family (one instrumented run): ms (share), rows computed / real rows "
          "(attention: the query rows; its key projections' dense tiles count as attention)")
    for name, arms in work.items():
        total, acc = breakdown(models["exact"], arms["exact"])
        parts = [f"{fam} {ms:.1f} ({ms / total:.0%}) {comp}/{real}" for fam, (ms, real, comp) in sorted(acc.items())]
        rest = total - sum(ms for ms, _, _ in acc.values())
        print(f"{name:<28} {total:8.1f} ms: " + ", ".join(parts) + f", other {rest:.1f} ({rest / total:.0%})")


if __name__ == "__main__":
    main()
