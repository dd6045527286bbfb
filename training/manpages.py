"""Troff man pages as plain text, for the prose domain of the training corpus.

Owns the conversion of man/mdoc macros to deterministic plain text without groff; it never
reads files or decides what enters the corpus (training/corpus.py does).
"""

from __future__ import annotations

import re

_ESCAPES = [
    (re.compile(r"\\f(\[[^\]]*\]|\(..|.)"), ""),  # font changes
    (re.compile(r"\\s[+-]?\d"), ""),  # size changes
    (re.compile(r"\\\*(\[[^\]]*\]|\(..|.)"), ""),  # strings (mostly quotes and dashes)
    (re.compile(r"\\\((em|en|hy)"), "-"),
    (re.compile(r"\\\((aq|cq|oq)"), "'"),
    (re.compile(r"\\\((dq|lq|rq)"), '"'),
    (re.compile(r"\\\(bu"), "*"),
    (re.compile(r"\\\(co"), "(c)"),
    (re.compile(r"\\\(.."), ""),
    (re.compile(r"\\\[[^\]]*\]"), ""),
    (re.compile(r"\\[hvwNoZXkbDlLx]'[^']*'"), ""),  # motions, widths, glyph numbers
    (re.compile(r"\\n(\[[^\]]*\]|\(..|.)"), ""),  # number registers
    (re.compile(r"\\-"), "-"),
    (re.compile(r"\\e"), "\\\\"),
    (re.compile(r"\\ "), " "),
    (re.compile(r"\\[&|^c%:!)dutrpa{}]"), ""),
    (re.compile(r'\\".*$'), ""),  # trailing comments
]
_TEXT_MACROS = {".B", ".I", ".BR", ".IR", ".RB", ".BI", ".IB", ".RI", ".SM", ".SB", ".Nm", ".Ar", ".Fl"}
_BREAK_MACROS = {".PP", ".LP", ".P", ".TP", ".sp", ".br", ".Pp", ".HP", ".TQ"}
_ALTERNATING = {".BR", ".IR", ".RB", ".BI", ".IB", ".RI"}  # alternate fonts, no spaces between words


def _unescape(line: str) -> str:
    for pat, rep in _ESCAPES:
        line = pat.sub(rep, line)
    return line


class _ManReader:
    """One page's conversion state: finished lines, the open paragraph, fill mode and
    whether the next text line is a .TP/.TQ tag."""

    def __init__(self) -> None:
        self.out: list[str] = []
        self.para: list[str] = []
        self.in_def, self.fill, self.tag_next = False, True, False

    def flush(self) -> None:
        if self.para:
            self.out.append(" ".join(" ".join(self.para).split()))
            self.para.clear()

    def text(self, t: str) -> None:
        if self.fill:
            self.para.append(t)
        else:
            self.out.append(t.rstrip())

    def line(self, line: str) -> bool:
        """Take one source line; False for a `.so` redirect (the page is only a pointer)."""
        if self.in_def:
            self.in_def = line != ".."
        elif line.startswith((".de", "'de")):
            self.in_def = True
        elif line.startswith(('.\\"', "'\\\"")) or line in (".", "'"):
            pass
        elif line.startswith(".so "):
            return False
        elif line.startswith((".", "'")):
            parts = line.split(None, 1)
            self.macro(parts[0], parts[1] if len(parts) > 1 else "")
        elif self.tag_next:
            self.flush()
            self.out.append(_unescape(line))
            self.tag_next = False
        else:
            self.text(_unescape(line))
        return True

    def macro(self, macro: str, arg: str) -> None:
        """One request line: headings, font macros, fill switches, breaks and .IP tags."""
        if macro in (".SH", ".SS", ".Sh", ".Ss"):
            self.flush()
            self.out += ["", _unescape(arg.replace('"', "")).strip(), ""]
        elif macro in _TEXT_MACROS:
            words = [w.strip('"') for w in re.findall(r'"[^"]*"|\S+', arg)]
            t = _unescape("".join(words) if macro in _ALTERNATING else " ".join(words))
            if self.tag_next:
                self.flush()
                self.out.append(t)
                self.tag_next = False
            else:
                self.text(t)
        elif macro in (".nf", ".EX"):
            self.flush()
            self.fill = False
        elif macro in (".fi", ".EE"):
            self.fill = True
        elif macro in _BREAK_MACROS:
            self.flush()
            self.out.append("")
            self.tag_next = macro in (".TP", ".TQ")
        elif macro == ".IP":
            self.flush()
            self.out.append("")
            if arg:
                self.out.append(_unescape(arg.split('"')[1] if arg.startswith('"') else arg.split()[0]))


def man_to_text(src: str) -> str:
    """Plain text of a troff man page (man/mdoc macros), deterministic and groff-free.

    Comments, requests and macro definitions are dropped; headings (.SH/.SS) become their own
    paragraphs; filled text is joined into one line per paragraph (no-fill blocks, .nf/.EX,
    keep their lines); font macros (.B, .IR, ...) keep their words; .TP/.IP tags get their
    own line; escapes are replaced (dashes, quotes) or removed. Returns "" for a `.so` redirect.
    """
    reader = _ManReader()
    for raw in src.splitlines():
        if not reader.line(raw.rstrip()):
            return ""
    reader.flush()
    body = re.sub(r"[ \t]+\n", "\n", "\n".join(reader.out))
    return re.sub(r"\n{3,}", "\n\n", body).strip() + "\n"
