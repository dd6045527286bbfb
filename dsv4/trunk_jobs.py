"""Trunk call checks: the state-machine and capacity checks of every `Trunk` call, and the
builders that turn a checked `BatchItem` into the forward loop's `Job`s.

Owns what `Trunk.forward_batch`, `prefill` and `rollback` check before any state changes
(integer scalars, a state that fits the model and has no open block, positions that continue
the state, max_seq_len, the numerics' block cap, undo records) and the ValueErrors that name
the bad value. It must not run a forward or change a state: `dsv4.batch.run_pass` runs the
jobs, `Trunk` owns the modules and commits. Request values a serving engine validates once
at its boundary (token ids in range) are only asserted here.

Dimension legend: S = tokens in an item.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol, Sequence

import torch
from torch import nn

from dsv4.batch import BatchItem, Job, prompt_pieces
from dsv4.config import ModelConfig
from dsv4.layers import Embedding
from dsv4.numerics import Call, FastNumerics
from dsv4.scalars import as_int, short_repr
from dsv4.trunk_state import BlockUndo, TrunkState


class CheckedTrunk(Protocol):
    """What these checks read of the model: `dsv4.trunk.Trunk` has it all. Named here as a
    protocol so that this module, which `dsv4.trunk` imports, never imports it back."""

    cfg: ModelConfig
    embed: Embedding
    layers: nn.ModuleList  # of `dsv4.trunk.Block`: `.attn.state_mismatch(layer_state)`
    numerics: FastNumerics

    @property
    def loaded(self) -> bool: ...

    @property
    def verify_numerics(self) -> str: ...


def id_tensor(model: CheckedTrunk, ids: Any) -> torch.Tensor:
    """ids (a 1-D integer tensor, or a list / tuple of ints) -> int64 [S] on the model's device.
    Request values were validated by the caller (the engine); here they are asserted
    invariants. Python ids are range-checked on the host before they cross; a tensor's values
    are not read (that would be a host sync in the step: dsv4.host_sync), only its shape and
    dtype, and the embedding lookup refuses an out-of-range id."""
    if torch.is_tensor(ids):
        t = ids
    else:
        values = [int(v) for v in ids]
        assert all(0 <= v < model.cfg.vocab_size for v in values), \
            f"token ids outside [0, vocab_size={model.cfg.vocab_size}): {short_repr(values)}"
        t = torch.tensor(values, dtype=torch.int64)
    assert t.ndim == 1 and t.numel() and not (t.is_floating_point() or t.dtype == torch.bool), \
        f"token ids must be a non-empty 1-D integer tensor, got {t.dtype} {tuple(t.shape)}"
    return t.to(device=model.embed.weight.device, dtype=torch.int64, non_blocking=True)


def check_state(model: CheckedTrunk, state: Any, open_block_ok: bool = False) -> None:
    """Loaded model, a state made by `model.new_state` (or one of the same shapes), and no open
    verify block unless `open_block_ok` (rollback).

    Raises:
        ValueError: not a TrunkState, a state that does not fit the model (layer named), an
            open verify block (its positions named).
        RuntimeError: weights not loaded.
    """
    if not isinstance(state, TrunkState):
        raise ValueError(f"state must be a TrunkState (model.new_state()), got {type(state).__name__}")
    if not model.loaded:
        raise RuntimeError("Trunk weights are not loaded: call load_weights first")
    if len(state.layers) != len(model.layers):
        raise ValueError(f"state has {len(state.layers)} layers, the model {len(model.layers)}: "
                         "use model.new_state()")
    if state._fits is None or state._fits() is not model:  # ~10 us per layer: once per (state, model)
        for i, (layer, st) in enumerate(zip(model.layers, state.layers)):
            problem = layer.attn.state_mismatch(st)
            if problem:
                raise ValueError(f"state does not fit this model: layer {i}: {problem}; use model.new_state()")
        state._fits = weakref.ref(model)
    block = state.open_block
    if block is not None and not open_block_ok:
        raise ValueError(f"state has an open verify block at positions {block.start_pos}.."
                         f"{block.start_pos + block.n_tokens - 1}: call rollback(state, undo, keep) first "
                         f"(keep={block.n_tokens} commits the whole block)")


def batch_jobs(model: CheckedTrunk, items: Sequence[BatchItem]) -> list[list[Job]]:
    """Check every item of a `forward_batch` (see there) and return each one's jobs, in order
    (a prompt chunk may be several pieces; a decode or verify block is one Job).

    Raises:
        ValueError: an empty batch, an item that is not a BatchItem, one state in two items,
            or an item's own problem (prefixed with its index when the batch has several).
        RuntimeError: weights not loaded.
    """
    if not items:
        raise ValueError("forward_batch needs at least one BatchItem, got none")
    groups, seen = [], set()
    for n, item in enumerate(items):
        if not isinstance(item, BatchItem):
            raise ValueError(f"forward_batch item {n}: {short_repr(item)} is not a BatchItem")
        if id(item.state) in seen:
            raise ValueError(f"forward_batch item {n}: its state is already in the batch (one item per session)")
        seen.add(id(item.state))
        try:
            groups.append(chunk_jobs(model, item) if item.prefill else
                          [block_job(model, item) if item.verify else decode_job(model, item)])
        except ValueError as e:
            raise ValueError(f"forward_batch item {n}: {e}" if len(items) > 1 else str(e)) from None
    return groups


def chunk_jobs(model: CheckedTrunk, item: BatchItem) -> list[Job]:
    """A prompt chunk's checks (see `BatchItem.prefill_chunk`) -> its jobs (`prompt_pieces`).
    Raises ValueError: start_pos off the state's next position, past max_seq_len, keep_rows < 0."""
    state = item.state
    check_state(model, state)
    start = as_int("prefill chunk start_pos", item.start_pos)
    ids = id_tensor(model, item.tokens)
    S = ids.shape[0]
    if start != state.next_position:
        raise ValueError(f"prefill chunk at start_pos={start} does not continue the state: "
                         f"next_position={state.next_position}")
    if start + S > model.cfg.max_seq_len:
        raise ValueError(f"prefill chunk of {S} tokens at {start} runs past max_seq_len={model.cfg.max_seq_len}")
    keep = None if item.keep_rows is None else as_int("keep_rows", item.keep_rows)
    if keep is not None and keep < 0:
        raise ValueError(f"keep_rows={keep}: must be >= 0")
    return prompt_pieces(state, start, ids, keep, model.numerics.prompt_tokens, item.all_logits)


