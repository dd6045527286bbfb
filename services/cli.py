"""The `dspark` command line: one subcommand per job (replay now; serve, up, generate later)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace

from rich.console import Console
from rich.table import Table

from services.gateway.gate import GateConfig
from services.gateway.replay import POLICIES, ReplayReport, WorkloadReport, comparisons, replay_log, report_to_dict
from services.gateway.rounds import load_rounds
from services.gateway.synthetic import DEFAULT_ROUNDS, DEFAULT_SEED, generate

# CLI flag -> GateConfig field; each overrides the DEEPSEEK_DSPARK_GATE_* env value for the replay.
_OVERRIDES = {
    "draft_ms": float,
    "verify_base_ms": float,
    "verify_slope_ms": float,
    "plain_ms": float,
    "margin": float,
    "min_draft": int,
    "decay": float,
    "margin_threshold": float,
}


def _add_replay(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "replay",
        help="replay recorded rounds through plain / always-k / threshold / gated policies",
        description="Replay rounds under the cost model. Costs and gate settings come from the "
        "DEEPSEEK_DSPARK_GATE_* env vars, then from the flags below; the gated policies run the "
        "gate enabled whatever DEEPSEEK_DSPARK_GATE says.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("file", nargs="?", help="rounds JSON file (format: docs/gate.md)")
    src.add_argument("--synthetic", action="store_true", help="the synthetic rounds (fixed seed)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--policy", action="append", choices=POLICIES, help="policies to show (repeatable; default all)")
    for name, kind in _OVERRIDES.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None, help=f"override {name}")
    p.set_defaults(func=_run_replay)


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _fmt_pct(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def _zero_accept(w: WorkloadReport, policy: str) -> str:
    r = w.results.get(policy)
    return "-" if r is None else f"{r.zero_accept_rounds} / {r.zero_accept_cost_ms / 1000:.1f}s"


def _threshold_cell(w: WorkloadReport) -> str:
    r = w.results["threshold"]
    return f"{r.tok_s:.2f}" + ("" if w.threshold is None else f" (t={w.threshold:.3g})")


def _row(w: WorkloadReport, policies: Sequence[str]) -> list[str]:
    cells = [w.name, str(w.rounds), _fmt_pct(w.accept_rate, 1)]
    for p in policies:
        cells.append(_threshold_cell(w) if p == "threshold" else f"{w.results[p].tok_s:.2f}")
    if "gated" in w.results:
        cmp = comparisons(w.results, "gated")
        gated = w.results["gated"]
        cells += [_fmt_ratio(cmp["vs_plain"]), _fmt_ratio(cmp["vs_always_k"]), _fmt_pct(cmp["recovered"])]
        cells.append(f"{gated.truncated}/{gated.skipped_after_draft}")
    cells += [_zero_accept(w, "always-k"), _zero_accept(w, "gated")]
    return cells


def render_report(report: ReplayReport, console: Console) -> None:
    """Print the replay as a rich table (tok/s per workload and policy, then the overall row)."""
    cfg = report.config
    policies = list(report.overall.results)
    title = (
        f"Replay of {report.source}: tok/s under draft {cfg.draft_ms:g} ms + verify "
        f"{cfg.verify_base_ms:g} + {cfg.verify_slope_ms:g}·n ms, plain {cfg.plain_ms:g} ms; "
        f"margin {cfg.margin:g}, decay {cfg.decay:g}, min_draft {cfg.min_draft}"
    )
    caption = (
        "threshold: leave-one-workload-out, t chosen on the other workloads. recovered: "
        "(gated - always-k) / (plain - always-k), where always-k < plain. cut/skip: gated rounds "
        "truncated / cut to 0 after the draft. zero-accept: rounds / time above plain."
    )
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
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
    config = GateConfig.from_env()
    overrides = {k: getattr(args, k) for k in _OVERRIDES if getattr(args, k) is not None}
    return replace(config, **overrides)


def _run_replay(args: argparse.Namespace) -> int:
    try:
        config = _config_from(args)
        if args.synthetic:
            log, source = generate(), f"synthetic rounds (seed {DEFAULT_SEED}, {DEFAULT_ROUNDS}/workload)"
        else:
            log, source = load_rounds(args.file), args.file
        report = replay_log(log, config, args.policy or POLICIES, source)
    except (ValueError, OSError) as exc:
        print(f"dspark replay: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report_to_dict(report), indent=2))
    else:
        render_report(report, Console(width=None if sys.stdout.isatty() else 160))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `dspark` parser; each subcommand sets `func(args) -> exit code`."""
    parser = argparse.ArgumentParser(prog="dspark", description="DSpark speculative-decoding serving tools")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_replay(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `dspark` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
