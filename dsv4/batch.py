"""The trunk's forward loop over one or several sequences at once (docs/architecture.md §4).
This module owns `run_pass`, the one loop embed -> blocks -> taps -> head that prefill,
decode, verify blocks and batches of decodes, verify blocks and prompt chunks of different
sessions all run, and `BatchItem`, one session's pending work in a batch. It checks nothing (the trunk
validates every item before a pass starts) and keeps no state: each sequence's state is the
`TrunkState` its item carries.

Dimension legend: N = rows of the pass (the tokens of every call, concatenated in item
order), S = tokens of one call, C = hc_mult lanes, D = dim, Lq = q_lora_rank, H = n_heads,
Dh = head_dim, V = vocab, T = len(dspark_target_layer_ids).

Per layer, the dense ops (mHC, norms, q / kv / output projections, gate, shared expert) run
once over all N rows through the numerics strategy's `dense`, the routed experts through its
`route`, and only attention (ring, compressors, indexer, key lists) runs per call on its own
slice of rows and its own state (its strategy's `attend`; exact mode then reduces the rows of
all calls together on fixed tiles). A row's computation is the one it would get alone: fast
mode to rounding, exact mode bitwise (`dsv4.numerics.ExactNumerics`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from dsv4.mhc import hc_post, hc_pre, sinkhorn_pairs
from dsv4.numerics import Call, FastNumerics
from dsv4.trunk_state import BlockOutput, BlockUndo, ForwardOutput, TrunkState


@dataclass(frozen=True)
class BatchItem:
    """One session's pending work for `Trunk.forward_batch`. Build with one of:

    * `BatchItem.decode`: one token at `start_pos` (`tokens` one integer); `taps`: whether it
      returns its tap row;
    * `BatchItem.block`: a verify block of the anchor and k drafts at start_pos.. (`verify`
      True; `tokens` a 1-D integer sequence / tensor of 1..k+1 ids), always with taps;
    * `BatchItem.prefill_chunk`: S prompt tokens at start_pos.. (`prefill` True), committed
      as they run (no undo record): the whole prompt from 0, or one chunk of it continuing a
      state prefilled up to start_pos; `keep_rows`: how many of its last positions' tap rows
      it returns (None: no taps); `all_logits`: it also returns the logits of every one of
      its positions (prompt logprobs), not only of its last.

    Values are checked by `Trunk.forward_batch`, exactly as `decode` / `forward_block` /
    `prefill` check theirs."""

    state: TrunkState
    tokens: Any
    start_pos: Any
    verify: bool = False
    taps: bool = True
    prefill: bool = False
    keep_rows: Any = None
    all_logits: bool = False

    @classmethod
    def decode(cls, state: TrunkState, token_id: Any, position: Any, taps: bool = True) -> "BatchItem":
        """The work of `Trunk.decode(state, token_id, position, taps)`."""
        return cls(state, token_id, position, False, taps)

    @classmethod
    def block(cls, state: TrunkState, token_ids: Any, start_pos: Any) -> "BatchItem":
        """The work of `Trunk.forward_block(state, token_ids, start_pos)`."""
        return cls(state, token_ids, start_pos, True, True)

    @classmethod
    def prefill_chunk(cls, state: TrunkState, token_ids: Any, start_pos: Any, keep_rows: Any = None,
                      all_logits: bool = False) -> "BatchItem":
        """Prompt tokens token_ids [S] at start_pos.. (= state.next_position), committed; its
        output is a ForwardOutput with the logits [V] fp32 of position start_pos + S - 1 and,
        unless keep_rows is None, the tap rows [min(keep_rows, S), T*D] fp32 of its last
        positions; with `all_logits`, also `prompt_logits` [S, V] fp32, the logits of every
        position (the head then runs over all S rows, otherwise over the last one only).
        `Trunk.prefill(state, ids, keep)` is the item of the whole prompt at 0."""
        return cls(state, token_ids, start_pos, False, keep_rows is not None, True, keep_rows, bool(all_logits))


@dataclass(frozen=True)
class Job:
    """A validated item: `call` on `state` with ids [S] int64; the pass returns logits of the
    call's last `n_logits` positions and taps of its last `n_taps` (None: no taps)."""

    state: TrunkState
    call: Call
    ids: torch.Tensor
    n_logits: int
    n_taps: int | None


