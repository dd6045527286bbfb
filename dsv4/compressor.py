"""KV compressor: pools every r consecutive tokens into one compressed entry (docs/model.md §5.6).
This module owns the pooling math, the per-sequence `CompressorState` of one compressor and
its verify-block journal (`CompressorJournal`); it never attends or selects entries
(`dsv4.attention`, `dsv4.indexer` consume the entries) and keeps no state outside the
`CompressorState` it is handed.

Dimension legend: S = tokens in a call, D = model dim, r = compress ratio, k = 2 if the
compressor is overlapped (r == 4) else 1, d = entry width (head_dim for the attention
compressor, index_head_dim for the indexer's), n = complete blocks, Dn = d - R (no-rope part).

Entry j covers positions [j*r, (j+1)*r). Per token t: v_t = wkv(x_t), g_t = wgate(x_t) +
ape[t mod r] (both [k*d], fp32). Plain: c_j = sum over the r slots of softmax_slots(g) * v,
per channel. Overlapped: 2r slots = the previous block's tokens (first half of v/g) then
the current block's tokens (second half); block 0's previous slots are value 0 / score -inf.
Then c = norm(c in model dtype), rope at position j*r, and with quantisation simulation
either the fp8 round trip of c[:Dn] (attention) or Hadamard + fp4 round trip (indexer).

Decode keeps the raw (v, g) rows of the unfinished block in `CompressorState` (`kv`,
`score`: [k*r, k*d]; overlapped: rows [0, r) = previous block, [r, 2r) = current block).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dsv4.codecs import act_quant_fp4, act_quant_fp8, hadamard_rotate
from dsv4.config import KV_QUANT_BLOCK  # fp8 sim block of the no-rope part of K/V (docs/model.md §5.2)
from dsv4.layers import Linear, RMSNorm, frozen_param, pad_rows
from dsv4.rope import Rope

FP4_QUANT_BLOCK = 32  # fp4 sim block of indexer vectors (docs/model.md §5.7)
# Blocks per finalisation tile (`Compressor.finalize_pending`): a constant, never chosen by the load,
# so an entry's arithmetic has one shape however many blocks complete in a step.
FINALIZE_BLOCKS = 8


@dataclass
class CompressorState:
    """Per-sequence compressor state.

    kv, score: [k*r, k*d] fp32 raw values / gate scores (ape included) of unfinished blocks
    (empty rows: value 0, score -inf). cache: [max_seq_len // r, d] model dtype, the entries;
    the first `n_entries` rows are valid.
    """

    kv: torch.Tensor
    score: torch.Tensor
    cache: torch.Tensor
    n_entries: int = 0
    journal: "CompressorJournal | None" = None  # open while a verify block steps this state

    def reset(self) -> None:
        """Back to empty: kv 0, score -inf, cache zeroed, no entries (docs/model.md §5.6 implementation note)."""
        self.kv.zero_()
        self.score.fill_(float("-inf"))
        self.cache.zero_()
        self.n_entries = 0
        self.journal = None

    def entries(self) -> torch.Tensor:
        """The valid entries [n_entries, d]."""
        return self.cache[: self.n_entries]


@dataclass
class CompressorJournal:
    """What a multi-token verify block did to one `CompressorState`, for exact rollback.

    rows: indices of the state rows the block may modify, saved before its first step
    (each token writes its own row; an overlapped boundary also overwrites rows [0, r));
    kv_rows, score_rows: their contents then; n_entries: the entry count then;
    steps: the (pos, v [k*d], g [k*d]) projections fed, in order, so kept tokens can be
    replayed bit for bit. Cache rows past the restored `n_entries` are invisible and are
    rewritten when their block completes again, so they are not saved.
    """

    rows: torch.Tensor
    kv_rows: torch.Tensor
    score_rows: torch.Tensor
    n_entries: int
    steps: list[tuple[int, torch.Tensor, torch.Tensor]]

    @property
    def saved_bytes(self) -> int:
        """Bytes copied out of the state when the journal was opened."""
        return self.kv_rows.numel() * self.kv_rows.element_size() * 2


# A block pooled but not yet stored (fast numerics, `Compressor.finalize_pending`): its state,
# its entry index j, and its slots' values and scores v, g [slots, d] fp32 (slots = 2r
# overlapped, else r), copied out before later tokens overwrite the state's rows.
PendingBlock = tuple[CompressorState, int, torch.Tensor, torch.Tensor]


class Compressor(nn.Module):
    """Attention or indexer compressor of one layer (docs/model.md §5.6).

    Parameters: wkv.weight, wgate.weight [k*d, D] fp32 (computed in fp32 as the reference),
    ape [r, k*d] fp32, norm.weight [d] fp32. `rotate=True` marks the indexer's compressor
    (Hadamard + fp4 sim when `quant_sim`); otherwise fp8 sim of c[:Dn] when `quant_sim`.
    """

    def __init__(self, dim: int, head_dim: int, ratio: int, rope: Rope, norm_eps: float,
                 dtype: torch.dtype, quant_sim: bool, rotate: bool, device: torch.device | str = "cpu"):
        super().__init__()
        self.ratio, self.head_dim, self.dtype = ratio, head_dim, dtype
        self.overlap = ratio == 4
        self.quant_sim, self.rotate = quant_sim, rotate
        width = (2 if self.overlap else 1) * head_dim
        self.wkv = Linear(dim, width, torch.float32, device)
        self.wgate = Linear(dim, width, torch.float32, device)
        self.ape = frozen_param((ratio, width), torch.float32, device)
        self.norm = RMSNorm(head_dim, norm_eps, device)
        self.rope = rope  # shared with the layer (not a state-dict entry: its buffer is non-persistent)

    def new_state(self, max_seq_len: int) -> CompressorState:
        """Empty state with room for max_seq_len // r entries."""
        dev = self.ape.device
        rows, width = self.ape.shape[0] * (2 if self.overlap else 1), self.ape.shape[1]
        st = CompressorState(
            kv=torch.zeros(rows, width, device=dev),
            score=torch.empty(rows, width, device=dev),
            cache=torch.zeros(max_seq_len // self.ratio, self.head_dim, dtype=self.dtype, device=dev),
        )
        st.reset()
        return st

    def state_mismatch(self, st: CompressorState, max_seq_len: int) -> str | None:
        """Why `st` is not a state `new_state(max_seq_len)` of this compressor could make, or None."""
        if not isinstance(st, CompressorState):
            return f"state is a {type(st).__name__}, not a CompressorState"
        dev = self.ape.device
        rows, width = self.ape.shape[0] * (2 if self.overlap else 1), self.ape.shape[1]
        for name, t in (("kv", st.kv), ("score", st.score)):
            if tuple(t.shape) != (rows, width) or t.dtype != torch.float32 or t.device != dev:
                return f"{name} {tuple(t.shape)} {t.dtype} on {t.device}, expected {(rows, width)} torch.float32 on {dev}"
        want = (max_seq_len // self.ratio, self.head_dim)
        if tuple(st.cache.shape) != want or st.cache.dtype != self.dtype or st.cache.device != dev:
            return (f"cache {tuple(st.cache.shape)} {st.cache.dtype} on {st.cache.device}, expected {want} "
                    f"{self.dtype} on {dev}")
        return None

    def _project(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [S, D], pos [S] -> v, g [S, k*d] fp32 (g includes ape[pos mod r])."""
        xf = x.float()
        return self.wkv(xf), self.wgate(xf) + self.ape[pos % self.ratio]

    def prefill(self, x: torch.Tensor, st: CompressorState) -> None:
        """Compress a whole prompt x [S, D] (positions 0..S-1) into a reset state.

        Writes entries 0..S//r-1 and hands the unfinished rows to the decode state: the
        last complete block's (v, g) to rows [0, r) when overlapped, the S mod r remainder
        tokens to rows off + (0..S mod r - 1) (off = r if overlapped else 0).
        """
        S, r, d = x.shape[0], self.ratio, self.head_dim
        st.reset()
        v, g = self._project(x, torch.arange(S, device=x.device))
        n = S // r
        cutoff = n * r
        if n:
            vb = v[:cutoff].view(n, r, -1)  # (n, r, k*d)
            gb = g[:cutoff].view(n, r, -1)  # (n, r, k*d)
            if self.overlap:
                prev_v = torch.cat((vb.new_zeros(1, r, d), vb[:-1, :, :d]))  # (n, r, d)
                prev_g = torch.cat((gb.new_full((1, r, d), float("-inf")), gb[:-1, :, :d]))  # (n, r, d)
                vb = torch.cat((prev_v, vb[:, :, d:]), dim=1)  # (n, 2r, d)
                gb = torch.cat((prev_g, gb[:, :, d:]), dim=1)  # (n, 2r, d)
            st.cache[:n] = self.finalize(pool(vb, gb), torch.arange(n, device=x.device) * r)
            st.n_entries = n
            if self.overlap:
                st.kv[:r], st.score[:r] = v[cutoff - r:cutoff], g[cutoff - r:cutoff]
        off = r if self.overlap else 0
        st.kv[off:off + S - cutoff], st.score[off:off + S - cutoff] = v[cutoff:], g[cutoff:]

    def step(self, x: torch.Tensor, pos: int, st: CompressorState) -> bool:
        """Feed one token x [1, D] at position `pos`; returns True when it completed entry pos // r.

        While `st.journal` is open (see `open_journal`) the token's projections are recorded
        so a verify block can be rolled back exactly (`rollback`).

        Overlapped: at a block boundary the current half (rows [r, 2r)) shifts into the
        previous half (rows [0, r)); nothing is cleared (the next block overwrites it).
        """
        v, g = self._project(x, torch.tensor([pos], device=x.device))
        if st.journal is not None:
            st.journal.steps.append((pos, v[0], g[0]))
        return self._write_token(v[0], g[0], pos, st)

    def project(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A token's projections: x [S, D], pos [S] -> v, g [S, k*d] fp32 (g includes
        ape[pos mod r]); row-wise, so exact mode computes them on its fixed row tiles."""
        return self._project(x, pos)

    def write_tile(self, v: torch.Tensor, g: torch.Tensor, start: int, n_real: int, st: CompressorState,
                   pending: list[PendingBlock] | None = None) -> None:
        """Feed tokens start..start+n_real-1 whose projections (`project`, computed over a whole
        pass: exact mode's tiles, fast mode's joined step) are the first n_real rows of v, g
        [R, k*d] fp32, as `step` feeds tokens one by one (journaled likewise). Padding rows
        never reach `st`. `pending` (fast numerics): completed blocks are appended to it and
        their entries written by `finalize_pending`; None writes each at once."""
        for i in range(n_real):
            if st.journal is not None:
                st.journal.steps.append((start + i, v[i], g[i]))
            self._write_token(v[i], g[i], start + i, st, pending)

    def write_decodes(self, v: torch.Tensor, g: torch.Tensor, positions: list[int],
                      states: list[CompressorState], pending: list[PendingBlock]) -> None:
        """Fast numerics: one decode token in each of B sessions, v, g [B, k*d] fp32 (`project`)
        of the token at positions[b] (int) for states[b] (B distinct states), fed as `step`
        feeds one (journaled likewise); the blocks they complete go to `pending`."""
        for st, pos, vb, gb in zip(states, positions, v.unbind(0), g.unbind(0)):
            if st.journal is not None:
                st.journal.steps.append((pos, vb, gb))
            self._write_token(vb, gb, pos, st, pending)

    def finalize_pending(self, pending: list[PendingBlock]) -> None:
        """Write the entries of the m blocks in `pending` (then emptied), pooled and finalised
        on fixed tiles of FINALIZE_BLOCKS blocks (the last one zero-padded), rather than one op
        per block. Until then those entries' cache rows are stale, though n_entries already
        counts them.

        Every entry, whichever path completes it (a decode, a verify block, a rollback's replay,
        the blocks of a whole batch step together), is computed on a tile of that one shape,
        and pooling and `finalize` are row-wise on it, so an entry does not depend on how many
        blocks, or which, are finalised with it: exact numerics' batch invariance needs that."""
        if not pending:
            return
        dev, T = pending[0][2].device, FINALIZE_BLOCKS
        m = len(pending)
        mp = -(-m // T) * T
        v = pad_rows(torch.stack([b[2] for b in pending]), mp)
        g = pad_rows(torch.stack([b[3] for b in pending]), mp)
        first = torch.tensor([j * self.ratio for _, j, _, _ in pending] + [0] * (mp - m), device=dev)
        entries = torch.cat([self.finalize(pool(v[i:i + T], g[i:i + T]), first[i:i + T])
                             for i in range(0, mp, T)])  # (mp, d)
        for (st, j, _, _), entry in zip(pending, entries.unbind(0)):
            st.cache[j] = entry
        pending.clear()

    def _write_token(self, v: torch.Tensor, g: torch.Tensor, pos: int, st: CompressorState,
                     pending: list[PendingBlock] | None = None) -> bool:
        """Write one token's projections v, g [k*d] at `pos` into `st`; pool at a block
        boundary: at once (pending None), or into `pending` for `finalize_pending`."""
        r, i = self.ratio, pos % self.ratio
        row = r + i if self.overlap else i
        st.kv[row], st.score[row] = v, g
        if (pos + 1) % r:
            return False
        block = self._take_block(st, pos // r)
        if pending is None:
            self.finalize_pending([block])
        else:
            pending.append(block)
        return True

    def _take_block(self, st: CompressorState, j: int) -> PendingBlock:
        """The slots of block j, just completed in `st`: (st, j, v, g [slots, d] fp32, copies);
        counts the entry and, overlapped, shifts the current half into the previous half."""
        r, d = self.ratio, self.head_dim
        if self.overlap:
            vs = torch.cat((st.kv[:r, :d], st.kv[r:, d:]))  # (2r, d)
            gs = torch.cat((st.score[:r, :d], st.score[r:, d:]))  # (2r, d)
            st.kv[:r].copy_(st.kv[r:])  # rows [0, r) and [r, 2r) are disjoint: no clone needed
            st.score[:r].copy_(st.score[r:])
        else:  # later tokens overwrite these rows before a deferred store reads them: copy
            vs, gs = st.kv.clone(), st.score.clone()
        st.n_entries = j + 1
        return st, j, vs, gs

    def open_journal(self, st: CompressorState, start_pos: int, n_tokens: int) -> CompressorJournal:
        """Open `st.journal`: save the rows tokens start_pos..start_pos+n_tokens-1 may modify.

        Each token writes row (r + pos % r) if overlapped else (pos % r); a block boundary of
        the overlapped layout also shifts rows [r, 2r) into [0, r).
        """
        r, span = self.ratio, range(start_pos, start_pos + n_tokens)
        rows = {p % r + (r if self.overlap else 0) for p in span}
        if self.overlap and any((p + 1) % r == 0 for p in span):
            rows.update(range(r))
        idx = torch.tensor(sorted(rows), device=st.kv.device)
        # indexing with a tensor copies: the saved rows do not follow later writes
        st.journal = CompressorJournal(idx, st.kv[idx], st.score[idx], st.n_entries, [])
        return st.journal

    def rollback(self, st: CompressorState, journal: CompressorJournal, keep: int) -> int:
        """Undo a journaled block, keeping its first `keep` tokens; returns bytes copied.

        Restores the saved rows and entry count, then replays the kept tokens' recorded
        projections (`_write_token`), so the state equals that of feeding only the kept tokens.
        """
        st.journal = None
        if keep >= len(journal.steps):  # everything kept: the state is already right
            return journal.saved_bytes
        st.kv[journal.rows], st.score[journal.rows] = journal.kv_rows, journal.score_rows
        st.n_entries = journal.n_entries
        for pos, v, g in journal.steps[:keep]:
            self._write_token(v, g, pos, st)
        return journal.saved_bytes * 2  # saved once, written back once

    def finalize(self, c: torch.Tensor, first_pos: torch.Tensor) -> torch.Tensor:
        """Pooled c [n, d] fp32 -> stored entries [n, d] model dtype: norm, rope at first_pos [n], quant sim."""
        c = self.rope(self.norm(c.to(self.dtype)), first_pos)
        if not self.quant_sim:
            return c
        if self.rotate:
            return act_quant_fp4(hadamard_rotate(c), FP4_QUANT_BLOCK)
        dn = self.head_dim - 2 * self.rope.inv_freq.shape[0]
        return torch.cat((act_quant_fp8(c[:, :dn], KV_QUANT_BLOCK), c[:, dn:]), dim=-1)


def pool(v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Channel-wise softmax pooling over slots: v, g [n, slots, d] fp32 -> [n, d]."""
    return (torch.softmax(g, dim=1) * v).sum(1)

