"""Tensor-parallel trunk for the verifier: rank 0 drives tp-1 worker processes (docs/architecture.md §10).

Owns rank 0's side of tensor parallelism: starting the workers, forming the process group and
sending every trunk call to all ranks in one order; it never changes what a forward computes
(`dsv4.tp` shards the model) and never waits without a deadline.

`start_tp_trunk(cfg, weights, tp)` returns a plain loaded `Trunk` at tp=1 (no
torch.distributed, no processes) and otherwise a `TPTrunk`: a proxy with the Trunk's call
interface that `VerifierEngine` uses unchanged. Rank 0 (the calling process) owns the
sessions; every call is sent as an explicit command (op, state handle, args) to each
worker over a pipe, then run locally, so all ranks forward exactly the positions rank 0
forwards and issue the same collectives in the same order. Workers
(`services.verifier.tp_worker`) keep their own states keyed by handle and loop on commands
until `close()`.

`forward_batch` is one command too: rank 0 sends every worker the whole batch description
(per item its state handle and every other `BatchItem` field, in item order), and each rank
runs the same `Trunk.forward_batch` on its shard, so the verifier's step loop
(`services.verifier.batcher`) drives a TP trunk exactly as it drives a plain one: one
command and one set of collectives per step, whatever the number of sessions in it.

Start-up order (a short rendezvous loses ranks while rank 0 loads 167 GB, docs/architecture.md
§12): rank 0 opens a TCP store, spawns the workers, every rank announces itself in the store
and waits for the others (bounded by `DSPARK_TP_INIT_TIMEOUT_S`, default 600 s), the process
group is created, and only then does each rank load and shard its weights; rank 0 waits for
every worker's "ready" within the same init deadline. The process side of that order, with
`TPWorkerError`, is `services.verifier.tp_start`'s; `TPSettings` is `services.verifier.tp_worker`'s
(every rank is built with it); both are re-exported here.

Failure policy: each collective fails after `DSPARK_TP_CALL_TIMEOUT_S` (default 120 s, the
process group's op timeout), a dead peer fails it at once (gloo sees the closed socket),
and rank 0 watches the worker processes while it waits for their acknowledgements. A dead,
stalled or diverging worker raises `TPWorkerError` on rank 0 within about the call timeout,
never a hang; the proxy is then unusable (every call raises) until closed.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
import weakref
from multiprocessing.connection import wait as wait_ready
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from dsv4 import tp as dtp
from dsv4.batch import BatchItem
from dsv4.checkpoint import read_config, stream_trunk_weights
from dsv4.config import ModelConfig
from dsv4.trunk import BlockOutput, ForwardOutput, Trunk, TrunkState
from services.verifier.tp_start import (ENV_CALL_TIMEOUT, ENV_INIT_TIMEOUT, TPSettings, TPWorkerError, Worker,
                                        spawn_workers, start_rank0, stop_workers)
from services.verifier.tp_worker import RankSpec, send, worker_main
from kernels.select import KernelConfig
from services.verifier.topk_diag import TopKDiagSettings

log = logging.getLogger("dspark.verifier.tp")

# The settings, errors and variable names are imported from here by services.settings, the app and tests.
__all__ = ["ENV_CALL_TIMEOUT", "ENV_INIT_TIMEOUT", "TPSettings", "TPState", "TPTrunk", "TPWorkerError",
           "start_tp_trunk"]

ACK_GRACE_S = 1.0  # extra wait for acks after rank 0's own part failed at the deadline


# ---------------------------------------------------------------------------- rank 0
class TPState(TrunkState):
    """Rank 0's state of one sequence; `handle` names the workers' copies.

    Dropping the last reference frees the workers' copies at the next command; `reset()`
    resets every rank's copy.
    """

    def __init__(self, local: TrunkState, handle: int, driver: "TPTrunk"):
        super().__init__(local.layers)
        self.handle = handle
        self._driver = weakref.ref(driver)

    def reset(self) -> None:
        """Reset every rank's copy. Raises TPWorkerError when the TPTrunk that made it is gone."""
        driver = self._driver()
        if driver is None:
            raise TPWorkerError("the TPTrunk that made this state is gone")
        driver.reset_state(self)


