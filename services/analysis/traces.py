"""Load finished spans from trace files: the services' JSON lines or OTLP-JSON.

Owns the file formats and the `Span` value every analysis reads; it interprets no span
(which span means what is `report`'s) and rejects a malformed value with the file and line.

Accepted per file (the format is detected per JSON value, so files may mix them):
  * the JSON-lines exporter's output (`DSPARK_TRACES_JSONL`): one `ReadableSpan.to_json()`
    object per line (`name`, `context.trace_id`, `context.span_id`, `parent_id`,
    `start_time`/`end_time` as ISO-8601 UTC, `attributes`, `events`, `resource`);
  * the console exporter's output: the same objects pretty-printed one after another;
  * OTLP-JSON: `ExportTraceServiceRequest` documents (`resourceSpans` → `scopeSpans` →
    `spans`, ids in hex, times in `*UnixNano`, attributes as `AnyValue` lists), one per line
    (the collector's file exporter) or one per file; a JSON array of either kind of object.
A recorded-rounds file (`dspark replay`'s input, docs/gate.md §9) is not a span file:
`looks_like_rounds` tells one apart by its content, and `services.gateway.rounds` reads it.
Files over `PROGRESS_MIN_BYTES` show a progress bar (rich) on stderr when it is a terminal.
"""

from __future__ import annotations

import base64
import binascii
import calendar
import datetime
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from services.gateway.values import short_repr

PROGRESS_MIN_BYTES = 16 << 20  # inputs at least this large get a progress bar (when stderr is a terminal)
_DECODER = json.JSONDecoder()
_SNIFF_BYTES = 4096  # a top-level object's first key lies within its opening bytes
# The top-level keys of a rounds file (docs/gate.md §9); a span object has none of them
# (name, context, ...) and an OTLP document opens with resourceSpans.
_ROUNDS_KEYS = frozenset({"format", "version", "metadata", "rounds"})


@dataclass(frozen=True)
class Span:
    """One finished span. Ids are lowercase hex without `0x`; times are ns since the epoch."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str | None
    start_ns: int
    end_ns: int
    attributes: Mapping[str, Any] = field(default_factory=dict)
    events: tuple[Mapping[str, Any], ...] = ()
    service: str = ""
    origin: str = field(default="", compare=False, repr=False)  # "file:line" it was read from ("" if built)

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6

    def attr(self, key: str, default: Any = None) -> Any:
        return self.attributes.get(key, default)


# ---------------------------------------------------------------------------- SDK JSON
_SECONDS_CACHE: dict[str, int] = {}


def iso_to_ns(text: str) -> int:
    """'2026-11-29T23:50:37.157496Z' (the SDK's format; any fraction length, 'Z' or '+00:00') -> ns.

    Raises ValueError naming the text when it is not such a timestamp.
    """
    if not isinstance(text, str) or len(text) < 20 or text[10] != "T":
        raise ValueError(f"timestamp {text!r} is not ISO-8601 'YYYY-MM-DDTHH:MM:SS[.ffffff]Z'")
    head, rest = text[:19], text[19:]
    seconds = _SECONDS_CACHE.get(head)
    if seconds is None:
        try:
            dt = datetime.datetime.strptime(head, "%Y-%m-%dT%H:%M:%S")
        except ValueError:
            raise ValueError(f"timestamp {text!r} is not ISO-8601 'YYYY-MM-DDTHH:MM:SS[.ffffff]Z'") from None
        seconds = calendar.timegm(dt.timetuple())
        if len(_SECONDS_CACHE) > 100_000:
            _SECONDS_CACHE.clear()
        _SECONDS_CACHE[head] = seconds
    frac_ns = 0
    if rest.startswith("."):
        digits = rest[1:].rstrip("Z").split("+")[0]
        if not digits.isdigit():
            raise ValueError(f"timestamp {text!r} has a bad fraction")
        frac_ns = int((digits + "000000000")[:9])
        rest = rest[1 + len(digits):]
    if rest not in ("Z", "+00:00", ""):
        raise ValueError(f"timestamp {text!r} is not UTC")
    return seconds * 1_000_000_000 + frac_ns


def _hex_id(value: Any, width: int, what: str) -> str:
    """An id as lowercase hex of `width` digits: '0x…' (SDK), plain hex or base64 (OTLP-JSON)."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what}={value!r} is not an id")
    text = value[2:] if value.startswith("0x") else value
    if len(text) == width:
        try:
            int(text, 16)
            return text.lower()
        except ValueError:
            pass
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) * 2 == width:
        return raw.hex()
    raise ValueError(f"{what}={value!r} is neither {width} hex digits nor base64 of {width // 2} bytes")


