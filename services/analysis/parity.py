"""`dspark parity A B`: compare two top-k dumps (`DSPARK_TOPK_DIAG=K`) position by position.

Owns reading and aligning two dumps and the verdict per position; it reads files only and
never runs a model (the dumps come from `services.verifier.topk_diag`).

Alignment. Sessions are paired in prefill order (the i-th session of A with the i-th of
B); a pair whose prompts differ (`prompt_sha256`) is reported and not compared. Within a
session each position keeps its last record (a verify block's rejected positions are
forwarded again after the rollback, and the later forward supersedes). Positions present on
both sides are walked in order; the walk stops at the first position whose input token
differs ("inputs diverge"): from there the two sides no longer condition on the same text.

Verdict of an aligned row, with a = A's argmax and b = B's argmax there:
  argmax_agree  a == b;
  near_tie      a != b, both a and b are in both top-K lists, and
                    gap_A + gap_B <= 2·δ,
                where gap_A = ℓ_A(a) − ℓ_A(b) (≥ 0, A's margin of its pick over B's pick; the
                top-2 margin when b is A's runner-up), gap_B = ℓ_B(b) − ℓ_B(a), and δ is the
                measured logit disagreement between the two sides (below);
  mismatch      otherwise (including a pick outside the other side's top-K: its gap is
                unknown, so nothing shows the flip is a tie).
Why 2·δ: if no logit differs between the sides by more than δ, the difference
ℓ(a) − ℓ(b) can move by at most 2·δ, and the argmax flips only if it changes sign, i.e. it
moves by gap_A + gap_B. So a near_tie is a flip the measured drift can explain, and a
mismatch is one it cannot (a wrong state, a wrong position, a bad weight).
δ = max over the rows whose argmax agrees, and over the ids in both top-K lists of a row,
of |ℓ_A(id) − ℓ_B(id)|, raised to `tolerance` when that is larger. It is measured on the
agreeing rows only: the disagreement at a mismatching row is what is being judged, so it
cannot be its own yardstick. With no agreeing row δ = tolerance (default 0; pass the δ of a
comparable run, e.g. one that agreed, with --tolerance).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field

from services.gateway.values import short_repr
from services.verifier.topk_diag import FORMAT

VERDICTS = ("argmax_agree", "near_tie", "mismatch")


@dataclass(frozen=True)
class Row:
    """One forwarded position: its input token and the top-K (ids, logits), best first."""

    position: int
    token: int
    ids: tuple[int, ...]
    logits: tuple[float, ...]
    op: str

    @property
    def argmax(self) -> int:
        return self.ids[0]

    @property
    def margin(self) -> float | None:
        """top1 − top2 (None with K = 1)."""
        return self.logits[0] - self.logits[1] if len(self.logits) > 1 else None

    def logit(self, token: int) -> float | None:
        try:
            return self.logits[self.ids.index(token)]
        except ValueError:
            return None


@dataclass
class Session:
    index: int
    prompt_len: int | None = None
    prompt_sha256: str | None = None
    rows: dict[int, Row] = field(default_factory=dict)  # position -> last record


@dataclass
class Dump:
    path: str
    header: dict
    sessions: list[Session]


FLOAT32_MAX = 3.4028234663852886e38  # the dumps hold float32 logits; larger values are not logits


def _int(value, what: str) -> int:
    """`value` when it is a JSON integer (not a bool, not a float); ValueError naming `what` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what}={short_repr(value)} is not an integer")
    return value


def _list(value, what: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"{what}={short_repr(value)} is not a list")
    return value


def _row(q, tok, ids, logits, op: str) -> Row:
    """One position's record, checked: integer position and token, distinct integer ids, and
    as many finite float32 logits in descending order (as `torch.topk` writes them)."""
    q = _int(q, "position")
    ids, logits = _list(ids, f"position {q}: ids"), _list(logits, f"position {q}: logits")
    if len(ids) != len(logits) or not ids:
        raise ValueError(f"position {q}: {len(ids)} ids but {len(logits)} logits")
    ids = tuple(_int(x, f"position {q}: id") for x in ids)
    if len(set(ids)) != len(ids):
        raise ValueError(f"position {q}: ids {short_repr(list(ids))} repeat a token")
    for x in logits:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not abs(x) <= FLOAT32_MAX:
            raise ValueError(f"position {q}: logit {short_repr(x)} is not a finite float32 number")
    if any(b > a for a, b in zip(logits, logits[1:])):
        raise ValueError(f"position {q}: logits {short_repr(logits)} are not in descending order")
    return Row(q, _int(tok, f"position {q}: token"), ids, tuple(float(x) for x in logits), op)