@torch.no_grad()
def run_pass(model: Any, num: FastNumerics, jobs: list[Job]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Run every job's call in one pass of `model` (a `dsv4.trunk.Trunk`) under numerics `num`.

    Returns, per job in order, (logits [n_logits, V] fp32, taps [n_taps, T*D] fp32 or None).
    Each job's state advances to start_pos + S once the whole pass has succeeded; the
    caller opens verify blocks (the undo lists are filled by the pass). Several jobs may
    share one state when they are consecutive pieces of one prompt, in position order:
    every layer runs their attention in job order, so each piece sees the ones before it.
    """
    cfg, dev = model.cfg, model.embed.weight.device
    ids = torch.cat([j.ids for j in jobs])  # [N]
    pos = torch.cat([torch.arange(j.call.start_pos, j.call.start_pos + j.call.n_tokens, device=dev)
                     for j in jobs])  # [N]
    ends = list(itertools.accumulate(j.call.n_tokens for j in jobs))  # host ints: no tensor round trip
    spans = list(zip([0] + ends[:-1], ends))
    logit_rows = _last_rows(spans, [j.n_logits for j in jobs], dev)
    tap_rows = _last_rows(spans, [j.n_taps or 0 for j in jobs], dev)
    want_taps = any(j.n_taps is not None for j in jobs)
    small_m = all(j.call.small_m for j in jobs)
    taps = []
    with num.scope():
        rows = [(j.call, None, s) for j, s in zip(jobs, spans)]
        h = num.dense(lambda i: model.embed(i).unsqueeze(1).repeat(1, cfg.hc_mult, 1), ids, calls=rows)  # [N, C, D]
        for i, block in enumerate(model.layers):
            h = block(h, ids, pos, [(j.call, j.state.layers[i], s) for j, s in zip(jobs, spans)], num, small_m)
            if want_taps and i in cfg.dspark_target_layer_ids:
                taps.append(num.dense(model._lane_mean, h[tap_rows]))  # [sum n_taps, D]
        logits = num.dense(model._head, h[logit_rows])  # [sum n_logits, V]
    taps = torch.cat(taps, dim=-1) if taps else logits.new_zeros(tap_rows.numel(), 0)
    out, lo, tlo = [], 0, 0
    for j in jobs:
        nt = j.n_taps or 0
        out.append((logits[lo:lo + j.n_logits], taps[tlo:tlo + nt] if j.n_taps is not None else None))
        lo, tlo = lo + j.n_logits, tlo + nt
        j.state.next_position = j.call.start_pos + j.call.n_tokens
    return out


def finish(job: Job, logits: torch.Tensor, taps: torch.Tensor | None) -> ForwardOutput | BlockOutput:
    """A job's pass result as its API record: a decode's ForwardOutput (logits [V] fp32), or a
    verify block's BlockOutput, whose undo record this opens on the job's state."""
    call = job.call
    if call.undo is None:
        return ForwardOutput(logits=logits[0], taps=taps)
    record = BlockUndo(call.start_pos, call.n_tokens, call.undo, job.state._token)
    job.state.open_block = record
    return BlockOutput(logits, taps, record)


def prompt_pieces(state: TrunkState, start: int, ids: torch.Tensor, keep: int | None,
                  max_tokens: int | None, all_logits: bool = False) -> list[Job]:
    """A validated prompt chunk, ids [S] int64 at start.. on `state`, as its jobs: one, or
    (exact numerics, `max_tokens` = PROMPT_ROWS) consecutive pieces of at most max_tokens
    tokens, each one exact prompt tile. Logits are asked of the last piece only (position
    start + S - 1), or with `all_logits` of every position of every piece; the tap rows of
    the chunk's last `keep` positions (None: no taps) are spread over the pieces that hold
    them, so `join_pieces` returns them in order."""
    S = ids.shape[0]
    step = max_tokens or S
    jobs = []
    for a in range(0, S, step):
        b = min(a + step, S)
        taps = None if keep is None else max(0, min(b - a, b - (S - keep)))
        n_logits = b - a if all_logits else int(b == S)
        jobs.append(Job(state, Call(start + a, b - a, None, prefill=True), ids[a:b], n_logits, taps))
    return jobs


def join_pieces(parts: list[tuple[torch.Tensor, torch.Tensor | None]], all_logits: bool = False) -> ForwardOutput:
    """The pass results of a chunk's `prompt_pieces` -> its ForwardOutput: logits [V] fp32
    of its last position, taps [min(keep, S), T*D] fp32 (or None) of its last positions and,
    with `all_logits`, prompt_logits [S, V] fp32 of every position."""
    taps = None if parts[-1][1] is None else torch.cat([t for _, t in parts])
    every = torch.cat([lg for lg, _ in parts]) if all_logits else None
    return ForwardOutput(logits=parts[-1][0][-1], taps=taps, prompt_logits=every)


def _last_rows(spans: list[tuple[int, int]], counts: list[int], device: torch.device) -> torch.Tensor:
    """Row indices [sum counts] of the last counts[j] rows of every span (lo, hi)."""
    rows = [torch.arange(hi - c, hi, device=device) for (_, hi), c in zip(spans, counts)]
    return torch.cat(rows)


def layer(block: Any, num: FastNumerics, h: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor,
          calls: list[tuple[Call, Any, tuple[int, int]]], small_m: bool) -> torch.Tensor:
    """One trunk block (`dsv4.trunk.Block`) over the pass: h [N, C, D], ids / pos [N] -> [N, C, D].

    `calls`: per call, (call, its `AttentionState` of this layer, its rows (lo, hi)). The
    math is `Block.forward`'s, cut where attention needs the per-call state.
    """
    cfg, attn, moe = block.cfg, block.attn, block.ffn
    # The dense ops stop the Sinkhorn normalisation after its first column step (iters 1); its
    # remaining pairs run once over all N rows (`sinkhorn_pairs`), not once per exact tile:
    # they are most of mHC's ops, and their arithmetic is per row whatever the rows' count.
    eps, pairs = (cfg.norm_eps, cfg.hc_eps, 1), cfg.hc_sinkhorn_iters - 1

    def pre_attn(h, pos):
        x, post, comb = hc_pre(h, block.hc_attn_fn, block.hc_attn_scale, block.hc_attn_base, *eps)
        x = block.attn_norm(x)
        q, qr = attn.project_q(x, pos)
        return x, qr, q, attn.project_kv(x, pos), post, comb

    x, qr, q, kv, post, comb = num.dense(pre_attn, h, pos, calls=calls)
    comb = sinkhorn_pairs(comb, cfg.hc_eps, pairs)
    o = num.attend(attn, x, qr, q, kv, calls)  # [N, H, Dh]

    h, y, post, comb, weights, experts = num.dense(
        lambda *rows: _post_attn(block, *rows, eps), o, pos, h, post, comb, ids, calls=calls)
    comb = sinkhorn_pairs(comb, cfg.hc_eps, pairs)
    routed = num.route(moe, y, weights, experts, small_m)  # [N, D] fp32
    if moe.reduce_routed is not None:
        routed = moe.reduce_routed(routed)

    def ffn_out(y, routed, h, post, comb):
        out = (routed + moe.shared_experts(y).float()).to(y.dtype)
        return hc_post(out, h, post, comb)

    return num.dense(ffn_out, y, routed, h, post, comb, calls=calls)


def _post_attn(block: Any, o: torch.Tensor, pos: torch.Tensor, h: torch.Tensor, post: torch.Tensor,
               comb: torch.Tensor, ids: torch.Tensor, eps: tuple) -> tuple[torch.Tensor, ...]:
    """Rows after attention up to the routed experts: o [n, H, Dh] -> h [n, C, D] after the
    attention residual, y [n, D] the normed MoE input, post / comb of the ffn sublayer (comb
    before its remaining Sinkhorn pairs when eps says iters 1, as `layer` passes), and the
    gate's weights [n, k] fp32 / experts [n, k]."""
    h = hc_post(block.attn.project_out(o, pos), h, post, comb)
    y, post, comb = hc_pre(h, block.hc_ffn_fn, block.hc_ffn_scale, block.hc_ffn_base, *eps)
    y = block.ffn_norm(y)
    return (h, y, post, comb, *block.ffn.gate(y, ids))
