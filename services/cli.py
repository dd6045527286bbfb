"""The `dspark` command line: replay here; serve, up, generate and stats in `services.serve_cli`;
trace-report, calibrate and parity in `services.analysis.cli`.

Owns the top-level parser and the `replay` command's output; it is an entry point, so it may
read the environment, but only through `services.settings`, once per command, and it holds no
replay logic (`services.analysis.replay`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import fields, replace

from rich.console import Console
from rich.table import Table
from rich.text import Text

from services.common.terminal import printable
from services.gateway.gate import CostModel, GateConfig
from services.analysis.replay import (
    POLICIES,
    ReplayReport,
    WorkloadReport,
    calibration_of,
    comparisons,
    headline_of,
    redecided,
    replay_log,
    report_to_dict,
)
from services.gateway.rounds import decode_rounds_json, load_rounds
from services.analysis.synthetic import DEFAULT_ROUNDS, DEFAULT_SEED, generate
from services.gateway.values import parse_setting
from services.gateway.warm import DEFAULT_MAX_WEIGHT, parse_warm_start
from services.settings import gate_config

# GateConfig fields settable by flag (--draft-ms ...); each overrides its DSPARK_GATE_* env value.
_OVERRIDES = (
    "draft_ms",
    "verify_base_ms",
    "verify_slope_ms",
    "plain_ms",
    "win_factor",
    "decay",
    "margin_threshold",
    "position_classes",
)

# The cost shapes of docs/gate.md §10: the reference setup's, and a cheap-verify one (a real
# DeepSeek-V4-Flash shape: an extra draft costs ~16 ms against a ~73 ms decode).
COST_SHAPES = {"seed": CostModel(196.0, 300.0, 109.0, 303.0), "cheap": CostModel(24.0, 71.0, 16.0, 73.0)}
_BASE_COSTS = ("draft_ms", "verify_base_ms", "verify_slope_ms", "plain_ms")
_MAX_COST_FILE_BYTES = 1 << 20


def _flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _add_replay(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "replay",
        help="replay recorded rounds through plain / always-k / threshold / gated policies",
        description="Replay rounds under the cost model. Costs and gate settings come from the "
        "DSPARK_GATE_* env vars, then from the flags below; the gated policies run the "
        "gate enabled whatever DSPARK_GATE says. Bad input exits 2 with a one-line error.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("file", nargs="?", metavar="FILE", help="rounds JSON file (format: docs/gate.md; at most 256 MiB)")
    src.add_argument(
        "--synthetic",
        action="store_true",
        help=f"regenerate the committed synthetic rounds from the fixed seed ({DEFAULT_SEED}, "
        f"{DEFAULT_ROUNDS}/workload); identical to tests/data/synthetic_rounds.json, which a test checks",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON (several --costs: {\"reports\": [...]})")
    p.add_argument(
        "--costs",
        action="append",
        metavar="SHAPE",
        help="cost shape (repeatable, one report each): 'seed' (draft 196, verify 300 + 109·n, plain 303 ms), "
        "'cheap' (24, 71 + 16·n, 73 ms) or a JSON file of CostModel fields (draft_ms, verify_base_ms, "
        "verify_slope_ms, plain_ms). It replaces the env costs; --draft-ms etc. still override it",
    )
    p.add_argument(
        "--policy",
        action="append",
        choices=POLICIES,
        help="policy to replay besides plain and always-k (repeatable, a repeat counts once; default: "
        "every policy that applies). A requested policy that cannot run is an error",
    )
    p.add_argument(
        "--warm",
        default=None,
        metavar="W",
        help="warm-start each workload's gated policies from the OTHER workloads' calibration "
        "(leave-one-workload-out), lending at most W observations per confidence bucket "
        f"(the gateway's default is {DEFAULT_MAX_WEIGHT:g}); without it every workload starts cold",
    )
    for name in _OVERRIDES:
        p.add_argument(_flag(name), default=None, metavar="X", help=f"override {name} (ASCII decimal)")
    # --win-factor's former spelling, after DEEPSEEK_DSPARK_GATE_MARGIN: kept, since argparse
    # would otherwise read an old script's --margin as an abbreviation of --margin-threshold.
    p.add_argument("--margin", dest="margin_spelling", default=None, metavar="X", help=argparse.SUPPRESS)
    p.set_defaults(func=_run_replay)


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _fmt_pct(x: float | None, digits: int = 0, sign: bool = False) -> str:
    return "-" if x is None else f"{100 * x:{'+' if sign else ''}.{digits}f}%"


def _zero_accept(w: WorkloadReport, policy: str) -> str:
    r = w.results.get(policy)
    return "-" if r is None else f"{r.gate.zero_accept_rounds}/{r.gate.zero_accept_cost_ms / 1000:.1f}s"


def _threshold_cell(w: WorkloadReport) -> str:
    r = w.results["threshold"]
    return f"{r.tok_s:.2f}" + ("" if w.threshold is None else f" (t={w.threshold:.3g})")


def _table(title: str, caption: str, headers: Sequence[str]) -> Table:
    table = Table(title=Text(title), title_justify="left", caption=Text(caption), caption_justify="left")
    for col in headers:
        table.add_column(col, justify="left" if col == "workload" else "right")
    return table


def _rows(report: ReplayReport, table: Table, row) -> Table:
    """`table` with one row per workload, then the overall row below a rule."""
    for w in report.workloads:
        table.add_row(Text(printable(w.name)), *row(w))
    table.add_section()
    table.add_row(Text(printable(report.overall.name)), *row(report.overall))
    return table


def _heading(report: ReplayReport) -> Text:
    """What was replayed, under which costs and gate settings (printed above the tables)."""
    cfg = report.config
    return Text(f"Replay of {printable(report.source)}\ncosts {printable(report.costs)}: draft {cfg.draft_ms:g} ms"
                f" + verify {cfg.verify_base_ms:g} + {cfg.verify_slope_ms:g}·n ms, plain {cfg.plain_ms:g} ms; "
                f"win factor {cfg.win_factor:g}, decay {cfg.decay:g}, position classes "
                f"{cfg.position_classes}\ngate "
                + ("cold at the start of each workload" if report.warm is None else
                   f"warm-started from the other workloads (at most {report.warm.max_weight:g} observations per bucket)"))


def _policy_table(report: ReplayReport) -> Table:
    """tok/s of each replayed policy."""
    cfg, policies = report.config, list(report.overall.results)
    title = "tok/s per policy"
    # each caption sentence explains a column, so only the columns shown get one
    notes = {"gated": f"gated: the gate always enabled here (DSPARK_GATE={int(cfg.enabled)} is not used).",
             "threshold": "threshold: leave-one-workload-out, t chosen on the other workloads."}
    caption = " ".join(text for p, text in notes.items() if p in policies)
    headers = ["workload", "rounds", "accept"] + [{"threshold": "threshold\n(LOWO)", "gated+margin": "gated+\nmargin"}
                                                  .get(p, p) for p in policies]

    def row(w: WorkloadReport) -> list[str]:
        cells = [str(w.rounds), _fmt_pct(w.accept_rate, 1)]
        return cells + [_threshold_cell(w) if p == "threshold" else f"{w.results[p].tok_s:.2f}" for p in policies]

    return _rows(report, _table(title, caption, headers), row)


def _gated_table(report: ReplayReport) -> Table:
    """The gated policy against plain and always-k, its cuts, and the zero-accept rounds."""
    gated = "gated" in report.overall.results
    headers = ["workload"] + (["vs\nplain", "vs\nalways-k", "recovered", "cut/\nskip"] if gated else [])
    headers += ["0-accept\nalways-k"] + (["0-accept\ngated"] if gated else [])
    caption = ("gated vs plain and always-k (tok/s ratios). recovered: (gated - always-k) / (plain - always-k), "
               "where always-k < plain. cut/skip: rounds truncated / cut to 0 after the draft. 0-accept: verified "
               "rounds with nothing accepted / their time above plain.")

    def row(w: WorkloadReport) -> list[str]:
        if not gated:
            return [_zero_accept(w, "always-k")]
        cmp, g = comparisons(w.results, "gated"), w.results["gated"]
        return [_fmt_ratio(cmp["vs_plain"]), _fmt_ratio(cmp["vs_always_k"]), _fmt_pct(cmp["recovered"]),
                f"{g.truncated_rounds}/{g.skipped_after_draft}", _zero_accept(w, "always-k"), _zero_accept(w, "gated")]

    return _rows(report, _table("Gated policy", caption, headers), row)


def _reference_table(report: ReplayReport) -> Table:
    """The reference policies (tok/s) and the gate's headline fractions."""
    headers = ["workload", "best\nfixed k", "calib.\ngate", "oracle", "calib.\ngain", "gated of\ncalib.",
               "gated of\noracle", "ECE"]
    caption = ("tok/s of the references: best fixed k (k = 0: plain), the gate's rule given each workload's true "
               "bucket rates, the per-round oracle. calib. gain: calibrated / always-k - 1. gated of calib. "
               "(the headline): (gated - always-k) / (calibrated - always-k); of oracle: the same against the "
               "oracle. ECE: the gated policy's estimates against the recorded matches.")

    def row(w: WorkloadReport) -> list[str]:
        tok = {name: f"{r.tok_s:.2f}" for name, r in w.references.results.items()}
        k = w.references.best_k
        head, cal = headline_of(w) or {}, calibration_of(w) or {}
        ece = cal.get("ece")
        return [tok["best-fixed-k"] + ("" if k is None else f" k={k}"), tok["calibrated-hindsight"], tok["oracle"],
                _fmt_pct(head.get("calibrated_gain"), 1, sign=True), _fmt_pct(head.get("of_calibrated_gain")),
                _fmt_pct(head.get("of_oracle_gap")), "-" if ece is None else f"{ece:.3f}"]

    return _rows(report, _table("Reference policies (tok/s) and the headline", caption, headers), row)


