"""The committed tap rows a verifier session keeps to prime a replacement drafter.

This module owns the tail of one session's committed history: the last `window` tap rows
and the current anchor. It runs no model and validates no request beyond the count asked
for; the verifier engine feeds it after every successful forward.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CommittedTail:
    """The last committed rows of a session and its current anchor.

    rows: [R, row_width] bfloat16 on CPU, the tap rows of positions
        first_position..next_position-1.
    first_position: position of rows[0].
    next_position: the position after the last committed row (where the anchor goes).
    next_token: the anchor (the target's argmax at next_position - 1).
    margin: the anchor's top1 - top2 logit margin (logit units).
    """

    rows: torch.Tensor
    first_position: int
    next_position: int
    next_token: int
    margin: float


class CommittedRows:
    """The last `window` committed tap rows of one session and its anchor.

    Rows are kept as bfloat16 on CPU, the wire dtype, so a resend is bit-identical to the
    first send. Memory: window * row_width * 2 bytes per session.

    Args:
        window: rows kept (the drafter's ring size, `window_size`), an int >= 1.
    Not thread safe: the engine calls it under the session's lock.
    """

    def __init__(self, window: int):
        self._rows: collections.deque[torch.Tensor] = collections.deque(maxlen=window)
        self.next_position = 0  # position after the last kept row
        self.next_token, self.margin = 0, 0.0

    def add(self, rows: torch.Tensor, positions: range, next_token: int, margin: float) -> None:
        """Keep rows [len(positions), row_width] (any float dtype or device) of `positions`,
        which continue the kept ones, and the new anchor `next_token` with its `margin`."""
        self._rows.extend(rows.detach().to("cpu", torch.bfloat16).unbind(0))
        self.next_position = positions.stop
        self.next_token, self.margin = next_token, margin

    def tail(self, count: int) -> CommittedTail:
        """The last min(count, kept) rows (count 0: every kept row) with the anchor.

        Raises:
            ValueError: count < 0, or nothing committed yet (both named).
        """
        if count < 0:
            raise ValueError(f"rows count={count}: must be >= 0 (0 = every kept row)")
        if not self._rows:
            raise ValueError("rows: the session has no committed positions yet: prefill first")
        n = len(self._rows) if count == 0 else min(count, len(self._rows))
        rows = torch.stack(list(self._rows)[-n:])
        return CommittedTail(rows, self.next_position - n, self.next_position, self.next_token, self.margin)
