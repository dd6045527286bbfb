"""The `dspark` command line: replay here; serve, up, generate and stats in `services.serve_cli`;
trace-report, calibrate and parity in `services.analysis.cli`.

Owns the top-level parser and the `replay` command's output; it is an entry point, so it may
read the environment, but only through `services.settings`, once per command, and it holds no
replay logic (`services.gateway.replay`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import unicodedata
from collections.abc import Sequence
from dataclasses import replace

from rich.console import Console
from rich.table import Table
from rich.text import Text

from services.gateway.gate import GateConfig
from services.gateway.replay import POLICIES, ReplayReport, WorkloadReport, comparisons, replay_log, report_to_dict
from services.gateway.rounds import load_rounds
from services.gateway.synthetic import DEFAULT_ROUNDS, DEFAULT_SEED, generate
from services.gateway.values import parse_setting
from services.settings import gate_config

# GateConfig fields settable by flag (--draft-ms ...); each overrides its DEEPSEEK_DSPARK_GATE_* env value.
_OVERRIDES = (
    "draft_ms",
    "verify_base_ms",
    "verify_slope_ms",
    "plain_ms",
    "margin",
    "min_draft",
    "decay",
    "margin_threshold",
)


def _flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def printable(text: str) -> str:
    """`text` with control and format characters (ANSI escapes, newlines, bidi marks) written as
    backslash escapes, so labels and file names cannot drive the terminal or break a line."""
    return "".join(ascii(ch)[1:-1] if unicodedata.category(ch)[0] == "C" else ch for ch in text)


def _add_replay(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "replay",
        help="replay recorded rounds through plain / always-k / threshold / gated policies",
        description="Replay rounds under the cost model. Costs and gate settings come from the "
        "DEEPSEEK_DSPARK_GATE_* env vars, then from the flags below; the gated policies run the "
        "gate enabled whatever DEEPSEEK_DSPARK_GATE says. Bad input exits 2 with a one-line error.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("file", nargs="?", metavar="FILE", help="rounds JSON file (format: docs/gate.md; at most 256 MiB)")
    src.add_argument(
        "--synthetic",
        action="store_true",
        help=f"regenerate the committed synthetic rounds from the fixed seed ({DEFAULT_SEED}, "
        f"{DEFAULT_ROUNDS}/workload); identical to tests/data/synthetic_rounds.json, which a test checks",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--policy",
        action="append",
        choices=POLICIES,
        help="policy to replay besides plain and always-k (repeatable, a repeat counts once; default: "
        "every policy that applies). A requested policy that cannot run is an error",
    )
    for name in _OVERRIDES:
        p.add_argument(_flag(name), default=None, metavar="X", help=f"override {name} (ASCII decimal)")
    p.set_defaults(func=_run_replay)


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _fmt_pct(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def _zero_accept(w: WorkloadReport, policy: str) -> str:
    r = w.results.get(policy)
    return "-" if r is None else f"{r.gate.zero_accept_rounds} / {r.gate.zero_accept_cost_ms / 1000:.1f}s"


def _threshold_cell(w: WorkloadReport) -> str:
    r = w.results["threshold"]
    return f"{r.tok_s:.2f}" + ("" if w.threshold is None else f" (t={w.threshold:.3g})")


def _row(w: WorkloadReport, policies: Sequence[str]) -> list[str | Text]:
    cells = [Text(printable(w.name)), str(w.rounds), _fmt_pct(w.accept_rate, 1)]
    for p in policies:
        cells.append(_threshold_cell(w) if p == "threshold" else f"{w.results[p].tok_s:.2f}")
    if "gated" in w.results:
        cmp = comparisons(w.results, "gated")
        gated = w.results["gated"]
        cells += [_fmt_ratio(cmp["vs_plain"]), _fmt_ratio(cmp["vs_always_k"]), _fmt_pct(cmp["recovered"])]
        cells.append(f"{gated.truncated_rounds}/{gated.skipped_after_draft}")
    cells += [_zero_accept(w, "always-k"), _zero_accept(w, "gated")]
    return cells


def render_report(report: ReplayReport, console: Console) -> None:
    """Print the replay as a rich table (tok/s per workload and policy, then the overall row)."""
    cfg = report.config
    policies = list(report.overall.results)
    title = (
        f"Replay of {printable(report.source)}: tok/s under draft {cfg.draft_ms:g} ms + verify "
        f"{cfg.verify_base_ms:g} + {cfg.verify_slope_ms:g}·n ms, plain {cfg.plain_ms:g} ms; "
        f"margin {cfg.margin:g}, decay {cfg.decay:g}, min_draft {cfg.min_draft}"
    )
    caption = (
        f"gated: the gate always enabled here (DEEPSEEK_DSPARK_GATE={int(cfg.enabled)} is not used). "
        "threshold: leave-one-workload-out, t chosen on the other workloads. recovered: "
        "(gated - always-k) / (plain - always-k), where always-k < plain. cut/skip: gated rounds "
        "truncated / cut to 0 after the draft. zero-accept: rounds / time above plain."
    )
    table = Table(title=Text(title), title_justify="left", caption=Text(caption), caption_justify="left")
    headers = ["workload", "rounds", "accept"] + [p + ("\n(LOWO)" if p == "threshold" else "") for p in policies]
    if "gated" in policies:
        headers += ["gated vs\nplain", "gated vs\nalways-k", "recovered", "gated\ncut/skip"]
    headers += ["zero-accept\nalways-k", "zero-accept\ngated"]
    for col in headers:
        table.add_column(col, justify="left" if col == "workload" else "right")
    for w in report.workloads:
        table.add_row(*_row(w, policies))
    table.add_section()
    table.add_row(*_row(report.overall, policies))
    console.print(table)


def _config_from(args: argparse.Namespace) -> GateConfig:
    """The DEEPSEEK_DSPARK_GATE_* values, then the flags; a bad value raises ValueError naming
    the variable or the flag."""
    config = gate_config(os.environ)
    overrides = {k: parse_setting(k, getattr(args, k), _flag(k)) for k in _OVERRIDES if getattr(args, k) is not None}
    return replace(config, **overrides)


def _error(message: str) -> int:
    print(f"dspark replay: error: {printable(message)}", file=sys.stderr)
    return 2


def _run_replay(args: argparse.Namespace) -> int:
    if args.file == "":
        return _error("argument FILE is an empty path ('')")
    try:
        config = _config_from(args)
        if args.synthetic:
            log, source = generate(), f"synthetic rounds (seed {DEFAULT_SEED}, {DEFAULT_ROUNDS}/workload)"
        else:
            log, source = load_rounds(args.file), args.file
        report = replay_log(log, config, args.policy, source)
    except (ValueError, OSError) as exc:
        return _error(str(exc))
    if report.skipped:
        skipped = "; ".join(f"{p}: {why}" for p, why in report.skipped.items())
        print(f"dspark replay: note: skipped {skipped}", file=sys.stderr)
    if args.json:
        print(json.dumps(report_to_dict(report), indent=2, allow_nan=False))
    else:
        render_report(report, Console(width=None if sys.stdout.isatty() else 160, emoji=False))
    return 0


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows each option's default, except where there is none to show (None, a
    store_true flag's False, an empty list) or the help text already names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, [], "") or action.default is argparse.SUPPRESS:
            return action.help or ""
        if "default:" in (action.help or "") or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _OneLineErrors(argparse.ArgumentParser):
    """argparse whose usage errors are one line (`prog: error: message`, exit 2), like ours;
    every (sub)command's `--help` lists the defaults (`DefaultsHelpFormatter`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {printable(message)}\n")


def build_parser() -> argparse.ArgumentParser:
    """The `dspark` parser; each subcommand sets `func(args) -> exit code`."""
    parser = _OneLineErrors(prog="dspark", description="DSpark speculative-decoding serving tools")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_replay(subparsers)
    from services.serve_cli import add_commands  # serve, up, generate, stats
    add_commands(subparsers)
    from services.analysis.cli import add_commands as add_analysis  # trace-report, calibrate, parity
    add_analysis(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `dspark` console script; returns the exit code (1 when stdout closed early)."""
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`dspark replay --json | head`). Python docs, "Note on SIGPIPE":
        # point stdout at devnull so the interpreter's exit-time flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
