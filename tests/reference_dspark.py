"""Dense float64 reference of one DSpark draft round, for conformance tests (docs/model.md §9).

Written from docs/model.md, sharing no code with `dsv4/` except `ModelConfig`; the §2–§6
primitives (RMSNorm, rope, mHC, clamped SwiGLU expert) come from the trunk's float64
reference `reference_dsv4`. Deliberately non-incremental: no ring. The context keys of
stage s are computed straight from the committed rows of positions max(0, p-W+1)..p
(main_x = main_norm(main_proj(row)), key = rope(kv_norm(wkv_s(main_x)), position)).

One round (§9.2–§9.5), seed position p, anchor a: block ids [a, noise x (B-1)] at positions
p+1..p+B; per stage (a full block with layer id n_layers + s, rope theta no YaRN, scored
gate) each slot attends over the context keys and every block slot (non-causal), with the
sink in the denominator, de-rope at the slot's position, grouped output projection; then
hc_head (the last stage's), norm, the shared head, and the sequential Markov head: the bias
of slot j is markov_w2 · markov_w1[previous token] (anchor for slot 0); confidence logit
j = proj · [y_j ; markov_w1[previous token of j]] with y the pre-norm hc_head output.
Quantisation simulation is off.

Dimension legend: B block slots, D dim, C hc_mult, H heads, Dh head_dim, R rope_head_dim,
W window_size, G o_groups, Lo o_lora_rank, E routed experts, K activated experts,
V vocab, Rm markov rank, T target layers, n context keys.

`breaks` falsifies one named step on purpose (tests only), see `BREAKS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv4.config import ModelConfig
from reference_dsv4 import expert, hc_head, hc_post, hc_pre, rms_norm, rope, rope_inv_freq

F64 = torch.float64
BREAKS = frozenset({
    "no_markov_bias",      # logits without the Markov bias (§9.5)
    "markov_from_anchor",  # every slot's bias from the anchor, not the previous token (§12 (15))
    "lane_mean_head",      # lanes reduced by their mean instead of hc_head (§12 (13))
    "swap_expert",         # slot 0 of stage 0: the K-th selected routed expert replaced by the next-ranked
    "causal_block",        # slot j sees only block slots <= j (the block is non-causal, §9.4)
    "block_at_seed",       # off by one (§9.2): block roped at p..p+B-1 instead of p+1..p+B
})


@dataclass
class RefDraft:
    """Result of `reference_draft` (float64).

    tokens: B drafted ids; logits [B, V] incl. the Markov bias; confidence [B] raw logits
    (None without the head); hidden [B, D] pre-norm hc_head output; margins [B]: top1 - top2
    of each slot's logits; route_margins: stage -> [B] gap between the K-th and (K+1)-th
    selection keys of the gate.
    """

    tokens: list[int]
    logits: torch.Tensor
    confidence: torch.Tensor | None
    hidden: torch.Tensor
    margins: torch.Tensor
    route_margins: dict[int, torch.Tensor] = field(default_factory=dict)


def to_f64(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every float tensor as float64 (integers untouched)."""
    return {k: (v.detach().to(F64) if v.is_floating_point() else v) for k, v in weights.items()}


def main_features(rows: torch.Tensor, w: dict, cfg: ModelConfig) -> torch.Tensor:
    """§9.3: main_norm(main_proj(rows)); rows [n, T·D] -> [n, D]."""
    return rms_norm(rows.to(F64) @ w["mtp.0.main_proj.weight"].T, w["mtp.0.main_norm.weight"], cfg.norm_eps)


def context_keys(rows: dict[int, torch.Tensor], p: int, w: dict, s: int, cfg: ModelConfig) -> torch.Tensor:
    """§9.4 / §9.6: stage s's keys of the committed positions max(0, p-W+1)..p -> [n, Dh].

    rows: position -> tap row [T·D]; every position of the window must be present.
    """
    window = range(max(0, p - cfg.window_size + 1), p + 1)
    missing = [q for q in window if q not in rows]
    if missing:
        raise ValueError(f"rows: positions {missing} of the window {window.start}..{p} are missing")
    a, inv = f"mtp.{s}.attn.", rope_inv_freq(cfg, cfg.n_layers + s)
    mx = main_features(torch.stack([rows[q] for q in window]), w, cfg)  # [n, D]
    kv = rms_norm(mx @ w[a + "wkv.weight"].T, w[a + "kv_norm.weight"], cfg.norm_eps)  # [n, Dh]
    return torch.stack([rope(kv[i], q, inv) for i, q in enumerate(window)])


