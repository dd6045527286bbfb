"""Verify numerics of the trunk's forward loop: what one pass is (`Call`) and how its rows are
computed (`FastNumerics`, `ExactNumerics`; docs/architecture.md §4). This module owns the
choice between the two recipes and nothing else: it holds no weights and no per-sequence
state, and it never validates arguments (`dsv4.trunk.Trunk` and the serving engine do).

`dsv4.batch.run_pass` is the one loop, embed -> blocks -> taps -> head, for prefill, decode
and verify alike, and for one session or many: a pass holds several `Call`s whose rows are
concatenated for the dense ops while attention's state work (ring, compressors, indexer
top-k) runs on each call's own state (fast mode batches what is not per state across the
calls, `dsv4.joined_keys`). Every place where the recipes differ is one method of the strategy:

- `dense(fn, *rows, calls=)`: a row-wise op (projections, mHC, norms, gate, shared expert,
  taps, head) over the concatenated rows of every call: fast runs it once on all rows, exact
  on fixed tiles (EXACT_ROWS rows for decode / verify rows, PROMPT_ROWS for prompt rows), so
  a row's result never depends on how many rows, or which, share the pass;
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

from dsv4.attention import EXACT_KEY_CHUNK, Attention, AttentionState, AttentionUndo, sparse_attn_tiled
from dsv4.joined_keys import Select, joined_keys
from dsv4.layers import pad_rows
from dsv4.moe import MoE

EXACT_ROWS = 16  # exact mode: rows of a decode / verify tile, and the most tokens a verify block holds
# Exact mode: rows of a prompt tile, and the most tokens of a prompt one call holds. A prompt's
# rows depend on its own session only, so they may run on a larger tile than a decode's; 64 is
# the default prefill chunk (services/verifier/batcher.py), so a default chunk is one tile.
PROMPT_ROWS = 64
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
    prompt_tokens: int | None = None  # no limit on a prompt call's size
    threads: int | None = None

    def scope(self) -> ContextManager[None]:
        return nullcontext()

    def dense(self, fn: Rows, *rows: torch.Tensor,
              calls: list[CallRows] | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """fn(*rows): every tensor in `rows` has the same leading dim N (one entry per row);
        fn returns one tensor or a tuple of tensors, each with leading dim N. `calls` (the
        pass's calls and their row spans, when the rows are the whole pass's) lets the exact
        recipe tell prompt rows from the rest; fast mode ignores it."""
        return fn(*rows)

    def attend(self, attn: Attention, x: torch.Tensor, qr: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
               calls: list[CallRows]) -> torch.Tensor:
        """Attention of every call of the pass: the projected rows of the whole pass (x [N, D],
        qr [N, Lq], q [N, H, Dh], kv [N, Dh]) -> o [N, H, Dh] in q's dtype. `calls`: per call,
        (call, its layer `AttentionState`, its rows (lo, hi)), each state in at most one call.

        A prompt piece runs alone on its rows and state (`Attention.core`): its lists are
        long and would pad every decode row to their width. Decodes and verify blocks (when
        there are two or more) build their keys together (`dsv4.joined_keys.joined_keys`:
        each call's ring and compressor rows written on its own state, while the projections,
        the finalisation of completed blocks, the indexer's scoring and top-k and every row's
        list run once for the whole step), then ONE reduction (`attn.attend`) runs over all
        their query rows, on their keys concatenated, each list offset into its own call's
        keys and padded with -1; a masked column adds nothing, so a row agrees with its
        per-call result to rounding. One key build and one reduction per layer instead of
        one per session is what makes a wide decode step cheaper per row."""
        step = [(call, st, span) for call, st, span in calls if not call.prefill]
        if len(step) > 1 and len(step) == len(calls):  # no prompt piece: the step is every row
            keys, idx = joined_keys(attn, x, qr, kv, step)
            return attn.attend(q, keys, attn.attn_sink, idx, attn.softmax_scale)
        out = q.new_empty(q.shape)
        for call, st, (lo, hi) in calls:
            if call.prefill or len(step) == 1:
                out[lo:hi] = attn.core(x[lo:hi], qr[lo:hi], q[lo:hi], kv[lo:hi], call.start_pos, st, call.undo)
        if len(step) > 1:
            rows = torch.tensor([i for _, _, (lo, hi) in step for i in range(lo, hi)], device=q.device)
            keys, idx = joined_keys(attn, x[rows], qr[rows], kv[rows], step)
            out[rows] = attn.attend(q[rows], keys, attn.attn_sink, idx, attn.softmax_scale)
        return out

    def route(self, moe: MoE, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
              small_m: bool) -> torch.Tensor:
        """Routed experts grouped by expert: x [N, D], weights / experts [N, k] -> [N, D] fp32."""
        return moe.combine(x, weights, experts, small_m=small_m)


class ExactNumerics(FastNumerics):
    """A row's logits and taps are bitwise the same whatever else is in the pass: decode or
    verify block, alone or among other sessions' rows, so a batched speculative chain equals
    the plain greedy chain token for token at any concurrency.

    Rows come in two kinds, each computed on its own fixed tile size, never one chosen by
    the load: decode and verify rows on tiles of EXACT_ROWS rows, prompt rows on tiles of
    PROMPT_ROWS rows. Every dense op runs on the pass's rows of one kind, in order, cut into
    that kind's tiles (the last one zero-padded): each GEMM has one shape per kind, and within
    it a row's result depends on that row only. Attention computes the key building's row-wise
    projections the same way (`Attention.exact_rows`); a prompt piece builds its keys on one
    prompt tile (`Attention.exact_keys`), the decodes and verify blocks of the pass together
    (`dsv4.joined_keys`, finalising on fixed block tiles and scoring on fixed row tiles and
    entry chunks), with the same key list for a position in a decode and in a verify block;
    the query rows of all calls of a kind are then reduced together on that kind's tiles over
    fixed key chunks (`sparse_attn_tiled`). Routed experts
    run on fixed tiles of the rows routed to them (`MoE.combine_tiled`); intra-op threads are
    pinned to `threads` (a GEMM may split its work, and so its sums, differently with another
    thread count). Blocks hold at most EXACT_ROWS tokens.

    A prompt runs as consecutive calls of at most PROMPT_ROWS tokens on one state
    (`dsv4.trunk.Trunk.forward_batch`), each on one prompt tile. Its rows are a function of
    the prompt alone: they depend neither on how it is cut into chunks (a row's tile shape is
    PROMPT_ROWS whichever piece holds it) nor on what shares its passes. They are not bitwise
    the rows of decoding the prompt token by token (another GEMM shape), which nothing needs:
    a generation's decodes and verify blocks are the rows that must agree.
    """

    name = "exact"
    max_tokens = EXACT_ROWS
    prompt_tokens = PROMPT_ROWS
    prompt_rows = PROMPT_ROWS  # rows of a prompt tile (a constant: never chosen by the load)
    key_chunk = EXACT_KEY_CHUNK  # keys per step of the attention fold (a constant likewise)

    def __init__(self, threads: int):
        self.threads = threads

    def scope(self) -> ContextManager[None]:
        return pinned_threads(self.threads)

    def dense(self, fn: Rows, *rows: torch.Tensor,
              calls: list[CallRows] | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """fn over the rows of each kind (`calls` given: rows of prompt calls are prompt rows;
        None: all rows are decode / verify rows) on that kind's tiles, put back in row order."""
        return by_kind(lambda tile, *part: tiled(fn, tile, *part), rows, calls, self.prompt_rows)

    def attend(self, attn: Attention, x: torch.Tensor, qr: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
               calls: list[CallRows]) -> torch.Tensor:
        """As `FastNumerics.attend`. The row-wise projections of the key building (compressor
        and indexer, `Attention.exact_rows`) run over the whole pass on the dense tiles. Each
        prompt piece builds its keys and lists on its rows zero-padded to one prompt tile
        (`Attention.exact_keys`, in call order, so pieces of one prompt see each other). The
        decodes and verify blocks, one or many, build theirs together (`joined_keys`: each
        call's compressors stepped on its own state, the completed blocks finalised on fixed
        tiles, the indexer scoring every row on fixed row tiles and key chunks,
        `Indexer.topk_tiled`, every row's list from one set of ops), the same way whether a
        call is alone or not. Then the query rows of every call of a kind are reduced together
        on that kind's tiles (`sparse_attn_tiled`), each row over its own list, whose columns
        are the same whatever shares the pass."""
        pos = torch.cat([torch.arange(c.start_pos, c.start_pos + c.n_tokens, device=x.device) for c, _, _ in calls])
        rows = self.dense(attn.exact_rows, x, qr, pos, calls=calls) if attn.ratio else ()  # per-row projections
        parts, keys, offset = [], [], 0  # parts: (row index or span, its lists offset into the pass's keys)
        for call, st, (lo, hi) in calls:
            if call.prefill:
                kv_tile, *tile = [pad_rows(t[lo:hi], self.prompt_rows) for t in (kv, *rows)]
                k, idx = attn.exact_keys(kv_tile, tuple(tile), call.start_pos, call.n_tokens, st, call.undo)
                parts.append((slice(lo, hi), torch.where(idx[:call.n_tokens] >= 0, idx[:call.n_tokens] + offset, -1)))
                keys.append(k)
                offset += k.shape[0]
        step = [(call, st, span) for call, st, span in calls if not call.prefill]
        if step:
            sel = slice(None) if len(step) == len(calls) else torch.tensor(
                [i for _, _, (lo, hi) in step for i in range(lo, hi)], device=x.device)
            k, idx = joined_keys(attn, x[sel], None, kv[sel], step, tuple(t[sel] for t in rows), self._select(attn))
            parts.append((sel, torch.where(idx >= 0, idx + offset, -1)))
            keys.append(k)
        width = max(t.shape[1] for _, t in parts)
        idx = torch.full((x.shape[0], width), -1, dtype=torch.long, device=x.device)  # [N, width]
        for at, t in parts:
            idx[at, :t.shape[1]] = t
        keys = torch.cat(keys)
        return by_kind(lambda tile, qt, it: sparse_attn_tiled(qt, keys, attn.attn_sink, it, attn.softmax_scale,
                                                              self.key_chunk, tile), (q, idx), calls,
                       self.prompt_rows)

    def _select(self, attn: Attention) -> Select | None:
        """The indexer's joined top-k for `joined_keys`: rows on EXACT_ROWS tiles, entries in
        key_chunk chunks (`Indexer.topk_tiled`); None for a layer without an indexer."""
        if attn.indexer is None:
            return None
        return lambda qi, w, p, states, owner: attn.indexer.topk_tiled(qi, w, p, states, owner, EXACT_ROWS,
                                                                      self.key_chunk)

    def route(self, moe: MoE, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
              small_m: bool) -> torch.Tensor:
        """Each expert on fixed EXACT_ROWS-row tiles of the rows routed to it."""
        return moe.combine_tiled(x, weights, experts, EXACT_ROWS)


