"""Key building for one layer of a batch step: the keys and index lists of every decode and
verify block of the step, joined so that ONE attention reduction serves them all
(`dsv4.numerics.FastNumerics.attend` and `ExactNumerics.attend`, docs/architecture.md §4).
Fast numerics projects the rows here and selects with `Indexer.topk_joined`; exact numerics
passes the rows it projected on its dense tiles and selects with `Indexer.topk_tiled`. This
module owns how the calls' keys are laid side by side and which of their key work runs once
for the whole step; each call's state semantics (ring slots, compressor rows and entries,
indexer selection, journals) stay those of `dsv4.attention.Attention.keys`. It never runs the
reduction and never validates.

Dimension legend: M = rows of the joined calls, C = calls, W = window_size, Dh = head_dim,
S_c = tokens of call c, E_c = compressed entries of call c's session, K = index columns per
row (-1 = masked).

Why the step's calls are built together: a call's key work is a handful of tiny ops (ring
rows, compressor rows, a pooled entry every r positions, an indexer top-k over a few
entries), and at 16 sessions their per-op overhead, not their arithmetic, was most of a step.
Here every call's state is stepped row by row (each state is its own tensor), but completed
blocks are finalised, the indexer scores and selects, and the lists of all M rows are built
in one op each for the whole step. Every call, a decode included, attends over keys
[ring before the call | its own rows | its entries], the layout of a verify block
(`Attention.block_finish`), so one rule makes every list.
"""

from __future__ import annotations

from typing import Callable

import torch

from dsv4.attention import Attention

Select = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list, list[int]], torch.Tensor]


def joined_keys(attn: Attention, x: torch.Tensor, qr: torch.Tensor, kv: torch.Tensor, calls: list,
                rows: tuple[torch.Tensor, ...] | None = None,
                select: Select | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every call's keys and index lists joined for one reduction. x [M, D], qr [M, Lq],
    kv [M, Dh]: the calls' projected rows, in call order; `calls`: (call, layer state, rows
    (lo, hi) of the pass) of decodes and verify blocks only (start_pos > 0), each state in
    one call.

    Three phases: (1) the compressor and indexer projections (`Attention.exact_rows`,
    row-wise) of all M rows, then each call's compressor steps (`_step_calls`; a verify
    block's journaled), the blocks they complete pooled but not stored; (2) those entries
    finalised and stored, one batch per compressor (`Compressor.finalize_pending`), and the
    indexer's top-k of all M rows in one op (`select`); (3) the keys, every list (`_lists`),
    then each call's ring write and journal. Returns keys [sum_c (W + S_c + E_c), Dh] in kv's
    dtype (per call, in call order: its ring as before the call, its rows, its entries) and
    idx [M, K] int64: row i's list offset into its own call's keys, padded with -1 (masked).

    rows: the M rows' `exact_rows`, when the caller computed them (exact numerics: on its
    fixed tiles); None computes them here in one op (fast). select(qi [M, Hi, Di], w [M, Hi],
    positions [M], indexer states [C], owner [M]) -> top [M, K] int64: the indexer's selection
    (exact: `Indexer.topk_tiled`); None: `Indexer.topk_joined` (fast).
    """
    W, r = attn.window, attn.ratio
    sizes = [c.n_tokens for c, _, _ in calls]
    pos = torch.tensor([c.start_pos + i for c, _, _ in calls for i in range(c.n_tokens)], device=x.device)  # [M]
    if rows is None:
        rows = attn.exact_rows(x, qr, pos)  # () for ratio 0
    kv_calls = kv.split(sizes)
    pending: tuple[list, list] = ([], [])  # completed blocks of the attention / indexer compressor
    records = _step_calls(attn, x, kv_calls, rows, calls, pending)
    top = None
    if r:
        attn.compressor.finalize_pending(pending[0])
    if r == 4:
        attn.indexer.compressor.finalize_pending(pending[1])
        owner = [i for i, n in enumerate(sizes) for _ in range(n)]
        top = (select or attn.indexer.topk_joined)(rows[4], rows[5], pos, [st.indexer for _, st, _ in calls], owner)
    keys = torch.cat([t for (_, st, _), k in zip(calls, kv_calls)
                      for t in ((st.ring, k, st.compressor.entries()) if r else (st.ring, k))])
    idx = _lists(attn, calls, pos, top)
    _write_rings(W, calls, kv_calls, records)  # after the cat above: the keys hold the rings before
    return keys, idx


def _write_rings(W: int, calls: list, kv: tuple, records: list) -> None:
    """Each call's last min(S_c, W) key rows (kv split per call, [S_c, Dh] each) into its
    ring's slots p % W, and each verify block's journal (`records`, from `_step_calls`) onto
    its undo list."""
    for (call, st, _), k, record in zip(calls, kv, records):
        if record is not None:
            st.ring[record.slots] = k[-W:]
            call.undo.append(record)
        elif call.n_tokens == 1:
            st.ring[call.start_pos % W] = k[0]
        else:  # several tokens without a journal (a prompt chunk; `FastNumerics.attend` sends none here)
            st.ring[torch.arange(call.start_pos, call.start_pos + call.n_tokens)[-W:] % W] = k[-W:]


def _step_calls(attn: Attention, x: torch.Tensor, kv: tuple, rows: tuple, calls: list,
                pending: tuple[list, list]) -> list:
    """Phase (1) of `joined_keys`: step each call's compressors on its rows (x [M, D], every
    `exact_rows` tensor [M, ...]; kv already split per call). The decodes (one token, no
    journal) step together (`Compressor.write_decodes`); each other call through
    `Attention.block_step`, which saves its ring slots and opens its journals. Completed
    blocks go to `pending` (attention compressor's, indexer compressor's). Returns each
    call's `AttentionUndo` (None for a decode)."""
    sizes = [c.n_tokens for c, _, _ in calls]
    decodes = [i for i, n in enumerate(sizes) if n == 1 and calls[i][0].undo is None]
    if decodes and attn.ratio:
        if len(decodes) == len(calls):  # the usual plain-decode step: every row, in order
            sel = slice(None)
        else:
            first = torch.tensor(sizes).cumsum(0) - torch.tensor(sizes)
            sel = first[decodes].to(x.device)
        starts = [calls[i][0].start_pos for i in decodes]
        parts = [(attn.compressor, "compressor", 0, 0)]
        if attn.ratio == 4:
            parts.append((attn.indexer.compressor, "indexer", 2, 1))
        for module, name, at, which in parts:
            module.write_decodes(rows[at][sel], rows[at + 1][sel], starts,
                                 [getattr(calls[i][1], name) for i in decodes], pending[which])
    records: list = [None] * len(calls)
    blocks = sorted(set(range(len(calls))) - set(decodes))
    if blocks:
        x_calls, row_calls = x.split(sizes), [t.split(sizes) for t in rows]
        for i in blocks:
            call, st, _ = calls[i]
            records[i] = attn.block_step(x_calls[i], kv[i], call.start_pos, st, call.undo,
                                         tuple(t[i] for t in row_calls), pending)
    return records


