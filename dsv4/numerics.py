"""Verify numerics of the trunk's forward loop: what one pass is (`Call`) and how its rows are
computed (`FastNumerics`, `ExactNumerics`; docs/architecture.md §4). This module owns the
choice between the two recipes and nothing else: it holds no weights and no per-sequence
state, and it never validates arguments (`dsv4.trunk.Trunk` and the serving engine do).

`Trunk._run` is the one loop, embed -> blocks -> taps -> head, for prefill, decode and
verify alike; every place where the recipes differ is one method of the strategy:

- `tile(ids)`: the rows the dense ops see (exact pads every decode and verify to EXACT_ROWS);
- `attend(attn, x, call, st)`: which key lists and which attention reduction a layer uses;
- `route(moe, x, weights, experts, call)`: grouped expert calls, or one call per route;
- `on_rows(fn, t, lo, hi)`: run a row-wise op (taps, head) on rows lo..hi-1 only, or on the
  whole fixed tile and slice after (so its shape never depends on the call);
- `scope()`: the intra-op thread count a forward runs under.

A `Call` describes the rows of one sequence. Cross-session batching extends the same shape:
a pass then holds several calls whose rows are concatenated for the dense ops (linears, mHC,
norms, MoE, head) while `attend` runs per call on its slice of rows and state.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator

import torch
import torch.nn.functional as F

from dsv4.attention import Attention, AttentionState, AttentionUndo
from dsv4.moe import MoE

EXACT_ROWS = 8  # exact mode: rows of every dense forward (a decode, or a verify block of <= 8 tokens)
VERIFY_NUMERICS = ("fast", "exact")


@dataclass(frozen=True)
class Call:
    """One forward pass over `n_tokens` tokens of one sequence at positions start_pos...

    start_pos == 0 is a prefill; `undo` (the list each layer appends its `AttentionUndo` to)
    marks a verify block; otherwise it is a decode of one token.
    """

    start_pos: int
    n_tokens: int
    undo: list[AttentionUndo] | None = None

    @property
    def small_m(self) -> bool:
        """Decode and verify: few rows, the shape the small-batch fp4 expert path is for."""
        return self.start_pos > 0


class FastNumerics:
    """Rows computed in the call's own shape: decode runs one row, a verify block k + 1 rows,
    and their logits agree to rounding (~1e-6 relative in fp32, ~5e-3 in bf16), not bitwise."""

    name = "fast"
    max_tokens: int | None = None  # no limit on a verify block's size
    threads: int | None = None

    def tile(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [S] int64 -> the rows the dense ops run on (here: ids itself)."""
        return ids

    def scope(self) -> ContextManager[None]:
        return nullcontext()

    def attend(self, attn: Attention, x: torch.Tensor, call: Call, st: AttentionState) -> torch.Tensor:
        """x [S, D] -> [S, D]: the layer's prefill, decode or verify-block attention."""
        return attn(x, call.start_pos, st, call.undo)

    def route(self, moe: MoE, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
              call: Call) -> torch.Tensor:
        """Routed experts grouped by expert: x [S, D], weights / experts [S, k] -> [S, D] fp32."""
        return moe.combine(x, weights, experts, small_m=call.small_m)

    def on_rows(self, fn: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """fn(t[lo:hi]): a row-wise op on the rows that are asked for only."""
        return fn(t[lo:hi])


class ExactNumerics(FastNumerics):
    """Decode and verify compute a position's logits and taps bitwise alike, so a batched
    speculative chain equals the plain greedy chain token for token.

    Every decode and verify block runs as a tile of EXACT_ROWS rows (the tokens, then
    padding), so every dense op has one fixed shape and a row's result does not depend on
    the other rows; attention keys per query are the same list in decode and verify, reduced
    in fixed chunks (`Attention.forward_exact`); routed experts run one 1-row call per route
    (`MoE.combine_per_token`); intra-op threads are pinned to `threads` (a GEMM may split its
    work, and so its sums, differently with another thread count). Prefill is the fast one:
    plain and speculative runs share it. Blocks hold at most EXACT_ROWS tokens.
    """

    name = "exact"
    max_tokens = EXACT_ROWS

    def __init__(self, threads: int):
        self.threads = threads

    def tile(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [S] (S <= EXACT_ROWS) -> [EXACT_ROWS], padded with token 0 (never written to a state)."""
        return F.pad(ids, (0, EXACT_ROWS - ids.shape[0]))

    def scope(self) -> ContextManager[None]:
        return pinned_threads(self.threads)

    def attend(self, attn: Attention, x: torch.Tensor, call: Call, st: AttentionState) -> torch.Tensor:
        """x [R, D] tile -> [R, D]; padding rows attend to nothing."""
        return attn.forward_exact(x, call.start_pos, st, call.undo, call.n_tokens)

    def route(self, moe: MoE, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
              call: Call) -> torch.Tensor:
        """One expert call per route of the real rows; padding rows get 0."""
        return moe.combine_per_token(x, weights, experts, call.n_tokens)

    def on_rows(self, fn: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """fn(t)[lo:hi]: the op always sees the whole tile."""
        return fn(t)[lo:hi]


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