def load_dump(path: str | os.PathLike) -> Dump:
    """Read a top-k dump.

    Raises:
        ValueError: naming the file and line of a malformed record: not a JSON object, a
            missing field, a session, position, token or id that is not an integer, lists
            of different lengths, repeated ids, a logit that is NaN, infinite or beyond
            float32, logits not best first; a file that is not UTF-8, empty or a directory.
        OSError: a file that cannot be read (named).
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"top-k dump {path!r} is a directory")
    header: dict | None = None
    sessions: dict[int, Session] = {}
    with open(path, "rb") as f:
        lineno = 0
        try:
            for lineno, raw in enumerate(f, 1):
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise ValueError(f"a {type(rec).__name__}, not a JSON object")
                if header is None:
                    if rec.get("format") != FORMAT:
                        raise ValueError(f"first line is not a {FORMAT} header")
                    header = rec
                    continue
                if rec.get("format") == FORMAT:  # a second process appended to the file
                    continue
                op = rec["op"]
                if op not in ("prefill", "decode", "block"):
                    raise ValueError(f"op={short_repr(op)} is not prefill, decode or block")
                index = _int(rec["session"], "session")
                s = sessions.setdefault(index, Session(index))
                if op == "prefill":
                    s.prompt_len, s.prompt_sha256 = rec.get("prompt_len"), rec.get("prompt_sha256")
                    if not isinstance(s.prompt_sha256, (str, type(None))):
                        raise ValueError(f"prompt_sha256={short_repr(s.prompt_sha256)} is not a string")
                columns = [_list(rec[k], k) for k in ("positions", "tokens", "ids", "logits")]
                if len({len(c) for c in columns}) != 1:
                    raise ValueError("positions, tokens, ids and logits differ in length")
                for q, tok, i, v in zip(*columns):
                    row = _row(q, tok, i, v, op)
                    s.rows[row.position] = row
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not UTF-8 text ({e.reason})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
        except (KeyError, TypeError, ValueError, RecursionError) as e:
            why = f"missing field {e}" if isinstance(e, KeyError) else \
                "JSON nested too deeply" if isinstance(e, RecursionError) else str(e)
            raise ValueError(f"{path}:{lineno}: {why}") from None
    if header is None:
        raise ValueError(f"{path}: empty, not a {FORMAT} dump")
    return Dump(path, header, [sessions[k] for k in sorted(sessions) if k >= 0])


def verdict(a: Row, b: Row, delta: float) -> tuple[str, dict]:
    """The verdict of one aligned row (module docstring) and its numbers."""
    info = {"argmax_a": a.argmax, "argmax_b": b.argmax, "margin_a": a.margin, "margin_b": b.margin}
    if a.argmax == b.argmax:
        return "argmax_agree", info
    la_a, la_b = a.logit(a.argmax), a.logit(b.argmax)
    lb_b, lb_a = b.logit(b.argmax), b.logit(a.argmax)
    if la_b is None or lb_a is None:
        info.update(gap_a=None, gap_b=None, bound=2 * delta)
        return "mismatch", info
    gap_a, gap_b = la_a - la_b, lb_b - lb_a
    info.update(gap_a=gap_a, gap_b=gap_b, bound=2 * delta)
    return ("near_tie" if gap_a + gap_b <= 2 * delta else "mismatch"), info


def disagreement(a: Row, b: Row) -> float | None:
    """max |ℓ_A − ℓ_B| over the ids in both top-K lists (None when they share none)."""
    shared = set(a.ids) & set(b.ids)
    if not shared:
        return None
    return max(abs(a.logit(t) - b.logit(t)) for t in shared)


def aligned_rows(sa: Session, sb: Session) -> tuple[list[tuple[Row, Row]], int | None]:
    """Rows of both sides at the common positions, up to the first input difference (its position)."""
    pairs = []
    for q in sorted(set(sa.rows) & set(sb.rows)):
        ra, rb = sa.rows[q], sb.rows[q]
        if ra.token != rb.token:
            return pairs, q
        pairs.append((ra, rb))
    return pairs, None


def compare(a: Dump, b: Dump, tolerance: float = 0.0) -> dict:
    """Per-session and overall verdicts of B against A (module docstring); JSON-ready.

    Raises ValueError naming the tolerance when it is negative, NaN or infinite.
    """
    if not 0 <= tolerance < float("inf"):
        raise ValueError(f"tolerance={tolerance!r}: must be a finite number >= 0")
    pairs, notes = [], []
    for sa, sb in zip(a.sessions, b.sessions):
        if sa.prompt_sha256 != sb.prompt_sha256:
            notes.append(f"session {sa.index}: different prompts (A {sa.prompt_len} tokens, B {sb.prompt_len}); "
                         "not compared")
            pairs.append((sa, sb, [], None))
            continue
        rows, diverged = aligned_rows(sa, sb)
        pairs.append((sa, sb, rows, diverged))
    if len(a.sessions) != len(b.sessions):
        notes.append(f"A has {len(a.sessions)} sessions, B {len(b.sessions)}: compared the first "
                     f"{min(len(a.sessions), len(b.sessions))}")
    measured = [d for _, _, rows, _ in pairs for ra, rb in rows
                if ra.argmax == rb.argmax and (d := disagreement(ra, rb)) is not None]
    delta = max([tolerance, *measured])
    total: Counter = Counter()
    sessions = []
    for sa, sb, rows, diverged in pairs:
        counts: Counter = Counter()
        first = None
        prefill = None
        for ra, rb in rows:
            v, info = verdict(ra, rb, delta)
            counts[v] += 1
            if ra.op == "prefill" or rb.op == "prefill":
                prefill = {"verdict": v, "position": ra.position, **info}
            if v != "argmax_agree" and first is None:
                first = {"position": ra.position, "verdict": v, **info}
        total.update(counts)
        sessions.append({"session": sa.index, "prompt_len": sa.prompt_len, "rows": len(rows),
                         "verdicts": {k: counts[k] for k in VERDICTS}, "prefill": prefill,
                         "first_difference": first, "inputs_diverge_at": diverged})
    return {"a": a.path, "b": b.path, "k": [a.header.get("k"), b.header.get("k")],
            "config_hash": [a.header.get("config_hash"), b.header.get("config_hash")],
            "delta": delta, "delta_rows": len(measured), "tolerance": tolerance,
            "verdicts": {k: total[k] for k in VERDICTS}, "sessions": sessions, "notes": notes}


def render(result: dict, console) -> None:
    """The comparison as a rich table, one row per session."""
    from rich.table import Table
    from rich.text import Text

    def num(x):
        return "-" if x is None else f"{x:.4g}"

    console.print(Text(f"parity: A = {result['a']}  B = {result['b']}"))
    console.print(Text(f"measured logit disagreement δ = {result['delta']:.4g} (max over {result['delta_rows']} "
                       f"agreeing rows, tolerance {result['tolerance']:g}); near_tie: gap_A + gap_B <= 2δ"))
    t = Table(title="Per session", title_justify="left")
    for col in ("session", "prompt", "rows", "agree", "near_tie", "mismatch", "prefill A / margin",
                "prefill B / margin", "prefill", "first difference", "inputs diverge"):
        t.add_column(col, justify="right")
    for s in result["sessions"]:
        p, f, v = s["prefill"], s["first_difference"], s["verdicts"]
        first = "-" if f is None else f"{f['verdict']} @ {f['position']} ({f['argmax_a']} vs {f['argmax_b']})"
        t.add_row(str(s["session"]), str(s["prompt_len"]), str(s["rows"]), str(v["argmax_agree"]),
                  str(v["near_tie"]), str(v["mismatch"]),
                  "-" if p is None else f"{p['argmax_a']} / {num(p['margin_a'])}",
                  "-" if p is None else f"{p['argmax_b']} / {num(p['margin_b'])}",
                  "-" if p is None else p["verdict"], first,
                  "-" if s["inputs_diverge_at"] is None else str(s["inputs_diverge_at"]))
    console.print(t)
    v = result["verdicts"]
    console.print(Text(f"overall: {v['argmax_agree']} argmax_agree, {v['near_tie']} near_tie, "
                       f"{v['mismatch']} mismatch"))
    for note in result["notes"]:
        console.print(Text(f"note: {note}"))


def exit_code(result: dict) -> int:
    """0 when no row is a mismatch, 1 otherwise (near ties are numerical drift, not failures)."""
    return 1 if result["verdicts"]["mismatch"] else 0


def parity_files(a: str, b: str, tolerance: float = 0.0) -> dict:
    return compare(load_dump(a), load_dump(b), tolerance)