def by_kind(fn: Callable[..., "torch.Tensor | tuple[torch.Tensor, ...]"], rows: tuple | list,
            calls: list[CallRows] | None, prompt_rows: int = PROMPT_ROWS) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """fn(tile, *part) on the rows of each kind apart, results put back in row order: prompt
    rows with tile = prompt_rows, decode / verify rows with tile = EXACT_ROWS.

    rows: tensors with the same leading dim N; calls: the pass's calls and their row spans
    (None: every row is a decode / verify row). `part` holds one kind's rows in order; fn
    returns one tensor or a tuple, each with part's leading dim."""
    prompt = [] if calls is None else [(lo, hi) for call, _, (lo, hi) in calls if call.prefill]
    n, n_prompt = rows[0].shape[0], sum(hi - lo for lo, hi in prompt)
    if n_prompt == 0 or n_prompt == n:
        return fn(prompt_rows if n_prompt else EXACT_ROWS, *rows)
    is_prompt = torch.zeros(n, dtype=torch.bool, device=rows[0].device)
    for lo, hi in prompt:
        is_prompt[lo:hi] = True
    kinds = [(prompt_rows, is_prompt.nonzero().squeeze(1)), (EXACT_ROWS, (~is_prompt).nonzero().squeeze(1))]
    parts = [(sel, fn(tile, *(t[sel] for t in rows))) for tile, sel in kinds]
    single = not isinstance(parts[0][1], tuple)
    outs = []
    for i in range(1 if single else len(parts[0][1])):
        pieces = [(sel, out if single else out[i]) for sel, out in parts]
        full = pieces[0][1].new_empty(n, *pieces[0][1].shape[1:])
        for sel, piece in pieces:
            full[sel] = piece
        outs.append(full)
    return outs[0] if single else tuple(outs)


def tiled(fn: Rows, tile: int, *rows: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """fn over consecutive tiles of `tile` rows of `rows` (each [N, ...]; the last tile
    zero-padded), concatenated and cut back to N rows. N == 0: fn(*rows) as it is."""
    n = rows[0].shape[0]
    if n == 0:  # nothing asked of this op (no tap rows): no tile to run
        return fn(*rows)
    padded = [pad_rows(t, -(-n // tile) * tile) for t in rows]
    outs = [fn(*(t[i:i + tile] for t in padded)) for i in range(0, padded[0].shape[0], tile)]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts)[:n] for parts in zip(*outs))
    return torch.cat(outs)[:n]


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
