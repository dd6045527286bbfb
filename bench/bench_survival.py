"""Survival of a drafted block on recorded rounds: where a product of per-bucket rates errs, and
what the gate's length rule earns with each model (docs/gate.md §4).

Two parts, each on every `--files` rounds file (default: the two committed ones):

1. **Survival by position and confidence.** For each position j, the realised survival S_j =
   P(accepted >= j + 1) against two estimates of it, both fitted leave-one-workload-out (on
   the file's other workloads, so a model with more cells cannot win by fitting the rounds it
   is scored on) and in-sample (`--in-sample`, the same rounds): the product of per-bucket
   hazards pooled over positions (the gate's model before the survival estimator) and the
   conditional hazards per (position class, bucket) (`services.gateway.survival`). Also the
   hazard per (class, bucket) itself and the error of each model by the bucket of position j.
2. **The rule fed each model.** `dspark replay` per workload under the cost shapes of
   `bench.gate_shapes`: plain, always-k, the LOWO threshold, the gate with 1 position class
   (product) and with 3 (conditional), the calibrated-in-hindsight gate with each model's true
   rates, best fixed k and the per-round oracle; tok/s, and the ratio of each gate to the
   threshold.
3. **Where the calibrated gate loses** (`--decompose`). The calibrated-in-hindsight gate (true
   hazards, 3 classes) with the win factor at 1.15 or 1.0 and the pre-draft suspension on or
   off, each against the LOWO threshold: what the rule costs apart from the estimate.

Run: `python -m bench.bench_survival [--files F ...] [--shapes seed cheap cpu] [--json OUT]`.
Owns only this report; it changes nothing.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from bench.gate_shapes import FILES, SHAPES, load
from services.gateway.gate import BUCKET_EDGES, NUM_BUCKETS, GateConfig
from services.analysis.references import (HindsightGate, gate_config_for_replay, hindsight_hazards, hindsight_rates,
                                         observed_positions, replay_through_gate)
from services.analysis.replay import lowo_thresholds, replay_fixed, replay_log
from services.gateway.rounds import Round
from services.gateway.survival import survival_from_hazards

CLASSES = 3  # position classes of the conditional model (the gate's default)


def _buckets(rec: Round) -> list[int]:
    return [bisect.bisect_right(BUCKET_EDGES, c) for c in rec.confidence_logits[: rec.submitted]]


def survival_rows(rounds: Sequence[Round], fit: Sequence[Round]) -> list[dict]:
    """Per position j: rounds that submitted it, realised S_j, and the mean predicted S_j of the
    product model (1 class) and the conditional model (CLASSES) fitted on `fit`."""
    models = {"product": hindsight_hazards(fit, 1), "conditional": hindsight_hazards(fit, CLASSES)}
    curves = {name: [survival_from_hazards(h, _buckets(r)) for r in rounds] for name, h in models.items()}
    rows = []
    for j in range(max(r.submitted for r in rounds)):
        idx = [i for i, r in enumerate(rounds) if r.submitted > j]
        row = {"j": j, "rounds": len(idx), "realised": sum(rounds[i].accepted > j for i in idx) / len(idx)}
        for name, c in curves.items():
            row[name] = sum(c[i][j] for i in idx) / len(idx)
        rows.append(row)
    return rows


def error_by_bucket(rounds: Sequence[Round], fit: Sequence[Round]) -> list[dict]:
    """Per bucket of position j (over every observed position, i.e. reached through accepted
    drafts): positions, realised hazard, and each model's mean predicted hazard there."""
    models = {"product": hindsight_hazards(fit, 1), "conditional": hindsight_hazards(fit, CLASSES)}
    obs, hit = [0] * NUM_BUCKETS, [0] * NUM_BUCKETS
    pred = {name: [0.0] * NUM_BUCKETS for name in models}
    for rec in rounds:
        for pos in observed_positions(rec):
            b = bisect.bisect_right(BUCKET_EDGES, rec.confidence_logits[pos])
            obs[b] += 1
            hit[b] += pos < rec.accepted
            for name, h in models.items():
                pred[name][b] += h[min(pos, len(h) - 1)][b]
    return [{"bucket": b, "positions": obs[b], "realised": hit[b] / obs[b],
             **{name: pred[name][b] / obs[b] for name in models}} for b in range(NUM_BUCKETS) if obs[b]]


