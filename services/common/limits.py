"""How many sessions a backend process holds at once: the open-session limit and its rule.

Owns the sizing rule of DSPARK_MAX_SESSIONS when it is unset: the session state a process
can hold is a fixed fraction of the memory available when it starts, divided by the bytes
one session's state takes on the loaded model, and capped. It reads no memory figure
itself: the entry point reads it (`available_memory_bytes`, /proc/meminfo) and passes it
down, so tests and embeddings size limits from values they choose.

Rule (`session_limit`): limit = min(cap, floor(fraction * available / per_session)),
fraction MEMORY_FRACTION (the rest stays for weights already loaded elsewhere, activations
of a step, the allocator's slack and the rest of the machine), cap MAX_SESSIONS_CAP (more
sessions than that only lengthen every step). Without a memory figure the limit is
FALLBACK_MAX_SESSIONS. When not one session fits, start-up fails instead of every session
later running out of memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MEMORY_FRACTION = 0.5
MAX_SESSIONS_CAP = 256
FALLBACK_MAX_SESSIONS = 16
MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class SessionLimit:
    """The open-session limit of a backend and why: `limit` sessions; `per_session_bytes`, the
    state bytes of one session of the loaded model (bytes); `rule`, one line saying how the
    limit was chosen (reported in Info and logged at start-up)."""

    limit: int
    per_session_bytes: int
    rule: str


def available_memory_bytes(meminfo: Path = MEMINFO) -> int | None:
    """MemAvailable of `meminfo` (a /proc/meminfo file) in bytes; None when the file or the
    line is missing or unreadable (not Linux, a sandbox): the caller then uses no memory rule."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if name == "MemAvailable" and parts and parts[0].isdigit():
            return int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return None


def session_limit(per_session_bytes: int, configured: int | None = None, available_bytes: int | None = None,
                  fraction: float = MEMORY_FRACTION, cap: int = MAX_SESSIONS_CAP) -> SessionLimit:
    """The limit: `configured` (DSPARK_MAX_SESSIONS) when given, else the memory rule of the
    module docstring over `available_bytes` (bytes), else FALLBACK_MAX_SESSIONS.

    Args:
        per_session_bytes: bytes of state one session holds (> 0).
        configured: an explicit limit (>= 1) or None.
        available_bytes: memory available to the process (bytes) or None (unknown).
        fraction: share of `available_bytes` given to session state, in (0, 1].
        cap: the most sessions the memory rule allows (>= 1).
    Raises:
        ValueError: a value outside its range (named), or `available_bytes` too small for
            one session (both figures named).
    """
    if isinstance(per_session_bytes, bool) or not isinstance(per_session_bytes, int) or per_session_bytes < 1:
        raise ValueError(f"per_session_bytes={per_session_bytes!r}: must be an integer >= 1")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction={fraction!r}: must lie in (0, 1]")
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ValueError(f"cap={cap!r}: must be an integer >= 1")
    if configured is not None:
        return SessionLimit(configured, per_session_bytes, f"DSPARK_MAX_SESSIONS={configured}")
    if available_bytes is None:
        return SessionLimit(FALLBACK_MAX_SESSIONS, per_session_bytes,
                            f"default {FALLBACK_MAX_SESSIONS} (available memory unknown)")
    fits = int(fraction * available_bytes) // per_session_bytes
    if fits < 1:
        raise ValueError(f"{fraction:g} of the {available_bytes} bytes of memory available holds no session of "
                         f"{per_session_bytes} bytes: free memory, or set DSPARK_MAX_SESSIONS")
    limit = min(cap, fits)
    return SessionLimit(limit, per_session_bytes,
                        f"memory: {fraction:g} x {available_bytes / 2**30:.1f} GiB available / "
                        f"{per_session_bytes / 2**20:.2f} MiB per session = {fits}, cap {cap}")