def render_report(report: ReplayReport, console: Console) -> None:
    """Print the replay as tables that fit 80 columns: tok/s per policy, the gated policy's
    comparisons, then (when replayed) the reference policies and the headline fractions."""
    console.print(_heading(report))
    console.print(_policy_table(report))
    console.print(_gated_table(report))
    if report.overall.references is not None:
        console.print(_reference_table(report))


def _cost_file(path: str) -> CostModel:
    """The CostModel of a JSON cost file: an object of CostModel fields, the four base costs required.

    Raises ValueError naming the file and the key or value (a file over _MAX_COST_FILE_BYTES
    included); OSError naming the file."""
    if os.path.getsize(path) > _MAX_COST_FILE_BYTES:
        raise ValueError(f"--costs {path!r}: larger than {_MAX_COST_FILE_BYTES} bytes; a cost file is one small object")
    try:
        with open(path, encoding="utf-8") as f:
            doc = decode_rounds_json(f.read())
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"--costs {path!r}: not a JSON cost file ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"--costs {path!r}: must be a JSON object of CostModel fields, got {type(doc).__name__}")
    known = {f.name for f in fields(CostModel)}
    unknown, missing = sorted(set(doc) - known), [k for k in _BASE_COSTS if k not in doc]
    if unknown or missing:
        raise ValueError(f"--costs {path!r}: unknown keys {unknown}, missing keys {missing}; "
                         f"CostModel fields: {', '.join(sorted(known))}")
    try:
        return CostModel(**doc)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--costs {path!r}: {exc}") from None