def _object(value: Any, what: str) -> Mapping[str, Any]:
    """`value` when it is a JSON object (None: an empty one); ValueError naming `what` otherwise."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{what}={short_repr(value)} is not a JSON object")
    return value


def _checked(span: Span) -> Span:
    """`span` when its name is a string and 0 <= start <= end; ValueError naming the field otherwise."""
    if not isinstance(span.name, str):
        raise ValueError(f"span name {short_repr(span.name)} is not a string")
    if span.start_ns < 0:
        raise ValueError(f"span {span.name!r}: start time {span.start_ns} ns is before 1970")
    if span.end_ns < span.start_ns:
        raise ValueError(f"span {span.name!r}: ends {(span.start_ns - span.end_ns) / 1e6:g} ms before it starts")
    return span


def _sdk_span(obj: Mapping[str, Any], origin: str = "") -> Span:
    ctx = _object(obj["context"], "context")
    parent = obj.get("parent_id")
    resource = _object(_object(obj.get("resource"), "resource").get("attributes"), "resource.attributes")
    events = tuple({"name": e.get("name", ""), "attributes": _object(e.get("attributes"), "event attributes")}
                   for e in (_object(e, "event") for e in obj.get("events") or ()))
    return _checked(Span(name=obj["name"], trace_id=_hex_id(ctx["trace_id"], 32, "trace_id"),
                         span_id=_hex_id(ctx["span_id"], 16, "span_id"),
                         parent_id=_hex_id(parent, 16, "parent_id") if parent else None,
                         start_ns=iso_to_ns(obj["start_time"]), end_ns=iso_to_ns(obj["end_time"]),
                         attributes=dict(_object(obj.get("attributes"), "attributes")), events=events,
                         service=str(resource.get("service.name", "")), origin=origin))


# ---------------------------------------------------------------------------- OTLP-JSON
def _any_value(v: Mapping[str, Any]) -> Any:
    """An OTLP `AnyValue` as a Python value (int64 arrives as a string in JSON)."""
    v = _object(v, "attribute value")
    if "stringValue" in v:
        return v["stringValue"]
    if "boolValue" in v:
        return bool(v["boolValue"])
    if "intValue" in v:
        i = v["intValue"]
        if isinstance(i, bool) or not (isinstance(i, int) or isinstance(i, str) and i.lstrip("-").isdigit()):
            raise ValueError(f"intValue={short_repr(i)} is not an integer")
        return int(i)
    if "doubleValue" in v:
        d = v["doubleValue"]
        if isinstance(d, bool) or not isinstance(d, (int, float, str)):
            raise ValueError(f"doubleValue={short_repr(d)} is not a number")
        try:
            return float(d)
        except ValueError:
            raise ValueError(f"doubleValue={short_repr(d)} is not a number") from None
    if "arrayValue" in v:
        return [_any_value(x) for x in (_object(v["arrayValue"], "arrayValue").get("values") or [])]
    if "kvlistValue" in v:
        return _otlp_attributes(_object(v["kvlistValue"], "kvlistValue").get("values") or [])
    if "bytesValue" in v:
        return v["bytesValue"]
    return None


def _otlp_attributes(items: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    if not isinstance(items, list):
        raise ValueError(f"attributes={short_repr(items)} is not a list of key/value objects")
    return {_object(kv, "attribute")["key"]: _any_value(kv.get("value") or {}) for kv in items}


def _list(value: Any, what: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"{what}={short_repr(value)} is not a JSON array")
    return value


def _unix_nano(value: Any, what: str) -> int:
    """An OTLP `fixed64` time: a decimal string (proto3 JSON) or a whole JSON number."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and value >= 0 \
            and value != float("inf") and int(value) == value:
        return int(value)
    raise ValueError(f"{what}={short_repr(value)} is not a time in ns since 1970")


