"""The worker side of the tensor-parallel verifier trunk: what ranks 1..tp-1 run.

This module owns one rank's life (and `TPSettings`, the timeouts every rank is built with): join the rendezvous, load and shard its part of the
trunk, report "ready", then execute rank 0's commands (op, state handle, args) against its
own states until shutdown. It also holds the description of a rank (`RankSpec`) and the
shard build that rank 0 shares. It never decides anything: rank 0
(`services.verifier.tp.TPTrunk`) orders every command, and a worker only answers
"ok" / "error" per command so rank 0 can tell agreement from divergence.

Pipe protocol (rank 0 -> worker): (seq, op, handle, args, kwargs, frees); the worker drops
the states named in `frees`, runs `op` and replies (seq, "ok" | "error", payload). A
"forward_batch" names no single state: its one argument lists, in item order, (handle,
fields) per item, `fields` being every `BatchItem` field but the state; the worker rebuilds
the items on its own states and runs the same batched forward as rank 0.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import torch

from dsv4 import tp as dtp
from dsv4.checkpoint import stream_trunk_weights
from dsv4.config import ModelConfig
from dsv4.batch import BatchItem
from dsv4.trunk import BlockOutput, Trunk, TrunkState

if TYPE_CHECKING:
    from kernels.select import KernelConfig
    from services.verifier.topk_diag import TopKDiagSettings

ENV_INIT_TIMEOUT = "DSPARK_TP_INIT_TIMEOUT_S"  # the variables of TPSettings, named in its errors
ENV_CALL_TIMEOUT = "DSPARK_TP_CALL_TIMEOUT_S"


@dataclass(frozen=True)
class TPSettings:
    """TP timeouts in seconds (`services.settings`: `DSPARK_TP_INIT_TIMEOUT_S`, `DSPARK_TP_CALL_TIMEOUT_S`).

    init_timeout_s: rendezvous plus weight loading of every rank.
    call_timeout_s: one proxied call (the process group's per-collective timeout).
    Raises:
        ValueError: a value that is not a finite number > 0 (naming the field).
    """

    init_timeout_s: float = 600.0
    call_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("init_timeout_s", "call_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name}={value!r}: must be a finite number of seconds > 0")


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to build its shard (pickled to the workers).

    weights: logical weights (name -> tensor) or a checkpoint folder each rank reads itself.
    backend: "gloo" (CPU) or "nccl" (rank r on cuda:r).
    port: the rendezvous TCP store's port on this host.
    settings: the TP timeouts (init and per call, seconds).
    num_threads: torch intra-op threads of the rank.
    topk: the rank's top-k logit dumps (None = off); kernels: its `kernels/` implementations.
    """

    cfg: ModelConfig
    weights: Mapping[str, torch.Tensor] | str
    plan: dtp.ShardPlan
    dtype: torch.dtype
    quant_sim: bool | None
    deterministic_reduce: bool | None
    backend: str
    port: int
    settings: TPSettings
    num_threads: int
    topk: "TopKDiagSettings | None" = None
    kernels: "KernelConfig | None" = None

    def device(self, rank: int) -> torch.device:
        """Where `rank`'s shard lives."""
        return torch.device("cuda", rank) if self.backend == "nccl" else torch.device("cpu")


def build_rank(spec: RankSpec, comm: dtp.Collectives) -> Trunk:
    """Load and shard this rank's trunk on `spec.device(rank)`.

    A checkpoint path is streamed by every rank itself, straight onto its device, one decoded
    tensor at a time (`stream_trunk_weights`, decoded to `spec.dtype`), each cut to the rank's
    part and copied in (`dtp.build_rank_trunk`); other ranks' experts are never read. So a
    rank's peak is its shard plus one decoded tensor, on its device: no host copy of the model.
    Raises whatever loading raises (a missing or mismatched checkpoint: ValueError / OSError).
    """
    weights = spec.weights
    if isinstance(weights, str):
        def mine(name: str) -> bool:  # not another rank's expert
            return dtp.shard_name(spec.cfg, spec.plan, comm.rank, name) is not None

        _, weights = stream_trunk_weights(weights, spec.cfg, dtype=spec.dtype, device=spec.device(comm.rank),
                                          select=mine)
    from services.verifier.topk_diag import maybe_wrap  # DSPARK_TOPK_DIAG: one dump file per rank
    return maybe_wrap(dtp.build_rank_trunk(spec.cfg, weights, comm, spec.plan, spec.dtype, spec.quant_sim,
                                           spec.deterministic_reduce, spec.device(comm.rank), spec.kernels),
                      spec.topk, comm.rank)


def rendezvous(store, spec: RankSpec, rank: int) -> dtp.Collectives:
    """Join `rank` to the process group (collectives time out after the call timeout)."""
    return dtp.connect(store, rank, spec.plan.world_size, spec.backend, spec.settings.call_timeout_s,
                       spec.device(rank))


def send(conn, msg) -> bool:
    """Send `msg` on a pipe end; False when the other end is gone (never raises for that)."""
    try:
        conn.send(msg)
        return True
    except (OSError, EOFError):  # the peer is gone
        return False


def worker_main(rank: int, spec: RankSpec, conn) -> None:
    """Entry point of worker `rank` (a spawned process): join, build, answer "ready", then
    serve commands on `conn` until shutdown or until rank 0's end of the pipe closes.

    A start-up failure is reported to rank 0 as ("error", traceback) instead of raised.
    """
    try:
        torch.set_num_threads(spec.num_threads)
        store = dtp.join_store(spec.port, spec.plan.world_size, spec.settings.init_timeout_s)
        dtp.mark_joined(store, rank)
        dtp.wait_joined(store, spec.plan.world_size)
        model = build_rank(spec, rendezvous(store, spec, rank))
    except BaseException:  # report any start-up failure to rank 0, then exit
        send(conn, ("error", traceback.format_exc(limit=4)))
        return
    if send(conn, ("ready", None)):
        _serve(model, conn)


def _serve(model: Trunk, conn) -> None:
    states: dict[int, TrunkState] = {}
    undos: dict[int, Any] = {}
    while True:
        try:
            seq, op, handle, args, kwargs, frees = conn.recv()
        except (EOFError, OSError):  # rank 0 exited: nothing left to serve
            return
        for h in frees:
            states.pop(h, None)
            undos.pop(h, None)
        if op == "shutdown":
            send(conn, (seq, "ok", None))
            return
        try:
            payload = _run(model, states, undos, op, handle, args, kwargs)
            reply = (seq, "ok", payload)
        except Exception as e:  # the same error on rank 0 is expected; rank 0 compares
            reply = (seq, "error", f"{type(e).__name__}: {e}")
        if not send(conn, reply):
            return


def _run(model: Trunk, states: dict, undos: dict, op: str, handle: int, args: tuple, kwargs: dict):
    """One command on a worker; returns a small payload (only "stats" has one)."""
    if op == "new_state":
        states[handle] = model.new_state()
    elif op == "reset":
        states[handle].reset()
    elif op == "prefill":
        model.prefill(states[handle], *args, **kwargs)
    elif op == "decode":
        model.decode(states[handle], *args, **kwargs)
    elif op == "forward_block":
        undos[handle] = model.forward_block(states[handle], *args).undo
    elif op == "forward_batch":
        _forward_batch(model, states, undos, *args)
    elif op == "rollback":
        model.rollback(states[handle], undos[handle], *args, **kwargs)
        del undos[handle]  # only once it succeeded: a rejected keep leaves the block undoable
    elif op == "stats":
        return {"states": len(states)}
    else:
        raise ValueError(f"unknown TP command {op!r}")
    return None


def _forward_batch(model: Trunk, states: dict, undos: dict, wire: list[tuple[int, dict]]) -> None:
    """Rank 0's batch on this rank's states: `wire` holds (handle, BatchItem fields but the
    state) per item, in rank 0's item order, so the pass and its collectives are rank 0's.
    Keeps each verify block's undo record by its handle, as "forward_block" does.

    Raises:
        KeyError: a handle this worker does not hold (rank 0 then reports the ranks disagree).
        ValueError: what `Trunk.forward_batch` raises (rank 0 raises the same).
    """
    items = [BatchItem(state=states[h], **fields) for h, fields in wire]
    for (h, _), out in zip(wire, model.forward_batch(items)):
        if isinstance(out, BlockOutput):
            undos[h] = out.undo
