"""Replay the committed round files under the three cost shapes of docs/gate.md §11 and print
the gate's guarantees per workload, cold and warm-started side by side: gated / plain, gated /
always-k, gated's share of the calibrated-in-hindsight gain (the headline) where that gain
exceeds 3 %, and the ECE of the estimates the gate decided with.

Warm: each workload's gate warm-starts from the other workloads' calibration
(leave-one-workload-out, `services.gateway.replay_warm`), never from its own rounds.
Owns only this report; it never changes the gate. Run:
`python -m bench.gate_shapes [--json] [--max-weight W]`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from services.gateway.gate import GateConfig
from services.gateway.replay import ReplayReport, calibration_of, headline_of, replay_log
from services.gateway.rounds import parse_rounds
from services.gateway.warm import DEFAULT_MAX_WEIGHT, WarmStart, parse_warm_start

ROOT = Path(__file__).resolve().parents[1]
FILES = ("tests/data/bundled_rounds.json", "tests/data/synthetic_rounds.json")
# (draft, verify base, verify slope, plain) in ms. "cpu": the bundled model behind the services
# on the 2-core CPU box (the gateway's start-up profile, a line fitted through verify(1..5)).
SHAPES = {"seed": (196.0, 300.0, 109.0, 303.0), "cheap": (24.0, 71.0, 16.0, 73.0),
          "cpu": (21.0, 35.5, 16.5, 63.0)}
HEADLINE_MIN_GAIN = 0.03  # the headline is shown where the calibrated gate gains more than this


def _figures(report: ReplayReport) -> dict[str, dict]:
    """Per workload: gated / plain, gated / always-k, the calibrated gain, the headline and the ECE."""
    out = {}
    for w in report.workloads:
        tok = {k: r.tok_s for k, r in w.results.items()}
        gain = w.references.results["calibrated-hindsight"].tok_s / tok["always-k"] - 1.0
        head = (headline_of(w) or {}).get("of_calibrated_gain") if gain > HEADLINE_MIN_GAIN else None
        out[w.name] = {"vs_plain": tok["gated"] / tok["plain"], "vs_always": tok["gated"] / tok["always-k"],
                       "calib_gain": gain, "headline": head, "ece": (calibration_of(w) or {}).get("ece")}
    return out


def shape_rows(path: str, shape: str, config: GateConfig | None = None,
               warm: WarmStart | None = None) -> list[dict]:
    """One row per workload of `path` under cost shape `shape`: the cold figures and, under
    `warm_*` keys, the leave-one-workload-out warm-started ones (`warm`: default settings when None)."""
    d, b, s, p = SHAPES[shape]
    base = config or GateConfig()
    cfg = GateConfig(**{**base.__dict__, "enabled": True, "draft_ms": d, "verify_base_ms": b,
                        "verify_slope_ms": s, "plain_ms": p})
    log = parse_rounds(json.loads((ROOT / path).read_text()))
    policies = ["plain", "always-k", "gated"]
    cold = _figures(replay_log(log, cfg, policies=policies, references=True))
    hot = _figures(replay_log(log, cfg, policies=policies, references=True, warm=warm or WarmStart()))
    return [{"file": Path(path).stem, "shape": shape, "workload": name, **cold[name],
             **{f"warm_{k}": v for k, v in hot[name].items() if k != "calib_gain"}} for name in cold]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _ece(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--max-weight", default=str(DEFAULT_MAX_WEIGHT),
                    help="observations per bucket the warm start lends (default %(default)s)")
    args = ap.parse_args()
    try:
        warm = parse_warm_start(args.max_weight, "--max-weight")
    except ValueError as exc:
        ap.error(str(exc))
    rows = [r for f in FILES for s in SHAPES for r in shape_rows(f, s, warm=warm)]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'':35}{'cold':^27}  {'warm (leave-one-workload-out)':^27}")
    print(f"{'file':17}{'shape':6}{'workload':8}{'calib':>6} " + f"{'xplain':>7}{'xalways':>8}{'head':>5}{'ece':>7}" * 2)
    for r in rows:
        cold = f"{r['vs_plain']:7.3f}{r['vs_always']:8.3f}{_pct(r['headline']):>5}{_ece(r['ece']):>7}"
        hot = (f"{r['warm_vs_plain']:7.3f}{r['warm_vs_always']:8.3f}{_pct(r['warm_headline']):>5}"
               f"{_ece(r['warm_ece']):>7}")
        print(f"{r['file']:17}{r['shape']:6}{r['workload']:8}{100 * r['calib_gain']:+5.1f}% {cold}  {hot}")


if __name__ == "__main__":
    main()