def decode_job(model: CheckedTrunk, item: BatchItem) -> Job:
    """A decode item's checks (see `Trunk.decode`) -> its Job. Raises ValueError as `decode` does."""
    state = item.state
    check_state(model, state)
    position = as_int("decode position", item.start_pos)
    ids = id_tensor(model, [as_int("token_id", item.tokens)])
    if position != state.next_position:
        raise ValueError(f"decode position={position} does not match state.next_position="
                         f"{state.next_position}")
    if position >= model.cfg.max_seq_len:
        raise ValueError(f"decode position={position}: must be < max_seq_len={model.cfg.max_seq_len}")
    return Job(state, Call(position, 1), ids, 1, 1 if item.taps else None)


def block_job(model: CheckedTrunk, item: BatchItem) -> Job:
    """A verify block's checks (see `Trunk.forward_block`) -> its Job. Raises ValueError as
    `forward_block` does."""
    state = item.state
    check_state(model, state)
    start_pos = as_int("start_pos", item.start_pos)
    if start_pos != state.next_position or start_pos == 0:
        raise ValueError(f"verify block at start_pos={start_pos} needs a prefilled state at that "
                         f"position, got next_position={state.next_position}")
    ids = id_tensor(model, item.tokens)
    S, cap = ids.shape[0], model.numerics.max_tokens
    if start_pos + S > model.cfg.max_seq_len:
        raise ValueError(f"verify block of {S} tokens at {start_pos} runs past max_seq_len={model.cfg.max_seq_len}")
    if cap is not None and S > cap:
        raise ValueError(f"verify block of {S} tokens: {model.verify_numerics} mode verifies at most {cap} "
                         f"(k <= {cap - 1} drafts)")
    return Job(state, Call(start_pos, S, []), ids, S, S)


def check_rollback(model: CheckedTrunk, state: TrunkState, undo: Any, keep: Any) -> int:
    """`Trunk.rollback`'s checks; returns keep as an int. Changes nothing.

    Raises:
        ValueError: keep not an integer or outside [1, n_tokens]; undo not a BlockUndo, of
            another state, or stale; the state moved since the block; a state that does not
            fit the model.
        RuntimeError: weights not loaded.
    """
    check_state(model, state, open_block_ok=True)
    if not isinstance(undo, BlockUndo):
        raise ValueError(f"rollback: undo={short_repr(undo)} is not a BlockUndo (use forward_block(...).undo)")
    keep = as_int("rollback keep", keep)
    if not 1 <= keep <= undo.n_tokens:
        raise ValueError(f"rollback keep={keep}: must lie in [1, {undo.n_tokens}]")
    if undo.state_token is not state._token:
        raise ValueError("rollback: the undo record belongs to another state")
    if state.open_block is not undo:
        raise ValueError(f"rollback: stale undo record of the block at {undo.start_pos}..."
                         f"{undo.start_pos + undo.n_tokens - 1}: it was already rolled back, or the state "
                         "was reset (records are single use)")
    if state.next_position != undo.start_pos + undo.n_tokens:
        raise ValueError(f"rollback: state is at position {state.next_position}, the block ended at "
                         f"{undo.start_pos + undo.n_tokens}")
    return keep