def parse_costs(value: str) -> tuple[str, CostModel]:
    """(label, CostModel) of a --costs value: a named shape (COST_SHAPES) or a JSON cost file.

    Raises ValueError naming the value when it is neither a name nor a usable file."""
    if value in COST_SHAPES:
        return value, COST_SHAPES[value]
    if value == "" or not os.path.isfile(value):
        raise ValueError(f"--costs {value!r}: not one of {', '.join(COST_SHAPES)} nor a JSON cost file")
    return value, _cost_file(value)


def _configs_from(args: argparse.Namespace) -> list[tuple[str, GateConfig]]:
    """(cost label, config) per --costs value (or the env costs alone): the DSPARK_GATE_*
    values, then the cost shape, then the flags; a bad value raises ValueError naming the
    variable, the flag or the --costs value."""
    config = gate_config(os.environ)
    given = {k: (getattr(args, k), _flag(k)) for k in _OVERRIDES if getattr(args, k) is not None}
    if args.margin_spelling is not None:
        given.setdefault("win_factor", (args.margin_spelling, "--margin"))
    overrides = {k: parse_setting(k, raw, flag) for k, (raw, flag) in given.items()}
    shapes = [parse_costs(v) for v in dict.fromkeys(args.costs)] if args.costs else [("configured", None)]
    out = []
    for label, cost in shapes:
        shaped = config if cost is None else replace(config, **{k: getattr(cost, k) for k in _BASE_COSTS})
        out.append((label, replace(shaped, **overrides)))
    return out


def _error(message: str) -> int:
    print(f"dspark replay: error: {printable(message)}", file=sys.stderr)
    return 2


def _run_replay(args: argparse.Namespace) -> int:
    if args.file == "":
        return _error("argument FILE is an empty path ('')")
    try:
        configs = _configs_from(args)
        if args.synthetic:
            log, source = generate(), f"synthetic rounds (seed {DEFAULT_SEED}, {DEFAULT_ROUNDS}/workload)"
        else:
            log, source = load_rounds(args.file), args.file
        warm = None if args.warm is None else parse_warm_start(args.warm, "--warm")
        reports = [replay_log(log, config, args.policy, source, costs=label, warm=warm) for label, config in configs]
    except (ValueError, OSError) as exc:
        return _error(str(exc))
    if reports[0].skipped:
        skipped = "; ".join(f"{p}: {why}" for p, why in reports[0].skipped.items())
        print(f"dspark replay: note: skipped {skipped}", file=sys.stderr)
    same, decided = redecided(log.rounds, configs[0][1])
    if decided:  # rounds that recorded their decision's inputs (docs/gate.md §9)
        print(f"dspark replay: note: re-decided from the recorded inputs, {same} of {decided} rounds choose "
              f"the k they submitted", file=sys.stderr)
    if args.json:
        docs = [report_to_dict(r) for r in reports]
        print(json.dumps(docs[0] if len(docs) == 1 else {"reports": docs}, indent=2, allow_nan=False))
    else:
        console = Console(width=None if sys.stdout.isatty() else 160, emoji=False)
        for report in reports:
            render_report(report, console)
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
    from services.simulate.cli import add_command as add_simulate  # simulate
    add_simulate(subparsers)
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
