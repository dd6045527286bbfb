"""Fast numerics' key building for one layer of a batch step: the keys and index lists of every
decode and verify block of the step, joined so that ONE attention reduction serves them all
(`dsv4.numerics.FastNumerics.attend`, docs/architecture.md §4). This module owns how the calls'
keys are laid side by side and how the decodes among them are built together; each call's
state semantics (ring slots, compressor rows and entries, indexer selection, journals) stay
those of `dsv4.attention.Attention.keys`. It never runs the reduction and never validates.

Dimension legend: M = rows of the joined calls, B = decode calls, W = window_size, Dh =
head_dim, E_b = compressed entries of decode b's session, Kc = the widest entry list, K =
index columns per row (-1 = masked).

Why decodes are built together: a decode's key work is a handful of tiny ops (one ring row,
one compressor row, a pooled entry every r positions, an indexer top-k over a few entries),
and at 16 sessions their per-op overhead, not their arithmetic, was most of a step. Built
together, a layer's B decodes write their rows one by one (each state is its own tensor) but
pool, finalise, score and select in one op each, and their lists come from one set of
tensor ops over [B, W + Kc].
"""

from __future__ import annotations

import torch

from dsv4.attention import Attention, AttentionState


def joined_keys(attn: Attention, x: torch.Tensor, qr: torch.Tensor, kv: torch.Tensor,
                calls: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Every call's keys and index lists joined for one reduction. x [M, D], qr [M, Lq],
    kv [M, Dh]: the calls' projected rows, in call order; `calls`: (call, layer state, rows
    (lo, hi) of the pass) of decodes and verify blocks only (start_pos > 0), each state in
    one call.

    Three phases, so that what is not per state runs once for the whole step: (1) the
    compressor and indexer projections (`Attention.exact_rows`, row-wise) of all M rows, then
    each call's state steps (decodes: ring row and compressor rows; verify blocks:
    `Attention.block_step`, journaled), the blocks they complete pooled but not stored;
    (2) those entries finalised and stored, one batch per compressor
    (`Compressor.finalize_pending`), and the indexer's top-k of all M rows in one padded op
    (`Indexer.topk_joined`); (3) the keys and lists: the decodes' together (`decode_keys`),
    each verify block's on its own state (`Attention.block_finish`). Returns keys [sum of
    the calls' key rows, Dh] in kv's dtype (the decodes' keys first, then the blocks' in call
    order) and idx [M, K] int64: row i's list, offset into its own call's keys, padded with
    -1 (masked) to the longest list K.
    """
    dev = x.device
    positions = [c.start_pos + i for c, _, _ in calls for i in range(c.n_tokens)]
    rows = attn.exact_rows(x, qr, torch.tensor(positions, device=dev))  # () for ratio 0
    spans, a = [], 0
    for c, _, _ in calls:
        spans.append((a, a + c.n_tokens))
        a += c.n_tokens
    decodes = [i for i, (c, _, _) in enumerate(calls) if c.n_tokens == 1 and c.undo is None]
    blocks = [i for i in range(len(calls)) if i not in set(decodes)]
    every = len(decodes) == len(calls)  # the usual plain-decode step: no gather needed
    sel = slice(None) if every else torch.tensor([spans[i][0] for i in decodes], device=dev, dtype=torch.long)
    pending: tuple[list, list] = ([], [])  # completed blocks of the attention / indexer compressor
    if decodes:
        step_decodes(attn, kv[sel], tuple(t[sel] for t in rows), [calls[i][0].start_pos for i in decodes],
                     [calls[i][1] for i in decodes], pending)
    records = {}
    for i in blocks:
        (call, st, _), (a, b) = calls[i], spans[i]
        records[i] = attn.block_step(x[a:b], kv[a:b], call.start_pos, st, call.undo,
                                     tuple(t[a:b] for t in rows), pending)
    if attn.ratio:
        attn.compressor.finalize_pending(pending[0])
    top = None
    if attn.ratio == 4:
        attn.indexer.compressor.finalize_pending(pending[1])
        owner = [i for i, (c, _, _) in enumerate(calls) for _ in range(c.n_tokens)]
        top = attn.indexer.topk_joined(rows[4], rows[5], positions, [st.indexer for _, st, _ in calls], owner)
    return _join(attn, kv, calls, spans, decodes, blocks, sel, records, top)


def _join(attn: Attention, kv: torch.Tensor, calls: list, spans: list[tuple[int, int]], decodes: list[int],
          blocks: list[int], sel: slice | torch.Tensor, records: dict, top: torch.Tensor | None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase (3) of `joined_keys`, on stepped states with their entries stored: the decodes'
    keys and lists (rows `sel` of the step), then each block's (`Attention.block_finish`,
    `records` its journal or None), laid side by side -> (keys, idx [M, K]) as there."""
    keys, parts, offset = [], [], 0  # parts: (rows of idx, their lists shifted by their keys' offset)
    if decodes:
        k, idx = decode_keys(attn, [calls[i][1] for i in decodes], [calls[i][0].start_pos for i in decodes],
                             None if top is None else top[sel])
        keys.append(k)
        parts.append((sel, idx))
        offset = k.shape[0]
    for i in blocks:
        (call, st, _), (a, b) = calls[i], spans[i]
        k, idx = attn.block_finish(kv[a:b], call.start_pos, st, call.undo, records[i],
                                   None if top is None else top[a:b])
        parts.append((slice(a, b), torch.where(idx >= 0, idx + offset, -1)))
        keys.append(k)
        offset += k.shape[0]
    if len(parts) == 1:
        return torch.cat(keys), parts[0][1]
    width = max(t.shape[1] for _, t in parts)
    idx = torch.full((kv.shape[0], width), -1, dtype=torch.int64, device=kv.device)
    for where, t in parts:
        idx[where, :t.shape[1]] = t
    return torch.cat(keys), idx


