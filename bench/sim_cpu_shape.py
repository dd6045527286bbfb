"""Measure the `cpu` shape of `dspark simulate` on this machine: the bundled model's step times.

Verifier: steps of the verifier's step loop (`services.verifier.batcher.StepLoop`, timed as
it reports them: the forward, the accept rule and the rollbacks) over up to `--sessions`
sessions holding bench_serving's prompts, each forwarding its real DSpark draft block (the
drafter runs in the same process between steps, untimed) or a decode, at every row count the
start-up profile visits (`services.verifier.step_profile.row_targets`), `--repeats` times;
the table is the step table those steps fill (`services.verifier.step_table`). Real blocks
advance the sessions as served text does (drafts accepted at the served rate, the
compressors emitting as they do when served), where the start-up profile's random drafts are
rejected at once; on this box the two tables agree within noise (29.4 and 29.3 ms at one
6-row block). Drafter:
batched drafts at 1..64 sessions and batched commits of 1, 2 and 4 rows of one session, then
of 4 rows (about what a round commits: its accepted drafts and bonus token) at 2..64
sessions (`DSparkDraft.draft_batch` / `write_main_kv_batch`, what the drafter's step loop
calls), median of `--repeats`; the commit table is over rows written. Prints the shape file
(JSON, the format of docs/simulate.md §2) to stdout.

    python -m bench.sim_cpu_shape [--checkpoint assets/dspark-small] [--sessions 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import queue
import statistics
import time
from pathlib import Path

import torch

from bench.bench_serving import WORKLOADS
from services import app
from services.common.settings import BackendSettings
from services.gateway.tokenizer import HFTokenizer
from services.verifier.batcher import StepLoop
from services.verifier.engine import VerifyResult
from services.verifier.step_profile import row_targets, split_rows
from services.verifier.step_table import LoadTracker

SIZES = (1, 2, 4, 8, 16, 32, 64)
COMMIT_ROWS = 4  # rows per session of the commit table's batched steps


class _Served:
    """Verifier sessions on bench_serving's prompts, each with the DSpark rings its drafts come
    from (what the drafter holds for it when served)."""

    def __init__(self, checkpoint: str, sessions: int):
        trunk = app.load_trunk(checkpoint)
        self.engine = app.verifier_engine(trunk, BackendSettings(max_sessions=sessions))
        self.module = app.load_drafter(checkpoint)
        self.steps = StepLoop(self.engine)
        self.reports: queue.Queue = queue.Queue()
        self.steps.on_step = self.reports.put
        tok = HFTokenizer(Path(checkpoint) / "tokenizer.json")
        self.prompts = [tok.encode(text) for text in WORKLOADS.values()]
        self.sids: list[int] = []
        self.state, self.anchor = {}, {}
        for i in range(sessions):
            self._open(i)

    def _open(self, i: int) -> None:
        """(Re)open session slot i on prompt i mod 4, its rings primed with the prefill's rows."""
        sid = self.engine.open_session()
        res = self.steps.prefill(sid, self.prompts[i % len(self.prompts)])
        state = self.module.new_state()
        self.module.write_main_kv(state, res.rows, res.positions)
        if i < len(self.sids):
            self.engine.close_session(self.sids[i])
            self.sids[i] = sid
        else:
            self.sids.append(sid)
        self.state[sid], self.anchor[sid] = state, res.next_token

    def step_ms(self, sizes: list[int]) -> float:
        """One step: session i forwards sizes[i] rows (its anchor and its first sizes[i] - 1
        drafted tokens, or a decode for 1); returns the step's ms as the loop reported it.
        The answers are committed to the rings; a session near max_seq_len starts again."""
        eng, sids = self.engine, self.sids[:len(sizes)]
        seeds = [eng.next_position(sid) - 1 for sid in sids]
        drafts = self.module.draft_batch([self.state[s] for s in sids], [self.anchor[s] for s in sids], seeds)
        records = [eng.admit_decode(sid, self.anchor[sid], seed + 1) if size == 1 else
                   eng.admit_verify(sid, self.anchor[sid], d.tokens[:size - 1], seed + 1, "batched")
                   for sid, size, seed, d in zip(sids, sizes, seeds, drafts)]
        while not self.reports.empty():
            self.reports.get_nowait()
        results = [f.result() for f in self.steps.submit_all(records)]
        ms = self.reports.get(timeout=60).ms
        for i, (sid, res) in enumerate(zip(sids, results)):
            self.module.write_main_kv(self.state[sid], res.rows, res.positions)
            self.anchor[sid] = res.bonus_token if isinstance(res, VerifyResult) else res.next_token
            if eng.next_position(sid) + 2 * len(drafts[i].tokens) + 2 >= eng.cfg.max_seq_len:
                self._open(i)
        return ms

    def close(self) -> None:
        self.steps.close()


