"""The table and the plot of `dspark simulate` (rich, matplotlib); no figure is computed here."""

from __future__ import annotations

import sys


def render(result: dict, wall_s: float) -> None:
    """Print one table per load (a row per arm) and the ratio table to stdout."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160, emoji=False, highlight=False)
    inputs = result["inputs"]
    console.print(f"costs {inputs['costs']}, workloads {', '.join(inputs['workloads'])} ({inputs['order']} order), "
                  f"prompt {inputs['prompt']}, "
                  f"output {inputs['output']}, {'shared' if inputs['shared_compute'] else 'separate'} compute, "
                  f"seed {inputs['seed']}; simulated in {wall_s:.1f} s", markup=False)
    for label, row in result["cells"].items():
        t = Table(title=f"load {label}")
        for col in ("arm", "agg tok/s", "per-stream tok/s", "TTFT p50/p99 ms", "ITL p50/p99 ms", "sessions/step",
                    "verifier util", "drafter util", "drafts/round", "plain rounds"):
            t.add_column(col, justify="left" if col == "arm" else "right")
        for arm, f in row.items():
            t.add_row(arm, f"{f['aggregate_tok_s']:.2f}", f"{f['per_stream_tok_s']:.2f}",
                      f"{f['ttft_p50_ms']:.0f} / {f['ttft_p99_ms']:.0f}",
                      f"{f['itl_p50_ms']:.1f} / {f['itl_p99_ms']:.1f}",
                      f"{f['sessions_per_step']:.2f}", f"{f['verifier_util']:.0%}", f"{f['drafter_util']:.0%}",
                      f"{f['drafts_per_round']:.2f}", f"{f['plain_round_share']:.0%}")
        console.print(t)
    if "ratios" in result:
        t = Table(title="aggregate tok/s / plain (best fixed k per load)")
        arms = inputs["arms"]
        t.add_column("load")
        for arm in arms:
            t.add_column(arm, justify="right")
        t.add_column("best fixed")
        for label, ratios in result["ratios"].items():
            t.add_row(label, *("-" if ratios[a] is None else f"{ratios[a]:.2f}" for a in arms), result.get("best_fixed", {}).get(label, "-"))
        console.print(t)


def write_png(result: dict, path: str, title: str) -> None:
    """Aggregate tok/s against load (log scale) per arm, the way throughput-vs-concurrency
    plots are drawn. Raises ValueError on an empty path, OSError when it cannot be written."""
    if not path:
        raise ValueError("an empty path")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(result["cells"])
    xs = list(range(len(labels)))
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=90)
    for arm in result["inputs"]["arms"]:
        ys = [result["cells"][lab][arm]["aggregate_tok_s"] for lab in labels]
        style = "-" if arm in ("plain", "gated") else "--"
        ax.plot(xs, ys, style, marker="o", markersize=3, label=arm, linewidth=2 if arm in ("plain", "gated") else 1)
    ax.set_xticks(xs, labels)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent streams" if not labels[0].endswith("/s") else "arrival rate")
    ax.set_ylabel("aggregate tok/s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    # format given: matplotlib would otherwise append ".png" to a name without a suffix
    fig.savefig(path, format="png", metadata={"Software": None})
    plt.close(fig)