def step_decodes(attn: Attention, kv: torch.Tensor, rows: tuple[torch.Tensor, ...], positions: list[int],
                 states: list[AttentionState], pending: tuple[list, list]) -> None:
    """The state steps of B decodes of B sessions: decode b is one token at positions[b]
    (int, > 0) on states[b], kv [B, Dh] its key row, `rows` its `Attention.exact_rows` (each
    [B, ...]; () for ratio 0). Writes ring slot p % W and steps the compressors
    (`Compressor.write_decodes`), the blocks completed going to `pending` (attention
    compressor's, indexer compressor's) for `Compressor.finalize_pending`."""
    W, r = attn.window, attn.ratio
    for st, p, k in zip(states, positions, kv.unbind(0)):
        st.ring[p % W] = k
    if r == 4:
        attn.indexer.compressor.write_decodes(rows[2], rows[3], positions, [st.indexer for st in states], pending[1])
    if r:
        attn.compressor.write_decodes(rows[0], rows[1], positions, [st.compressor for st in states], pending[0])


def decode_keys(attn: Attention, states: list[AttentionState], positions: list[int],
                top: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and lists of B decodes once `step_decodes` ran and their entries are stored:
    decode b at positions[b] on states[b]; top [B, K] int64 the indexer's selection (ratio 4,
    else None). Returns keys [sum_b (W + E_b), Dh] in the ring's dtype (per session: its
    ring, then its entries) and idx [B, W + Kc] int64: the ring slots holding positions
    p-W+1..p, then the selected (ratio 4) or all (other ratios) entries, each offset into the
    session's own keys; -1 = masked. A row's columns may be ordered differently from
    `Attention.keys`' list (masked columns sit among them), which changes its reduction only
    by rounding.
    """
    W, r, dev = attn.window, attn.ratio, states[0].ring.device
    if r:
        keys = torch.cat([t for st in states for t in (st.ring, st.compressor.entries())])
        n_entries = [st.compressor.n_entries for st in states]
    else:
        keys = torch.cat([st.ring for st in states])
        n_entries = [0] * len(states)
    return keys, _decode_lists(W, r, positions, n_entries, top, dev)


def _decode_lists(W: int, r: int, positions: list[int], n_entries: list[int], top: torch.Tensor | None,
                  dev: torch.device) -> torch.Tensor:
    """Index lists [B, W + Kc] int64 of B decodes whose session b's keys are [ring (W) |
    entries (n_entries[b])] at key row offset sum_{c < b} (W + n_entries[c]): window slots
    0..min(p+1, W)-1, then top [B, K] + W (ratio 4; -1 kept) or entries 0..E_b-1 (other
    ratios; none for ratio 0), each shifted by its session's offset; -1 = masked."""
    p = torch.tensor(positions, device=dev)
    n = torch.tensor(n_entries, device=dev)
    first = torch.cumsum(n + W, 0) - (n + W)  # [B]: each session's first key row
    slot = torch.arange(W, device=dev)[None, :]
    lists = [torch.where(slot <= p[:, None], slot, -1)]  # [B, W]: before the first wrap, slots 0..p
    if r == 4:
        lists.append(torch.where(top >= 0, top + W, -1))
    elif r:
        j = torch.arange(max(n_entries), device=dev)[None, :]
        lists.append(torch.where(j < n[:, None], j + W, -1))
    idx = torch.cat(lists, dim=1)
    return torch.where(idx >= 0, idx + first[:, None], -1)
