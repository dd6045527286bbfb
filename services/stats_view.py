"""How `dspark stats` shows the gateway's `Stats` JSON to a person: rich tables at any width.

This module owns the layout only: the top-level scalars in one table, each section (a
dict) in a two-column table with nested keys dotted, and each list of records (the gate's
buckets) as a table of its own. It knows no key by name besides the formatting of rates, so
a field the gateway adds shows up without a change here. It reads no environment and makes
no call.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text


def fmt(key: str, value: object) -> str:
    """One value as shown: None -> "-", a `*_rate` in [0, 1] as a percentage, floats to 4
    significant digits, bools as yes / no, a list element by element, anything else as str."""
    if value is None:
        return "-"
    if isinstance(value, list):
        return "[" + ", ".join(fmt(key, v) for v in value) + "]"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if key.endswith("rate") and 0.0 <= value <= 1.0:
            return f"{100 * value:.1f}%"
        return f"{value:.4g}"
    return str(value)


def _flatten(prefix: str, value: dict, rows: list[tuple[str, object]], lists: dict[str, list]) -> None:
    for key, v in value.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(v, dict):
            _flatten(name, v, rows, lists)
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            lists[name] = v
        else:
            rows.append((name, v))


def _pairs(title: str, rows: list[tuple[str, object]]) -> Table:
    table = Table(title=Text(title), title_justify="left", show_header=False, box=None, pad_edge=False)
    table.add_column("field", style="bold", overflow="fold")  # long keys wrap, never cut
    table.add_column("value", justify="right")
    for key, value in rows:
        table.add_row(Text(key), Text(fmt(key, value)))
    return table


def _records(title: str, records: list[dict]) -> Table:
    columns = list(dict.fromkeys(k for r in records for k in r))
    table = Table(title=Text(title), title_justify="left")
    for col in columns:
        table.add_column(col, justify="left" if col in ("range", "name") else "right")
    for r in records:
        table.add_row(*(Text(fmt(col, r.get(col))) for col in columns))
    return table


def render_stats(stats: dict, console: Console, title: str = "gateway") -> None:
    """Print `stats` (the decoded `StatsResponse.json`: a dict) as tables on `console`.

    Raises:
        TypeError: `stats` is not a dict (named with its type).
    """
    if not isinstance(stats, dict):
        raise TypeError(f"stats must be a JSON object, got {type(stats).__name__}")
    scalars = [(k, v) for k, v in stats.items() if not isinstance(v, (dict, list))]
    if scalars:
        console.print(_pairs(title, scalars))
    for key, value in stats.items():
        if isinstance(value, dict):
            rows: list[tuple[str, object]] = []
            lists: dict[str, list] = {}
            _flatten("", value, rows, lists)
            console.print()
            console.print(_pairs(key, rows))
            for name, records in lists.items():
                console.print(_records(f"{key}.{name}", records))
        elif isinstance(value, list) and value and all(isinstance(x, dict) for x in value):
            console.print()
            console.print(_records(key, value))
