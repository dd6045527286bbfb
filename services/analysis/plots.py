"""`dspark trace-report --png DIR`: four matplotlib PNGs of a `Report`.

Owns the figures only: every number drawn comes from the `Report`, plus drawing aids (the
fitted line, Wilson intervals); it never reads spans or changes the report.

timeline.png     the rounds of one generation (the one with the most verify rounds) on three lanes:
                 gateway round spans coloured by gate decision, drafter calls, verifier calls;
verify_vs_k.png  each round's verify (or plain decode) wall ms against k, with the fitted line;
acceptance.png   verify rounds by accepted drafts, stacked by the submitted k;
reliability.png  match rate per confidence bucket (the gate's edges), censored as the gate
                 counts it, with counts, Wilson 95% intervals and σ(mean logit) for reference.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from services.analysis.report import GenerationRecord, Report, acceptance_histogram  # noqa: E402

DECISION_COLORS = {"full": "#2a9d8f", "truncated": "#e9c46a", "skipped_after_draft": "#f4a261",
                   "capped": "#8d99ae", "margin_skipped": "#e76f51", "plain": "#adb5bd"}
CALL_COLORS = {"drafter.draft": "#457b9d", "drafter.commit": "#a8dadc", "verifier.verify": "#1d3557",
               "verifier.decode": "#6c757d", "verifier.prefill": "#264653", "gateway.prefill": "#495057"}
DPI = 110


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=11, color="#555")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def plot_timeline(gen: GenerationRecord | None, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(13, 4.2))
    if gen is None or not gen.rounds:
        _empty(ax, "no generation with rounds in the traces")
        ax.set_axis_off()
        return _save(fig, path)
    t0 = gen.start_ns
    lanes = {"gateway": 2, "drafter": 1, "verifier": 0}

    def bar(lane: str, start_ns: int, end_ns: int, color: str, height: float = 0.7) -> None:
        ax.broken_barh([((start_ns - t0) / 1e6, max((end_ns - start_ns) / 1e6, 1e-3))],
                       (lanes[lane] - height / 2, height), facecolors=color, edgecolors="white", linewidth=0.4)

    used = set()
    for s in gen.prefill:
        lane = s.name.split(".")[0]
        bar(lane, s.start_ns, s.end_ns, CALL_COLORS.get(s.name, "#999"))
        used.add(s.name)
    for r in gen.rounds:
        bar("gateway", r.start_ns, r.end_ns, DECISION_COLORS.get(r.decision, "#999"))
        for c in r.children:
            lane = c.name.split(".")[0]
            if lane in lanes:
                bar(lane, c.start_ns, c.end_ns, CALL_COLORS.get(c.name, "#999"), 0.5)
                used.add(c.name)
        if len(gen.rounds) <= 40:
            ax.text((r.start_ns + r.end_ns) / 2e6 - t0 / 1e6, 2.42, f"{r.accepted}/{r.submitted}",
                    ha="center", va="bottom", fontsize=7)
    decisions = [d for d in DECISION_COLORS if any(r.decision == d for r in gen.rounds)]
    handles = [plt.Rectangle((0, 0), 1, 1, color=DECISION_COLORS[d]) for d in decisions]
    handles += [plt.Rectangle((0, 0), 1, 1, color=CALL_COLORS[n]) for n in CALL_COLORS if n in used]
    labels = [f"round: {d}" for d in decisions] + [n for n in CALL_COLORS if n in used]
    ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=min(6, len(labels)), fontsize=8,
              frameon=False)
    ax.set_yticks(list(lanes.values()), list(lanes))
    ax.set_ylim(-0.6, 2.9)
    ax.set_xlim(0, gen.duration_ms * 1.01)
    ax.set_xlabel("ms since the generation started")
    ttft = "-" if gen.ttft_ms is None else f"{gen.ttft_ms:.1f} ms"
    ax.set_title(f"Round timeline of trace {gen.trace_id[:12]} ({gen.mode}, {len(gen.rounds)} rounds, "
                 f"{gen.output_tokens} tokens, TTFT {ttft}); labels: accepted/submitted", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def plot_verify_vs_k(report: Report, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7.5, 5))
    rounds = [r for r in report.rounds if r.verify_ms is not None]
    if not rounds:
        _empty(ax, "no rounds with spec_decode.verify_ms")
        return _save(fig, path)
    rng = np.random.default_rng(0)  # fixed jitter so that reruns draw the same picture
    ks = np.array([r.submitted for r in rounds], dtype=float)
    ms = np.array([r.verify_ms for r in rounds])
    jitter = rng.uniform(-0.12, 0.12, size=len(ks))
    verify = ks > 0
    ax.scatter(ks[verify] + jitter[verify], ms[verify], s=12, alpha=0.5, color="#1d3557", label="verify rounds")
    ax.scatter(ks[~verify] + jitter[~verify], ms[~verify], s=12, alpha=0.5, color="#e76f51",
               label="plain decode (k = 0)")
    for k in sorted(set(ks.tolist())):
        ax.plot([k - 0.25, k + 0.25], [np.median(ms[ks == k])] * 2, color="black", linewidth=1.5)
    f = report.fit
    if f.verify_base_ms is not None:
        x = np.linspace(0, max(ks.max(), 1), 50)
        ax.plot(x, f.verify_base_ms + f.verify_slope_ms * x, color="#2a9d8f", linewidth=2,
                label=f"fit: {f.verify_base_ms:.2f} + {f.verify_slope_ms:.2f}·k ms")
    if f.draft_ms is not None:
        ax.axhline(f.draft_ms, color="#457b9d", linestyle=":", label=f"mean draft {f.draft_ms:.2f} ms")
    ax.set_xlabel("k = drafts submitted (0 = plain decode)")
    ax.set_ylabel("gateway wall of the verify / decode call (ms)")
    ax.set_title(f"Verify cost vs k ({f.verify_samples} verify rounds, {f.plain_samples} plain); bars = medians",
                 fontsize=10)
    ax.set_xticks(sorted(set(ks.astype(int).tolist())))
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_acceptance(report: Report, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7.5, 5))
    hist = acceptance_histogram(report.rounds)
    if not hist:
        _empty(ax, "no verify rounds")
        return _save(fig, path)
    xs = np.arange(max(hist) + 1)  # 0..the largest k: every acceptance length that was possible
    bottom = np.zeros(len(xs))
    cmap = plt.get_cmap("viridis", max(len(hist), 2))
    for i, (k, counts) in enumerate(hist.items()):
        ys = np.array([counts.get(a, 0) for a in xs], dtype=float)
        ax.bar(xs, ys, bottom=bottom, color=cmap(i), label=f"k = {k}", edgecolor="white")
        bottom += ys
    for x, total in zip(xs, bottom):
        if total:
            ax.text(x, total, str(int(total)), ha="center", va="bottom", fontsize=8)
    n = int(bottom.sum())
    accepted = sum(a * c for v in hist.values() for a, c in v.items())
    ax.set_xticks(xs)
    ax.set_xlabel("drafts accepted in the round (bonus token not counted)")
    ax.set_ylabel("verify rounds")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"Acceptance length over {n} verify rounds\nmean acceptance length "
                 f"{(accepted + n) / n:.2f} tokens/round (bonus included)", fontsize=10)
    ax.legend(title="submitted", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def _wilson(matched: int, n: int, z: float = 1.96) -> tuple[float, float]:
    p = matched / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def plot_reliability(report: Report, path: Path) -> Path:
    """Match rate per bucket; σ(mean logit) as 0.5·(1 + tanh(x/2)), which never overflows (x = ±1000)."""
    fig, ax = plt.subplots(figsize=(7.5, 5))
    stats = report.reliability
    xs = np.arange(len(stats))
    observed = sum(b.observed for b in stats)
    for b, x in zip(stats, xs):
        if not b.observed:
            ax.text(x, 0.02, "n = 0", ha="center", va="bottom", fontsize=8, color="#777")
            continue
        lo, hi = _wilson(b.matched, b.observed)
        ax.bar(x, b.rate, color="#2a9d8f", width=0.6,
               label="match rate (Wilson 95% interval)" if not ax.get_legend_handles_labels()[1] else None)
        ax.errorbar(x, b.rate, yerr=[[max(0.0, b.rate - lo)], [max(0.0, hi - b.rate)]], color="black", capsize=4, linewidth=1)
        ax.text(x, hi + 0.02, f"{b.matched}/{b.observed}", ha="center", va="bottom", fontsize=8)
        ax.plot(x, 0.5 * (1 + math.tanh(b.mean_logit / 2)), marker="D", color="#e76f51", markersize=6, linestyle="none",
                label="σ(mean confidence logit)" if len(ax.get_legend_handles_labels()[1]) < 2 else None)
    ax.set_xticks(xs, [b.label for b in stats])
    ax.set_xlim(-0.5, len(stats) - 0.5)
    ax.set_ylim(0, 1.3)
    ax.set_xlabel("draft confidence logit bucket (the gate's edges)")
    ax.set_ylabel("match rate (censored: positions up to the first rejection)")
    ax.set_title(f"Reliability of the draft confidence ({observed} observed positions)\n"
                 "labels: matched/observed", fontsize=10)
    if observed == 0:
        _empty(ax, "no verified rounds with confidence logits")
    elif ax.get_legend_handles_labels()[1]:
        ax.legend(fontsize=8, loc="upper center", ncol=2)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def write_plots(report: Report, out_dir: str | Path) -> list[Path]:
    """Write the four PNGs into `out_dir` (created when missing); returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # the timeline shows the generation with the most verify rounds (then the most rounds)
    gen = max(report.generations, key=lambda g: (sum(r.submitted > 0 for r in g.rounds), len(g.rounds)),
              default=None)
    return [plot_timeline(gen, out / "timeline.png"), plot_verify_vs_k(report, out / "verify_vs_k.png"),
            plot_acceptance(report, out / "acceptance.png"), plot_reliability(report, out / "reliability.png")]