def _otlp_spans(doc: Mapping[str, Any], origin: str = "") -> Iterator[Span]:
    for rs in _list(doc.get("resourceSpans") or [], "resourceSpans"):
        rs = _object(rs, "resourceSpans[]")
        resource = _otlp_attributes(_object(rs.get("resource"), "resource").get("attributes") or [])
        service = str(resource.get("service.name", ""))
        for ss in _list(rs.get("scopeSpans") or rs.get("instrumentationLibrarySpans") or [], "scopeSpans"):
            for s in _list(_object(ss, "scopeSpans[]").get("spans") or [], "spans"):
                s = _object(s, "span")
                parent = s.get("parentSpanId")
                events = tuple({"name": e.get("name", ""), "attributes": _otlp_attributes(e.get("attributes") or [])}
                               for e in (_object(e, "event") for e in _list(s.get("events") or [], "events")))
                yield _checked(Span(name=s["name"], trace_id=_hex_id(s["traceId"], 32, "traceId"),
                                    span_id=_hex_id(s["spanId"], 16, "spanId"),
                                    parent_id=_hex_id(parent, 16, "parentSpanId") if parent else None,
                                    start_ns=_unix_nano(s["startTimeUnixNano"], "startTimeUnixNano"),
                                    end_ns=_unix_nano(s["endTimeUnixNano"], "endTimeUnixNano"),
                                    attributes=_otlp_attributes(s.get("attributes") or []), events=events,
                                    service=service, origin=origin))


def spans_of(value: Any, origin: str = "") -> Iterator[Span]:
    """The spans in one decoded JSON value: an SDK span, an OTLP document, or a list of either.
    `origin` ("file:line") is stored on each span for error messages.

    Raises ValueError (KeyError/TypeError wrapped by the caller) when it is none of them, or
    a span whose name is not a string or that ends before it starts.
    """
    if isinstance(value, list):
        for item in value:
            yield from spans_of(item, origin)
    elif isinstance(value, dict) and "resourceSpans" in value:
        yield from _otlp_spans(value, origin)
    elif isinstance(value, dict) and "context" in value and "name" in value:
        yield _sdk_span(value, origin)
    else:
        keys = short_repr(sorted(value)[:6]) if isinstance(value, dict) else type(value).__name__
        raise ValueError(f"not a span or an OTLP document (keys {keys})")


# ---------------------------------------------------------------------------- files
def _values_of_text(text: str, path: str, first_line: int) -> Iterator[tuple[int, Any]]:
    """Every JSON value in `text` (concatenated or pretty-printed) with its line number."""
    pos, n = 0, len(text)
    while True:
        while pos < n and text[pos].isspace():
            pos += 1
        if pos >= n:
            return
        line = first_line + text.count("\n", 0, pos)
        try:
            value, end = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{first_line + text.count(chr(10), 0, e.pos)}: not JSON ({e.msg})") from None
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{path}:{line}: {_json_limit(e)}") from None
        yield line, value
        pos = end


def _json_limit(exc: BaseException) -> str:
    """Why a JSON value that parses could not be read: nested too deeply, an integer too long."""
    if isinstance(exc, RecursionError):
        return "JSON nested too deeply"
    return f"not readable as JSON ({exc})"


