"""Log line formats of the services: text for people, one JSON object per line for log shippers.

This module owns the root logger's configuration of a `dspark serve` process (`configure`)
and how a record's structured fields are written. A caller attaches fields with
`extra={FIELDS: {...}}`; the text format appends them as `key=value`, the JSON format puts
them beside `time`, `level`, `logger` and `message`. It reads no environment: the format
arrives from `DSPARK_LOG_FORMAT` through the entry point's settings.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from datetime import datetime, timezone

from services.common.settings import LOG_FORMATS

# The `extra` key a caller puts its structured fields under (a dict of JSON-ready values).
FIELDS = "dspark_fields"
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def _fields(record: logging.LogRecord) -> dict:
    fields = getattr(record, FIELDS, None)
    return fields if isinstance(fields, dict) else {}


def _plain(value: object) -> object:
    """A JSON-safe value: non-finite floats become None (JSON has no NaN)."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


class TextFormatter(logging.Formatter):
    """`TEXT_FORMAT`, then the record's fields as ` key=value` (strings quoted when they hold spaces)."""

    def __init__(self):
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        parts = []
        for key, value in _fields(record).items():
            text = json.dumps(value) if isinstance(value, str) and (" " in value or not value) else value
            parts.append(f"{key}={'-' if value is None else text}")
        return line + (" " + " ".join(parts) if parts else "")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (ISO 8601, UTC), level, logger, message, the record's
    fields, and `exception` (the formatted traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        for key, value in _fields(record).items():
            out.setdefault(key, _plain(value))
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, allow_nan=False, default=str)


def formatter(fmt: str) -> logging.Formatter:
    """The formatter of `fmt` (one of LOG_FORMATS). Raises ValueError naming an unknown format."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format={fmt!r}: must be one of {LOG_FORMATS}")
    return JsonFormatter() if fmt == "json" else TextFormatter()


def configure(fmt: str, level: int = logging.INFO) -> None:
    """Send every log record of this process to stderr in format `fmt` (replacing the root
    logger's handlers). Raises ValueError naming an unknown format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(fmt))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
