"""Training forward of the DSpark draft: what `DSparkDraft.draft` computes, for many anchors at once.

Owns the batched, differentiable restatement of the draft; it reuses `dsv4.dspark`'s
parameters and pieces of math and must never compute anything the inference draft does not
(a test holds the two equal).

Dimension legend: S = positions of one sequence, N = anchors (blocks), B = dspark_block_size,
C = hc_mult, D = dim, H = heads, Dh = head_dim, W = window_size, V = vocab, Rm = markov rank.

Inference (`dsv4.dspark`, docs/model.md §9) drafts one block per round: seed position p, block ids
[anchor = ids[p+1], noise x (B-1)] at positions p+1..p+B, every slot attending (non-causally)
the ring keys of positions max(0, p-W+1)..p (computed from the trunk's tap rows by
main_proj -> main_norm -> each stage's wkv / kv_norm / rope) plus the block's own keys.
`draft_blocks` computes the same for N seed positions of one sequence in one batched pass,
with gradients, reusing the module's own parameters and pieces of math (`main_features`,
`Attention.project_q/project_kv/project_out`, `Block.attn_residual/ffn_residual`, `DraftMoE`,
`hc_head`, the Markov and confidence heads): the context keys are computed once per stage for
all S positions, and each block's attention is a dense masked softmax with the sink (the
`sparse_attn` formula) over [those keys, masked to the block's window | its own B keys].

Markov head (docs/model.md §9.5). Inference adds markov_w2(markov_w1[prev]) to slot j with prev =
the draft of slot j-1 (the anchor for slot 0). `prev="draft"` does exactly that (sequential
argmax; used by the parity test); `prev="teacher"` uses the sequence's own tokens ids[p+1+j]
instead (teacher forcing). Slot j's draft only counts when every earlier slot matched the
target's greedy token, and then the two coincide, so training with the teacher tokens trains
the case that matters. The confidence head sees the same markov embedding.

A test (tests/test_draft_forward.py) checks the block logits and confidence logits against
`DSparkDraft.draft` for the same weights and anchors (fp32, rel 1e-5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.dspark import DSparkDraft, DSparkStage
from dsv4.mhc import hc_head


@dataclass(frozen=True)
class BlockOutput:
    """logits [N, B, V] fp32 (with the Markov bias), confidence [N, B] raw logits (None without
    a confidence head), hidden [N, B, D] the last stage's hc_head output, drafts [N, B] int64
    (argmax of each slot)."""

    logits: torch.Tensor
    confidence: torch.Tensor | None
    hidden: torch.Tensor
    drafts: torch.Tensor


def trainable_parameters(module: DSparkDraft) -> list[tuple[str, torch.nn.Parameter]]:
    """Turn requires_grad on for every `mtp.*` parameter except the gate biases (moved by
    `update_gate_biases`); embed and head stay frozen (shared with the trunk). Returns them by name."""
    out = []
    for name, p in module.named_parameters():
        train = name.startswith("mtp.") and not name.endswith("gate.bias")
        p.requires_grad_(train)
        if train:
            out.append((name, p))
    return out


def block_attention(stage: DSparkStage, x: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                    pos: torch.Tensor) -> torch.Tensor:
    """`DSparkStage.draft_attention` for N blocks: x [N*B, D] (normed sublayer input), keys
    [S, Dh] context keys of positions 0..S-1, visible [N, S] bool (block n's window),
    pos [N, B] block positions. Returns [N*B, D] after the output projection."""
    attn = stage.attn
    N, B = pos.shape
    flat = pos.flatten()
    q, _ = attn.project_q(x, flat)  # [N*B, H, Dh]
    q = q.unflatten(0, (N, B)).float()  # [N, B, H, Dh]
    own = attn.project_kv(x, flat).unflatten(0, (N, B)).float()  # [N, B, Dh]
    kf = keys.float()
    lc = torch.einsum("nbhd,sd->nbhs", q, kf) * attn.softmax_scale  # [N, B, H, S]
    lc = lc.masked_fill(~visible[:, None, None, :], float("-inf"))
    lb = torch.einsum("nbhd,ncd->nbhc", q, own) * attn.softmax_scale  # [N, B, H, B]
    sink = attn.attn_sink[None, None, :]  # [1, 1, H]
    m = torch.maximum(torch.maximum(lc.amax(-1), lb.amax(-1)), sink).unsqueeze(-1).detach()  # [N, B, H, 1]
    pc, pb = torch.exp(lc - m), torch.exp(lb - m)
    den = pc.sum(-1, keepdim=True) + pb.sum(-1, keepdim=True) + torch.exp(sink.unsqueeze(-1) - m)
    o = (torch.einsum("nbhs,sd->nbhd", pc, kf) + torch.einsum("nbhc,ncd->nbhd", pb, own)) / den
    return stage.reduce(attn.project_out(o.flatten(0, 1).to(x.dtype), flat))


def draft_blocks(module: DSparkDraft, taps: torch.Tensor, ids: torch.Tensor, seeds: torch.Tensor,
                 prev: str = "teacher") -> BlockOutput:
    """Draft blocks of N seed positions of one sequence, with autograd.

    taps [S, T*D] the trunk's tap rows of positions 0..S-1; ids [S] int64 the sequence;
    seeds [N] int64 seed positions p (0 <= p, p + 1 < S: the anchor ids[p+1] must exist;
    with prev="teacher" also p + B < S). Block n equals `module.draft(state, ids[p+1], p)`
    for a state holding the taps of positions 0..p (all B slots).
    Raises:
        ValueError: prev not "teacher"/"draft", or seeds out of range.
    """
    if prev not in ("teacher", "draft"):
        raise ValueError(f"prev={prev!r}: must be 'teacher' or 'draft'")
    cfg = module.cfg
    B, W, C, S = cfg.dspark_block_size, cfg.window_size, cfg.hc_mult, ids.shape[0]
    need = B if prev == "teacher" else 1
    if seeds.numel() == 0 or int(seeds.min()) < 0 or int(seeds.max()) + need >= S:
        raise ValueError(f"seeds must lie in [0, {S - need - 1}] for a sequence of {S} tokens (prev={prev})")
    dev = taps.device
    N = seeds.shape[0]
    slot = torch.arange(B, device=dev)
    pos = seeds[:, None] + 1 + slot[None, :]  # [N, B] block positions p+1..p+B
    block = torch.full((N, B), cfg.dspark_noise_token_id, dtype=torch.int64, device=dev)
    block[:, 0] = ids[seeds + 1]
    kpos = torch.arange(S, device=dev)
    visible = (kpos[None, :] <= seeds[:, None]) & (kpos[None, :] > seeds[:, None] - W)  # [N, S]
    feats = module.main_features(taps.to(module.embed.weight.dtype))  # [S, D]
    flat_ids = block.flatten()
    h = module.embed(flat_ids).unsqueeze(1).repeat(1, C, 1)  # [N*B, C, D]
    for stage in module.mtp:
        keys = stage.attn.project_kv(feats, kpos)  # [S, Dh]
        h = stage.attn_residual(h, lambda x, st=stage, k=keys: block_attention(st, x, k, visible, pos))
        h = stage.ffn_residual(h, flat_ids)
    last = module.mtp[-1]
    y = hc_head(h, last.hc_head_fn, last.hc_head_scale, last.hc_head_base, cfg.norm_eps, cfg.hc_eps)  # [N*B, D]
    base = module.head(last.norm(y).float()).unflatten(0, (N, B))  # [N, B, V]
    mk = last.markov_head
    if prev == "teacher":
        prev_ids = ids[pos]  # [N, B]: anchor, then the sequence's own tokens
        emb = mk.markov_w1(prev_ids)  # [N, B, Rm]
        logits = base + mk.markov_w2(emb)
    else:
        p_ids, rows, embs = block[:, 0], [], []
        for j in range(B):
            e = mk.markov_w1(p_ids)  # [N, Rm]
            lj = base[:, j] + mk.markov_w2(e)
            p_ids = lj.argmax(-1)
            rows.append(lj)
            embs.append(e)
        logits, emb = torch.stack(rows, 1), torch.stack(embs, 1)
    conf = None
    if module.has_confidence_head:
        conf = last.confidence_head.proj(torch.cat((y.float().unflatten(0, (N, B)), emb), dim=-1))[..., 0]  # [N, B]
    return BlockOutput(logits, conf, y.unflatten(0, (N, B)), logits.argmax(-1))
