"""Verify numerics of the trunk's forward loop: what one pass is (`Call`) and how its rows are
computed (`FastNumerics`, `ExactNumerics`; docs/architecture.md §4). This module owns the
choice between the two recipes and nothing else: it holds no weights and no per-sequence
state, and it never validates arguments (`dsv4.trunk.Trunk` and the serving engine do).

`dsv4.batch.run_pass` is the one loop, embed -> blocks -> taps -> head, for prefill, decode
and verify alike, and for one session or many: a pass holds several `Call`s whose rows are
concatenated for the dense ops while attention runs per call on its slice of rows and its
own state. Every place where the recipes differ is one method of the strategy:

- `dense(fn, *rows)`: a row-wise op (projections, mHC, norms, gate, shared expert, taps,
  head) over the concatenated rows of every call: fast runs it once on all rows, exact on
  fixed tiles of EXACT_ROWS rows, so a row's result never depends on how many rows, or
  which, share the pass;
- `attend(attn, x, qr, q, kv, calls)`: every call's key lists (each on its own state) and
  the attention reductions;
- `route(moe, x, weights, experts, small_m)`: grouped expert calls, or fixed expert tiles;
- `scope()`: the intra-op thread count a forward runs under.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator

import torch

import torch.nn.functional as F

from dsv4.attention import EXACT_KEY_CHUNK, Attention, AttentionState, AttentionUndo, sparse_attn_tiled
from dsv4.moe import MoE

EXACT_ROWS = 8  # exact mode: rows of every dense tile, and the most tokens a verify block holds
VERIFY_NUMERICS = ("fast", "exact")


@dataclass(frozen=True)
class Call:
    """One sequence's part of a forward pass: `n_tokens` tokens at positions start_pos...

    `undo` (the list each layer appends its `AttentionUndo` to) marks a verify block;
    `prefill` marks a piece of a prompt, committed as it runs (start_pos == 0: the prompt's
    first piece); otherwise it is a decode of one token.
    """

    start_pos: int
    n_tokens: int
    undo: list[AttentionUndo] | None = None
    prefill: bool = False

    @property
    def small_m(self) -> bool:
        """Decode and verify: few rows, the shape the small-batch fp4 expert path is for
        (a prompt's piece is many rows, whatever its start)."""
        return self.start_pos > 0 and not self.prefill


Rows = Callable[..., "torch.Tensor | tuple[torch.Tensor, ...]"]
CallRows = tuple[Call, AttentionState, tuple[int, int]]  # a call, its layer state, its rows (lo, hi) of the pass


class FastNumerics:
    """Rows computed in the pass's own shape: a decode alone runs one row, a verify block
    k + 1 rows, a batch all its rows at once; results agree to rounding (~1e-6 relative in
    fp32, ~5e-3 in bf16), not bitwise, across those shapes."""

    name = "fast"
    max_tokens: int | None = None  # no limit on a verify block's size
    threads: int | None = None

    def scope(self) -> ContextManager[None]:
        return nullcontext()

    def dense(self, fn: Rows, *rows: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """fn(*rows): every tensor in `rows` has the same leading dim N (one entry per row);
        fn returns one tensor or a tuple of tensors, each with leading dim N."""
        return fn(*rows)

    def attend(self, attn: Attention, x: torch.Tensor, qr: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
               calls: list[CallRows]) -> torch.Tensor:
        """Attention of every call of the pass: the projected rows of the whole pass (x [N, D],
        qr [N, Lq], q [N, H, Dh], kv [N, Dh]) -> o [N, H, Dh]. `calls`: per call, (call, its
        layer `AttentionState`, its rows (lo, hi)); each call's prefill, prompt piece, decode
        or verify block runs on its own rows and state (`Attention.core`), in order."""
        return torch.cat([attn.core(x[lo:hi], qr[lo:hi], q[lo:hi], kv[lo:hi], call.start_pos, st, call.undo)
                          for call, st, (lo, hi) in calls])

    def route(self, moe: MoE, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
              small_m: bool) -> torch.Tensor:
        """Routed experts grouped by expert: x [N, D], weights / experts [N, k] -> [N, D] fp32."""
        return moe.combine(x, weights, experts, small_m=small_m)


class ExactNumerics(FastNumerics):
    """A row's logits and taps are bitwise the same whatever else is in the pass: decode or
    verify block, alone or among other sessions' rows, so a batched speculative chain equals
    the plain greedy chain token for token at any concurrency.

    Dense ops run on fixed tiles of EXACT_ROWS rows filled with the pass's rows in order
    (the last tile zero-padded): every GEMM has one shape, and within it a row's result
    depends on that row only. Attention runs per call on its own EXACT_ROWS-row tile, with
    the same key list for a position in a decode and in a verify block, reduced in fixed
    chunks (`Attention.core_exact`); routed experts run on fixed tiles of the rows routed to
    them (`MoE.combine_tiled`); intra-op threads are pinned to `threads` (a GEMM may split
    its work, and so its sums, differently with another thread count). Blocks hold at most
    EXACT_ROWS tokens. A prompt runs as consecutive calls of at most EXACT_ROWS tokens on
    one state (`dsv4.trunk.Trunk.forward_batch`), each one of these tiles: its rows are then
    bitwise the rows the prompt would get decoded token by token, so a prefill's result
    depends neither on how the prompt is cut into chunks nor on what shares its passes.
    """

    name = "exact"
    max_tokens = EXACT_ROWS

    def __init__(self, threads: int):
        self.threads = threads

    def scope(self) -> ContextManager[None]:
        return pinned_threads(self.threads)

    def dense(self, fn: Rows, *rows: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """fn over tiles of EXACT_ROWS rows of `rows` (zero-padded), concatenated and cut back to N."""
        n = rows[0].shape[0]
        if n == 0:  # nothing asked of this op (no tap rows): no tile to run
            return fn(*rows)
        padded = [pad_rows(t, -(-n // EXACT_ROWS) * EXACT_ROWS) for t in rows]
        outs = [fn(*(t[i:i + EXACT_ROWS] for t in padded)) for i in range(0, padded[0].shape[0], EXACT_ROWS)]
        if isinstance(outs[0], tuple):
            return tuple(torch.cat(parts)[:n] for parts in zip(*outs))
        return torch.cat(outs)[:n]

    def attend(self, attn: Attention, x: torch.Tensor, qr: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
               calls: list[CallRows]) -> torch.Tensor:
        """As `FastNumerics.attend`. Each call builds its keys and index lists on its rows
        zero-padded to one EXACT_ROWS tile (`Attention.exact_keys`, in call order, so pieces
        of one prompt see each other); then the query rows of every call are reduced together
        on fixed EXACT_ROWS-row tiles (`sparse_attn_tiled`), each row over its own list: one
        reduction per 8 rows of the pass rather than one padded tile per call."""
        keys, lists, offset = [], [], 0
        for call, st, (lo, hi) in calls:
            tile = [pad_rows(t[lo:hi], EXACT_ROWS) for t in (x, qr, kv)]
            k, idx = attn.exact_keys(*tile, call.start_pos, call.n_tokens, st, call.undo)
            lists.append(torch.where(idx[:call.n_tokens] >= 0, idx[:call.n_tokens] + offset, -1))
            keys.append(k)
            offset += k.shape[0]
        width = max(t.shape[1] for t in lists)
        idx = torch.cat([F.pad(t, (0, width - t.shape[1]), value=-1) for t in lists])  # [N, width]
        return sparse_attn_tiled(q, torch.cat(keys), attn.attn_sink, idx, attn.softmax_scale, EXACT_KEY_CHUNK,
                                 EXACT_ROWS)

    def route(self, moe: MoE, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
              small_m: bool) -> torch.Tensor:
        """Each expert on fixed EXACT_ROWS-row tiles of the rows routed to it."""
        return moe.combine_tiled(x, weights, experts, EXACT_ROWS)


def pad_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """t [N, ...] -> [n, ...] (n >= N), the extra rows zero."""
    if t.shape[0] == n:
        return t
    return torch.cat((t, t.new_zeros(n - t.shape[0], *t.shape[1:])))


def numerics_for(verify_numerics: str) -> FastNumerics:
    """The strategy named `verify_numerics` ("fast" or "exact"); exact pins the thread count
    of the caller at construction.

    Raises:
        ValueError: another name.
    """
    if verify_numerics == "fast":
        return FastNumerics()
    if verify_numerics == "exact":
        return ExactNumerics(torch.get_num_threads())
    raise ValueError(f"verify_numerics={verify_numerics!r}: must be one of {VERIFY_NUMERICS}")


@contextmanager
def pinned_threads(n: int) -> Iterator[None]:
    """Run the body with `n` torch intra-op threads, restoring the count after."""
    before = torch.get_num_threads()
    if before != n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if before != n:
            torch.set_num_threads(before)
