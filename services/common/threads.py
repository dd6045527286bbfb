"""Torch intra-op threads of the threads that run a model in a backend process.

A verifier or drafter runs its forwards off the main thread: on its step loop's thread
(`services.common.step_queue`) or on asyncio's worker threads (`asyncio.to_thread`). torch's
thread count is per calling thread, and a thread other than the main one starts with one
OpenMP worker per core. On the 2-core box that made every forward about twice as slow as the
same forward on the main thread: a decode of the bundled model took 40-43 ms on a second
thread with 2 workers against 19-22 ms with 1 worker on either thread (or 2 on the main one),
because its hundreds of small ops each wake and wait for the team (docs/services.md §5). So
each backend process sets the count once, from `DSPARK_TORCH_THREADS`, on every thread that
forwards: the main thread (before the model is built: exact numerics pins the count it finds
then), the step loop's thread and asyncio's default executor.

Owns only the thread count; it never decides where a forward runs.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import torch


def pin_torch_threads(n: int) -> None:
    """Set torch's intra-op threads for the calling thread to n (>= 1)."""
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def use_torch_threads(n: int, loop: asyncio.AbstractEventLoop) -> None:
    """Pin `n` intra-op threads on the calling thread and make `loop`'s default executor (what
    `asyncio.to_thread` uses) one whose threads pin `n` when they start; the loop shuts it
    down when it closes."""
    pin_torch_threads(n)
    loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix="model", initializer=pin_torch_threads,
                                                 initargs=(n,)))
