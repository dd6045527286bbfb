"""Writes docs/settings.md, and the README's key-settings table, from `services.settings_vars`.

`python -m services.settings_doc` (or `make settings-doc`) rewrites both; `--check` writes
nothing and exits 1 naming the stale file (tests/test_settings_doc.py runs it). The
declarations are the only source: edit them, never the generated text.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.settings_vars import EXTERNAL, REMOVED, VARS, Var

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "settings.md"
README = REPO / "README.md"
BEGIN, END = "<!-- settings:begin (generated: make settings-doc) -->", "<!-- settings:end -->"
GROUPS = {"process": "Model and process", "verifier": "Verifier", "gateway": "Gateway", "gate": "Confidence gate",
          "serve": "Every service: ports, shutdown, logs, mTLS", "telemetry": "Traces"}

INTRO = """\
# Settings reference

For operators and developers configuring the services: every environment variable the project
reads, with its type, default, valid values, the processes that read it and what it changes.

Generated from `services/settings_vars.py` by `python -m services.settings_doc` (`make
settings-doc`); a test fails when this file is stale, so edit the declarations, not this page.

How settings are read: each entry point (`dspark serve|up|generate|replay`, `training/demo.py`)
parses the environment once, before any model loads, into typed, validated objects
(`services/settings.py`) and passes them down; nothing deeper reads the environment. A bad
value stops the command with one line naming the variable and its value. Unset means the
default; a flag (`--checkpoint`, `--metrics-port`, `--http-port`, `--token`) wins over its
variable. Seconds are plain ASCII decimals (`30`, `2.5`, `1e3`). The gate's cost defaults are
the reference 4x2080Ti measurements (architecture.md §12); only their ratios matter, and a
served gateway measures its own unless `DSPARK_GATE_COSTS=configured` ([gate.md](gate.md) §8, §12).
"""

OUTRO = """\
## Kept prefixes

Every variable of this project starts with `DSPARK_`. Two names from other projects are kept
as they are, because their owners define them: `OTEL_*` (OpenTelemetry's standard variables;
the OTLP exporter also reads `OTEL_EXPORTER_OTLP_*` itself) and `TRITON_INTERPRET`.
"""


def _cell(text: str) -> str:
    """`text` safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _row(v: Var) -> str:
    readers = ", ".join(v.readers) if set(v.readers) != {"verifier", "drafter", "gateway"} else "all services"
    cells = (f"`{v.name}`", v.kind if v.kind != "switch" else "switch", f"`{v.default_text()}`",
             v.range_text(), readers, v.effect)
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def settings_md() -> str:
    """The text of docs/settings.md."""
    out = [INTRO]
    for group, title in GROUPS.items():
        out += [f"## {title}", "", "| variable | type | default | valid values | read by | what it changes |",
                "|---|---|---|---|---|---|"]
        out += [_row(v) for v in VARS if v.group == group]
        out.append("")
    out += ["## Deprecated names", "", "Still read; the first use of one in a process logs one warning naming "
            "its replacement. Setting both names to different values is an error.", "",
            "| old name | new name |", "|---|---|"]
    out += [f"| `{old}` | `{v.name}` |" for v in VARS for old in v.aliases]
    out += ["", "## Removed", "", "No longer read: setting one logs one warning and changes nothing. The "
            "in-process benchmarks and tests set the fields directly.", "", "| variable | instead |", "|---|---|"]
    out += [f"| `{name}` | {_cell(why)} |" for name, why in REMOVED.items()]
    out += ["", "## Read by other projects' code", "", "| variable | meaning |", "|---|---|"]
    out += [f"| `{name}` | {_cell(what)} |" for name, what in EXTERNAL.items()]
    out += ["", OUTRO]
    return "\n".join(out)


def key_table() -> str:
    """The README's block: the settings that change behaviour, one row each."""
    rows = ["| variable | default | what it changes |", "|---|---|---|"]
    rows += [f"| `{v.name}` | `{v.default_text()}` | {_cell(v.effect)} |" for v in VARS if v.key]
    return "\n".join([BEGIN, *rows, END])


def readme_with_keys(text: str) -> str:
    """`text` (the README) with its generated block replaced. Raises ValueError when the
    markers are missing or out of order."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README.md: the markers {BEGIN!r} ... {END!r} are missing")
    return text[:start] + key_table() + text[end + len(END):]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m services.settings_doc", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file is stale")
    args = ap.parse_args(argv)
    wanted = {DOC: settings_md(), README: readme_with_keys(README.read_text(encoding="utf-8"))}
    stale = [p for p, text in wanted.items() if not p.is_file() or p.read_text(encoding="utf-8") != text]
    if args.check:
        for p in stale:
            print(f"{p.relative_to(REPO)} is stale: run make settings-doc", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.write_text(wanted[p], encoding="utf-8")
        print(f"wrote {p.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
