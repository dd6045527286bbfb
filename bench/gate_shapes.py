"""Replay the committed round files under the three cost shapes of docs/gate.md §11 and print
the gate's guarantees per workload: gated / plain, gated / always-k, and gated's share of the
calibrated-in-hindsight gain (the headline) where that gain exceeds 3 %.

Owns only this report; it never changes the gate. Run: `python -m bench.gate_shapes [--json]`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from services.gateway.gate import GateConfig
from services.gateway.replay import headline_of, replay_log
from services.gateway.rounds import parse_rounds

ROOT = Path(__file__).resolve().parents[1]
FILES = ("tests/data/bundled_rounds.json", "tests/data/synthetic_rounds.json")
# (draft, verify base, verify slope, plain) in ms. "cpu": the bundled model behind the services
# on the 2-core CPU box (the gateway's start-up profile, a line fitted through verify(1..5)).
SHAPES = {"seed": (196.0, 300.0, 109.0, 303.0), "cheap": (24.0, 71.0, 16.0, 73.0),
          "cpu": (21.0, 35.5, 16.5, 63.0)}


def shape_rows(path: str, shape: str, config: GateConfig | None = None) -> list[dict]:
    """One row per workload of `path` under cost shape `shape`: tok/s ratios and the headline."""
    d, b, s, p = SHAPES[shape]
    base = config or GateConfig()
    cfg = GateConfig(**{**base.__dict__, "enabled": True, "draft_ms": d, "verify_base_ms": b,
                        "verify_slope_ms": s, "plain_ms": p})
    log = parse_rounds(json.loads((ROOT / path).read_text()))
    report = replay_log(log, cfg, policies=["plain", "always-k", "gated"], references=True)
    rows = []
    for w in report.workloads:
        tok = {k: r.tok_s for k, r in w.results.items()}
        head = headline_of(w) or {}
        calib = w.references.results["calibrated-hindsight"].tok_s
        gain = calib / tok["always-k"] - 1.0
        rows.append({"file": Path(path).stem, "shape": shape, "workload": w.name,
                     "vs_plain": tok["gated"] / tok["plain"], "vs_always": tok["gated"] / tok["always-k"],
                     "calib_gain": gain, "headline": head.get("of_calibrated_gain") if gain > 0.03 else None})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [r for f in FILES for s in SHAPES for r in shape_rows(f, s)]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'file':18} {'shape':6} {'workload':9} {'x plain':>8} {'x always':>9} {'calib gain':>10} {'headline':>9}")
    for r in rows:
        head = "-" if r["headline"] is None else f"{100 * r['headline']:.0f}%"
        print(f"{r['file']:18} {r['shape']:6} {r['workload']:9} {r['vs_plain']:8.3f} {r['vs_always']:9.3f} "
              f"{100 * r['calib_gain']:+9.1f}% {head:>9}")


if __name__ == "__main__":
    main()
