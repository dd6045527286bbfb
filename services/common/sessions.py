"""Per-generation session tables shared by the verifier and drafter engines.

This module owns the bookkeeping every engine needs for its sessions: ids, the open-session
limit, a lock per session and thread-safe open / get / close. It knows nothing about what a
session holds (target state, rings, scripts) and imports no gRPC, so engines can use it;
`services.common.errors.status_for` maps its errors to RESOURCE_EXHAUSTED and NOT_FOUND.
"""

from __future__ import annotations

import contextlib
import itertools
import numbers
import threading
from dataclasses import dataclass, field
from typing import Generic, Iterator, TypeVar

S = TypeVar("S")


class SessionLimitError(RuntimeError):
    """No session slot free (the service maps this to RESOURCE_EXHAUSTED)."""


class UnknownSessionError(KeyError):
    """The session id is not open (closed, never opened, or from another engine)."""


@dataclass
class _Entry(Generic[S]):
    session: S
    lock: threading.Lock = field(default_factory=threading.Lock)


class SessionTable(Generic[S]):
    """Open sessions by id (ints from 1, never reused) with a limit on how many are open.

    Args:
        max_sessions: sessions allowed open at once: an integer >= 1 (Python or numpy
            integer; bool, float, str and None are refused).
    Raises:
        ValueError: max_sessions not an integer >= 1 (named with its value).
    Thread safety: open / get / close / len may be called from any thread. Each session
    also has its own lock, taken by `locked`, so calls on one session run one at a time
    while calls on different sessions run concurrently.
    """

    def __init__(self, max_sessions: int):
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, numbers.Integral) or max_sessions < 1:
            raise ValueError(f"max_sessions={max_sessions!r}: must be an integer >= 1")
        self.max_sessions = int(max_sessions)
        self._entries: dict[int, _Entry[S]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def open(self, session: S) -> int:
        """Store `session`; returns its new id. Raises SessionLimitError when max_sessions are open."""
        with self._lock:
            if len(self._entries) >= self.max_sessions:
                raise SessionLimitError(f"session limit reached: {self.max_sessions} sessions open (max_sessions="
                                        f"{self.max_sessions}); retry when a generation ends")
            sid = next(self._ids)
            self._entries[sid] = _Entry(session)
            return sid

    def close(self, sid: int) -> None:
        """Forget session `sid`; unknown or already closed ids are a no-op (a stream's cleanup
        may race an explicit close). A call that holds the session keeps it until it returns."""
        with self._lock:
            self._entries.pop(sid, None)

    def get(self, sid: int) -> S:
        """The session `sid` (without its lock). Raises UnknownSessionError when it is not open."""
        return self._entry(sid).session

    @contextlib.contextmanager
    def locked(self, sid: int) -> Iterator[S]:
        """Hold session `sid`'s lock for the `with` body and yield the session.

        Raises:
            UnknownSessionError: `sid` not open.
        """
        entry = self._entry(sid)
        with entry.lock:
            yield entry.session

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def sessions(self) -> list[S]:
        """The open sessions now (a snapshot; their locks not taken: diagnostics and metrics)."""
        with self._lock:
            return [e.session for e in self._entries.values()]

    def _entry(self, sid: int) -> _Entry[S]:
        with self._lock:
            entry = self._entries.get(sid)
        if entry is None:
            raise UnknownSessionError(f"session {sid} is not open")
        return entry


class SessionHost(Generic[S]):
    """Mixin for an engine whose sessions live in `self._table` (a `SessionTable`): the
    limit, the open count and close, the same for every engine."""

    _table: SessionTable[S]

    @property
    def max_sessions(self) -> int:
        """Sessions allowed open at once."""
        return self._table.max_sessions

    @property
    def num_sessions(self) -> int:
        """Sessions open now."""
        return len(self._table)

    def close_session(self, sid: int) -> None:
        """Free session `sid`'s state; closing an unknown or closed session is a no-op."""
        self._table.close(sid)
