"""Size of the serving path's speculation control: `python -m bench.control_lines [--json FILE]`.

Issue #38 asks for the control that decides what one round submits to fit in about two modules
(aim: 800 lines). This counts, per module of that control, its physical lines and its code
lines (not blank, not a comment, not a docstring), so the figure is reproducible and the set
it covers is written down here rather than in a note.

The set is every module a served round's decision runs through: whether to draft (the pre-draft
decision, the regime), how many drafts to submit (estimates, costs, the scoring rule, the step
budget) and which step the round's verify meets (alignment). Left out: I/O and records
(`scheduler.py`, `record.py`, `rounds.py`, `profile.py`, which times rounds at start-up,
`load.py`, which fetches the verifier's step table),
value checks (`values.py`), and the offline tools (`services/analysis/`: replay, reference
policies, synthetic rounds).
"""
from __future__ import annotations

import argparse
import io
import json
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CONTROL = (
    "services/gateway/round_policy.py",
    "services/gateway/gate.py",
    "services/gateway/probe.py",
    "services/gateway/decision.py",
    "services/gateway/estimator.py",
    "services/gateway/survival.py",
    "services/gateway/costs.py",
    "services/gateway/load_regime.py",
    "services/gateway/warm.py",
    "services/common/budget.py",
    "services/common/alignment.py",
)


def code_lines(source: str) -> int:
    """Lines of `source` (Python text) holding a token other than a comment, a docstring or
    layout. A docstring is a string token that is a whole statement (it follows a NEWLINE,
    INDENT or DEDENT, or opens the file). Raises tokenize.TokenError on unterminated input."""
    lines: set[int] = set()
    prev = tokenize.NEWLINE
    layout = {tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT,
              tokenize.ENCODING, tokenize.ENDMARKER}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in layout:
            if tok.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
                prev = tok.type
            continue
        docstring = tok.type == tokenize.STRING and prev in (tokenize.NEWLINE, tokenize.INDENT,
                                                             tokenize.DEDENT)
        prev = tok.type
        if not docstring:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines)


def count(paths=CONTROL) -> list[dict]:
    """One row per module: `path`, `lines` (physical), `code` (see `code_lines`).
    Raises FileNotFoundError naming a module that no longer exists (the set must be edited with
    the code)."""
    rows = []
    for rel in paths:
        text = (ROOT / rel).read_text(encoding="utf-8")
        rows.append({"path": rel, "lines": text.count("\n"), "code": code_lines(text)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the rows and totals to this file")
    args = ap.parse_args(argv)
    rows = count()
    total = {"lines": sum(r["lines"] for r in rows), "code": sum(r["code"] for r in rows)}
    width = max(len(r["path"]) for r in rows)
    for r in rows:
        print(f"{r['path']:<{width}}  {r['lines']:>5}  {r['code']:>5}")
    print(f"{'total (' + str(len(rows)) + ' modules)':<{width}}  {total['lines']:>5}  {total['code']:>5}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "total": total}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
