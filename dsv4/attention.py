"""Attention of one trunk layer: sliding window + optional compressed entries, with a sink
(docs/model.md §5). This module owns the layer's attention math, its per-sequence state
(`AttentionState`: the ring and the compressor and indexer states) and the journal that undoes
a verify block (`AttentionUndo`, docs/architecture.md §4). It does not choose the numerics
recipe (`dsv4.numerics` picks the forward a call runs) and never validates request values.

Dimension legend: S = query tokens, D = dim, Lq = q_lora_rank, H = n_heads, Dh = head_dim,
R = rope_head_dim, Dn = Dh - R, W = window_size, r = compress ratio, G = o_groups,
Lo = o_lora_rank, Dg = H*Dh/G (input width of one output group), N = rows of the key/value
tensor attended over, K = index columns per query (-1 = masked).

K and V are the same Dh-wide latent (one KV head). A query at position p sees the window
positions [p-W+1, p] and the compressed entries complete at p: all of them for a plain
compressor (HCA), the indexer's top-k for ratio 4 (CSA), none for ratio 0.

Prefill (start_pos == 0) attends over [fresh kv (S rows) | the prompt's entries] and then
fills the ring with the last min(S, W) rows; decode (start_pos > 0, one token) writes ring
slot p % W first and attends over [ring (W rows) | cached entries]. A later chunk of a
prompt (start_pos > 0, S > 1 tokens, no undo list) takes the verify block's keys
(`_block_keys`) without its journal: the chunk is committed as it runs.

Exact mode (`Trunk(verify_numerics="exact")`): a prompt piece's keys are built on a fixed
tile of R = PROMPT_ROWS rows whose first `n_real` are the tokens (`exact_keys`); the decodes
and verify blocks of a pass build theirs together (`dsv4.joined_keys`, on `exact_rows`
computed over the pass's dense tiles). Every query gets the same key list in decode and
verify: window positions p, p-1, .., p-W+1 (ring before the call, then the call's own rows),
then its compressed entries (indexer: exactly index_topk columns; plain compressor: ascending
entries), padded with -1. The indexer scores fixed chunks of entries on fixed row tiles, and
the reduction (`sparse_attn_tiled`) runs every call's query rows together on fixed tiles of
rows, each folding over fixed chunks of EXACT_KEY_CHUNK keys, so no reduction's shape depends
on how many tokens a call holds, which other calls share the pass or how many entries exist
yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from dsv4.codecs import act_quant_fp8
from dsv4.compressor import KV_QUANT_BLOCK, Compressor, CompressorJournal, CompressorState
from dsv4.config import ModelConfig
from dsv4.indexer import Indexer
from dsv4.layers import Linear, RMSNorm, frozen_param
from dsv4.rope import Rope

EXACT_KEY_CHUNK = 64  # keys (and indexer entries) per reduction step in exact mode


@dataclass
class AttentionState:
    """Per-sequence state of one layer: ring [W, Dh] (position p in slot p % W), and the
    attention compressor's and indexer compressor's states (None when absent)."""

    ring: torch.Tensor
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None

    def reset(self) -> None:
        """Back to empty: ring zeroed, compressor states reset."""
        self.ring.zero_()
        for st in (self.compressor, self.indexer):
            if st is not None:
                st.reset()


@dataclass
class AttentionUndo:
    """What one verify block changed in one layer's `AttentionState` (rollback, docs/architecture.md §4).

    start_pos, n_tokens: the block's positions; slots: the ring slots it wrote (the last
    min(n_tokens, W) positions' p % W); ring_rows [len(slots), Dh]: those slots before the
    block; block_kv [n_tokens, Dh]: the block's own rows (kept ones are written back after a
    restore); compressor / indexer: their journals.
    """

    start_pos: int
    n_tokens: int
    slots: torch.Tensor
    ring_rows: torch.Tensor
    block_kv: torch.Tensor
    compressor: CompressorJournal | None = None
    indexer: CompressorJournal | None = None


class Attention(nn.Module):
    """One layer's attention, parameterised by (cfg, layer_id) (docs/model.md §5.1).

    Parameters: wq_a [Lq, D], q_norm [Lq], wq_b [H*Dh, Lq], wkv [Dh, D], kv_norm [Dh],
    attn_sink [H] fp32, wo_a [G*Lo, Dg], wo_b [D, G*Lo]; `compressor` when r > 0,
    `indexer` when r == 4. Linears hold `dtype`; norms, sink and compressor math are fp32.
    With `quant_sim`: fp8 activation sim before fp8-stored linears (not wo_a, which the
    reference keeps in bf16), fp8 sim of kv[:Dn] (blocks of 64), compressor/indexer sims.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, quant_sim: bool,
                 device: torch.device | str = "cpu", attend: Callable[..., torch.Tensor] | None = None):
        super().__init__()
        # `attend`: the sparse attention implementation (`kernels.select.KernelConfig.op`),
        # same signature as `sparse_attn`; None -> `sparse_attn`. Not used by exact mode.
        self.attend = sparse_attn if attend is None else attend
        D, H, Dh, G = cfg.dim, cfg.n_heads, cfg.head_dim, cfg.o_groups
        self.n_heads, self.head_dim, self.groups = H, Dh, G
        self.rope_dim, self.window, self.ratio = cfg.rope_head_dim, cfg.window_size, cfg.layer_ratio(layer_id)
        self.max_seq_len, self.quant_sim = cfg.max_seq_len, quant_sim
        self.softmax_scale = Dh ** -0.5
        self.eps = cfg.norm_eps
        fp8 = quant_sim and cfg.weight_dtype == "fp8"
        self.rope = Rope.for_layer(cfg, layer_id, device)
        self.wq_a = Linear(D, cfg.q_lora_rank, dtype, device, act_quant=fp8)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, device)
        self.wq_b = Linear(cfg.q_lora_rank, H * Dh, dtype, device, act_quant=fp8)
        self.wkv = Linear(D, Dh, dtype, device, act_quant=fp8)
        self.kv_norm = RMSNorm(Dh, cfg.norm_eps, device)
        self.attn_sink = frozen_param((H,), torch.float32, device)
        self.wo_a = Linear(H * Dh // G, G * cfg.o_lora_rank, dtype, device)
        self.wo_b = Linear(G * cfg.o_lora_rank, D, dtype, device, act_quant=fp8)
        self.compressor = self.indexer = None
        if self.ratio:
            self.compressor = Compressor(D, Dh, self.ratio, self.rope, cfg.norm_eps, dtype, quant_sim,
                                         rotate=False, device=device)
        if self.ratio == 4:
            self.indexer = Indexer(cfg, self.rope, dtype, quant_sim, device)

    def new_state(self) -> AttentionState:
        """Empty per-sequence state (ring zeros, compressor scores -inf)."""
        ring = torch.zeros(self.window, self.head_dim, dtype=self.wkv.weight.dtype, device=self.wkv.weight.device)
        return AttentionState(
            ring=ring,
            compressor=self.compressor.new_state(self.max_seq_len) if self.compressor else None,
            indexer=self.indexer.compressor.new_state(self.max_seq_len) if self.indexer else None,
        )

    def state_mismatch(self, st: AttentionState) -> str | None:
        """Why `st` cannot be this layer's state (another model's: window, head_dim, dtype,
        device, ratio, max_seq_len), or None. Compares with what `new_state` makes."""
        if not isinstance(st, AttentionState):
            return f"state is a {type(st).__name__}, not an AttentionState"
        w = self.wkv.weight
        want = (self.window, self.head_dim)
        if tuple(st.ring.shape) != want or st.ring.dtype != w.dtype or st.ring.device != w.device:
            return (f"ring {tuple(st.ring.shape)} {st.ring.dtype} on {st.ring.device}, expected {want} "
                    f"{w.dtype} on {w.device}")
        parts = (("compressor", self.compressor, st.compressor),
                 ("indexer", self.indexer.compressor if self.indexer else None, st.indexer))
        for name, module, cst in parts:
            if (module is None) != (cst is None):
                return (f"{name} state {'absent' if cst is None else 'present'}, but this layer "
                        f"(ratio {self.ratio}) {'has' if module is not None else 'has no'} {name}")
            if module is not None:
                problem = module.state_mismatch(cst, self.max_seq_len)
                if problem:
                    return f"{name}: {problem}"
        return None

    # ------------------------------------------------------------------ projections (reusable by DSpark)
    def project_q(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [S, D], pos [S] -> (q [S, H, Dh] roped, per-head unweighted RMS-scaled; qr [S, Lq]) (docs/model.md §5.2)."""
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)).float()  # (S, H, Dh)
        q = (q * torch.rsqrt(q.square().mean(-1, keepdim=True) + self.eps)).to(qr.dtype)
        return self.rope(q, pos), qr

    def project_kv(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [S, D], pos [S] -> kv [S, Dh]: kv_norm(wkv(x)), roped; fp8 sim of kv[:, :Dn] when quant_sim."""
        kv = self.rope(self.kv_norm(self.wkv(x)), pos)
        if self.quant_sim:
            dn = self.head_dim - self.rope_dim
            kv = torch.cat((act_quant_fp8(kv[:, :dn], KV_QUANT_BLOCK), kv[:, dn:]), dim=-1)
        return kv

    def project_out(self, o: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """o [S, H, Dh] -> [S, D]: inverse rope at pos, block-diagonal wo_a per group, wo_b (docs/model.md §5.5)."""
        o = self.rope(o, pos, inverse=True).flatten(1).unflatten(1, (self.groups, -1))  # (S, G, Dg)
        wa = self.wo_a.weight.unflatten(0, (self.groups, -1))  # (G, Lo, Dg)
        z = torch.einsum("sgd,grd->sgr", o.to(wa.dtype), wa)  # (S, G, Lo)
        return self.wo_b(z.flatten(1))

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, start_pos: int, st: AttentionState,
                undo: list[AttentionUndo] | None = None) -> torch.Tensor:
        """x [S, D] (normed sublayer input) at positions start_pos.. -> [S, D]; updates `st`.

        start_pos == 0 is a prefill of the prompt (or of its first chunk) into an empty state;
        start_pos > 0 without `undo` is one decode token (S == 1) or a later chunk of a prompt
        (S > 1, committed as it runs); with `undo` (a list to append this layer's
        `AttentionUndo` to) it is a verify block of S >= 1 tokens (`_block_keys`).
        """
        pos = torch.arange(start_pos, start_pos + x.shape[0], device=x.device)
        q, qr = self.project_q(x, pos)
        o = self.core(x, qr, q, self.project_kv(x, pos), start_pos, st, undo)
        return self.project_out(o, pos)

    def core(self, x: torch.Tensor, qr: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, start_pos: int,
             st: AttentionState, undo: list[AttentionUndo] | None) -> torch.Tensor:
        """The per-sequence part of `forward`, between the projections: x [S, D] normed input,
        qr [S, Lq], q [S, H, Dh], kv [S, Dh] of tokens at start_pos.. -> o [S, H, Dh] before
        `project_out`; reads and updates `st` (and journals into `undo` for a verify block).
        The batched forward (`dsv4.batch`) runs the projections over every session's rows at
        once and this per session."""
        keys, idx = self.keys(x, qr, kv, start_pos, st, undo)
        return self.attend(q, keys, self.attn_sink, idx, self.softmax_scale)

    def keys(self, x: torch.Tensor, qr: torch.Tensor, kv: torch.Tensor, start_pos: int,
             st: AttentionState, undo: list[AttentionUndo] | None,
             rows: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The state half of `core` (fast numerics): tokens x [S, D], qr [S, Lq], kv [S, Dh] at
        start_pos.. -> (keys [N, Dh] in kv's dtype, idx [S, K] int64 rows of keys, -1 = masked);
        writes the ring, steps the compressors (journaled into `undo` for a verify block).
        The reduction over them (`self.attend`) is the caller's, so a batched pass can run one
        reduction over several calls' lists. `keys` may be a view of `st.ring`: use it before
        `st` changes again.

        rows: for start_pos > 0, the tokens' compressor / indexer projections (`exact_rows`,
        S rows each) when the caller computed them over a whole pass; None computes them here.
        With rows, a decode takes a one-token block's keys without a journal (`_block_keys`).

        Raises:
            ValueError: `rows` given for a prefill (start_pos == 0), which projects its own.
        """
        S = x.shape[0]
        if start_pos == 0:
            if rows is not None:
                raise ValueError("Attention.keys: rows are for start_pos > 0, got a prefill (start_pos 0)")
            return self._prefill_keys(x, qr, kv, st)
        if undo is not None or S > 1 or rows is not None:  # a verify block, or a prompt chunk (no journal)
            return self._block_keys(x, qr, kv, start_pos, st, undo, rows)
        return self._decode_keys(x, qr, kv, start_pos, st)

    def exact_rows(self, x: torch.Tensor, qr: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Exact mode: the row-wise projections the key building needs, of tokens x [S, D],
        qr [S, Lq] at pos [S]: the attention compressor's v, g [S, k*d] fp32 (ratio > 0), then
        the indexer's `Indexer.exact_rows` (ratio 4); () for ratio 0. Row-wise, so the
        caller computes them on its fixed row tiles over every call of the pass at once."""
        if not self.ratio:
            return ()
        rows = self.compressor.project(x, pos)
        return (*rows, *self.indexer.exact_rows(x, qr, pos)) if self.indexer is not None else rows

    def exact_keys(self, kv: torch.Tensor, rows: tuple[torch.Tensor, ...], start_pos: int, n_real: int,
                   st: AttentionState, undo: list[AttentionUndo] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact mode (module docstring): the key rows and index lists of a tile of R rows
        (kv [R, Dh] and `rows`, the tile's `exact_rows`) whose rows < n_real are tokens at
        start_pos.. (a decode or a piece of a prompt when `undo` is None, else a verify block)
        -> keys [W + R + E, Dh] in kv's dtype and idx [R, W + Kc] int64 (-1 = masked; padding
        rows all -1). Reads and updates `st` (padding rows never reach it); the reduction is
        the caller's (`sparse_attn_tiled`), so several calls' rows can share its tiles."""
        return self._exact_keys(kv, rows, start_pos, n_real, st, undo)

    def rollback(self, st: AttentionState, record: AttentionUndo, keep: int, ring: bool = True,
                 compressor: bool = True) -> int:
        """Undo a verify block's tokens keep..n_tokens-1 in `st`; returns bytes copied (saves + restores).

        `ring=False` / `compressor=False` skip that part (tests show each is needed).
        """
        row_bytes = record.ring_rows.element_size() * record.ring_rows.shape[1]
        copied = record.ring_rows.shape[0] * row_bytes  # the save
        if ring and keep < record.n_tokens:
            # Restore every written slot, then write the kept rows back: the ring then holds
            # exactly positions start_pos + keep - W .. start_pos + keep - 1.
            st.ring[record.slots] = record.ring_rows
            kept = torch.arange(record.start_pos, record.start_pos + keep, device=st.ring.device)[-self.window:]
            st.ring[kept % self.window] = record.block_kv[: keep][-self.window:]
            copied += (record.ring_rows.shape[0] + kept.numel()) * row_bytes
        parts = ((self.compressor, record.compressor, st.compressor),
                 (self.indexer.compressor if self.indexer else None, record.indexer, st.indexer))
        for module, journal, cst in parts:
            if journal is None:
                continue
            if compressor:
                copied += module.rollback(cst, journal, keep)
            else:
                cst.journal = None
        return copied

    def _block_keys(self, x: torch.Tensor, qr: torch.Tensor, kv: torch.Tensor, n: int, st: AttentionState,
                    undo: list[AttentionUndo] | None,
                    rows: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [W + S + E, Dh] = [ring before the block | block kv | entries] and per-query
        index lists [S, W + Kc] for a verify block at positions n..n+S-1 (docs/architecture.md §4).

        The three rules: (1) query n+i reads window positions < n from the ring as it was
        before the block (the block's writes evict positions still in earlier queries'
        windows) and positions >= n from the block's own rows; (2) it sees only the
        compressed entries complete at n+i (plain: j < (n+i+1)//r; indexer top-k restricted
        per query); (3) the compressors step token by token and may emit entries mid-block
        (on `rows`, the tokens' precomputed projections, when given: see `keys`).
        Every state change is journaled in an `AttentionUndo` appended to `undo`; with `undo`
        None (a later chunk of a prompt, never rolled back) nothing is journaled.
        """
        record = self.block_step(x, kv, n, st, undo, rows)
        top = None
        if self.ratio == 4:
            pos = torch.arange(n, n + x.shape[0], device=x.device)
            qi, w = rows[4:6] if rows is not None else (self.indexer.project_q(qr, pos), self.indexer.head_weights(x))
            top = self.indexer.topk_stepped(qi, w, n, st.indexer)  # [S, K]
        return self.block_finish(kv, n, st, undo, record, top)

    def block_step(self, x: torch.Tensor, kv: torch.Tensor, n: int, st: AttentionState,
                   undo: list[AttentionUndo] | None, rows: tuple[torch.Tensor, ...] | None,
                   pending: tuple[list, list] | None = None) -> AttentionUndo | None:
        """The state half of `_block_keys` before the lists: tokens x [S, D], kv [S, Dh] at
        n..n+S-1 (a verify block with `undo`, else a later prompt chunk). Saves the ring slots
        the block will write and opens the compressors' journals (undo given; returns that
        `AttentionUndo`, else None), then steps the indexer's compressor and the attention
        compressor token by token, on `rows` (`exact_rows`) when given, else on x.

        pending (with `rows`; fast numerics' joined step): the (attention compressor's,
        indexer compressor's) lists completed blocks go to, stored later by
        `Compressor.finalize_pending`; None stores each at once."""
        S, r = kv.shape[0], self.ratio
        slots = self._block_slots(n, S, kv.device)
        record = AttentionUndo(n, S, slots, st.ring[slots].clone(), kv) if undo is not None else None
        parts = ((self.indexer.compressor if r == 4 else None, "indexer", 2, 1),
                 (self.compressor if r else None, "compressor", 0, 0))
        for module, name, at, which in parts:
            if module is None:
                continue
            cst = getattr(st, name)
            if record is not None:
                setattr(record, name, module.open_journal(cst, n, S))
            if rows is not None:
                module.write_tile(rows[at], rows[at + 1], n, S, cst, None if pending is None else pending[which])
            else:
                for i in range(S):
                    module.step(x[i:i + 1], n + i, cst)
        return record

    def block_finish(self, kv: torch.Tensor, n: int, st: AttentionState, undo: list[AttentionUndo] | None,
                     record: AttentionUndo | None, top: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rest of `_block_keys` once `block_step` ran and the entries are stored: kv
        [S, Dh] of tokens n.., top [S, K] int64 the indexer's selection (ratio 4, else None)
        -> (keys [W + S + E, Dh], idx [S, W + Kc] int64); writes the block's ring slots and
        appends `record` (when not None) to `undo`."""
        S, W, r = kv.shape[0], self.window, self.ratio
        q_pos = torch.arange(n, n + S, device=kv.device)
        lists = [self.window_list(q_pos, n)]
        if r == 4:
            lists.append(torch.where(top >= 0, top + W + S, top))
        keys = torch.cat((st.ring, kv, st.compressor.entries()) if r else (st.ring, kv))
        if r and r != 4:
            lists.append(self.plain_entry_list(q_pos, st.compressor.n_entries, W + S))
        st.ring[self._block_slots(n, S, kv.device)] = kv[-W:]
        if record is not None:
            undo.append(record)
        return keys, torch.cat(lists, dim=1)

    def _block_slots(self, n: int, S: int, dev: torch.device) -> torch.Tensor:
        """Ring slots [min(S, W)] of a call's tokens n..n+S-1 that stay in the ring (its last W)."""
        return torch.arange(n, n + S, device=dev)[-self.window:] % self.window

    def window_list(self, q_pos: torch.Tensor, n: int | torch.Tensor) -> torch.Tensor:
        """Window index lists [Q, W] for queries at q_pos [Q] of a call starting at n (an int,
        or [Q, 1] int64: each query's own call's start): positions q, q-1, .. q-W+1; those >= n
        are the call's own rows (W + offset), earlier ones are ring slots as they were before
        the call (pos % W), negative positions -1."""
        W = self.window
        win_pos = q_pos[:, None] - torch.arange(W, device=q_pos.device)[None, :]  # [Q, W]
        win = torch.where(win_pos >= n, W + win_pos - n, win_pos % W)
        return torch.where(win_pos >= 0, win, -1)

    def plain_entry_list(self, q_pos: torch.Tensor, n_entries: int, offset: int | torch.Tensor) -> torch.Tensor:
        """Plain-compressor lists [Q, n_entries]: entry j (at key row offset + j) for j < (q+1)//r,
        else -1; `offset` an int or [Q, 1] int64 (each query's own)."""
        j = torch.arange(n_entries, device=q_pos.device)
        return torch.where(j[None, :] < ((q_pos + 1) // self.ratio)[:, None], j[None, :] + offset, -1)

    def _exact_keys(self, kv: torch.Tensor, rows: tuple[torch.Tensor, ...], n: int, S: int,
                    st: AttentionState, undo: list[AttentionUndo] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact mode: keys [W + R + E, Dh] = [ring before the call | the tile's kv | entries] and
        index lists [R, W + Kc] (padding rows all -1) for tokens n..n+S-1 of an R-row tile.

        The same lists for a position whether it is decoded alone or inside a block: window
        positions in descending order, then the indexer's top-k (exactly index_topk columns)
        or the plain compressor's visible entries in ascending order. Compressors step token by
        token on the tile's projections (`Compressor.write_tile`); with `undo` (a verify block)
        every change is journaled as in `_block_keys`.
        """
        R, W, r, dev = kv.shape[0], self.window, self.ratio, kv.device
        slots = torch.arange(n, n + S, device=dev)[-W:] % W
        record = AttentionUndo(n, S, slots, st.ring[slots].clone(), kv[:S]) if undo is not None else None
        q_pos = torch.arange(n, n + R, device=dev)
        lists = [self.window_list(q_pos, n)]
        if r == 4:
            if record is not None:
                record.indexer = self.indexer.compressor.open_journal(st.indexer, n, S)
            top = self.indexer.exact_topk(rows[2:], n, S, st.indexer, EXACT_KEY_CHUNK)  # [R, index_topk]
            lists.append(torch.where(top >= 0, top + W + R, top))
        keys = torch.cat((st.ring, kv))
        if r:
            if record is not None:
                record.compressor = self.compressor.open_journal(st.compressor, n, S)
            self.compressor.write_tile(rows[0], rows[1], n, S, st.compressor)
            keys = torch.cat((keys, st.compressor.entries()))
        if r and r != 4:
            lists.append(self.plain_entry_list(q_pos, st.compressor.n_entries, W + R))
        idx = torch.cat(lists, dim=1)
        idx[S:] = -1  # padding rows attend to nothing (output 0)
        st.ring[slots] = kv[:S][-W:]
        if record is not None:
            undo.append(record)
        return keys, idx

    def _prefill_keys(self, x: torch.Tensor, qr: torch.Tensor, kv: torch.Tensor,
                      st: AttentionState) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [S + n, Dh] = [kv | entries] and index lists [S, Kw + Kc] for a prompt (docs/model.md §5.4)."""
        S, W, r = x.shape[0], self.window, self.ratio
        t = torch.arange(S, device=x.device)
        win = t[:, None] - torch.arange(min(S, W), device=x.device)[None, :]  # [S, Kw]: t, t-1, ...
        lists = [win.clamp(min=-1)]
        keys = kv
        if r == 4:
            top = self.indexer(x, qr, 0, st.indexer)  # [S, K]
            lists.append(torch.where(top >= 0, top + S, top))
        if r:
            self.compressor.prefill(x, st.compressor)
            keys = torch.cat((kv, st.compressor.entries()))
        if r and r != 4:
            lists.append(self.plain_entry_list(t, S // r, S))  # [S, S//r]
        keep = min(S, W)
        st.ring[(t[-keep:] % W)] = kv[-keep:]
        return keys, torch.cat(lists, dim=1)

    def _decode_keys(self, x: torch.Tensor, qr: torch.Tensor, kv: torch.Tensor, p: int,
                     st: AttentionState) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [W + n, Dh] = [ring | entries] and the index list [1, Kw + Kc] for position p
        (docs/model.md §5.4)."""
        W, r = self.window, self.ratio
        lists = [torch.arange(min(p + 1, W), device=x.device)]  # ring slots holding positions p-W+1..p
        if r == 4:
            top = self.indexer(x, qr, p, st.indexer)[0]  # [K], stepping the indexer's compressor
            lists.append(torch.where(top >= 0, top + W, top))
        st.ring[p % W] = kv[0]
        keys = st.ring
        if r:
            self.compressor.step(x, p, st.compressor)
            keys = torch.cat((keys, st.compressor.entries()))
        if r and r != 4:
            lists.append(W + torch.arange(st.compressor.n_entries, device=x.device))
        return keys, torch.cat(lists)[None, :]


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                scale: float) -> torch.Tensor:
    """Gather-then-softmax attention with a per-head sink in the denominator (docs/model.md §5.4).

    q [S, H, Dh], kv [N, Dh] (key = value), sink [H] fp32, idx [S, K] int64 rows of kv
    (-1 = masked), scale = Dh^-0.5. Returns [S, H, Dh] in q.dtype. Stable form: the running
    max includes the sink, m = max(max logits, sink); out = sum exp(l - m) v / (sum exp(l - m)
    + exp(sink - m)). Computed in fp32.
    """
    rows = kv[idx.clamp(min=0)].float()  # (S, K, Dh)
    logits = torch.einsum("shd,skd->shk", q.float(), rows) * scale  # (S, H, K)
    logits = logits.masked_fill((idx < 0)[:, None, :], float("-inf"))
    m = torch.maximum(logits.amax(-1), sink[None, :]).unsqueeze(-1)  # (S, H, 1)
    p = torch.exp(logits - m)
    den = p.sum(-1, keepdim=True) + torch.exp(sink[None, :, None] - m)
    return torch.einsum("shk,skd->shd", p / den, rows).to(q.dtype)


def sparse_attn_chunked(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                        scale: float, chunk: int) -> torch.Tensor:
    """`sparse_attn` as a left fold over fixed chunks of `chunk` index columns (exact mode).

    Same arguments and result (up to rounding) as `sparse_attn`. Every matmul and sum has a
    shape fixed by (rows, heads, chunk), and a trailing chunk of masked columns adds exact
    zeros (p = exp(-inf) = 0, m unchanged), so a query's output is bitwise the same whatever
    the number of rows in the call and however many masked columns pad its list.
    """
    S, K = idx.shape
    Kp = max(chunk, -(-K // chunk) * chunk)
    idx = torch.nn.functional.pad(idx, (0, Kp - K), value=-1)  # [S, Kp]
    rows = kv[idx.clamp(min=0)].float()  # (S, Kp, Dh)
    qf, masked = q.float(), (idx < 0)[:, None, :]  # masked (S, 1, Kp)
    logits = [torch.einsum("shd,skd->shk", qf, rows[:, c:c + chunk]).mul_(scale)
              .masked_fill_(masked[..., c:c + chunk], float("-inf")) for c in range(0, Kp, chunk)]  # (S, H, chunk)
    m = sink[None, :].expand(S, -1)
    for lg in logits:
        m = torch.maximum(m, lg.amax(-1))
    m = m.unsqueeze(-1)  # (S, H, 1)
    den = out = None
    for c, lg in zip(range(0, Kp, chunk), logits):
        p = torch.exp(lg - m)
        part, pv = p.sum(-1, keepdim=True), torch.einsum("shk,skd->shd", p, rows[:, c:c + chunk])
        den, out = (part, pv) if den is None else (den + part, out + pv)
    den = den + torch.exp(sink[None, :, None] - m)
    return (out / den).to(q.dtype)


def sparse_attn_tiled(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                      scale: float, chunk: int, tile: int) -> torch.Tensor:
    """`sparse_attn_chunked` on fixed tiles of `tile` query rows (exact mode): q [S, H, Dh],
    kv [N, Dh], sink [H] fp32, idx [S, K] int64 (-1 = masked) -> [S, H, Dh] in q.dtype.

    The rows are cut into tiles of `tile` rows in order (the last one padded with zero
    queries whose lists are all masked, output 0), so every reduction has the shape
    (tile, H, chunk) whatever S is: a row's output depends on its own query and key list only,
    not on which rows share its tile, nor on how many masked columns pad the lists to K.
    """
    S = q.shape[0]
    n = -(-S // tile) * tile
    if n != S:
        q = torch.cat((q, q.new_zeros(n - S, *q.shape[1:])))
        idx = torch.cat((idx, idx.new_full((n - S, idx.shape[1]), -1)))
    outs = [sparse_attn_chunked(q[i:i + tile], kv, sink, idx[i:i + tile], scale, chunk) for i in range(0, n, tile)]
    return torch.cat(outs)[:S]