def draft_attention(x: torch.Tensor, ctx: torch.Tensor, p: int, w: dict, s: int, cfg: ModelConfig,
                    breaks: frozenset = frozenset()) -> torch.Tensor:
    """§9.4 DSparkAttention of stage s: x [B, D] (after attn_norm), ctx [n, Dh] -> [B, D]."""
    B, H, Dh, G, Lo = x.shape[0], cfg.n_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank
    a, inv, eps = f"mtp.{s}.attn.", rope_inv_freq(cfg, cfg.n_layers + s), cfg.norm_eps
    first = p if "block_at_seed" in breaks else p + 1
    qr = rms_norm(x @ w[a + "wq_a.weight"].T, w[a + "q_norm.weight"], eps)  # [B, Lq]
    q = rms_norm((qr @ w[a + "wq_b.weight"].T).view(B, H, Dh), None, eps)  # (B, H, Dh)
    kb = rms_norm(x @ w[a + "wkv.weight"].T, w[a + "kv_norm.weight"], eps)  # [B, Dh]
    kb = torch.stack([rope(kb[j], first + j, inv) for j in range(B)])
    sink = w[a + "attn_sink"]  # [H]
    o = torch.empty(B, H, Dh, dtype=F64)
    for j in range(B):
        keys = torch.cat([ctx, kb[: j + 1] if "causal_block" in breaks else kb])  # [n + B, Dh]
        logits = Dh ** -0.5 * (rope(q[j], first + j, inv) @ keys.T)  # [H, n + B]
        m = torch.maximum(logits.max(-1).values, sink)  # the sink only enlarges the denominator
        e = torch.exp(logits - m[:, None])
        o[j] = rope((e / (e.sum(-1) + torch.exp(sink - m))[:, None]) @ keys, first + j, inv, inverse=True)
    wa = w[a + "wo_a.weight"].view(G, Lo, H * Dh // G)  # (G, Lo, H·Dh/G) block-diagonal
    z = torch.einsum("bgd,grd->bgr", o.reshape(B, G, H * Dh // G), wa)  # (B, G, Lo)
    return z.reshape(B, G * Lo) @ w[a + "wo_b.weight"].T


def draft_moe(x: torch.Tensor, w: dict, s: int, cfg: ModelConfig, swap_token: int | None = None):
    """§6 scored MoE of stage s: x [B, D] (after ffn_norm) -> (y [B, D], route margins [B]).

    sqrt(softplus) scores; top-K of scores + bias selects; weights = unbiased scores of the
    chosen experts, renormalised, × route_scale; plus the shared expert. `swap_token`:
    that token's K-th chosen expert is replaced by the (K+1)-th ranked one.
    """
    f, K = f"mtp.{s}.ffn.", cfg.n_activated_experts
    sc = torch.sqrt(torch.logaddexp(torch.zeros(()), x @ w[f + "gate.weight"].T))  # [B, E]
    key = sc + w[f + "gate.bias"]
    ranked = key.sort(-1, descending=True)
    idx = ranked.indices[:, :K].clone()  # [B, K]
    if swap_token is not None:
        idx[swap_token, K - 1] = ranked.indices[swap_token, K]
    wts = sc.gather(-1, idx)
    wts = wts / wts.sum(-1, keepdim=True) * cfg.route_scale
    y = expert(x, w, f + "shared_experts.", cfg)
    for t in range(x.shape[0]):
        for e, wt in zip(idx[t].tolist(), wts[t]):
            y[t] += expert(x[t:t + 1], w, f"{f}experts.{e}.", cfg, wt.reshape(1))[0]
    return y, ranked.values[:, K - 1] - ranked.values[:, K]


def draft_head(h: torch.Tensor, anchor: int, w: dict, cfg: ModelConfig, breaks: frozenset = frozenset()):
    """§9.5 on the last stage's lanes h [B, C, D] -> (tokens, logits [B, V], confidence [B] | None, y [B, D])."""
    p = f"mtp.{cfg.n_mtp_layers - 1}."
    if "lane_mean_head" in breaks:
        y = h.mean(1)
    else:
        y = torch.stack([hc_head(h[j], w[p + "hc_head_fn"], w[p + "hc_head_scale"], w[p + "hc_head_base"], cfg)
                         for j in range(h.shape[0])])  # [B, D]
    logits = rms_norm(y, w[p + "norm.weight"], cfg.norm_eps) @ w["head.weight"].T  # [B, V]
    w1, w2 = w[p + "markov_head.markov_w1.weight"], w[p + "markov_head.markov_w2.weight"]  # [V, Rm]
    tokens, prevs = [], []
    for j in range(h.shape[0]):
        prev = anchor if (j == 0 or "markov_from_anchor" in breaks) else tokens[-1]
        prevs.append(prev)
        if "no_markov_bias" not in breaks:
            logits[j] = logits[j] + w2 @ w1[prev]
        tokens.append(int(logits[j].argmax()))
    conf = None
    if p + "confidence_head.proj.weight" in w:
        feats = torch.cat([y, w1[torch.tensor(prevs)]], dim=-1)  # [B, D + Rm], hidden first
        conf = feats @ w[p + "confidence_head.proj.weight"][0]
    return tokens, logits, conf, y


def stage(h: torch.Tensor, ids: torch.Tensor, ctx: torch.Tensor, p: int, w: dict, s: int, cfg: ModelConfig,
          breaks: frozenset, route_margins: dict):
    """§3.1 with the draft attention: lanes h [B, C, D] -> [B, C, D]."""
    pre = f"mtp.{s}."
    for part in ("attn", "ffn"):
        fn, scale, base = w[f"{pre}hc_{part}_fn"], w[f"{pre}hc_{part}_scale"], w[f"{pre}hc_{part}_base"]
        mixed = [hc_pre(h[j], fn, scale, base, cfg) for j in range(h.shape[0])]
        y = rms_norm(torch.stack([m[0] for m in mixed]), w[f"{pre}{part}_norm.weight"], cfg.norm_eps)  # [B, D]
        if part == "attn":
            y = draft_attention(y, ctx, p, w, s, cfg, breaks)
        else:
            swap = 0 if ("swap_expert" in breaks and s == 0) else None
            y, route_margins[s] = draft_moe(y, w, s, cfg, swap)
        h = torch.stack([hc_post(y[j], h[j], m[1], m[2]) for j, m in enumerate(mixed)])
    return h


def reference_draft(cfg: ModelConfig, weights: dict[str, torch.Tensor], rows: dict[int, torch.Tensor],
                    anchor: int, seed_position: int, breaks=frozenset()) -> RefDraft:
    """One draft round in float64.

    Args:
        weights: logical drafter weights (`drafter_params` names, any float dtype).
        rows: committed position -> tap row [T·D]; must cover max(0, p-W+1)..p.
        anchor: the committed token at seed_position + 1.
        breaks: names from `BREAKS` (tests only).
    Raises:
        ValueError: unknown break, anchor out of range, a window position without a row.
    """
    breaks = frozenset(breaks)
    if breaks - BREAKS:
        raise ValueError(f"breaks={sorted(breaks - BREAKS)}: unknown, known are {sorted(BREAKS)}")
    if not 0 <= anchor < cfg.vocab_size:
        raise ValueError(f"anchor={anchor} outside [0, {cfg.vocab_size})")
    w, p, B = to_f64(weights), seed_position, cfg.dspark_block_size
    ids = torch.tensor([anchor] + [cfg.dspark_noise_token_id] * (B - 1))
    h = w["embed.weight"][ids][:, None, :].expand(B, cfg.hc_mult, cfg.dim).clone()  # [B, C, D]
    route_margins: dict[int, torch.Tensor] = {}
    for s in range(cfg.n_mtp_layers):
        h = stage(h, ids, context_keys(rows, p, w, s, cfg), p, w, s, cfg, breaks, route_margins)
    tokens, logits, conf, y = draft_head(h, anchor, w, cfg, breaks)
    top2 = logits.topk(2, dim=-1).values
    return RefDraft(tokens, logits, conf, y, top2[:, 0] - top2[:, 1], route_margins)


def conformance_weights(cfg: ModelConfig, seed: int, confidence_head: bool = True) -> dict[str, torch.Tensor]:
    """Test input: drafter `random_weights` with the symmetric parts randomised (nonzero sinks,
    random mHC biases/scales and norm weights, larger gate bias) so every parameter matters."""
    from dsv4.init import random_weights  # test data only, no math

    w = random_weights(cfg, "drafter", seed, confidence_head=confidence_head)
    g = torch.Generator().manual_seed(seed + 7)
    for name, t in w.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "attn_sink":
            w[name] = torch.randn(t.shape, generator=g)
        elif leaf.startswith("hc_") and leaf.endswith("_base"):
            w[name] = 0.5 * torch.randn(t.shape, generator=g)
        elif leaf.startswith("hc_") and leaf.endswith("_scale"):
            w[name] = 1 + 0.2 * torch.randn(t.shape, generator=g)
        elif "norm" in name and leaf == "weight" and t.ndim == 1:
            w[name] = 1 + 0.2 * torch.randn(t.shape, generator=g)
        elif leaf == "bias":
            w[name] = 0.3 * torch.randn(t.shape, generator=g)
    return w


def synthetic_rows(cfg: ModelConfig, n: int, seed: int) -> torch.Tensor:
    """n synthetic tap rows [n, T·D] fp32 (standard normal, fixed seed)."""
    return torch.randn(n, cfg.tap_width, generator=torch.Generator().manual_seed(seed))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max over rows of ||a - b|| / ||b|| (rows = last dim), in float64."""
    a, b = a.to(F64).reshape(-1, b.shape[-1]), b.to(F64).reshape(-1, b.shape[-1])
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max())

