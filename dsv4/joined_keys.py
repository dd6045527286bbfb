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

    The compressor and indexer projections (`Attention.exact_rows`, row-wise) run once over
    all M rows; the decodes (one token, no journal) then build their keys together
    (`decode_keys`), and each other call on its own state (`Attention.keys`). Returns keys
    [sum of the calls' key rows, Dh] in kv's dtype (the decodes' keys first, then the other
    calls' in call order) and idx [M, K] int64: row i's list, offset into its own call's
    keys, padded with -1 (masked) to the longest list K.
    """
    dev = x.device
    starts = [c.start_pos + i for c, _, _ in calls for i in range(c.n_tokens)]
    rows = attn.exact_rows(x, qr, torch.tensor(starts, device=dev))  # () for ratio 0
    spans, a = [], 0
    for c, _, _ in calls:
        spans.append((a, a + c.n_tokens))
        a += c.n_tokens
    decodes = [i for i, (c, _, _) in enumerate(calls) if c.n_tokens == 1 and c.undo is None]
    keys, parts, offset = [], [], 0  # parts: (rows of idx, their lists shifted by their keys' offset)
    if decodes:
        every = len(decodes) == len(calls)  # the usual plain-decode step: no gather needed
        sel = slice(None) if every else torch.tensor([spans[i][0] for i in decodes], device=dev)
        k, idx = decode_keys(attn, kv[sel], tuple(t[sel] for t in rows),
                             [calls[i][0].start_pos for i in decodes], [calls[i][1] for i in decodes])
        keys.append(k)
        parts.append((sel, idx))
        offset = k.shape[0]
    built = set(decodes)
    for i, (call, st, _) in enumerate(calls):
        if i in built:
            continue
        a, b = spans[i]
        k, idx = attn.keys(x[a:b], qr[a:b], kv[a:b], call.start_pos, st, call.undo, tuple(t[a:b] for t in rows))
        parts.append((slice(a, b), torch.where(idx >= 0, idx + offset, -1)))
        keys.append(k)  # may be a view of the call's ring: the cat below copies it as it is now
        offset += k.shape[0]
    if len(parts) == 1:
        return torch.cat(keys), parts[0][1]
    width = max(t.shape[1] for _, t in parts)
    idx = torch.full((x.shape[0], width), -1, dtype=torch.int64, device=dev)
    for where, t in parts:
        idx[where, :t.shape[1]] = t
    return torch.cat(keys), idx


def decode_keys(attn: Attention, kv: torch.Tensor, rows: tuple[torch.Tensor, ...], positions: list[int],
                states: list[AttentionState]) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys of B decodes of B sessions, built together: decode b is one token at
    positions[b] (int, > 0) on states[b], kv [B, Dh] its key row, `rows` its
    `Attention.exact_rows` (each [B, ...]; () for ratio 0).

    Leaves every state as `Attention.keys` leaves it for that decode alone: ring slot p % W
    written, the compressors stepped (`Compressor.write_decodes`), the indexer's top-k taken
    over the session's own entries (`Indexer.topk_decodes`). Returns keys [sum_b (W + E_b),
    Dh] in the ring's dtype (per session: its ring, then its entries) and idx [B, W + Kc]
    int64: the ring slots holding positions p-W+1..p, then the selected (ratio 4) or all
    (other ratios) entries, each offset into the session's own keys; -1 = masked. A row's
    columns may be ordered differently from the per-call list (masked columns sit among
    them), which changes its reduction only by rounding.
    """
    W, r, dev = attn.window, attn.ratio, kv.device
    for st, p, k in zip(states, positions, kv.unbind(0)):
        st.ring[p % W] = k
    top = None
    if r == 4:
        index_states = [st.indexer for st in states]
        attn.indexer.compressor.write_decodes(rows[2], rows[3], positions, index_states)
        top = attn.indexer.topk_decodes(rows[4], rows[5], positions, index_states)  # [B, K]
    if r:
        attn.compressor.write_decodes(rows[0], rows[1], positions, [st.compressor for st in states])
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