def verifier_table(checkpoint: str, sessions: int, repeats: int) -> dict:
    """The step table {rows, ms} of real DSpark blocks over up to `sessions` sessions (module
    docstring), row counts visited in an order rotated per repeat so drift spreads over all."""
    served = _Served(checkpoint, sessions)
    load = LoadTracker()
    per = served.engine.cfg.dspark_block_size + 1
    targets = row_targets(sessions, per)
    try:
        served.step_ms(split_rows(targets[-1], sessions, per))  # first-call allocations, untimed
        for rep in range(repeats):
            for i in range(len(targets)):
                rows = targets[(i + rep) % len(targets)]
                load.seed(rows, served.step_ms(split_rows(rows, sessions, per)))
    finally:
        served.close()
    snap = load.table.snapshot()
    return {"rows": [float(r) for r in snap.rows], "ms": [round(m, 3) for m in snap.ms]}


def drafter_tables(checkpoint: str, repeats: int) -> dict:
    """Median ms of one batched draft per session count and of one batched commit per rows
    written (module docstring)."""
    module = app.load_drafter(checkpoint)
    g = torch.Generator().manual_seed(1)
    draft = [_median_ms(module, n, 1, repeats, g)[1] for n in SIZES]
    shapes = [(1, 1), (1, 2), (1, 4)] + [(n, COMMIT_ROWS) for n in SIZES[1:]]
    commit = [_median_ms(module, n, r, repeats, g)[0] for n, r in shapes]
    # A batch of more sessions does no less work: a median below the previous size's is noise
    # from the shared machine, and the simulator refuses a falling table.
    draft, commit = list(itertools.accumulate(draft, max)), list(itertools.accumulate(commit, max))
    return {"draft": {"sessions": list(SIZES), "ms": draft},
            "commit": {"rows": [n * r for n, r in shapes], "ms": commit}}


def _median_ms(module, n: int, rows: int, repeats: int, g: torch.Generator) -> tuple[float, float]:
    """(commit ms, draft ms), medians over `repeats` (after one warm-up pass), of n sessions
    each committing `rows` tap rows and then drafting one block."""
    cfg = module.cfg
    states = []
    for i in range(n):
        st = module.new_state()
        module.write_main_kv(st, torch.randn(32 + i, cfg.tap_width, generator=g), range(32 + i))
        states.append(st)
    anchors = [(5 + 11 * i) % cfg.vocab_size for i in range(n)]
    ends = [32 + i for i in range(n)]
    c_ms, d_ms = [], []
    for rep in range(repeats + 1):
        positions = [list(range(e, e + rows)) for e in ends]
        t0 = time.perf_counter()
        module.write_main_kv_batch(states, [torch.randn(rows, cfg.tap_width, generator=g) for _ in range(n)],
                                   positions)
        t1 = time.perf_counter()
        module.draft_batch(states, anchors, [p[-1] for p in positions])
        t2 = time.perf_counter()
        ends = [e + rows for e in ends]
        if rep:  # the first pass warms up
            c_ms.append((t1 - t0) * 1e3)
            d_ms.append((t2 - t1) * 1e3)
    return round(statistics.median(c_ms), 3), round(statistics.median(d_ms), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--checkpoint", default="assets/dspark-small", help="the model measured")
    ap.add_argument("--sessions", type=int, default=16, help="dummy sessions of the verifier's step profile")
    ap.add_argument("--repeats", type=int, default=3, help="timings per point (median)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    shape = {"name": "cpu", "source": f"bench.sim_cpu_shape on {args.checkpoint}",
             "verifier": verifier_table(args.checkpoint, args.sessions, args.repeats),
             "drafter": drafter_tables(args.checkpoint, args.repeats)}
    print(json.dumps(shape, indent=1))


if __name__ == "__main__":
    main()