def _lists(attn: Attention, calls: list, p: torch.Tensor, top: torch.Tensor | None) -> torch.Tensor:
    """Index lists [M, W + Kc] int64 of the joined calls' rows at positions p [M] int64, call c
    having keys [ring (W) | its S_c rows | its E_c entries] at key row offset sum_{c' < c}
    (W + S_c' + E_c'): the window (`Attention.window_list`: ring slots before the call, the
    call's own rows), then top [M, K] + W + S_c (ratio 4; -1 kept) or the plain compressor's
    entries complete at the row's position (`Attention.plain_entry_list`; none for ratio 0),
    each shifted by its call's offset; -1 = masked. Built once for all M rows."""
    W, r, dev = attn.window, attn.ratio, attn.attn_sink.device
    n_entries = [st.compressor.n_entries if r else 0 for _, st, _ in calls]
    per_row, offset = [], 0  # per row: its call's start, size and first key row
    for (call, _, _), e in zip(calls, n_entries):
        per_row += [(call.start_pos, call.n_tokens, offset)] * call.n_tokens
        offset += W + call.n_tokens + e
    start, size, first = torch.tensor(per_row, device=dev).unbind(1)  # [M] each
    lists = [attn.window_list(p, start[:, None])]  # [M, W]
    if r == 4:
        lists.append(torch.where(top >= 0, top + (W + size)[:, None], -1))
    elif r:  # entries a row cannot see yet, and another session's padding, fail j < (p + 1) // r
        lists.append(attn.plain_entry_list(p, max(n_entries), (W + size)[:, None]))
    idx = torch.cat(lists, dim=1)
    return torch.where(idx >= 0, idx + first[:, None], -1)