class TPTrunk:
    """Rank 0's proxy over a `tp`-rank sharded trunk, with the `Trunk` call interface
    (cfg, new_state, prefill, decode, forward_block, forward_batch, rollback, state_bytes).
    Build it with `start_tp_trunk`. Calls are serialised (one lock); each is broadcast to the
    workers and returns rank 0's result. `state_bytes` is per rank (every rank holds a full
    copy of the state). Thread safe; use as a context manager or call `close()`.
    """

    def __init__(self, model: Trunk, workers: list[Worker], store, settings: TPSettings, plan: dtp.ShardPlan):
        self.model, self.cfg, self.plan, self.settings = model, model.cfg, plan, settings
        self.tp = plan.world_size
        self._workers, self._store = workers, store
        self._lock = threading.Lock()
        self._handles = itertools.count(1)
        self._seq = itertools.count()
        self._pending_free: list[int] = []  # handles of collected states (appended by finalizers)
        self._undo: dict[int, Any] = {}  # handle -> undo of its latest forward_block
        self._broken: str | None = None
        self._closed = False
        # called once, with the reason, when the trunk becomes unusable (a dead, stalled or
        # diverging worker; not close()): the verifier turns its health NOT_SERVING with it,
        # so a probe or load balancer stops sending requests it can only refuse
        self.on_broken: Callable[[str], None] | None = None

    # ------------------------------------------------------------------ Trunk interface
    def new_state(self) -> TPState:
        """A fresh state on every rank."""
        st = TPState(self.model.new_state(), next(self._handles), self)
        self._call("new_state", st, (), {}, lambda: None)
        weakref.finalize(st, self._pending_free.append, st.handle)
        return st

    def reset_state(self, state: TPState) -> None:
        """Reset `state` on every rank (what `state.reset()` calls)."""
        self._call("reset", state, (), {}, lambda: TrunkState.reset(state))

    def free_state(self, state: TPState) -> None:
        """Free the workers' copies now (dropping the state does it lazily); `state` is then empty."""
        self._check(state)
        self._pending_free.append(state.handle)
        self._call("stats", None, (), {}, lambda: None)
        state.layers = []

    def prefill(self, state: TPState, token_ids, keep_rows: int | None = None, taps: bool = True) -> ForwardOutput:
        """`Trunk.prefill` on every rank; returns rank 0's output."""
        ids = torch.as_tensor(token_ids).cpu()
        return self._call("prefill", state, (ids,), {"keep_rows": keep_rows, "taps": False},
                          lambda: self.model.prefill(state, ids, keep_rows, taps))

    def decode(self, state: TPState, token_id, position: int, taps: bool = True) -> ForwardOutput:
        """`Trunk.decode` on every rank; returns rank 0's output."""
        tok = token_id.cpu() if torch.is_tensor(token_id) else token_id
        return self._call("decode", state, (tok, position), {"taps": False},
                          lambda: self.model.decode(state, tok, position, taps))

    def forward_block(self, state: TPState, token_ids, start_pos: int) -> BlockOutput:
        """`Trunk.forward_block` on every rank; each rank keeps its own undo record."""
        ids = torch.as_tensor(token_ids).cpu()
        out = self._call("forward_block", state, (ids, start_pos), {},
                         lambda: self.model.forward_block(state, ids, start_pos))
        self._undo[state.handle] = out.undo
        return out

    def forward_batch(self, items: Sequence[BatchItem]) -> list[ForwardOutput | BlockOutput]:
        """`Trunk.forward_batch` on every rank: the decodes and verify blocks of several states
        (TPStates of this trunk) in one pass and one command; returns rank 0's outputs.

        Per item, in order, a decode's ForwardOutput (logits [V] fp32, taps [1, T*D] fp32 or
        None) or a verify block's BlockOutput (logits and taps [S, V] / [S, T*D] fp32, the block
        left open on every rank: `rollback` closes it), as `Trunk.forward_batch` documents.
        Raises:
            ValueError: an empty batch, an item that is not a BatchItem or whose state is not
                this trunk's (its index named; nothing is sent to the workers), or what
                `Trunk.forward_batch` raises on every rank alike (the ranks still agree: the
                trunk stays usable).
            TPWorkerError: a worker died, stalled past the call timeout or disagreed; every
                item of the batch is lost and the trunk is unusable until closed.
        """
        if not items:
            raise ValueError("forward_batch needs at least one BatchItem, got none")
        wire = [self._wire_item(n, item) for n, item in enumerate(items)]
        outs = self._call("forward_batch", None, (wire,), {}, lambda: self.model.forward_batch(items))
        for item, out in zip(items, outs):
            if isinstance(out, BlockOutput):  # the workers keep theirs by the same handle
                self._undo[item.state.handle] = out.undo
        return outs

    def _wire_item(self, n: int, item: Any) -> tuple[int, dict[str, Any]]:
        """Item `n` as the workers rebuild it: (state handle, every other BatchItem field, tensors
        on the CPU). Every field travels, so a worker's item is rank 0's whatever fields it has."""
        if not isinstance(item, BatchItem):
            raise ValueError(f"forward_batch item {n}: {type(item).__name__} is not a BatchItem")
        if not isinstance(item.state, TPState) or item.state._driver() is not self:
            raise ValueError(f"forward_batch item {n}: its state does not belong to this TPTrunk: use its new_state()")
        return item.state.handle, {f.name: _on_cpu(getattr(item, f.name)) for f in dataclasses.fields(item)
                                   if f.name != "state"}

    def rollback(self, state: TPState, undo, keep: int, ring: bool = True, compressor: bool = True) -> int:
        """`Trunk.rollback` on every rank; returns rank 0's bytes copied.

        Raises:
            ValueError: `undo` is not the latest `forward_block` record of `state`.
        """
        self._check(state)
        if self._undo.get(state.handle) is not undo:
            raise ValueError("rollback: undo is not the latest forward_block record of this state")
        copied = self._call("rollback", state, (keep,), {"ring": ring, "compressor": compressor},
                            lambda: self.model.rollback(state, undo, keep, ring, compressor))
        del self._undo[state.handle]  # only once it succeeded, as on the workers
        return copied

    def state_bytes(self, state: TPState) -> int:
        """Bytes of `state` on one rank (each of the tp ranks holds as much)."""
        return self.model.state_bytes(state)

    @property
    def verify_numerics(self) -> str:
        """The ranks' verify numerics ("fast" or "exact"; every rank is built alike)."""
        return self.model.verify_numerics

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the workers, rank order (ranks 1..tp-1)."""
        return [w.proc.pid for w in self._workers]

    def worker_stats(self) -> list[dict]:
        """Per worker: {"states": live states} (after applying pending frees)."""
        return self._call("stats", None, (), {}, lambda: None, payloads=True)

    # ------------------------------------------------------------------ lifecycle
    def close(self, timeout_s: float = 5.0) -> None:
        """Shut the workers down (terminate them if they do not exit within `timeout_s`). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._broken = self._broken or "closed"
        for w in self._workers:
            send(w.conn, (-1, "shutdown", 0, (), {}, []))
        deadline = time.monotonic() + timeout_s
        for w in self._workers:
            w.proc.join(max(0.0, deadline - time.monotonic()))
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(timeout_s)
            w.conn.close()
        self.model = None  # drops rank 0's process group with the modules that hold it

    def __enter__(self) -> "TPTrunk":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the command path
    def _check(self, state) -> None:
        if not isinstance(state, TPState) or state._driver() is not self:
            raise ValueError("state does not belong to this TPTrunk: use its new_state()")

    def _call(self, op: str, state: TPState | None, args: tuple, kwargs: dict, local: Callable[[], Any],
              payloads: bool = False):
        """Broadcast one command, run it on rank 0, collect every worker's acknowledgement."""
        if state is not None:
            self._check(state)
        with self._lock:
            if self._broken is not None:
                raise TPWorkerError(f"TP trunk unusable: {self._broken}")
            frees = []
            while self._pending_free:  # pop() is atomic: finalizers may append meanwhile
                frees.append(self._pending_free.pop())
            for h in frees:
                self._undo.pop(h, None)
            seq, start = next(self._seq), time.monotonic()
            msg = (seq, op, state.handle if state is not None else 0, args, kwargs, frees)
            for w in self._workers:
                if not send(w.conn, msg):
                    self._fail(self._describe(w, op, dead=True))
            try:
                result, local_error = local(), None
                self._sync(op, start)
            except TPWorkerError:
                raise
            except Exception as e:  # a collective that failed because a peer died or stalled lands here too
                result, local_error = None, e
            except BaseException:  # interrupted mid-call: the workers may be inside a collective
                self._break(f"{op!r} was interrupted on rank 0")
                raise
            acks = self._collect(op, seq, start, local_error)
            errors = [(w.rank, text) for w, (kind, text) in zip(self._workers, acks) if kind == "error"]
            if _agreed(local_error, errors, len(self._workers)):
                raise local_error  # the same validation error everywhere: the ranks still agree
            if local_error is not None or errors:
                where = f"rank 0: {type(local_error).__name__}: {local_error}" if local_error else "rank 0 ok"
                self._fail(f"ranks disagree on {op!r} ({where}; workers: {errors or 'ok'})", local_error)
            return [text for _, text in acks] if payloads else result

    def _sync(self, op: str, start: float) -> None:
        """On CUDA, wait for rank 0's queued kernels (NCCL collectives are asynchronous) while
        watching the workers, so a stalled peer raises here instead of in the caller's sync."""
        if self.model.embed.weight.device.type != "cuda":
            return
        event = torch.cuda.Event()
        event.record()
        while not event.query():
            self._watch(op, start)
            time.sleep(0.001)

    def _watch(self, op: str, start: float) -> None:
        for w in self._workers:
            if not w.proc.is_alive():
                self._fail(self._describe(w, op, dead=True))
        if time.monotonic() - start > self.settings.call_timeout_s:
            self._fail(f"rank 0 did not finish {op!r} within {self.settings.call_timeout_s:g} s ({ENV_CALL_TIMEOUT})")

    def _collect(self, op: str, seq: int, start: float, local_error: Exception | None) -> list[tuple[str, Any]]:
        """Every worker's (kind, payload) for command `seq`; raises TPWorkerError on a dead or
        silent worker (deadline: the call timeout from `start`, at least ACK_GRACE_S from now)."""
        deadline = max(start + self.settings.call_timeout_s, time.monotonic() + ACK_GRACE_S)
        acks: dict[int, tuple[str, Any]] = {}
        while len(acks) < len(self._workers):
            waiting = [w for w in self._workers if w.rank not in acks]
            ready = wait_ready([w.conn for w in waiting] + [w.proc.sentinel for w in waiting],
                               max(0.0, deadline - time.monotonic()))
            for w in waiting:
                if w.conn in ready:
                    try:
                        got_seq, kind, payload = w.conn.recv()
                    except (EOFError, OSError):  # the worker's end closed: it exited
                        self._fail(self._describe(w, op, dead=True), local_error)
                    if got_seq == seq:
                        acks[w.rank] = (kind, payload)
                elif w.proc.sentinel in ready:
                    self._fail(self._describe(w, op, dead=True), local_error)
            if not ready:
                late = next(w for w in self._workers if w.rank not in acks)
                self._fail(self._describe(late, op, dead=False), local_error)
        return [acks[w.rank] for w in self._workers]

    def _describe(self, w: Worker, op: str, dead: bool) -> str:
        if dead or not w.proc.is_alive():
            w.proc.join(1.0)
            return f"TP worker rank {w.rank} (pid {w.proc.pid}) died with exit code {w.proc.exitcode} during {op!r}"
        return (f"TP worker rank {w.rank} (pid {w.proc.pid}) did not finish {op!r} within "
                f"{self.settings.call_timeout_s:g} s ({ENV_CALL_TIMEOUT}); it is alive but stalled")

    def _break(self, why: str) -> None:
        """Mark the trunk unusable (every later call raises) and tell `on_broken`, once."""
        first = self._broken is None
        self._broken = self._broken or why
        if first and self.on_broken is not None:
            try:
                self.on_broken(why)
            except Exception:  # a reporting hook must not mask the worker's failure
                log.exception("TP trunk: on_broken hook failed")

    def _fail(self, why: str, cause: BaseException | None = None):
        self._break(why)
        raise TPWorkerError(why + "; the TP trunk is unusable now: close() it and start a new one") from cause


