"""Dense float64 reference of the DeepSeek-V4-Flash trunk forward, for conformance tests.

Written directly from docs/model.md §2–§6 (section numbers below are that file's), sharing no
code with `dsv4/` except `ModelConfig`. It is deliberately slow and NON-incremental: no ring
buffer, no compressor state machine, no caches. For every layer and every query position t
it builds the set of keys t may attend to straight from the definitions:

* window: the kv rows of positions max(0, t-W+1) .. t (§5.4): in prefill that is §5.4's
  window list, in decode the ring holds exactly these rows (slot p % W, written first);
* ratio-r layers: compressed entry j (positions j·r .. j·r+r-1) from the pooled formula of
  §5.6, visible to query t iff j < (t+1)//r (the block is complete at t); HCA (r != 4) attends
  every visible entry, CSA (r == 4) the indexer's top-min(index_topk, #visible) visible
  entries by the §5.7 score.

Quantisation simulation is OFF: no fp8/fp4 activation round-trips (§2.4) and no Hadamard
rotation (§5.7). The Hadamard matrix is orthogonal and rotates both the indexer query and the
indexer key, so without the fp4 rounding it leaves every q·k score unchanged.

Dimension legend: S positions, V vocab, D dim, C hc_mult (lanes), M = (2+C)·C mHC logits,
H heads, Dh head_dim, R rope_head_dim, Lq q_lora_rank, G o_groups, Lo o_lora_rank,
W window_size, r compress ratio, N = S // r compressed entries, d compressed width,
Hi/Di indexer heads / head dim, E routed experts, K activated experts, I moe_inter_dim,
T = len(dspark_target_layer_ids), L n_layers.

`breaks` deliberately falsifies one named step (only for the test that shows the
comparison is not vacuous); `tap_reduce="sum"` is the lane-sum variant of the taps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dsv4.config import ModelConfig

F64 = torch.float64
BREAKS = frozenset({
    "comb_transposed",     # hc_post uses comb[k, j] instead of comb[j, k] (§4.3)
    "no_sink",             # attention sink left out of the softmax denominator (§5.4)
    "no_derope",           # attention output not de-rotated at the query position (§5.4)
    "rope_half_split",     # rope pairs (k, k + R/2) instead of interleaved (2k, 2k+1) (§2.3)
    "bias_in_weights",     # MoE routing weights taken from the biased selection key (§6.1)
})


@dataclass
class ReferenceOutput:
    """Result of `reference_forward`.

    logits: [S, V] float64, the head's logits at every position.
    taps: [S, T·D] float64, lane reduction (mean, or sum) of the block output of each target
        layer, concatenated in ascending layer order (§3).
    layer_taps: [L, S, D] float64, the same lane reduction for every trunk layer.
    selections: layer id -> per query t, the sorted compressed-entry ids attended (CSA and
        HCA layers).
    index_margins: layer id -> per query t, score gap between the last selected and the
        best unselected visible entry (inf when nothing is pruned); small gaps make the
        top-k fragile under fp32 rounding.
    route_margins: layer id -> [S] gap between the K-th and (K+1)-th selection key of the
        scored MoE gate (inf for hash layers).
    """

    logits: torch.Tensor
    taps: torch.Tensor
    layer_taps: torch.Tensor
    selections: dict[int, list[list[int]]] = field(default_factory=dict)
    index_margins: dict[int, list[float]] = field(default_factory=dict)
    route_margins: dict[int, torch.Tensor] = field(default_factory=dict)


# ------------------------------------------------------------------------------ primitives
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """§2.1: w · x / sqrt(mean(x², last dim) + eps); weight None = unweighted (§5.2 q scale)."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def rope_inv_freq(cfg: ModelConfig, layer_id: int) -> torch.Tensor:
    """§2.2 rotary frequencies [R/2] float64 of `layer_id`'s table.

    Compressed layers (ratio > 0): base compress_rope_theta with YaRN (original_seq_len,
    rope_factor, beta_fast, beta_slow); ratio-0 layers: base rope_theta, no YaRN.
    """
    R = cfg.rope_head_dim
    compressed = cfg.layer_ratio(layer_id) > 0
    base = cfg.compress_rope_theta if compressed else cfg.rope_theta
    inv = base ** (-torch.arange(0, R, 2, dtype=F64) / R)  # j = 0..R/2-1: base^(-2j/R)
    orig = cfg.original_seq_len if compressed else 0
    if orig > 0:
        def corr(n: float) -> float:
            return R * math.log(orig / (n * 2 * math.pi)) / (2 * math.log(base))
        lo = max(math.floor(corr(cfg.beta_fast)), 0)
        hi = min(math.ceil(corr(cfg.beta_slow)), R - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(R // 2, dtype=F64) - lo) / (hi - lo)).clamp(0, 1)
        keep = 1 - ramp
        inv = inv / cfg.rope_factor * (1 - keep) + inv * keep
    return inv


def rope(x: torch.Tensor, pos: float, inv_freq: torch.Tensor, inverse: bool = False,
         breaks: frozenset = frozenset()) -> torch.Tensor:
    """§2.3: rotate the last R = 2·len(inv_freq) dims of x [..., n] at position `pos`.

    Pairs are interleaved, (x[2k], x[2k+1]) rotated by the angle pos·inv_freq[k]; `inverse`
    rotates by the negative angle. Returns a new tensor.
    """
    R = 2 * inv_freq.numel()
    ang = (-1.0 if inverse else 1.0) * pos * inv_freq  # [R/2]
    cos, sin = torch.cos(ang), torch.sin(ang)
    out = x.clone()
    tail = x[..., -R:]
    if "rope_half_split" in breaks:
        a, b = tail[..., : R // 2], tail[..., R // 2:]
        out[..., -R:] = torch.cat([a * cos - b * sin, a * sin + b * cos], -1)
        return out
    a, b = tail[..., 0::2], tail[..., 1::2]
    out[..., -R::2] = a * cos - b * sin
    out[..., -R + 1::2] = a * sin + b * cos
    return out


# ------------------------------------------------------------------------------ mHC (§4)
def sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, cfg: ModelConfig):
    """§4.2 for one token: mixes [M] -> pre [C], post [C], comb [C, C] (row j = source lane)."""
    C, eps = cfg.hc_mult, cfg.hc_eps
    pre = torch.sigmoid(mixes[:C] * scale[0] + base[:C]) + eps
    post = 2 * torch.sigmoid(mixes[C:2 * C] * scale[1] + base[C:2 * C])
    logits = (mixes[2 * C:] * scale[2] + base[2 * C:]).view(C, C)  # [j, k] row-major
    P = torch.softmax(logits, dim=1) + eps
    P = P / (P.sum(0, keepdim=True) + eps)  # columns: Σ_j P[j, k]
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        P = P / (P.sum(1, keepdim=True) + eps)  # rows
        P = P / (P.sum(0, keepdim=True) + eps)  # columns (the last step is a column step)
    return pre, post, P


def hc_mixes(h: torch.Tensor, fn: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """§4.1 / §4.4: (flatten(h) · fnᵀ) / sqrt(mean(flatten(h)²) + norm_eps); h [C, D] -> [rows of fn]."""
    xf = h.reshape(-1)  # [C·D]
    return (fn @ xf) * torch.rsqrt(xf.pow(2).mean() + cfg.norm_eps)


def hc_pre(h: torch.Tensor, fn, scale, base, cfg: ModelConfig):
    """§4.1 for one token: lanes h [C, D] -> (y [D] = Σ_c pre[c]·h[c], post [C], comb [C, C])."""
    pre, post, comb = sinkhorn(hc_mixes(h, fn, cfg), scale, base, cfg)
    return pre @ h, post, comb


def hc_post(y: torch.Tensor, res: torch.Tensor, post, comb, breaks=frozenset()) -> torch.Tensor:
    """§4.3 for one token: out[k] = post[k]·y + Σ_j comb[j, k]·res[j]; y [D], res [C, D] -> [C, D]."""
    if "comb_transposed" in breaks:
        comb = comb.T
    return post[:, None] * y[None, :] + torch.einsum("jk,jd->kd", comb, res)


def hc_head(h: torch.Tensor, fn, scale, base, cfg: ModelConfig) -> torch.Tensor:
    """§4.4 for one token: lanes h [C, D] -> Σ_c (sigmoid(mix[c]·scale + base[c]) + hc_eps)·h[c], [D]."""
    w = torch.sigmoid(hc_mixes(h, fn, cfg) * scale + base) + cfg.hc_eps
    return w @ h


# ------------------------------------------------------------------------------ compressor (§5.6)
def compressed_entries(x: torch.Tensor, w: dict, prefix: str, ratio: int, cfg: ModelConfig,
                       inv_freq: torch.Tensor) -> torch.Tensor:
    """§5.6 pooled entries of every complete block: x [S, D] -> [N = S // ratio, d].

    Per token v_t = wkv(x_t), g_t = wgate(x_t) + ape[t mod r]. Plain (r != 4): entry j is the
    per-channel softmax over the r tokens of block j of g, weighting v. Overlapped (r == 4,
    outputs 2d wide): 2r slots, the previous block's r tokens with the FIRST half of v/g
    (value 0, score -inf for j = 0) and block j's r tokens with the SECOND half. Then RMSNorm
    with `prefix`norm.weight and rope on the last R dims at position j·r.
    """
    S = x.shape[0]
    v = x @ w[prefix + "wkv.weight"].T  # [S, k·d]
    g = x @ w[prefix + "wgate.weight"].T + w[prefix + "ape"][torch.arange(S) % ratio]  # [S, k·d]
    norm_w = w[prefix + "norm.weight"]
    d = norm_w.numel()
    out = []
    for j in range(S // ratio):
        cur = slice(j * ratio, (j + 1) * ratio)
        if ratio == 4:
            if j == 0:
                v_prev = torch.zeros(ratio, d, dtype=F64)
                g_prev = torch.full((ratio, d), -math.inf, dtype=F64)
            else:
                prev = slice((j - 1) * ratio, j * ratio)
                v_prev, g_prev = v[prev, :d], g[prev, :d]
            v_slots = torch.cat([v_prev, v[cur, d:]])  # [2r, d]
            g_slots = torch.cat([g_prev, g[cur, d:]])  # [2r, d]
        else:
            v_slots, g_slots = v[cur], g[cur]  # [r, d]
        c = (torch.softmax(g_slots, dim=0) * v_slots).sum(0)  # [d], softmax per channel over slots
        c = rms_norm(c, norm_w, cfg.norm_eps)
        out.append(rope(c, j * ratio, inv_freq))
    return torch.stack(out) if out else torch.zeros(0, d, dtype=F64)


# ------------------------------------------------------------------------------ attention (§5)
def indexer_selection(x, qr, w, a: str, cfg: ModelConfig, inv_freq):
    """§5.7 for a ratio-4 layer: per query t, the top-min(index_topk, #visible) visible entries.

    qi = indexer.wq_b(qr) [S, Hi, Di] with rope at t; kc = the indexer's own overlapped
    compressor (d = Di); wts = weights_proj(x)·Di^-0.5·Hi^-0.5 [S, Hi];
    score[t, j] = Σ_h relu(qi[t, h]·kc[j])·wts[t, h] over visible j < (t+1)//4.
    Equivalent to both §5.7 paths: prefill scores all S//4 entries, sets j >= (t+1)//4 to
    -inf and drops them from the top-k (so at most #visible survive); decode scores
    E = (p+1)//4 entries, all visible. Ties are left open by docs/model.md; `margins` reports
    how far the choice is from one.
    Returns (selections: list of sorted entry ids, margins: list of float).
    """
    S, Hi, Di = x.shape[0], cfg.index_n_heads, cfg.index_head_dim
    qi = (qr @ w[a + "indexer.wq_b.weight"].T).view(S, Hi, Di)  # (S, Hi, Di)
    kc = compressed_entries(x, w, a + "indexer.compressor.", 4, cfg, inv_freq)  # [N, Di]
    wts = (x @ w[a + "indexer.weights_proj.weight"].T) * (Di ** -0.5 * Hi ** -0.5)  # [S, Hi]
    selections, margins = [], []
    for t in range(S):
        n_vis = (t + 1) // 4
        q_t = rope(qi[t], t, inv_freq)  # [Hi, Di]
        score = (torch.relu(q_t @ kc[:n_vis].T) * wts[t][:, None]).sum(0)  # [n_vis]
        k = min(cfg.index_topk, n_vis)
        ranked = torch.sort(score, descending=True)
        selections.append(sorted(ranked.indices[:k].tolist()))
        margins.append(float(ranked.values[k - 1] - ranked.values[k]) if n_vis > k else math.inf)
    return selections, margins


def attention(x: torch.Tensor, w: dict, layer_id: int, cfg: ModelConfig, out: ReferenceOutput,
              breaks: frozenset) -> torch.Tensor:
    """§5 attention of one layer over all positions: x [S, D] (after attn_norm) -> [S, D].

    §5.2 q (with the unweighted per-head RMS scale, then rope) and the single latent kv row
    (K = V); §5.4 per-query key set (window ∪ visible/selected compressed entries), logits
    Dh^-0.5·q·k, softmax with the per-head sink in the denominator only, de-rope at t;
    §5.5 grouped low-rank output projection.
    """
    S, H, Dh, G, Lo = x.shape[0], cfg.n_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank
    W, ratio, eps = cfg.window_size, cfg.layer_ratio(layer_id), cfg.norm_eps
    a = f"layers.{layer_id}.attn."
    inv_freq = rope_inv_freq(cfg, layer_id)
    qr = rms_norm(x @ w[a + "wq_a.weight"].T, w[a + "q_norm.weight"], eps)  # [S, Lq]
    q = (qr @ w[a + "wq_b.weight"].T).view(S, H, Dh)  # (S, H, Dh)
    q = rms_norm(q, None, eps)
    kv = rms_norm(x @ w[a + "wkv.weight"].T, w[a + "kv_norm.weight"], eps)  # [S, Dh]
    kv = torch.stack([rope(kv[t], t, inv_freq, breaks=breaks) for t in range(S)])
    if ratio:
        comp = compressed_entries(x, w, a + "compressor.", ratio, cfg, inv_freq)  # [N, Dh]
        if ratio == 4:
            sel, margins = indexer_selection(x, qr, w, a, cfg, inv_freq)
            out.index_margins[layer_id] = margins
        else:
            sel = [list(range((t + 1) // ratio)) for t in range(S)]
        out.selections[layer_id] = sel
    sink = w[a + "attn_sink"]  # [H]
    o = torch.empty(S, H, Dh, dtype=F64)
    for t in range(S):
        keys = kv[max(0, t - W + 1): t + 1]  # window rows [≤W, Dh]
        if ratio:
            keys = torch.cat([keys, comp[sel[t]]])  # [nk, Dh]
        q_t = rope(q[t], t, inv_freq, breaks=breaks)  # [H, Dh]
        logits = Dh ** -0.5 * (q_t @ keys.T)  # [H, nk]
        # The sink enlarges the denominator only; m includes it for stability (same value).
        m = torch.maximum(logits.max(-1).values, sink)  # [H]
        e = torch.exp(logits - m[:, None])
        den = e.sum(-1) + (0 if "no_sink" in breaks else torch.exp(sink - m))
        o_t = (e / den[:, None]) @ keys  # [H, Dh]
        o[t] = o_t if "no_derope" in breaks else rope(o_t, t, inv_freq, inverse=True, breaks=breaks)
    wa = w[a + "wo_a.weight"].view(G, Lo, H * Dh // G)  # (G, Lo, H·Dh/G), block-diagonal
    z = torch.einsum("sgd,grd->sgr", o.reshape(S, G, H * Dh // G), wa)  # (S, G, Lo)
    return z.reshape(S, G * Lo) @ w[a + "wo_b.weight"].T  # (S, G·Lo) -> [S, D]


# ------------------------------------------------------------------------------ MoE (§6)
def expert(x: torch.Tensor, w: dict, prefix: str, cfg: ModelConfig,
           weight: torch.Tensor | None = None) -> torch.Tensor:
    """§6.2 clamped SwiGLU: x [n, D] -> [n, D]; the routing weight [n] scales h before w2."""
    g = x @ w[prefix + "w1.weight"].T  # [n, I]
    u = x @ w[prefix + "w3.weight"].T  # [n, I]
    lim = cfg.swiglu_limit
    if lim > 0:
        u = u.clamp(-lim, lim)
        g = g.clamp(max=lim)
    h = torch.nn.functional.silu(g) * u
    if weight is not None:
        h = weight[:, None] * h
    return h @ w[prefix + "w2.weight"].T


def moe(x: torch.Tensor, ids: torch.Tensor, w: dict, layer_id: int, cfg: ModelConfig,
        out: ReferenceOutput, breaks: frozenset) -> torch.Tensor:
    """§6 MoE of one layer: x [S, D] (after ffn_norm), ids [S] -> [S, D].

    Scores sqrt(softplus(x·gateᵀ)) [S, E]; experts by tid2eid[token] on hash layers, else
    top-K of scores + bias; weights = the UNBIASED scores of the chosen experts, renormalised,
    × route_scale; plus the one shared expert (no weight).
    """
    f, K = f"layers.{layer_id}.ffn.", cfg.n_activated_experts
    s = x @ w[f + "gate.weight"].T  # [S, E]
    if cfg.score_func == "sqrtsoftplus":
        s = torch.sqrt(torch.logaddexp(torch.zeros_like(s), s))
    elif cfg.score_func == "sigmoid":
        s = torch.sigmoid(s)
    else:
        s = torch.softmax(s, -1)
    if cfg.is_hash_layer(layer_id):
        idx = w[f + "gate.tid2eid"][ids]  # [S, K]
        out.route_margins[layer_id] = torch.full((x.shape[0],), math.inf)
        key = s
    else:
        key = s + w[f + "gate.bias"]  # selection key only
        ranked = key.sort(-1, descending=True).values
        out.route_margins[layer_id] = ranked[:, K - 1] - ranked[:, K]
        idx = key.topk(K, -1).indices  # [S, K]
    wts = (key if "bias_in_weights" in breaks else s).gather(-1, idx)  # [S, K]
    if cfg.score_func != "softmax":
        wts = wts / wts.sum(-1, keepdim=True)
    wts = wts * cfg.route_scale
    y = expert(x, w, f + "shared_experts.", cfg)
    for e in range(cfg.n_routed_experts):
        rows, slot = (idx == e).nonzero(as_tuple=True)
        if rows.numel():
            y.index_add_(0, rows, expert(x[rows], w, f"{f}experts.{e}.", cfg, wts[rows, slot]))
    return y


# ------------------------------------------------------------------------------ trunk (§3)
def block(h: torch.Tensor, ids: torch.Tensor, w: dict, i: int, cfg: ModelConfig,
          out: ReferenceOutput, breaks: frozenset) -> torch.Tensor:
    """§3.1 one block: lanes h [S, C, D] -> [S, C, D] (hc_pre, norm, sublayer, hc_post, twice)."""
    p = f"layers.{i}."
    for part in ("attn", "ffn"):
        fn, scale, base = w[f"{p}hc_{part}_fn"], w[f"{p}hc_{part}_scale"], w[f"{p}hc_{part}_base"]
        mixed = [hc_pre(h[t], fn, scale, base, cfg) for t in range(h.shape[0])]
        y = torch.stack([m[0] for m in mixed])  # [S, D]
        y = rms_norm(y, w[f"{p}{part}_norm.weight"], cfg.norm_eps)
        if part == "attn":
            y = attention(y, w, i, cfg, out, breaks)
        else:
            y = moe(y, ids, w, i, cfg, out, breaks)
        h = torch.stack([hc_post(y[t], h[t], m[1], m[2], breaks) for t, m in enumerate(mixed)])
    return h


def reference_forward(cfg: ModelConfig, weights: dict[str, torch.Tensor], tokens,
                      tap_reduce: str = "mean", breaks=frozenset()) -> ReferenceOutput:
    """§3 trunk forward of a whole prompt, every position at once, in float64.

    Args:
        cfg: the model configuration (quant_sim is ignored: the reference never simulates).
        weights: logical weights, names as `dsv4.inventory.trunk_params(cfg)` (any float
            dtype; converted to float64; `tid2eid` integer).
        tokens: S token ids (sequence of int or 1-D integer tensor), 1 <= S <= max_seq_len.
        tap_reduce: "mean" (the taps of docs/model.md §3) or "sum" over the C lanes.
        breaks: names from `BREAKS` to falsify on purpose (tests only).
    Returns:
        ReferenceOutput (logits [S, V] and taps [S, T·D] float64, plus diagnostics).
    Raises:
        ValueError: empty or too long token list, id out of range, missing weight, unknown
            tap_reduce or break name.
    """
    ids = torch.as_tensor(list(tokens) if not torch.is_tensor(tokens) else tokens, dtype=torch.long)
    if ids.ndim != 1 or not 1 <= ids.numel() <= cfg.max_seq_len:
        raise ValueError(f"tokens: need 1..{cfg.max_seq_len} ids in a flat list, got shape {tuple(ids.shape)}")
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(f"tokens: ids must lie in [0, {cfg.vocab_size}), got {ids.min()}..{ids.max()}")
    if tap_reduce not in ("mean", "sum"):
        raise ValueError(f"tap_reduce={tap_reduce!r}: must be 'mean' or 'sum'")
    breaks = frozenset(breaks)
    if breaks - BREAKS:
        raise ValueError(f"breaks={sorted(breaks - BREAKS)}: unknown, known are {sorted(BREAKS)}")
    w = _to_float64(weights, cfg)
    out = ReferenceOutput(logits=torch.empty(0), taps=torch.empty(0), layer_taps=torch.empty(0))
    S, C = ids.numel(), cfg.hc_mult
    h = w["embed.weight"][ids][:, None, :].expand(S, C, cfg.dim).clone()  # [S, C, D] copies
    layer_taps = []
    for i in range(cfg.n_layers):
        h = block(h, ids, w, i, cfg, out, breaks)
        layer_taps.append(h.mean(1) if tap_reduce == "mean" else h.sum(1))  # [S, D]
    x = torch.stack([hc_head(h[t], w["hc_head_fn"], w["hc_head_scale"], w["hc_head_base"], cfg)
                     for t in range(S)])  # [S, D]
    x = rms_norm(x, w["norm.weight"], cfg.norm_eps)
    out.logits = x @ w["head.weight"].T  # [S, V]
    out.layer_taps = torch.stack(layer_taps)  # [L, S, D]
    out.taps = torch.cat([out.layer_taps[i] for i in cfg.dspark_target_layer_ids], -1)  # [S, T·D]
    return out


def _to_float64(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    from dsv4.inventory import trunk_params  # names only: the inventory holds no math

    missing = [p.name for p in trunk_params(cfg) if p.name not in weights]
    if missing:
        raise ValueError(f"weights: missing {len(missing)} tensors, e.g. {missing[:3]}")
    return {k: (v.detach().to(F64) if v.is_floating_point() else v) for k, v in weights.items()}