def survival_report(path: str, in_sample: bool) -> dict:
    """Part 1 for one file: per workload (and all of it) the survival rows and bucket errors,
    fitted on the other workloads (or in-sample), plus the in-sample hazards per (class, bucket)."""
    label, log = load(path)
    groups = log.workloads()
    out = {"file": label, "fit": "in-sample" if in_sample else "leave-one-workload-out", "workloads": {}}
    for name, rounds in groups.items():
        fit = rounds if in_sample else [r for other, rs in groups.items() if other != name for r in rs]
        out["workloads"][name] = {"survival": survival_rows(rounds, fit), "by_bucket": error_by_bucket(rounds, fit)}
    everything = list(log.rounds)
    out["hazards_in_sample"] = [list(row) for row in hindsight_hazards(everything, CLASSES)]
    out["pooled_in_sample"] = list(hindsight_hazards(everything, 1)[0])
    return out


def replay_report(path: str, shape: str) -> dict:
    """Part 2 for one file and cost shape: tok/s per workload and policy."""
    d, b, s, p = SHAPES[shape]
    base = GateConfig(enabled=True, draft_ms=d, verify_base_ms=b, verify_slope_ms=s, plain_ms=p)
    label, log = load(path)
    policies = ["plain", "always-k", "threshold", "gated"]
    reports = {c: replay_log(log, replace(base, position_classes=c), policies=policies) for c in (1, CLASSES)}
    rows = {}
    for w1, wc in zip(reports[1].workloads + [reports[1].overall], reports[CLASSES].workloads + [reports[CLASSES].overall]):
        tok = {k: r.tok_s for k, r in w1.results.items()}
        ref1 = {k: r.tok_s for k, r in w1.references.results.items()}
        refc = {k: r.tok_s for k, r in wc.references.results.items()}
        rows[w1.name] = {"plain": tok["plain"], "always-k": tok["always-k"], "threshold": tok["threshold"],
                         "gated-product": tok["gated"], "gated-survival": wc.results["gated"].tok_s,
                         "hindsight-product": ref1["calibrated-hindsight"],
                         "hindsight-survival": refc["calibrated-hindsight"],
                         "best-fixed-k": ref1["best-fixed-k"], "oracle": ref1["oracle"]}
    return {"file": label, "shape": shape, "rows": rows}


def decompose(path: str, shape: str) -> dict:
    """Part 3 for one file and cost shape: per workload, the calibrated-in-hindsight gate's
    tok/s / the LOWO threshold's with (win factor, pre-draft suspension) in {1.15, 1.0} x {on, off}."""
    d, b, s, p = SHAPES[shape]
    base = gate_config_for_replay(GateConfig(draft_ms=d, verify_base_ms=b, verify_slope_ms=s, plain_ms=p))
    label, log = load(path)
    groups = log.workloads()
    thresholds = lowo_thresholds(groups, base.cost_model())
    rows = {}
    for name, rounds in groups.items():
        threshold = replay_fixed(rounds, base.cost_model(), "threshold", thresholds[name]).tok_s
        rates, hazards = hindsight_rates(rounds).rates, hindsight_hazards(rounds, CLASSES)
        row = {}
        for win in (1.15, 1.0):
            for pre in (True, False):
                gate = HindsightGate(replace(base, win_factor=win), rates, hazards)
                if not pre:
                    gate.pre_draft = lambda margin: None  # draft every round: no suspension, no probes
                row[f"win {win} pre-draft {'on' if pre else 'off'}"] = replay_through_gate(rounds, gate).tok_s / threshold
        rows[name] = row
    return {"file": label, "shape": shape, "rows": rows}


def _print_decompose(rep: dict) -> None:
    cols = list(next(iter(rep["rows"].values())))
    print(f"\n### {rep['file']}, {rep['shape']} shape: calibrated gate (3 classes) / LOWO threshold\n")
    print("| workload | " + " | ".join(cols) + " |\n" + "|---" * (len(cols) + 1) + "|")
    for name, row in rep["rows"].items():
        print(f"| {name} | " + " | ".join(f"{row[c]:.3f}" for c in cols) + " |")


