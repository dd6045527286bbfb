"""Text bound for a terminal: `printable` escapes what could drive it or break a line.

Owns that escaping only; every command-line tool (`dspark`'s subcommands, the benches)
prints labels, file names and error messages through it. It reads and writes nothing.
"""

from __future__ import annotations

import unicodedata


def printable(text: str) -> str:
    """`text` with control and format characters (ANSI escapes, newlines, bidi marks) written as
    backslash escapes, so labels and file names cannot drive the terminal or break a line."""
    return "".join(ascii(ch)[1:-1] if unicodedata.category(ch)[0] == "C" else ch for ch in text)