def _file_values(path: str, advance) -> Iterator[tuple[int, Any]]:
    """JSON values of one file: line by line while every line is a whole value, else the rest
    of the file as concatenated values (pretty-printed spans, an OTLP document)."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            advance(len(raw))
            line = raw.strip()
            if not line:
                continue
            try:
                value = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                pass  # not a whole value on this line: read the rest of the file as text below
            except (ValueError, RecursionError) as e:
                raise ValueError(f"{path}:{lineno}: {_json_limit(e)}") from None
            else:
                yield lineno, value
                continue
            rest = raw + f.read()
            advance(len(rest) - len(raw))
            try:
                text = rest.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text ({e.reason})") from None
            yield from _values_of_text(text, path, lineno)
            return


def looks_like_rounds(path: str | os.PathLike) -> bool:
    """Whether `path` is a recorded-rounds file: a regular file whose text opens a JSON object
    whose first key is one the rounds format defines (format, version, metadata, rounds), in
    whatever order a hand-edited file puts them. Such a file goes to the strict rounds reader,
    whose errors then name what is wrong with it. Anything unreadable answers False, so that
    the span reader reports it with its own error."""
    if not os.path.isfile(path):
        return False
    try:
        with open(path, "rb") as f:
            # utf-8-sig: a file saved with a byte-order mark goes to the rounds reader, which
            # names the mark, rather than to the span reader, which would not see rounds
            head = f.read(_SNIFF_BYTES).decode("utf-8-sig", errors="replace").lstrip()
    except OSError:
        return False
    if not head.startswith("{"):
        return False
    try:
        key, _ = _DECODER.raw_decode(head, len(head) - len(head[1:].lstrip()))
    except (ValueError, RecursionError):  # an empty object, a first key longer than the head, deep nesting
        return False
    return isinstance(key, str) and key in _ROUNDS_KEYS


def _check_file(path: str) -> int:
    if path == "":
        raise ValueError("trace file '' is an empty path")
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"trace file {path!r} is a directory")
    if p.exists() and not p.is_file():
        raise ValueError(f"trace file {path!r} is not a regular file")
    return os.stat(path).st_size  # OSError names the file when it is missing


def load_spans(paths: Sequence[str | os.PathLike], progress: bool | None = None) -> list[Span]:
    """Every span in `paths`, in file order; a span given twice (the same file passed twice,
    an exporter that retried) is kept once.

    progress: show a progress bar (None: when the inputs total at least PROGRESS_MIN_BYTES
    and stderr is a terminal).
    Raises:
        ValueError: naming the file and line of a value that is not JSON, not a span or an
            OTLP document, or a span with a missing or malformed field (a name that is not
            a string, an end before its start); two different spans with one id; a
            directory or an empty path.
        OSError: a file that cannot be read (the message names it).
    """
    names = [os.fspath(p) for p in paths]
    sizes = [_check_file(p) for p in names]
    total = sum(sizes)
    if progress is None:
        progress = total >= PROGRESS_MIN_BYTES and sys.stderr.isatty()
    spans: list[Span] = []
    bar = None
    if progress:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
        bar = Progress(TextColumn("reading traces"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                       console=Console(stderr=True), transient=True)
        task = bar.add_task("read", total=total)
        advance = lambda n: bar.advance(task, n)  # noqa: E731
        bar.start()
    else:
        advance = lambda n: None  # noqa: E731
    try:
        for path in names:
            for lineno, value in _file_values(path, advance):
                try:
                    spans.extend(spans_of(value, f"{path}:{lineno}"))
                except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as e:
                    why = f"missing field {e}" if isinstance(e, KeyError) else _json_limit(e) \
                        if isinstance(e, RecursionError) else str(e)
                    raise ValueError(f"{path}:{lineno}: {why}") from None
    finally:
        if bar is not None:
            bar.stop()
    return _unique(spans)


def _unique(spans: list[Span]) -> list[Span]:
    """`spans` without repeats of one span (a file passed twice, an exporter's retry); a span id
    used by two different spans of one trace raises ValueError naming both places."""
    first: dict[tuple[str, str], Span] = {}
    out = []
    for s in spans:
        seen = first.setdefault((s.trace_id, s.span_id), s)
        if seen is s:
            out.append(s)
        elif seen != s:
            raise ValueError(f"{s.origin}: span id {s.span_id} of trace {s.trace_id} is also the id of a different "
                             f"span at {seen.origin}")
    return out


# ---------------------------------------------------------------------------- writing (tests, tools)
def ns_to_iso(ns: int) -> str:
    """ns since the epoch -> the SDK's ISO-8601 form (microseconds, 'Z')."""
    seconds, rem = divmod(int(ns), 1_000_000_000)
    dt = datetime.datetime.fromtimestamp(seconds, tz=datetime.timezone.utc)
    return dt.strftime("%Y-%m-%dT%H:%M:%S") + f".{rem // 1000:06d}Z"


def span_to_json(span: Span) -> dict:
    """`span` as the JSON-lines exporter writes it (the fields `load_spans` reads)."""
    return {"name": span.name, "context": {"trace_id": "0x" + span.trace_id, "span_id": "0x" + span.span_id},
            "parent_id": None if span.parent_id is None else "0x" + span.parent_id,
            "start_time": ns_to_iso(span.start_ns), "end_time": ns_to_iso(span.end_ns),
            "attributes": dict(span.attributes), "events": [dict(e) for e in span.events],
            "resource": {"attributes": {"service.name": span.service}}}
