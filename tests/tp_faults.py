"""Fault injection for the TP verifier's worker processes (tests only).

`worker_faults(start_delays_s=..., stall=..., stall_batch=...)` substitutes the entry point
that `services.verifier.tp` spawns workers with, for the `start_tp_trunk` calls inside the
`with` block: a worker can start late (before joining the rendezvous), or sleep once on one
command, picked by its number or as the first batched step of at least so many sessions.
The substitute is a `functools.partial` of a module-level function, so it pickles into the
spawned processes (which import this module from the tests folder on sys.path).
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Callable, Iterator, Mapping

from services.verifier import tp
from services.verifier.tp_worker import worker_main


class _StallingConn:
    """A worker's pipe end that sleeps `seconds` after receiving the first command for which
    `when(number, message)` holds (numbers count from 0 after start-up; shutdown never stalls)."""

    def __init__(self, conn, when: Callable[[int, tuple], bool], seconds: float):
        self._conn, self._when, self._seconds = conn, when, seconds
        self._received, self._stalled = 0, False

    def recv(self):
        msg = self._conn.recv()
        if not self._stalled and msg[1] != "shutdown" and self._when(self._received, msg):
            self._stalled = True
            time.sleep(self._seconds)
        self._received += 1
        return msg

    def send(self, msg) -> None:
        self._conn.send(msg)


def _nth(command: int, number: int, msg: tuple) -> bool:
    return number == command


def _batch_of(min_items: int, number: int, msg: tuple) -> bool:
    """A "forward_batch" command (seq, op, handle, (items,), ...) of at least `min_items` items."""
    return msg[1] == "forward_batch" and len(msg[3][0]) >= min_items


def _faulty_worker_main(rank: int, spec, conn, delays: Mapping[int, float],
                        stall: tuple[int, int, float] | None,
                        stall_batch: tuple[int, int, float] | None = None) -> None:
    time.sleep(delays.get(rank, 0.0))
    if stall is not None and stall[0] == rank:
        conn = _StallingConn(conn, functools.partial(_nth, stall[1]), stall[2])
    elif stall_batch is not None and stall_batch[0] == rank:
        conn = _StallingConn(conn, functools.partial(_batch_of, stall_batch[1]), stall_batch[2])
    worker_main(rank, spec, conn)


@contextlib.contextmanager
def worker_faults(start_delays_s: Mapping[int, float] | None = None,
                  stall: tuple[int, int, float] | None = None,
                  stall_batch: tuple[int, int, float] | None = None) -> Iterator[None]:
    """Workers started inside the block sleep `start_delays_s[rank]` seconds before joining;
    worker `stall[0]` sleeps `stall[2]` seconds on receiving command number `stall[1]`, and
    worker `stall_batch[0]` sleeps `stall_batch[2]` seconds on its first "forward_batch" of at
    least `stall_batch[1]` items (one stall per worker: `stall` wins)."""
    saved = tp._worker_entry
    tp._worker_entry = functools.partial(_faulty_worker_main, delays=dict(start_delays_s or {}), stall=stall,
                                         stall_batch=stall_batch)
    try:
        yield
    finally:
        tp._worker_entry = saved
