"""Lightning indexer of ratio-4 layers: picks the top-k compressed entries per query (docs/model.md
§5.7). This module owns the index scores and the top-k selection; it never attends, and its
compressor's state lives in the layer's `AttentionState`, not here.

Dimension legend: S = query tokens, D = dim, Lq = q_lora_rank, Hi = index_n_heads,
Di = index_head_dim, E = compressed entries available, K = min(index_topk, E).

score[s, t] = sum_h relu(qi[s, h] . kc[t]) * w[s, h], w = weights_proj(x) * Di^-0.5 * Hi^-0.5;
entry t is visible to the query at position p iff t < (p + 1) // 4 (its block is complete).
No softmax, no sink. The Hadamard rotation of queries and entries is applied only with
quantisation simulation: it is orthonormal, so without the fp4 round trip it leaves every
score unchanged. Ties break towards the lower entry index (a stable descending sort), so
prefill and decode select the same entries when scores are equal (e.g. several exact zeros
after the relu).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from dsv4.codecs import act_quant_fp4, hadamard_rotate
from dsv4.compressor import FP4_QUANT_BLOCK, Compressor, CompressorState
from dsv4.config import ModelConfig
from dsv4.layers import Linear, pad_rows
from dsv4.rope import Rope

INDEX_RATIO = 4


class Indexer(nn.Module):
    """Parameters: wq_b.weight [Hi*Di, Lq], weights_proj.weight [Hi, D] (model dtype), and an
    overlapped ratio-4 `compressor` of width Di (rotate=True). Uses its layer's `rope`."""

    def __init__(self, cfg: ModelConfig, rope: Rope, dtype: torch.dtype, quant_sim: bool,
                 device: torch.device | str = "cpu"):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.quant_sim = quant_sim
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype, device,
                           act_quant=quant_sim and cfg.weight_dtype == "fp8")
        self.weights_proj = Linear(cfg.dim, self.n_heads, dtype, device)
        self.compressor = Compressor(cfg.dim, self.head_dim, INDEX_RATIO, rope, cfg.norm_eps, dtype,
                                     quant_sim, rotate=True, device=device)
        self.rope = rope
        # Score weight scale from the GLOBAL head count: `dsv4.tp` shards the heads (n_heads
        # becomes this rank's count) and sets `reduce_scores`, which sums the per-head partial
        # scores [S, E] fp32 over the ranks before the top-k. TP=1 leaves it None.
        self.score_scale = self.head_dim ** -0.5 * self.n_heads ** -0.5
        self.reduce_scores: Callable[[torch.Tensor], torch.Tensor] | None = None

    def project_q(self, qr: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """qr [S, Lq] -> qi [S, Hi, Di]: wq_b, rope at pos [S]; Hadamard + fp4 sim when quant_sim."""
        qi = self.rope(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), pos)  # (S, Hi, Di)
        if self.quant_sim:
            qi = act_quant_fp4(hadamard_rotate(qi), FP4_QUANT_BLOCK)
        return qi

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """x [S, D] -> per-head score weights [S, Hi] fp32."""
        return self.weights_proj(x).float() * self.score_scale

    def forward(self, x: torch.Tensor, qr: torch.Tensor, start_pos: int, st: CompressorState) -> torch.Tensor:
        """Top-k entry indices for queries at positions start_pos.. (x [S, D], qr [S, Lq]) -> [S, K] int64.

        start_pos == 0: compresses the prompt (`Compressor.prefill`); otherwise feeds the S
        tokens one by one (`Compressor.step`). Slots with no visible entry hold -1.
        """
        S = x.shape[0]
        pos = torch.arange(start_pos, start_pos + S, device=x.device)
        if start_pos == 0:
            self.compressor.prefill(x, st)
        else:
            for s in range(S):
                self.compressor.step(x[s:s + 1], start_pos + s, st)
        return self.topk_stepped(self.project_q(qr, pos), self.head_weights(x), start_pos, st)

    def topk_stepped(self, qi: torch.Tensor, w: torch.Tensor, start_pos: int, st: CompressorState) -> torch.Tensor:
        """The top-k of S tokens at start_pos.. once their steps are in `st`: qi [S, Hi, Di],
        w [S, Hi] fp32 -> [S, K] int64 (-1 = none), each token seeing the entries complete at
        its own position."""
        pos = torch.arange(start_pos, start_pos + qi.shape[0], device=qi.device)
        scores = index_scores(qi, w, st.entries())  # [S, E]
        if self.reduce_scores is not None:
            scores = self.reduce_scores(scores)
        return select_topk(scores, (pos + 1) // INDEX_RATIO, self.topk)

    def topk_joined(self, qi: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, states: list[CompressorState],
                    owner: list[int]) -> torch.Tensor:
        """Fast numerics: the top-k of M tokens of several calls at once, each over its own
        session's entries, once every call's compressor steps are in its state: qi [M, Hi, Di],
        w [M, Hi] fp32 (`exact_rows`); token m at positions[m] (positions [M] int64, > 0) belongs to
        states[owner[m]] -> [M, K] int64 with K = min(index_topk, the most entries of any
        state), -1 = none. The states' entries are zero-padded to the longest and scored in one
        batched product; the padding columns are invisible, as are entries not yet complete at
        a token's position, so a row selects what `topk_stepped` selects for its call alone
        (scores agree to rounding)."""
        dev = qi.device
        kc = pad_sequence([st.entries() for st in states], batch_first=True)  # [C, Emax, Di]
        if owner != list(range(len(states))):  # not one row per state: each row its state's entries
            kc = kc[torch.tensor(owner, device=dev)]  # [M, Emax, Di]
        dots = torch.einsum("mhd,med->mhe", qi.float(), kc.float())  # [M, Hi, Emax]
        scores = (torch.relu(dots) * w.unsqueeze(-1)).sum(1)  # [M, Emax]
        if self.reduce_scores is not None:
            scores = self.reduce_scores(scores)
        n_entries = torch.tensor([states[o].n_entries for o in owner], device=dev)
        visible = torch.minimum((positions + 1) // INDEX_RATIO, n_entries)
        return select_topk(scores, visible, self.topk)

    def topk_tiled(self, qi: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, states: list[CompressorState],
                   owner: list[int], tile: int, chunk: int) -> torch.Tensor:
        """Exact numerics: the top-k of M tokens of several calls at once, each over its own
        session's entries, once every call's compressor steps are in its state: qi [M, Hi, Di],
        w [M, Hi] fp32 (`exact_rows`), token m at positions[m] (int64 [M]) of states[owner[m]]
        -> [M, index_topk] int64, exactly index_topk columns, -1 = none.

        The rows are cut into fixed tiles of `tile` rows (the last zero-padded), each row's
        entries zero-padded to Ep columns, a multiple of `chunk` >= index_topk; every tile
        scores every chunk of `chunk` entries with one product of the fixed shape (tile, Hi,
        Di) x (tile, Di, chunk), a row against its own session's entries only, so an entry's
        score depends on that row and that entry alone: not on which rows share the tile, nor
        on Ep (how many entries the step's longest session has). The selection (`select_topk`)
        only compares scores and is exact. Padding entries and entries not yet complete at a
        row's position are invisible."""
        dev, M = qi.device, qi.shape[0]
        kc = pad_sequence([st.entries() for st in states], batch_first=True)  # [C, Emax, Di]
        Ep = -(-max(kc.shape[1], self.topk, 1) // chunk) * chunk
        Mp = -(-M // tile) * tile
        kc = torch.nn.functional.pad(kc, (0, 0, 0, Ep - kc.shape[1]))  # [C, Ep, Di]
        kc = kc[torch.tensor(owner + [0] * (Mp - M), device=dev)]  # [Mp, Ep, Di]: each row its session's
        scores = index_scores_tiled(pad_rows(qi, Mp), pad_rows(w, Mp), kc, tile, chunk)[:M]  # [M, Ep]
        if self.reduce_scores is not None:
            scores = self.reduce_scores(scores)
        return select_topk(scores, (positions + 1) // INDEX_RATIO, self.topk)

    def exact_rows(self, x: torch.Tensor, qr: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Exact mode: the indexer's row-wise projections of tokens x [S, D], qr [S, Lq] at
        pos [S] -> (compressor v, g [S, Di*2] fp32, qi [S, Hi, Di], head weights [S, Hi] fp32),
        computed on the caller's fixed row tiles (`dsv4.numerics.ExactNumerics.attend`)."""
        return (*self.compressor.project(x, pos), self.project_q(qr, pos), self.head_weights(x))

    def exact_topk(self, rows: tuple[torch.Tensor, ...], start_pos: int, n_real: int, st: CompressorState,
                   chunk: int) -> torch.Tensor:
        """Exact mode (see `dsv4.attention`): `rows`, the `exact_rows` of an R-row tile whose
        first n_real rows are tokens at start_pos.. -> [R, index_topk] int64, exactly
        index_topk columns (-1 = none; padding rows all -1). Steps the compressor over the
        n_real tokens (`Compressor.write_tile`), then scores fixed chunks of entries
        (`index_scores_chunked`), so the selection of a position is the same in a decode and
        inside a verify block."""
        v, g, qi, w = rows
        R = qi.shape[0]
        pos = torch.arange(start_pos, start_pos + R, device=qi.device)
        self.compressor.write_tile(v, g, start_pos, n_real, st)
        scores = index_scores_chunked(qi, w, st.entries(), chunk, self.topk)
        if self.reduce_scores is not None:
            scores = self.reduce_scores(scores)
        n_visible = torch.where(pos < start_pos + n_real, (pos + 1) // INDEX_RATIO, 0)
        return select_topk(scores, n_visible, self.topk)


def index_scores_chunked(qi: torch.Tensor, w: torch.Tensor, kc: torch.Tensor, chunk: int,
                         min_cols: int) -> torch.Tensor:
    """`index_scores` over fixed chunks of `chunk` entries (exact mode): -> [S, Ep] fp32.

    The entries are zero-padded to Ep = a multiple of `chunk` >= max(E, min_cols), and each
    chunk is scored by the same fixed-shape matmul and head sum, so an entry's score does not
    depend on how many entries exist; columns >= E are padding (the caller masks them).
    """
    E = kc.shape[0]
    Ep = -(-max(E, min_cols, 1) // chunk) * chunk
    kp = kc.new_zeros(Ep, kc.shape[1])
    kp[:E] = kc
    return torch.cat([index_scores(qi, w, kp[c:c + chunk]) for c in range(0, Ep, chunk)], dim=1)


def index_scores_tiled(qi: torch.Tensor, w: torch.Tensor, kc: torch.Tensor, tile: int, chunk: int) -> torch.Tensor:
    """Exact numerics' scores of rows against their own entries: qi [M, Hi, Di], w [M, Hi] fp32,
    kc [M, Ep, Di] (row m's entries, zero-padded), M a multiple of `tile` and Ep of `chunk`
    -> scores [M, Ep] fp32 (`index_scores` per row).

    One product of the fixed shape (tile, Hi, Di) x (tile, Di, chunk) per tile of rows and
    chunk of entries, then relu, the head weights and the sum over heads: row m's score of
    entry e depends on qi[m], w[m] and kc[m, e] alone, not on M, Ep or the other rows."""
    qi, kc = qi.float(), kc.float()
    return torch.cat([torch.cat([(torch.relu(torch.einsum("mhd,med->mhe", qi[t:t + tile], kc[t:t + tile, c:c + chunk]))
                                  * w[t:t + tile, :, None]).sum(1) for c in range(0, kc.shape[1], chunk)], dim=1)
                      for t in range(0, qi.shape[0], tile)])


def index_scores(qi: torch.Tensor, w: torch.Tensor, kc: torch.Tensor) -> torch.Tensor:
    """qi [S, Hi, Di], w [S, Hi] fp32, kc [E, Di] -> scores [S, E] fp32 (docs/model.md §5.7)."""
    dots = torch.einsum("shd,ed->she", qi.float(), kc.float())  # [S, Hi, E]
    return (torch.relu(dots) * w.unsqueeze(-1)).sum(1)


def select_topk(scores: torch.Tensor, n_visible: torch.Tensor, topk: int) -> torch.Tensor:
    """Top-min(topk, E) visible entries per row: scores [S, E], n_visible [S] -> [S, K] int64, -1 = none.

    Entries t >= n_visible[s] are invisible to row s. Order: descending score, ties to the
    lower index.
    """
    E = scores.shape[1]
    k = min(topk, E)
    visible = torch.arange(E, device=scores.device)[None, :] < n_visible[:, None]  # [S, E]
    masked = scores.masked_fill(~visible, float("-inf"))
    top = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :k]  # [S, K]
    return torch.where(top < n_visible[:, None], top, torch.full_like(top, -1))
