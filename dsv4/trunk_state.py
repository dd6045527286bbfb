"""Per-sequence trunk state and the records of one forward: `TrunkState`, `BlockUndo`,
`BlockOutput`, `ForwardOutput`. This module owns the data a forward leaves behind (rings, compressor states, the open
verify block) and nothing that computes: `dsv4.trunk.Trunk` runs the forwards, checks the
protocol and fills these records.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from dsv4.attention import AttentionState, AttentionUndo


class TrunkState:
    """Per-sequence trunk state: one `AttentionState` per layer (ring, compressor and indexer
    states, compressed caches) and `next_position`, the position the next token takes.
    Several states can be used with one model side by side.

    `open_block` is the `BlockUndo` of a verify block (`Trunk.forward_block`) that has not
    been closed by `Trunk.rollback` yet, else None. While a block is open the state takes no
    other forward (see `Trunk`).
    """

    def __init__(self, layers: list[AttentionState]):
        self.layers = layers
        self.next_position = 0
        self.open_block: BlockUndo | None = None
        self._token = object()  # identity every undo record of this state is bound to
        self._fits: weakref.ref | None = None  # the model whose shape check this state passed

    def reset(self) -> None:
        """Back to empty: rings and caches zeroed, compressor kv 0 / scores -inf, next_position 0,
        no open block (an outstanding undo record becomes unusable)."""
        for st in self.layers:
            st.reset()
        self.next_position = 0
        self.open_block = None


@dataclass(frozen=True, eq=False)
class BlockUndo:
    """Everything a verify block changed in a `TrunkState`: its positions and one
    `AttentionUndo` per layer (ring slots, compressor and indexer journals).

    Single use and bound to the state that made it: `state_token` is that state's identity,
    and the state's `open_block` is this record until `Trunk.rollback` consumes it.
    """

    start_pos: int
    n_tokens: int
    layers: list[AttentionUndo]
    state_token: object = field(default=None, repr=False)


@dataclass(frozen=True)
class BlockOutput:
    """Result of `Trunk.forward_block`: logits [S, V] fp32 and taps [S, T*D] fp32 of every
    block position, and the undo record `Trunk.rollback` needs."""

    logits: torch.Tensor
    taps: torch.Tensor
    undo: BlockUndo


@dataclass(frozen=True)
class ForwardOutput:
    """logits [V] fp32 of the last position; taps [rows, T*D] fp32 or None; prompt_logits
    [S, V] fp32 of every position of a prompt chunk that asked for them
    (`BatchItem.prefill_chunk(all_logits=True)`), else None."""

    logits: torch.Tensor
    taps: torch.Tensor | None
    prompt_logits: torch.Tensor | None = None
