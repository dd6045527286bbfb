"""Bounded reads of small text files given by users (rounds files, cost files).

A path a user passes may name a directory, a device (`/dev/zero`: read whole it never ends), a
FIFO (opening it blocks) or a file far larger than the format needs. `read_text` refuses
each before reading past its limit, with a reason the caller prefixes with what the file was
for.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def read_text(path: str | Path, limit: int) -> str:
    """The UTF-8 text of the regular file `path`, at most `limit` bytes (int >= 0).

    Raises ValueError whose message is the reason alone (the caller names the file and its
    use): "is a directory", "is not a regular file", "N bytes exceeds the L byte limit"
    (checked by fstat of the opened file and again by the read, as the file may grow between them), or "not
    UTF-8 text (reason at byte N)". Raises OSError when it is missing or unreadable."""
    # Opened first and checked by fstat, so what is checked is what is read: a path checked by
    # stat and then swapped for a FIFO would block the open. O_NONBLOCK opens a FIFO at once
    # (to be refused), and changes nothing in a regular file's reads.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("is a directory" if stat.S_ISDIR(info.st_mode) else "is not a regular file")
        if info.st_size > limit:
            raise ValueError(f"{info.st_size} bytes exceeds the {limit} byte limit")
        with open(fd, "rb", closefd=False) as f:  # a regular file now: FileIO takes it
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ValueError(f"more than the {limit} byte limit")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
