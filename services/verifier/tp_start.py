"""Tensor-parallel start-up on rank 0: the worker processes, and the wait until every rank
has joined the process group and loaded its shard (docs/architecture.md §10).

Owns `TPWorkerError`, spawning the tp-1 worker processes (each gets one pipe to rank 0),
rank 0's side of the start-up order (announce in the store, wait for every rank to join
within the init deadline of `TPSettings`, form the group, load rank 0's shard, wait for
every worker's "ready") and stopping workers when start-up fails. It must not proxy trunk calls
(`services.verifier.tp.TPTrunk` does, over the workers started here), shard the model
(`dsv4.tp`) or run a worker's side (`services.verifier.tp_worker`), and it never waits
without a deadline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch.multiprocessing as mp

from dsv4 import tp as dtp
from dsv4.trunk import Trunk
from services.verifier.tp_worker import (ENV_CALL_TIMEOUT, ENV_INIT_TIMEOUT, RankSpec,  # noqa: F401 (re-exported)
                                        TPSettings, build_rank, rendezvous)

POLL_S = 0.05  # liveness poll while waiting for the store rendezvous (s)


class TPWorkerError(RuntimeError):
    """A TP worker died, stalled, failed to start or diverged from rank 0; the `TPTrunk` is
    unusable afterwards (close it and start a new one)."""


@dataclass
class Worker:
    """One worker process as rank 0 sees it: its rank (1..tp-1), the process and rank 0's end
    of its pipe (commands out, acknowledgements back)."""

    rank: int
    proc: Any
    conn: Any


def spawn_workers(spec: RankSpec, entry: Callable[[int, RankSpec, Any], None]) -> list[Worker]:
    """Start ranks 1..world_size-1 as spawned daemon processes running entry(rank, spec, conn);
    returns them in rank order. Does not wait for them (`start_rank0` does)."""
    ctx = mp.get_context("spawn")
    workers = []
    for rank in range(1, spec.plan.world_size):
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=entry, args=(rank, spec, theirs), daemon=True, name=f"dsv4-tp-rank{rank}")
        proc.start()
        theirs.close()
        workers.append(Worker(rank, proc, ours))
    return workers


def start_rank0(spec: RankSpec, store, workers: list[Worker]) -> Trunk:
    """Rendezvous (watching the workers), group, load rank 0, then wait for every "ready";
    returns rank 0's loaded trunk shard.

    Raises:
        TPWorkerError: a worker exited (its exit code and last message named), a rank did not
            join or a worker did not load within `spec.settings.init_timeout_s`, or a worker
            reported a start-up failure.
    """
    deadline = time.monotonic() + spec.settings.init_timeout_s
    dtp.mark_joined(store, 0)
    while missing := dtp.missing_ranks(store, spec.plan.world_size):
        _check_starting(workers, "joining")
        if time.monotonic() > deadline:
            raise TPWorkerError(f"TP ranks {missing} did not join within {spec.settings.init_timeout_s:g} s "
                                f"({ENV_INIT_TIMEOUT})")
        time.sleep(POLL_S)
    try:
        model = build_rank(spec, rendezvous(store, spec, 0))
    except Exception:
        _check_starting(workers, "creating the process group")  # name a dead worker if there is one
        raise
    for w in workers:
        while not w.conn.poll(POLL_S):
            _check_starting([w], "loading")
            if time.monotonic() > deadline:
                raise TPWorkerError(f"TP worker rank {w.rank} did not load its weights within "
                                    f"{spec.settings.init_timeout_s:g} s ({ENV_INIT_TIMEOUT})")
        kind, text = w.conn.recv()
        if kind != "ready":
            raise TPWorkerError(f"TP worker rank {w.rank} failed to start:\n{text}")
    return model


def _check_starting(workers: list[Worker], phase: str) -> None:
    """Raise TPWorkerError naming the first worker that has exited during `phase`."""
    for w in workers:
        if not w.proc.is_alive():
            text = w.conn.recv()[1] if w.conn.poll() else "no message"
            raise TPWorkerError(f"TP worker rank {w.rank} (pid {w.proc.pid}) exited with code "
                                f"{w.proc.exitcode} while {phase}: {text}")


def stop_workers(workers: list[Worker]) -> None:
    """Kill the workers of a failed start-up and close their pipes (join bounded at 5 s each)."""
    for w in workers:
        if w.proc.is_alive():
            w.proc.kill()
        w.proc.join(5.0)
        w.conn.close()