def _agreed(local_error: Exception | None, errors: list[tuple[int, str]], workers: int) -> bool:
    """Whether every rank rejected a command with the same validation error (a ValueError raised
    before any state or collective changed). A failed collective also fails every rank, but
    with different texts, and leaves the ranks out of step: that is a disagreement."""
    if not isinstance(local_error, ValueError) or len(errors) != workers:
        return False
    text = f"{type(local_error).__name__}: {local_error}"
    return all(t == text for _, t in errors)


def _on_cpu(value: Any) -> Any:
    """A tensor moved to the CPU (what pickles to a worker on any device); anything else as is."""
    return value.cpu() if torch.is_tensor(value) else value


# ---------------------------------------------------------------------------- start-up
def start_tp_trunk(cfg: ModelConfig | None, weights: Mapping[str, torch.Tensor] | str | Path, tp: int,
                   dtype: torch.dtype = torch.float32, *, quant_sim: bool | None = None,
                   deterministic_reduce: bool | None = None, device: str = "cpu",
                   settings: TPSettings | None = None, strict: bool = False, num_threads: int | None = None,
                   topk: TopKDiagSettings | None = None, kernels: KernelConfig | None = None) -> Trunk | TPTrunk:
    """Start the trunk on `tp` ranks and return what `VerifierEngine(model)` takes.

    Args:
        cfg: model config; None reads it from the checkpoint folder `weights`.
        weights: logical weights (name -> tensor, `trunk_params` names) or a checkpoint folder
            that every rank streams itself, straight onto its device, one decoded tensor at a
            time cut to its shard (`tp_worker.build_rank`): no rank holds the whole model.
        tp: ranks; 1 returns a loaded plain `Trunk` (no processes, no torch.distributed).
        device: "cpu" (gloo) or "cuda" (NCCL, rank r on cuda:r).
        settings: timeouts; default `TPSettings()`.
        strict: raise instead of replicating a part whose size tp does not divide
            (`dsv4.tp.plan_sharding`).
        num_threads: torch intra-op threads per worker (default: this process's count).
        topk: at tp > 1 every rank dumps its top-k logits (`topk_diag.maybe_wrap`); None = off.
        kernels: the `kernels/` implementations every rank's trunk uses (None = torch).
    Raises:
        ValueError: tp < 1, bad device, cfg None with weights not a path, an invalid
            DSPARK_TP_* variable (named), or (strict) a size tp does not divide.
        TPWorkerError: a worker failed to start, died, or did not join and load within
            the init timeout (`DSPARK_TP_INIT_TIMEOUT_S`).
    """
    settings = TPSettings() if settings is None else settings
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r}: must be an integer >= 1")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: must be 'cpu' or 'cuda'")
    if isinstance(weights, Path):
        weights = str(weights)
    if cfg is None:
        if not isinstance(weights, str):
            raise ValueError("cfg=None needs weights to be a checkpoint folder")
        cfg = read_config(weights)
    if tp == 1:
        model = Trunk(cfg, dtype, quant_sim, deterministic_reduce, device=device, kernels=kernels)
        if isinstance(weights, str):  # one decoded tensor at a time, onto the device: no host copy
            model.load_streamed(stream_trunk_weights(weights, cfg, dtype, device=model.embed.weight.device)[1])
        else:
            model.load_weights(weights)
        return model
    if device == "cuda" and torch.cuda.device_count() < tp:
        raise ValueError(f"tp={tp} needs {tp} CUDA devices, found {torch.cuda.device_count()}")
    plan = dtp.plan_sharding(cfg, tp, quant_sim, strict)
    store, port = dtp.create_store(tp, settings.init_timeout_s)
    spec = RankSpec(cfg, weights, plan, dtype, quant_sim, deterministic_reduce,
                     "nccl" if device == "cuda" else "gloo", port, settings,
                     num_threads or torch.get_num_threads(), topk, kernels)
    workers = spawn_workers(spec, _worker_entry)
    try:
        model = start_rank0(spec, store, workers)
    except BaseException:
        stop_workers(workers)  # no proxy yet: stop the workers directly
        raise
    return TPTrunk(model, workers, store, settings, plan)


# What each spawned worker runs: called as _worker_entry(rank, spec, conn). A module-level
# name (not a parameter) so tests can substitute a picklable wrapper that injects late starts
# and stalls without production signatures carrying those knobs.
_worker_entry: Callable[[int, RankSpec, Any], None] = worker_main