def _print_survival(rep: dict) -> None:
    print(f"\n### {rep['file']}: survival S_j, realised vs predicted ({rep['fit']})\n")
    print("| workload | j | rounds | realised | product | conditional |\n|---|---|---|---|---|---|")
    for name, w in rep["workloads"].items():
        for r in w["survival"]:
            print(f"| {name} | {r['j']} | {r['rounds']} | {r['realised']:.3f} | {r['product']:.3f} | "
                  f"{r['conditional']:.3f} |")
    print(f"\n{rep['file']}: hazard by bucket of position j ({rep['fit']}), all workloads' positions\n")
    print("| workload | bucket | positions | realised | product | conditional |\n|---|---|---|---|---|---|")
    for name, w in rep["workloads"].items():
        for r in w["by_bucket"]:
            print(f"| {name} | {r['bucket']} | {r['positions']} | {r['realised']:.3f} | {r['product']:.3f} | "
                  f"{r['conditional']:.3f} |")
    print(f"\n{rep['file']}: in-sample hazards, class x bucket (pooled: "
          + " ".join(f"{h:.2f}" for h in rep["pooled_in_sample"]) + ")")
    for c, row in enumerate(rep["hazards_in_sample"]):
        print(f"  class {c}: " + " ".join(f"{h:.2f}" for h in row))


def _print_replay(rep: dict) -> None:
    cols = ["plain", "always-k", "threshold", "gated-product", "gated-survival", "hindsight-product",
            "hindsight-survival", "best-fixed-k", "oracle"]
    print(f"\n### {rep['file']}, {rep['shape']} shape: tok/s (gate cold per workload; survival / threshold)\n")
    print("| workload | " + " | ".join(cols) + " | survival/threshold | product/threshold |")
    print("|---" * (len(cols) + 3) + "|")
    for name, row in rep["rows"].items():
        print(f"| {name} | " + " | ".join(f"{row[c]:.2f}" for c in cols)
              + f" | {row['gated-survival'] / row['threshold']:.3f} | {row['gated-product'] / row['threshold']:.3f} |")


def summary(replays: Sequence[dict]) -> dict:
    """Over every (file, shape, workload) row but the overall ones: per gate, how many rows fall
    below the LOWO threshold, the geometric mean and the least of gate / threshold."""
    out = {}
    for gate in ("gated-product", "gated-survival", "hindsight-product", "hindsight-survival"):
        ratios = [row[gate] / row["threshold"] for rep in replays for name, row in rep["rows"].items()
                  if name != "overall"]
        out[gate] = {"rows": len(ratios), "below_threshold": sum(r < 1.0 for r in ratios),
                     "below_0.98": sum(r < 0.98 for r in ratios), "min": min(ratios),
                     "geomean": math.exp(sum(math.log(r) for r in ratios) / len(ratios))}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Print both parts as markdown tables; `--json OUT` also writes them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="+", default=list(FILES), help="rounds files (or synthetic:SEED)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--in-sample", action="store_true", help="fit part 1 on the scored rounds themselves")
    parser.add_argument("--decompose", action="store_true", help="also part 3 (the calibrated gate's losses)")
    parser.add_argument("--json", help="also write the figures to this path")
    args = parser.parse_args(argv)
    out = {"survival": [], "replay": []}
    for path in args.files:
        rep = survival_report(path, args.in_sample)
        _print_survival(rep)
        out["survival"].append(rep)
    for path in args.files:
        for shape in args.shapes:
            rep = replay_report(path, shape)
            _print_replay(rep)
            out["replay"].append(rep)
    for path in args.files if args.decompose else ():
        for shape in args.shapes:
            rep = decompose(path, shape)
            _print_decompose(rep)
            out.setdefault("decompose", []).append(rep)
    out["summary"] = summary(out["replay"])
    print("\n### gate / LOWO threshold over every (file, shape, workload) row\n")
    print("| gate | rows | below threshold | below 0.98x | least | geometric mean |\n|---|---|---|---|---|---|")
    for gate, f in out["summary"].items():
        print(f"| {gate} | {f['rows']} | {f['below_threshold']} | {f['below_0.98']} | {f['min']:.3f} | "
              f"{f['geomean']:.4f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
