"""Markdown tables of `dspark simulate --json` grids, as bench/README.md shows them.

Per file: one row per load, plain's aggregate tok/s, every other arm's aggregate tok/s ÷ plain,
the best fixed k, gated ÷ that k and gated ÷ the best of plain and every fixed k.

    python -m bench.sim_tables FILE.json[=TITLE] [FILE.json[=TITLE] ...]

TITLE defaults to the cost shape, the alignment, the rounds source and the workloads replayed.
"""

from __future__ import annotations

import argparse
import json


def table(result: dict, title: str) -> str:
    """One grid's ratio table (markdown)."""
    arms = [a for a in result["inputs"]["arms"] if a != "plain"]
    lines = [f"**{title}**", "", "| streams | plain tok/s | " + " | ".join(arms)
             + " | best fixed | gated ÷ best fixed | gated ÷ best of plain, k |",
             "|---|---|" + "---|" * len(arms) + "---|---|---|"]
    for label, ratios in result["ratios"].items():
        best = result["best_fixed"][label]
        plain = result["cells"][label]["plain"]["aggregate_tok_s"]
        gated = ratios["gated"] / ratios[best]
        lines.append(f"| {label} | {plain:.1f} | " + " | ".join(f"{ratios[a]:.2f}" for a in arms)
                     + f" | {best} | {gated:.2f} | {ratios['gated'] / max(1.0, ratios[best]):.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    for spec in args.files:
        path, _, title = spec.partition("=")
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
        inputs = result["inputs"]
        rounds = inputs.get("rounds", "?")
        rounds = ", ".join(rounds) if isinstance(rounds, list) else rounds
        title = title or f"{inputs['costs']} ({inputs.get('alignment', '?')}), {rounds}: {', '.join(inputs['workloads'])}"
        print(table(result, title))
        print()


if __name__ == "__main__":
    main()
