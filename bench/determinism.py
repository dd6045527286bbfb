"""The output-determinism table (docs/architecture.md §12) for this code base: `python -m bench.determinism`.

Owns the measurement of whether speculative decoding changes the tokens, per verify mode and
prompt, and the attribution of a divergence to the gate or to the verify path; it only prints
(a table, or JSON with `--json`) and never asserts, times or changes the engines it drives.

For each verify mode (sequential, batched, exact) and prompt (math, code and prose as in
docs/architecture.md §12; repeat with `--prompts`), five greedy generations run through the
gateway's `Scheduler` over in-process sessions (`LocalVerifierSession` / `LocalDrafterSession`, rows rounded to
bfloat16 as on the wire), each in fresh sessions: plain twice, always-k twice, gated once.
Cells compare token sequences:
  plain vs plain | always-k vs always-k | gated vs always-k | always-k vs plain
(and gated vs plain in --json) each "identical" or "diverges at i (margin m)": i is the first differing completion token
(0-based) and m the top1 - top2 logit margin a plain forward of prompt + the common prefix
gives there (how close to a tie the choice was). Attribution (docs/architecture.md §4): a
gated vs always-k divergence is gate-caused only if always-k agrees with itself through that
token; if always-k already differs from itself at or before it, it is the verify path's.
The "exact" rows run batched verify on a trunk built with exact verify numerics
(`services.app.load_trunk(..., verify_numerics="exact")`), whose plain runs decode with the
same trunk.
Defaults: the random tiny model (no checkpoint), the live oracle drafter with a corrupted
slot every 4 positions (so the gate truncates and batched verify rolls back), 32 tokens,
float32 (`--dtype bfloat16` for the serving precision, where batched drift is larger).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass

import torch

from services.app import drafter_engine, load_drafter, load_trunk, verifier_engine
from services.common.settings import BackendSettings
from services.gateway.backends import LocalDrafterSession, LocalVerifierSession
from services.gateway.gate import GateConfig
from services.gateway.scheduler import FinalEvent, ModelLimits, Scheduler
from services.gateway.tokenizer import load_tokenizer
from services.verifier.batcher import StepVerifier

PROMPTS = {
    "math": "Solve for x: 3x + 7 = 22. Subtract 7 from both sides: 3x =",
    "code": "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "prose": "The old lighthouse keeper walked slowly along the shore, watching",
    "repeat": "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15",
}
CHECKS = ("plain vs plain", "always-k vs always-k", "gated vs always-k", "always-k vs plain")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
EXACT_ROWS = ("exact = batched verify on a trunk with verify_numerics='exact' (decode and verify rows bitwise "
              "alike); its plain runs decode with the same trunk")


@dataclass(frozen=True)
class Cell:
    diverges_at: int | None
    margin: float | None

    def text(self) -> str:
        return "identical" if self.diverges_at is None else f"diverges at {self.diverges_at} (margin {self.margin:.3g})"


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """First index where a and b differ (a length difference counts), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class Bench:
    def __init__(self, checkpoint: str | None, drafter: str, corrupt_every: int, max_tokens: int,
                 dtype: torch.dtype = torch.float32):
        self.trunk = load_trunk(checkpoint, dtype=dtype)
        self.engine = StepVerifier(verifier_engine(self.trunk, BackendSettings()))
        exact = StepVerifier(verifier_engine(load_trunk(checkpoint, dtype=dtype, verify_numerics="exact"),
                                             BackendSettings()))
        # verify mode -> (verifier engine, the scheduler's verify mode)
        self.modes = {"sequential": (self.engine, "sequential"), "batched": (self.engine, "batched"),
                      "exact": (exact, "batched")}
        if drafter == "oracle":
            self.drafter = drafter_engine(self.trunk, oracle=True, settings=BackendSettings(),
                                          corrupt_every=corrupt_every)
        else:
            self.drafter = drafter_engine(load_drafter(checkpoint, dtype=dtype), settings=BackendSettings())
        cfg = self.trunk.cfg
        self.tokenizer = load_tokenizer(checkpoint, cfg.vocab_size, cfg.eos_token_id)
        self.limits = ModelLimits(cfg.vocab_size, cfg.max_seq_len, cfg.eos_token_id, cfg.dspark_block_size,
                                  self.drafter.identity()["confidence_head"])
        self.max_tokens = max_tokens

    async def generate(self, prompt: str, spec: str, verify_mode: str) -> list[int]:
        engine, mode = self.modes[verify_mode]
        sched = Scheduler(self.limits, self.tokenizer, GateConfig(), mode, "configured")
        p = sched.params(prompt, [], self.max_tokens, spec, ignore_eos=True)
        verifier = LocalVerifierSession(engine.steps)
        drafter = LocalDrafterSession(self.drafter) if spec != "off" else None
        tokens: list[int] = []
        try:
            async for ev in sched.generate(p, verifier, drafter):
                if not isinstance(ev, FinalEvent):
                    tokens += ev.token_ids
        finally:
            await verifier.close()
            if drafter is not None:
                await drafter.close()
        return tokens

    def margin(self, prompt: str, prefix: list[int]) -> float:
        """top1 - top2 of a plain forward over prompt + prefix, at its last position."""
        sid = self.engine.open_session()
        try:
            return self.engine.prefill(sid, self.tokenizer.encode(prompt) + prefix).margin
        finally:
            self.engine.close_session(sid)

    def cell(self, prompt: str, a: list[int], b: list[int]) -> Cell:
        i = first_divergence(a, b)
        return Cell(i, None if i is None else self.margin(prompt, a[:i]))

    async def row(self, name: str, prompt: str, verify_mode: str) -> dict:
        runs = {}
        for key, spec in (("plain1", "off"), ("plain2", "off"), ("always1", "always"), ("always2", "always"),
                          ("gated", "gated")):
            runs[key] = await self.generate(prompt, spec, verify_mode)
        cells = {"plain vs plain": self.cell(prompt, runs["plain1"], runs["plain2"]),
                 "always-k vs always-k": self.cell(prompt, runs["always1"], runs["always2"]),
                 "gated vs always-k": self.cell(prompt, runs["gated"], runs["always1"]),
                 "always-k vs plain": self.cell(prompt, runs["always1"], runs["plain1"]),
                 "gated vs plain": self.cell(prompt, runs["gated"], runs["plain1"])}
        return {"verify_mode": verify_mode, "prompt": name, "cells": cells,
                "attribution": attribution(cells), "tokens": runs}


