"""`dspark trace-report`, `dspark calibrate` and `dspark parity` (registered by `add_commands`).

Owns the three commands' arguments, output and exit codes; every number they print is
computed in `traces`, `report`, `calibration`, `parity` and `plots`, never here.

Bad input (a missing or unreadable file, a value that is not a span) exits 2 with one line
on stderr naming the file and line. `calibrate` exits 1 when the traces cannot give all four
costs (it prints the lines it can, and says on stderr what is missing); `parity` exits 1
when a row is a mismatch (near ties are numerical drift and exit 0).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register trace-report, calibrate and parity on the `dspark` parser's subcommands."""
    rep = sub.add_parser("trace-report", help="latency split, gate mix and fitted gate costs from span files or recorded rounds",
                         description="Read the services' span files (DSPARK_TRACES_JSONL of each service, or "
                         "OTLP-JSON) and report per round: gateway wall, drafter compute, verifier compute, "
                         "residual (network + serialisation); p50/p99 per k; gate decisions; TTFT and time per "
                         "output token per generation; fitted gate costs as DSPARK_GATE_* lines.")
    rep.add_argument("traces", nargs="+", metavar="TRACES",
                     help="span files (JSON lines or OTLP-JSON) or recorded-rounds files (told apart by content)")
    rep.add_argument("--png", metavar="DIR", default=None, help="also write the four plots as PNG files into DIR")
    rep.add_argument("--json", action="store_true", help="print the report as JSON")
    rep.add_argument("--rounds", action="store_true",
                     help="print one line per round instead: what it submitted and why, with the decision's inputs "
                          "(survival per position, lambda, value(k) per k, the step budget's cut)")
    rep.set_defaults(func=_run_report)

    cal = sub.add_parser("calibrate", help="print fitted DSPARK_GATE_*_MS lines from span files or recorded rounds",
                         description="Fit verify(k) = base + slope·k, draft ms and plain ms from the gateway's "
                         "round spans or a recorded-rounds file's timings and print them as ready-to-use DSPARK_GATE_*=value lines.")
    cal.add_argument("traces", nargs="+", metavar="TRACES",
                     help="span files (JSON lines or OTLP-JSON) or recorded-rounds files (told apart by content)")
    cal.set_defaults(func=_run_calibrate)

    par = sub.add_parser("parity", help="compare two DSPARK_TOPK_DIAG top-k dumps (argmax_agree / near_tie / mismatch)",
                         description="Align two top-k dumps by session and position and give each row a verdict; "
                         "near_tie: gap_A + gap_B <= 2·δ with δ the logit disagreement measured on the agreeing "
                         "rows (docs/analysis.md).")
    par.add_argument("a", metavar="A", help="top-k dump of one side (topk-rank*-pid*.jsonl)")
    par.add_argument("b", metavar="B", help="top-k dump of the other side")
    par.add_argument("--tolerance", type=float, default=0.0,
                     help="lower bound on δ in logits (default 0: δ is measured from the agreeing rows only)")
    par.add_argument("--json", action="store_true", help="print the comparison as JSON")
    par.set_defaults(func=_run_parity)


def _error(command: str, message: str) -> int:
    from services.common.terminal import printable
    print(f"dspark {command}: error: {printable(message)}", file=sys.stderr)
    return 2


def _console():
    from rich.console import Console
    return Console(width=None if sys.stdout.isatty() else 160, emoji=False, highlight=False)


def _load(args):
    """The report of the inputs: recorded-rounds files (told apart by content) and span files."""
    from services.analysis.report import build_report
    from services.analysis.traces import load_spans, looks_like_rounds
    from services.gateway.rounds import load_rounds
    rounds_files = [p for p in args.traces if looks_like_rounds(p)]
    span_files = [p for p in args.traces if p not in rounds_files]
    # A file named twice (or through a link) counts once, as a span given twice does.
    once = {}
    for p in rounds_files:
        st = os.stat(p)
        once.setdefault((st.st_dev, st.st_ino), p)
    recorded = [r for p in once.values() for r in load_rounds(p).rounds]
    return build_report(load_spans(span_files) if span_files else [], args.traces, recorded)


def _run_report(args: argparse.Namespace) -> int:
    from services.analysis.report import report_to_dict
    from services.analysis.report_view import render_report
    if args.rounds:
        return _run_round_lines(args)
    try:
        report = _load(args)
        paths = []
        if args.png is not None:
            if args.png == "":
                raise ValueError("--png '' is an empty path")
            from services.analysis.plots import write_plots
            try:
                paths = write_plots(report, args.png)
            except OverflowError as exc:  # timings near the float limit have no finite axis
                raise ValueError(f"--png: these timings cannot be plotted ({exc})") from None
    except (ValueError, OSError) as exc:
        return _error("trace-report", str(exc))
    if args.json:
        out = report_to_dict(report)
        out["png"] = [str(p) for p in paths]
        print(json.dumps(out, indent=1, allow_nan=False))
    else:
        console = _console()
        render_report(report, console)
        for p in paths:
            console.print(f"wrote {p}", markup=False)
    return 0


def _run_round_lines(args: argparse.Namespace) -> int:
    """`trace-report --rounds`: one line per round span of the span files."""
    from services.analysis.report import why_lines
    from services.analysis.traces import load_spans, looks_like_rounds
    try:
        spans = load_spans([p for p in args.traces if not looks_like_rounds(p)])
    except (ValueError, OSError) as exc:
        return _error("trace-report", str(exc))
    lines = why_lines(spans)
    print("\n".join(lines) if lines else "no spec_decode.round span in the span files")
    return 0


def _run_calibrate(args: argparse.Namespace) -> int:
    from services.analysis.calibration import gate_env_lines
    try:
        report = _load(args)
    except (ValueError, OSError) as exc:
        return _error("calibrate", str(exc))
    lines, notes = gate_env_lines(report.fit)
    if not lines:
        return _error("calibrate", "no costs could be fitted: needs " + "; ".join(report.fit.missing()))
    print("\n".join(lines))
    for note in notes + [f"not fitted: needs {m}" for m in report.fit.missing()]:
        print(f"dspark calibrate: {note}", file=sys.stderr)
    return 1 if report.fit.missing() else 0


def _run_parity(args: argparse.Namespace) -> int:
    from services.analysis.parity import exit_code, parity_files, render
    try:
        for path in (args.a, args.b):
            if path == "":
                raise ValueError("top-k dump '' is an empty path")
        result = parity_files(args.a, args.b, args.tolerance)
    except (ValueError, OSError) as exc:
        return _error("parity", str(exc))
    if args.json:
        print(json.dumps(result, indent=1, allow_nan=False))
    else:
        render(result, _console())
    return exit_code(result)
