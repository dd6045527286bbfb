"""Training forward of the trunk: what `Trunk.prefill` computes, for every position, with gradients.

Owns the differentiable, stateless restatement of the prefill path and the training-only
routing rules (indexer auxiliary loss, gate-bias updates); it reuses `dsv4`'s modules and must
never compute anything the inference prefill does not (a test holds the two equal).

Dimension legend: S = tokens of one sequence (positions 0..S-1), D = dim, C = hc_mult,
H = n_heads, Dh = head_dim, W = window_size, r = compress ratio, E = compressed entries
(S // r), Hi / Di = indexer heads / head dim, V = vocab, N = keys attended over (S + E).

The model's modules are inference-oriented: parameters are created with requires_grad off,
`Trunk._forward` runs under `torch.no_grad` and returns the last position's logits only, and
attention keeps per-sequence ring / compressor states. `trunk_logits` is the training
counterpart of the prefill path (start_pos 0): it reuses the same modules and parameters
(the caller turns requires_grad on, `trainable_parameters`) and the same pieces of math
(`Attention.project_q/project_kv/project_out`, `Compressor.finalize`, `compressor.pool`,
`Indexer.project_q/head_weights`, `index_scores`, `select_topk`, `Gate`, `MoE.combine`, the
mHC functions; `residual` restates `Block`'s three-line mHC residual so those functions can
be compiled) without per-sequence state, and returns logits for all S positions. A test (tests/test_training_forward.py) checks the logits against
`Trunk.prefill` of every prefix (fp32, rel 1e-5).

Two routing decisions are discrete and get no gradient from the language-model loss:

* Indexer (ratio-4 layers). Its top-k selection is non-differentiable, so the indexer is
  trained by an auxiliary loss instead: for every query, KL(p_attn || softmax(score)) over the
  compressed entries visible to it, where score = the indexer's score (`index_scores`) and
  p_attn = the layer's own attention probabilities over ALL visible entries (dense, not only the
  top-k; softmax per head over the entries, summed over heads, renormalised), detached. The
  indexer sees detached inputs (x, q_norm output), so the auxiliary loss trains only the
  indexer's parameters (wq_b, weights_proj, its compressor) and the LM loss only the rest
  (the DeepSeek-V3.2 lightning-indexer recipe). Selection uses the same scores.
* MoE. Scored layers: the gate weight is trained through the routing weights; the gate bias,
  which only shifts selection, is updated outside the optimizer by the auxiliary-loss-free rule
  of DeepSeek-V3 (`update_gate_biases`: bias_e += gamma * sign(mean load - load_e) after each
  step). Hash layers route by the fixed `tid2eid` table, balanced by construction
  (`training.train_trunk.balanced_tid2eid` spreads token frequency mass evenly over experts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from dsv4.attention import Attention
from dsv4.compressor import Compressor, pool
from dsv4.indexer import INDEX_RATIO, index_scores, select_topk
from dsv4.layers import RMSNorm
from dsv4.mhc import hc_head, hc_post, hc_pre
from dsv4.moe import MoE
from dsv4.trunk import Block, Trunk


@dataclass(frozen=True)
class MhcFns:
    """The mHC functions the training forward calls: `dsv4.mhc.hc_pre` / `hc_post` themselves,
    or (`compiled_mhc`) their `torch.compile`d versions, which fuse the 20 Sinkhorn steps'
    small element-wise ops (forward and backward; the speed-up is in bench/README.md, "Training")."""

    hc_pre: Callable = hc_pre
    hc_post: Callable = hc_post


def compiled_mhc() -> MhcFns:
    """`MhcFns` compiled with `torch.compile` (static shapes; needs a C++ compiler; compiles on
    first use, ~15-40 s on one core). Numerically close to eager, not bit-equal."""
    return MhcFns(torch.compile(hc_pre, dynamic=False), torch.compile(hc_post, dynamic=False))


EAGER = MhcFns()


@dataclass
class ForwardStats:
    """Side outputs of one `trunk_logits` call.

    index_kl: per ratio-4 layer, the indexer's auxiliary KL loss (scalar tensors with grad);
    expert_load: layer id -> tokens routed to each expert [E] int64 (scored and hash layers).
    """

    index_kl: list[torch.Tensor] = field(default_factory=list)
    expert_load: dict[int, torch.Tensor] = field(default_factory=dict)


def trainable_parameters(trunk: Trunk) -> list[tuple[str, torch.nn.Parameter]]:
    """Turn requires_grad on for every trunk parameter except the gate biases; return them by name.

    Gate biases (`*.ffn.gate.bias`) only shift expert selection and are updated by
    `update_gate_biases`; `tid2eid` is a buffer and never trained.
    """
    out = []
    for name, p in trunk.named_parameters():
        p.requires_grad_(not name.endswith("gate.bias"))
        if p.requires_grad:
            out.append((name, p))
    return out


def compress(comp: Compressor, x: torch.Tensor) -> torch.Tensor:
    """Entries of a prompt x [S, D] (positions 0..S-1): [S // r, d], as `Compressor.prefill` stores them.

    Entry j pools positions [j*r, (j+1)*r) (overlapped: also the previous block's first half,
    block 0's previous slots value 0 / score -inf), then `Compressor.finalize`.
    """
    S, r, d = x.shape[0], comp.ratio, comp.head_dim
    n = S // r
    if n == 0:
        return x.new_zeros(0, d, dtype=comp.dtype)
    pos = torch.arange(n * r, device=x.device)
    xf = x[: n * r].float()
    v = comp.wkv(xf).view(n, r, -1)  # (n, r, k*d)
    g = (comp.wgate(xf) + comp.ape[pos % r]).view(n, r, -1)  # (n, r, k*d)
    if comp.overlap:
        prev_v = torch.cat((v.new_zeros(1, r, d), v[:-1, :, :d]))  # (n, r, d)
        prev_g = torch.cat((g.new_full((1, r, d), float("-inf")), g[:-1, :, :d]))  # (n, r, d)
        v = torch.cat((prev_v, v[:, :, d:]), dim=1)  # (n, 2r, d)
        g = torch.cat((prev_g, g[:, :, d:]), dim=1)  # (n, 2r, d)
    return comp.finalize(pool(v, g), torch.arange(n, device=x.device) * r)


def masked_attn(q: torch.Tensor, keys: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                scale: float) -> torch.Tensor:
    """`dsv4.attention.sparse_attn` computed densely: the same softmax with sink, over a mask.

    q [S, H, Dh], keys [N, Dh] (key = value), sink [H] fp32, idx [S, K] rows of keys (-1 =
    masked, each row's entries distinct). Returns [S, H, Dh] in q.dtype, computed in fp32.
    Dense is cheaper to differentiate than the gather (no [S, K, Dh] scatter in backward).
    """
    S, N = q.shape[0], keys.shape[0]
    mask = torch.zeros(S, N + 1, dtype=torch.bool, device=q.device)
    mask.scatter_(1, torch.where(idx >= 0, idx, N), True)  # column N collects the -1 slots
    kf = keys.float()
    logits = torch.einsum("shd,nd->shn", q.float(), kf) * scale  # (S, H, N)
    logits = logits.masked_fill(~mask[:, None, :N], float("-inf"))
    m = torch.maximum(logits.amax(-1), sink[None, :]).unsqueeze(-1).detach()  # (S, H, 1)
    p = torch.exp(logits - m)
    den = p.sum(-1, keepdim=True) + torch.exp(sink[None, :, None] - m)
    return torch.einsum("shn,nd->shd", p / den, kf).to(q.dtype)


def _indexer_topk(attn: Attention, x: torch.Tensor, qr: torch.Tensor, q: torch.Tensor,
                  entries: torch.Tensor, stats: ForwardStats | None) -> torch.Tensor:
    """Top-k entry ids [S, K] (-1 = none) of a ratio-4 layer, and its auxiliary KL loss into `stats`.

    The indexer runs on detached x [S, D] and qr [S, Lq]; the target is the attention's own
    distribution over visible entries from q [S, H, Dh] and entries [E, Dh], detached.
    """
    ix = attn.indexer
    S = x.shape[0]
    pos = torch.arange(S, device=x.device)
    xd, qd = x.detach(), qr.detach()
    kc = compress(ix.compressor, xd)  # [E, Di]
    scores = index_scores(ix.project_q(qd, pos), ix.head_weights(xd), kc)  # [S, E] fp32
    n_visible = (pos + 1) // INDEX_RATIO  # [S]
    top = select_topk(scores.detach(), n_visible, ix.topk)
    if stats is not None and kc.shape[0]:
        visible = torch.arange(kc.shape[0], device=x.device)[None, :] < n_visible[:, None]  # [S, E]
        with torch.no_grad():
            al = torch.einsum("shd,ed->she", q.float(), entries.float()) * attn.softmax_scale  # (S, H, E)
            pa = al.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1).nan_to_num(0.0).sum(1)
            target = pa / pa.sum(-1, keepdim=True).clamp(min=1e-30)  # [S, E]
        logq = scores.masked_fill(~visible, float("-inf")).log_softmax(-1)
        rows = n_visible > 0
        kl = (target * (target.clamp(min=1e-30).log() - logq)).masked_fill(~visible, 0.0).sum(-1)  # [S]
        stats.index_kl.append(kl[rows].mean())
    return top


def attention_train(attn: Attention, x: torch.Tensor, stats: ForwardStats | None = None) -> torch.Tensor:
    """One layer's attention over a whole prompt x [S, D] at positions 0..S-1 -> [S, D].

    The prefill path of `Attention.forward` (start_pos 0, `_prefill_keys`) without state:
    keys [S + E, Dh] = [kv | compressed entries]; query t sees window rows t-W+1..t, for
    ratio 4 the indexer's top-k entries among those complete at t, for other ratios every
    entry complete at t.
    """
    S, W, r, dev = x.shape[0], attn.window, attn.ratio, x.device
    pos = torch.arange(S, device=dev)
    q, qr = attn.project_q(x, pos)
    kv = attn.project_kv(x, pos)
    win = pos[:, None] - torch.arange(min(S, W), device=dev)[None, :]  # [S, Kw]
    lists, keys = [win.clamp(min=-1)], kv
    if r:
        entries = compress(attn.compressor, x)  # [E, Dh]
        keys = torch.cat((kv, entries))
        if r == INDEX_RATIO:
            top = _indexer_topk(attn, x, qr, q, entries, stats)
            lists.append(torch.where(top >= 0, top + S, top))
        else:
            j = torch.arange(S // r, device=dev)
            lists.append(torch.where(j[None, :] < ((pos + 1) // r)[:, None], j[None, :] + S, -1))
    o = masked_attn(q, keys, attn.attn_sink, torch.cat(lists, dim=1), attn.softmax_scale)
    return attn.project_out(o, pos)


def moe_train(moe: MoE, x: torch.Tensor, ids: torch.Tensor, layer_id: int,
              stats: ForwardStats | None = None) -> torch.Tensor:
    """`MoE.forward` (TP=1) recording each expert's token count: x [N, D], ids [N] -> [N, D]."""
    weights, experts = moe.gate(x, ids)
    if stats is not None:
        stats.expert_load[layer_id] = torch.bincount(experts.flatten(), minlength=len(moe.experts))
    y = moe.combine(x, weights, experts) + moe.shared_experts(x).float()
    return y.to(x.dtype)


def residual(block: Block, h: torch.Tensor, part: str, norm: RMSNorm, sublayer: Callable[[torch.Tensor], torch.Tensor],
             mhc: MhcFns = EAGER) -> torch.Tensor:
    """`Block`'s mHC residual around a sublayer: h [S, C, D] -> hc_post(sublayer(norm(hc_pre(h))), h)."""
    cfg = block.cfg
    fn, scale, base = (getattr(block, f"hc_{part}_{n}") for n in ("fn", "scale", "base"))
    x, post, comb = mhc.hc_pre(h, fn, scale, base, cfg.norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)
    return mhc.hc_post(sublayer(norm(x)), h, post, comb)


def block_train(block: Block, h: torch.Tensor, ids: torch.Tensor, stats: ForwardStats | None = None,
                mhc: MhcFns = EAGER) -> torch.Tensor:
    """One trunk block over a prompt: h [S, C, D], ids [S] -> [S, C, D] (`Block.forward`, start_pos 0)."""
    h = residual(block, h, "attn", block.attn_norm, lambda x: attention_train(block.attn, x, stats), mhc)
    return residual(block, h, "ffn", block.ffn_norm, lambda x: moe_train(block.ffn, x, ids, block.layer_id, stats), mhc)


def trunk_logits(trunk: Trunk, ids: torch.Tensor, stats: ForwardStats | None = None,
                 mhc: MhcFns = EAGER) -> torch.Tensor:
    """Logits [S, V] fp32 of every position of ids [S] int64 (positions 0..S-1), with autograd.

    Row t equals `Trunk.prefill(ids[:t+1]).logits` for the same weights (fp32). Gradients flow
    to every parameter with requires_grad except through the discrete routing (see the module
    docstring); `stats` collects the indexer losses and expert loads; `mhc` picks eager or
    compiled mHC functions.
    Raises:
        ValueError: ids not 1-D, empty, longer than max_seq_len, or outside [0, vocab_size).
    """
    cfg = trunk.cfg
    if ids.ndim != 1 or ids.numel() == 0 or ids.shape[0] > cfg.max_seq_len:
        raise ValueError(f"ids must be 1-D with 1..{cfg.max_seq_len} tokens, got shape {tuple(ids.shape)}")
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
        raise ValueError(f"token ids must lie in [0, {cfg.vocab_size}), got [{int(ids.min())}, {int(ids.max())}]")
    h = trunk.embed(ids).unsqueeze(1).repeat(1, cfg.hc_mult, 1)  # (S, C, D)
    for block in trunk.layers:
        h = block_train(block, h, ids, stats, mhc)
    x = hc_head(h, trunk.hc_head_fn, trunk.hc_head_scale, trunk.hc_head_base, cfg.norm_eps, cfg.hc_eps)  # [S, D]
    return trunk.head(trunk.norm(x).float())  # [S, V] fp32


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats): logits [S, V] predict ids[1:] from positions 0..S-2."""
    return F.cross_entropy(logits[:-1], ids[1:])


@torch.no_grad()
def update_gate_biases(trunk: Trunk, loads: dict[int, torch.Tensor], gamma: float) -> None:
    """DeepSeek-V3 auxiliary-loss-free balancing: for every scored layer in `loads`,
    bias_e += gamma * sign(mean_e(load) - load_e) (under-loaded experts become more likely).

    loads: layer id -> tokens per expert [E] summed over the step's sequences.
    """
    for layer_id, load in loads.items():
        gate = trunk.layers[layer_id].ffn.gate
        if gate.bias is None:
            continue
        lf = load.float()
        gate.bias += gamma * torch.sign(lf.mean() - lf)