def attribution(cells: dict[str, Cell]) -> str:
    """The attribution rule of docs/architecture.md §4, plus what the gated run followed when it
    is the gate's by that rule."""
    gated, self_cmp = cells["gated vs always-k"], cells["always-k vs always-k"]
    if gated.diverges_at is None:
        return "-"
    i = gated.diverges_at
    if self_cmp.diverges_at is not None and self_cmp.diverges_at <= i:
        return f"verify path (always-k differs from itself at {self_cmp.diverges_at})"
    text = f"gate (always-k agrees with itself through {i})"
    vs_plain, gated_plain = cells["always-k vs plain"], cells["gated vs plain"]
    if vs_plain.diverges_at == i and (gated_plain.diverges_at is None or gated_plain.diverges_at > i):
        text += (f"; gated equals plain there: always-k's verify drifted from plain at {i} "
                 f"(margin {vs_plain.margin:.3g}) and the gated run's blocks did not")
    return text


def render(rows: list[dict], meta: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(width=None if sys.stdout.isatty() else 200, emoji=False, highlight=False)
    t = Table(title=Text(f"Output determinism: {meta['model']}, drafter {meta['drafter']}, {meta['max_tokens']} "
                         "tokens per generation (i = completion token index, margin = top1 - top2 of plain decode there)"),
              title_justify="left", caption=Text(meta["exact"]), caption_justify="left")
    for col in ("verify", "prompt", *CHECKS, "attribution (gated vs always-k)"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["verify_mode"], r["prompt"], *[r["cells"][c].text() for c in CHECKS], Text(r["attribution"]))
    console.print(t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.determinism", description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default=None, help="checkpoint folder (default: the random tiny model)")
    ap.add_argument("--drafter", choices=("oracle", "dspark"), default="oracle")
    ap.add_argument("--corrupt-every", type=int, default=4, help="oracle drafter: corrupt one slot in N positions")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="weights and activations")
    ap.add_argument("--prompts", default="math,code,prose", help=f"comma-separated, from {sorted(PROMPTS)}")
    ap.add_argument("--json", action="store_true", help="print the table as JSON")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.prompts.split(",") if n.strip()]
    bad = [n for n in names if n not in PROMPTS]
    if bad or not names:
        ap.error(f"--prompts={args.prompts!r}: names must be from {sorted(PROMPTS)}")
    if args.max_tokens <= 0:
        ap.error(f"--max-tokens={args.max_tokens}: must be > 0")
    bench = Bench(args.checkpoint, args.drafter, args.corrupt_every, args.max_tokens, DTYPES[args.dtype])
    rows = [asyncio.run(bench.row(n, PROMPTS[n], mode)) for mode in bench.modes for n in names]
    meta = {"model": f"{args.checkpoint or 'random tiny model'} ({args.dtype})", "drafter": args.drafter + (
        f" (corrupt every {args.corrupt_every})" if args.drafter == "oracle" else ""), "max_tokens": args.max_tokens,
        "exact": EXACT_ROWS}
    if args.json:
        print(json.dumps({"meta": meta, "rows": [{**r, "cells": {c: v.text() for c, v in r["cells"].items()}}
                                                 for r in rows]}, indent=1))
    else:
        render(rows, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
