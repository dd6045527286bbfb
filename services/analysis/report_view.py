"""The text form of a trace report: rich tables for `dspark trace-report` (times in ms).

Owns the layout of the report's tables and lines; it computes nothing itself (the figures come
from `services.analysis.report`) and never reads files or fits costs.
"""

from __future__ import annotations

import math

from services.analysis.calibration import gate_env_lines
from services.analysis.report import (MAX_GENERATION_ROWS, Report, decision_mix, latency_summary, parts_summary,
                                      per_k)


def _ms(x: float | None, digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def render_report(report: Report, console) -> None:
    """Rich tables on `console`: the round split, per-k percentiles, the gate mix,
    generations, the reliability table and the fitted costs (all times in ms)."""
    from rich.text import Text

    console.print(Text(f"{report.spans} spans and {report.recorded_rounds} recorded rounds from "
                       f"{len(report.sources)} file(s): {len(report.generations)} generations, "
                       f"{len(report.rounds)} rounds"))
    if report.recorded_rounds:
        console.print(Text("recorded rounds carry no spans: they add to the per-k times, the gate mix, the "
                           "reliability table and the fitted costs, not to the time split or the generations"))
    if not report.backend_spans and report.spans:
        console.print(Text("no verifier spans in the input: the compute split needs the verifier's and the "
                           "drafter's span files too (each service writes its own DSPARK_TRACES_JSONL)"))
    _render_rounds(report.rounds, console, split=report.recorded_rounds < len(report.rounds))
    _render_generations(report.generations, console)
    _render_calibration(report, console)


def _render_split(rounds, console) -> None:
    """Where the rounds' wall time went: drafter, verifier, residual (ms)."""
    from rich.table import Table

    parts = parts_summary(rounds)
    wall = parts["wall_ms"]["sum"] or 0.0
    t = Table(title="Round time split (ms; residual = network + serialisation + overheads)", title_justify="left")
    for col in ("part", "total", "share", "mean", "p50", "p99", "min"):
        t.add_column(col, justify="left" if col == "part" else "right")
    for name, label in (("wall_ms", "gateway round wall"), ("drafter_ms", "drafter compute"),
                        ("verifier_ms", "verifier compute"), ("residual_ms", "residual"),
                        ("verifier_overhead_ms", "  of which verifier servicer")):
        s = parts[name]
        share = f"{100 * s['sum'] / wall:.1f}%" if wall and s["n"] else "-"
        t.add_row(label, _ms(s["sum"], 1), share, _ms(s["mean"]), _ms(s["p50"]), _ms(s["p99"]), _ms(s["min"]))
    console.print(t)


def _render_rounds(rounds, console, split: bool = True) -> None:
    """The round time split (split=False: left out, no round has a span), the per-k
    percentiles and the gate's decision mix."""
    from rich.table import Table

    if split:
        _render_split(rounds, console)
    t = Table(title="Per submitted length k (ms)", title_justify="left")
    for col in ("k", "rounds", "wall p50", "wall p99", "verify p50", "verify p99", "verifier p50", "residual p50"):
        t.add_column(col, justify="right")
    for row in per_k(rounds):
        t.add_row(str(row["k"]), str(row["rounds"]), _ms(row["wall_ms"]["p50"]), _ms(row["wall_ms"]["p99"]),
                  _ms(row["verify_ms"]["p50"]), _ms(row["verify_ms"]["p99"]), _ms(row["verifier_ms"]["p50"]),
                  _ms(row["residual_ms"]["p50"]))
    console.print(t)

    t = Table(title="Gate decisions", title_justify="left")
    t.add_column("decision")
    t.add_column("rounds", justify="right")
    t.add_column("share", justify="right")
    for d, v in decision_mix(rounds).items():
        t.add_row(d, str(v["rounds"]), f"{100 * v['share']:.1f}%")
    console.print(t)


def _render_generations(gens, console) -> None:
    """One row per generation (at most MAX_GENERATION_ROWS), then TTFT / TPOT percentiles."""
    from rich.table import Table
    from rich.text import Text

    shown = gens if len(gens) <= MAX_GENERATION_ROWS else gens[:MAX_GENERATION_ROWS]
    t = Table(title="Generations (TTFT and time per output token after the first, ms)", title_justify="left",
              caption=None if shown is gens else f"first {len(shown)} of {len(gens)} generations (all in --json)",
              caption_justify="left")
    for col in ("trace", "mode", "tokens", "rounds", "accepted/submitted", "TTFT", "TPOT", "duration", "stats match"):
        t.add_column(col, justify="left" if col in ("trace", "mode") else "right")
    for g in shown:
        c = g.counts()
        t.add_row(g.trace_id[:12], Text(g.mode), str(g.output_tokens), str(c["rounds"]),
                  f"{c['accepted']}/{c['submitted']}", _ms(g.ttft_ms, 1), _ms(g.tpot_ms, 1), _ms(g.duration_ms, 1),
                  {True: "yes", False: "NO", None: "-"}[g.consistent])
    console.print(t)
    lat = latency_summary(gens)
    console.print(Text(f"over {len(gens)} generations: TTFT p50 {_ms(lat['ttft_ms']['p50'], 1)} / p99 "
                       f"{_ms(lat['ttft_ms']['p99'], 1)} ms; TPOT p50 {_ms(lat['tpot_ms']['p50'], 1)} / p99 "
                       f"{_ms(lat['tpot_ms']['p99'], 1)} ms; stats match in "
                       f"{sum(g.consistent is True for g in gens)}"))


def _render_calibration(report: Report, console) -> None:
    """The confidence reliability table and the fitted costs as gate settings."""
    from rich.table import Table
    from rich.text import Text

    t = Table(title="Draft confidence vs match rate (censored; the gate's buckets)", title_justify="left")
    for col in ("bucket", "observed", "matched", "match rate"):
        t.add_column(col, justify="right")
    for b in report.reliability:
        t.add_row(b.label, str(b.observed), str(b.matched), "-" if b.rate is None else f"{100 * b.rate:.0f}%")
    console.print(t)
    f = report.fit
    console.print(Text(
        f"Fitted costs: verify(k) = {_ms(f.verify_base_ms)} + {_ms(f.verify_slope_ms)}·k ms over {f.verify_samples} "
        f"verify rounds ({f.distinct_k} distinct k, rms {_ms(f.verify_rms_ms)} ms); draft {_ms(f.draft_ms)} ms "
        f"({f.draft_samples}); plain {_ms(f.plain_ms)} ms ({f.plain_samples})"))
    lines, notes = gate_env_lines(f)
    for line in lines:
        console.print(Text(line))
    for note in notes + [f"not fitted: needs {m}" for m in f.missing()]:
        console.print(Text(f"# {note}"))
