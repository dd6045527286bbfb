"""Fault injection for the TP verifier's worker processes (tests only).

`worker_faults(start_delays_s=..., stall=...)` substitutes the entry point that
`services.verifier.tp` spawns workers with, for the `start_tp_trunk` calls inside the
`with` block: a worker can start late (before joining the rendezvous) or sleep on one
command. The substitute is a `functools.partial` of a module-level function, so it pickles
into the spawned processes (which import this module from the tests folder on sys.path).
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Iterator, Mapping

from services.verifier import tp
from services.verifier.tp_worker import worker_main


class _StallingConn:
    """A worker's pipe end that sleeps `seconds` after receiving command number `command`
    (counted from 0 after start-up; shutdown never stalls)."""

    def __init__(self, conn, command: int, seconds: float):
        self._conn, self._command, self._seconds, self._received = conn, command, seconds, 0

    def recv(self):
        msg = self._conn.recv()
        if self._received == self._command and msg[1] != "shutdown":
            time.sleep(self._seconds)
        self._received += 1
        return msg

    def send(self, msg) -> None:
        self._conn.send(msg)


def _faulty_worker_main(rank: int, spec, conn, delays: Mapping[int, float],
                        stall: tuple[int, int, float] | None) -> None:
    time.sleep(delays.get(rank, 0.0))
    if stall is not None and stall[0] == rank:
        conn = _StallingConn(conn, stall[1], stall[2])
    worker_main(rank, spec, conn)


@contextlib.contextmanager
def worker_faults(start_delays_s: Mapping[int, float] | None = None,
                  stall: tuple[int, int, float] | None = None) -> Iterator[None]:
    """Workers started inside the block sleep `start_delays_s[rank]` seconds before joining,
    and worker `stall[0]` sleeps `stall[2]` seconds on receiving command `stall[1]`."""
    saved = tp._worker_entry
    tp._worker_entry = functools.partial(_faulty_worker_main, delays=dict(start_delays_s or {}), stall=stall)
    try:
        yield
    finally:
        tp._worker_entry = saved
