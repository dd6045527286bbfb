"""Unit tests of the trunk's parts: settings, rope/YaRN, mHC, compressor, indexer, sparse
attention, MoE (docs/model.md §2, §4, §5, §6). fp32, quantisation simulation off.

Brute-force references are written here from the formulas of docs/model.md with Python loops; they
share only parameter tensors with the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsv4.attention import sparse_attn
from dsv4.config import tiny_config
from dsv4.init import random_weights
from dsv4.indexer import index_scores, select_topk
from dsv4.mhc import hc_head, hc_post, hc_pre, split_sinkhorn
from dsv4.moe import Expert
from dsv4.rope import Rope, apply_rope, rope_inv_freq, yarn_ramp_bounds
from dsv4.settings import ENV_MOE_DETERMINISTIC_REDUCE
from dsv4.trunk import Trunk
from model_fixtures import varied_weights
from services.settings import model_settings

CFG = tiny_config()


@pytest.fixture(scope="module")
def model():
    m = Trunk(CFG, dtype=torch.float32, quant_sim=False, deterministic_reduce=True)
    m.load_weights(varied_weights(CFG))
    return m


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


# ----------------------------------------------------------------------------- settings
def test_settings_default_is_deterministic_reduce():
    assert model_settings({}).moe_deterministic_reduce is True
    assert model_settings({ENV_MOE_DETERMINISTIC_REDUCE: ""}).moe_deterministic_reduce is True


@pytest.mark.parametrize("raw, expected", [("0", False), ("1", True), (" 0 ", False)])
def test_settings_reads_deterministic_reduce(raw, expected):
    assert model_settings({ENV_MOE_DETERMINISTIC_REDUCE: raw}).moe_deterministic_reduce is expected


@pytest.mark.parametrize("raw", ["yes", "2", "true", "-1"])
def test_settings_invalid_value_names_variable_and_value(raw):
    with pytest.raises(ValueError, match=f"{ENV_MOE_DETERMINISTIC_REDUCE}={raw!r}"):
        model_settings({ENV_MOE_DETERMINISTIC_REDUCE: raw})


def test_trunk_takes_deterministic_reduce_from_the_settings():
    for raw, expected in (("0", False), ("1", True)):
        reduce = model_settings({ENV_MOE_DETERMINISTIC_REDUCE: raw}).moe_deterministic_reduce
        assert Trunk(CFG, deterministic_reduce=reduce, device="meta").layers[3].ffn.deterministic_reduce is expected
    assert Trunk(CFG, device="meta").layers[3].ffn.deterministic_reduce is True  # no setting: the default


# ----------------------------------------------------------------------------- rope
def test_rope_matches_complex_multiplication_on_last_dims():
    R, Dh, S, H = 32, 96, 7, 3
    inv = rope_inv_freq(R, 10000.0)
    x, pos = randn(S, H, Dh), torch.tensor([0, 1, 5, 17, 63, 100, 1000])
    out = apply_rope(x, pos, inv)
    table = torch.polar(torch.ones(S, R // 2), pos[:, None].float() * inv[None, :])  # [S, R/2] complex
    pairs = torch.view_as_complex(x[..., -R:].reshape(S, H, R // 2, 2).contiguous())
    expected = torch.view_as_real(pairs * table[:, None, :]).reshape(S, H, R)
    assert torch.equal(out[..., :-R], x[..., :-R])
    torch.testing.assert_close(out[..., -R:], expected, rtol=1e-5, atol=1e-5)


def test_inverse_rope_undoes_rope():
    inv, x, pos = rope_inv_freq(32, 160000.0, 32, 4.0), randn(9, 2, 96), torch.arange(9) * 7
    back = apply_rope(apply_rope(x, pos, inv), pos, inv, inverse=True)
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)


def test_yarn_interpolates_only_above_the_ramp():
    R, base, orig, factor = 32, 160000.0, 32, 4.0
    plain, yarn = rope_inv_freq(R, base), rope_inv_freq(R, base, orig, factor)
    lo, hi = yarn_ramp_bounds(R, base, orig, 32.0, 1.0)
    assert (lo, hi) == (0, 3)  # docs/model.md §13: "lo=0, hi=3 of 16 freqs"
    assert torch.equal(yarn[: lo + 1], plain[: lo + 1])  # ramp 0: unchanged
    torch.testing.assert_close(yarn[hi:], plain[hi:] / factor)  # ramp 1: fully interpolated
    ramp = (torch.arange(lo + 1, hi).float() - lo) / (hi - lo)
    torch.testing.assert_close(yarn[lo + 1:hi], plain[lo + 1:hi] * (1 - ramp + ramp / factor))


def test_layer_rope_tables_follow_ratio():
    yarn = rope_inv_freq(CFG.rope_head_dim, CFG.compress_rope_theta, CFG.original_seq_len, CFG.rope_factor)
    plain = rope_inv_freq(CFG.rope_head_dim, CFG.rope_theta)
    assert torch.equal(Rope.for_layer(CFG, 0).inv_freq, plain)  # ratio 0
    assert torch.equal(Rope.for_layer(CFG, 1).inv_freq, yarn)  # ratio 4
    assert torch.equal(Rope.for_layer(CFG, 2).inv_freq, yarn)  # ratio 8
    assert torch.equal(Rope.for_layer(CFG, CFG.n_layers).inv_freq, plain)  # DSpark stage


# ----------------------------------------------------------------------------- mHC
def test_sinkhorn_rows_and_columns_sum_to_one():
    C, S = 4, 16
    mixes = randn(S, (2 + C) * C)
    _, _, comb = split_sinkhorn(mixes, torch.ones(3), 0.3 * randn((2 + C) * C, seed=1), C, 1e-6, 20)
    torch.testing.assert_close(comb.sum(-2), torch.ones(S, C), rtol=0, atol=1e-5)  # last step: columns
    # rows converge geometrically; unit-variance logits leave < 1e-3 after 20 iterations
    torch.testing.assert_close(comb.sum(-1), torch.ones(S, C), rtol=0, atol=2e-3)
    assert (comb > 0).all()


def test_split_sinkhorn_pre_post_layout():
    C = 4
    mixes, scale, base = randn(5, 24), torch.tensor([0.5, 2.0, 1.0]), randn(24, seed=3)
    pre, post, _ = split_sinkhorn(mixes, scale, base, C, 1e-6, 20)
    torch.testing.assert_close(pre, torch.sigmoid(mixes[:, :C] * 0.5 + base[:C]) + 1e-6)
    torch.testing.assert_close(post, 2 * torch.sigmoid(mixes[:, C:2 * C] * 2.0 + base[C:2 * C]))


def test_hc_post_comb_rows_are_sources_columns_destinations():
    y = torch.tensor([[100.0, 200.0]])  # [S=1, D=2]
    res = torch.tensor([[[1.0, 2.0], [10.0, 20.0]]])  # lanes 0, 1
    post = torch.tensor([[0.5, 2.0]])
    comb = torch.tensor([[[0.0, 1.0], [0.25, 0.0]]])  # lane 0 -> lane 1 (1.0); lane 1 -> lane 0 (0.25)
    out = hc_post(y, res, post, comb)
    expected = torch.tensor([[[0.5 * 100 + 0.25 * 10, 0.5 * 200 + 0.25 * 20],
                              [2 * 100 + 1 * 1, 2 * 200 + 1 * 2]]])
    assert torch.equal(out, expected)


def test_hc_pre_mixes_lanes_with_pre_weights():
    C, D, S = 4, 8, 3
    x, fn, base = randn(S, C, D), 0.1 * randn(24, C * D, seed=1), randn(24, seed=2)
    y, post, comb = hc_pre(x, fn, torch.ones(3), base, 1e-6, 1e-6, 20)
    xf = x.flatten(1)
    mixes = (xf @ fn.T) / torch.sqrt(xf.square().mean(-1, keepdim=True) + 1e-6)
    pre = torch.sigmoid(mixes[:, :C] + base[:C]) + 1e-6
    torch.testing.assert_close(y, (pre[:, :, None] * x).sum(1))
    assert post.shape == (S, C) and comb.shape == (S, C, C)


def test_hc_head_weights_lanes_by_sigmoid():
    C, D = 4, 8
    x, fn, base, scale = randn(2, C, D), 0.1 * randn(C, C * D, seed=1), randn(C, seed=2), torch.tensor([0.7])
    xf = x.flatten(1)
    mixes = (xf @ fn.T) / torch.sqrt(xf.square().mean(-1, keepdim=True) + 1e-6)
    w = torch.sigmoid(mixes * 0.7 + base) + 1e-6
    torch.testing.assert_close(hc_head(x, fn, scale, base, 1e-6, 1e-6), (w[:, :, None] * x).sum(1))


# ----------------------------------------------------------------------------- compressor
def brute_force_entries(comp, x):
    """docs/model.md §5.6 pooled formula with explicit loops, then norm / rope at the block start."""
    r, d = comp.ratio, comp.head_dim
    wkv, wgate, ape = comp.wkv.weight, comp.wgate.weight, comp.ape
    v = [wkv @ x[t] for t in range(x.shape[0])]
    g = [wgate @ x[t] + ape[t % r] for t in range(x.shape[0])]
    out = []
    for j in range(x.shape[0] // r):
        slots_v, slots_g = [], []
        if comp.overlap and j > 0:
            for t in range((j - 1) * r, j * r):
                slots_v.append(v[t][:d])
                slots_g.append(g[t][:d])
        for t in range(j * r, (j + 1) * r):
            slots_v.append(v[t][d:] if comp.overlap else v[t])
            slots_g.append(g[t][d:] if comp.overlap else g[t])
        sv, sg = torch.stack(slots_v), torch.stack(slots_g)  # [slots, d]
        c = (torch.exp(sg - sg.max(0).values) / torch.exp(sg - sg.max(0).values).sum(0) * sv).sum(0)
        c = comp.norm.weight * c / torch.sqrt(c.square().mean() + CFG.norm_eps)
        out.append(apply_rope(c[None], torch.tensor([j * r]), comp.rope.inv_freq)[0])
    return torch.stack(out)


@pytest.mark.parametrize("layer, ratio", [(1, 4), (2, 8)])
def test_compressor_prefill_matches_pooled_formula(model, layer, ratio):
    comp = model.layers[layer].attn.compressor
    assert comp.ratio == ratio and comp.overlap == (ratio == 4)
    x = randn(27, CFG.dim, seed=layer)
    st = comp.new_state(CFG.max_seq_len)
    comp.prefill(x, st)
    assert st.n_entries == 27 // ratio
    torch.testing.assert_close(st.entries(), brute_force_entries(comp, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer", [1, 2])
@pytest.mark.parametrize("k", [1, 3, 6, 13, 16])
def test_compressor_prefill_remainder_hands_off_to_decode(model, layer, k):
    comp, N = model.layers[layer].attn.compressor, 40
    x = randn(N, CFG.dim, seed=5)
    full = comp.new_state(CFG.max_seq_len)
    comp.prefill(x, full)
    split = comp.new_state(CFG.max_seq_len)
    comp.prefill(x[:k], split)
    for p in range(k, N):
        produced = comp.step(x[p:p + 1], p, split)
        assert produced == ((p + 1) % comp.ratio == 0)
    assert split.n_entries == full.n_entries == N // comp.ratio
    torch.testing.assert_close(split.entries(), full.entries(), rtol=1e-5, atol=1e-5)


def test_overlap_first_block_uses_masked_previous_slots(model):
    comp = model.layers[1].attn.compressor
    r, d = comp.ratio, comp.head_dim
    st = comp.new_state(CFG.max_seq_len)
    assert torch.isneginf(st.score).all() and (st.kv == 0).all()
    x = randn(r, CFG.dim, seed=9)
    for p in range(r):
        comp.step(x[p:p + 1], p, st)
    # entry 0 pools only the current block's second half (previous slots: value 0, score -inf)
    v = x @ comp.wkv.weight[d:].T
    g = x @ comp.wgate.weight[d:].T + comp.ape[:, d:]
    c = (torch.softmax(g, dim=0) * v).sum(0)
    expected = comp.finalize(c[None], torch.tensor([0]))[0]
    torch.testing.assert_close(st.entries()[0], expected, rtol=1e-5, atol=1e-6)
    prefilled = comp.new_state(CFG.max_seq_len)
    comp.prefill(x, prefilled)
    torch.testing.assert_close(prefilled.entries()[0], expected, rtol=1e-5, atol=1e-6)


def test_compressor_prefill_resets_stale_state(model):
    comp = model.layers[1].attn.compressor
    st = comp.new_state(CFG.max_seq_len)
    comp.prefill(randn(23, CFG.dim, seed=1), st)  # leaves previous-block rows and a remainder
    x = randn(6, CFG.dim, seed=2)
    comp.prefill(x[:2], st)
    fresh = comp.new_state(CFG.max_seq_len)
    comp.prefill(x[:2], fresh)
    for p in range(2, 6):
        comp.step(x[p:p + 1], p, st)
        comp.step(x[p:p + 1], p, fresh)
    assert torch.equal(st.entries(), fresh.entries())


# ----------------------------------------------------------------------------- indexer
def brute_force_topk(qi, w, kc, positions, topk):
    rows = []
    for s, p in enumerate(positions):
        visible = (p + 1) // 4
        scored = []
        for t in range(min(visible, kc.shape[0])):
            score = sum(torch.relu(qi[s, h] @ kc[t]) * w[s, h] for h in range(qi.shape[1]))
            scored.append((-float(score), t))
        chosen = [t for _, t in sorted(scored)[:topk]]
        width = min(topk, kc.shape[0])
        rows.append(chosen + [-1] * (width - len(chosen)))
    return torch.tensor(rows)


def test_indexer_prefill_topk_matches_brute_force(model):
    idx_mod = model.layers[1].attn.indexer
    S = 30
    x, qr = randn(S, CFG.dim, seed=3), randn(S, CFG.q_lora_rank, seed=4)
    st = idx_mod.compressor.new_state(CFG.max_seq_len)
    top = idx_mod(x, qr, 0, st)
    qi, w = idx_mod.project_q(qr, torch.arange(S)), idx_mod.head_weights(x)
    expected = brute_force_topk(qi, w, st.entries(), range(S), CFG.index_topk)
    assert top.shape == (S, min(CFG.index_topk, S // 4))
    assert torch.equal(top, expected)
    assert (top[:3] == -1).all() and (top[-1] >= 0).all()  # nothing visible before position 3


def test_indexer_decode_topk_matches_brute_force(model):
    idx_mod = model.layers[3].attn.indexer
    x, qr = randn(24, CFG.dim, seed=6), randn(24, CFG.q_lora_rank, seed=7)
    st = idx_mod.compressor.new_state(CFG.max_seq_len)
    idx_mod(x[:13], qr[:13], 0, st)
    for p in range(13, 24):
        top = idx_mod(x[p:p + 1], qr[p:p + 1], p, st)
        qi, w = idx_mod.project_q(qr[p:p + 1], torch.tensor([p])), idx_mod.head_weights(x[p:p + 1])
        assert torch.equal(top, brute_force_topk(qi, w, st.entries(), [p], CFG.index_topk))


def test_select_topk_breaks_ties_to_lower_index():
    scores = torch.tensor([[0.0, 2.0, 0.0, 0.0, 5.0]])
    assert select_topk(scores, torch.tensor([4]), 3).tolist() == [[1, 0, 2]]
    assert select_topk(scores, torch.tensor([1]), 3).tolist() == [[0, -1, -1]]


def test_index_scores_is_weighted_relu_sum():
    qi, w, kc = randn(2, 3, 8), randn(2, 3, seed=1), randn(5, 8, seed=2)
    expected = torch.stack([torch.stack([(torch.relu(qi[s] @ kc[t]) * w[s]).sum() for t in range(5)])
                            for s in range(2)])
    torch.testing.assert_close(index_scores(qi, w, kc), expected)


# ----------------------------------------------------------------------------- sparse attention
def dense_reference(q, kv, sink, idx, scale):
    """Dense masked softmax over all kv rows with an extra sink logit column."""
    S, H, _ = q.shape
    mask = torch.zeros(S, kv.shape[0], dtype=torch.bool)
    for s in range(S):
        for j in idx[s].tolist():
            if j >= 0:
                mask[s, j] = True
    logits = torch.einsum("shd,nd->shn", q.double(), kv.double()) * scale
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    with_sink = torch.cat((logits, sink.double()[None, :, None].expand(S, H, 1)), dim=-1)
    probs = torch.softmax(with_sink, dim=-1)[..., :-1]
    return torch.einsum("shn,nd->shd", probs, kv.double())


@pytest.mark.parametrize("sink_scale", [1.0, 50.0])
def test_sparse_attn_matches_dense_softmax_with_sink(sink_scale):
    S, H, Dh, N = 6, 4, 96, 20
    q, kv, sink = randn(S, H, Dh), randn(N, Dh, seed=1), sink_scale * randn(H, seed=2)
    g = torch.Generator().manual_seed(3)
    idx = torch.stack([torch.randperm(N, generator=g)[:7] for _ in range(S)])
    idx[0, 3:] = -1
    idx[2, :6] = -1
    out = sparse_attn(q, kv, sink, idx, Dh ** -0.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), dense_reference(q, kv, sink, idx, Dh ** -0.5), rtol=1e-5, atol=1e-6)


def test_sparse_attn_sink_only_enlarges_denominator():
    q, kv, idx = randn(1, 2, 8), randn(3, 8, seed=1), torch.tensor([[0, 1, 2]])
    no_sink = sparse_attn(q, kv, torch.full((2,), -1e4), idx, 1.0)
    with_sink = sparse_attn(q, kv, torch.zeros(2), idx, 1.0)
    logits = torch.einsum("shd,nd->shn", q, kv)
    den = torch.exp(logits).sum(-1)
    torch.testing.assert_close(with_sink, no_sink * (den / (den + 1))[..., None])


# ----------------------------------------------------------------------------- MoE
def test_routing_weights_sum_to_route_scale(model):
    x, ids = randn(16, CFG.dim), torch.arange(16) * 31 % CFG.vocab_size
    for layer in (0, 3):  # hash, scored
        weights, experts = model.layers[layer].ffn.gate(x, ids)
        assert experts.shape == weights.shape == (16, CFG.n_activated_experts)
        torch.testing.assert_close(weights.sum(-1), torch.full((16,), CFG.route_scale))


def test_hash_routing_uses_tid2eid_not_scores(model):
    gate = model.layers[1].ffn.gate
    assert gate.hash and gate.bias is None
    x, ids = randn(8, CFG.dim), torch.tensor([0, 5, 9, 100, 200, 300, 400, 511])
    weights, experts = gate(x, ids)
    assert torch.equal(experts, gate.tid2eid[ids])
    s = gate.scores(x).gather(1, experts)
    torch.testing.assert_close(weights, s / s.sum(-1, keepdim=True) * CFG.route_scale)
    saved_w, saved_t = gate.weight.clone(), gate.tid2eid.clone()
    try:
        gate.weight.mul_(-3.0)  # new scores: same experts, other weights
        w2, e2 = gate(x, ids)
        assert torch.equal(e2, experts) and not torch.allclose(w2, weights)
        gate.tid2eid.copy_((gate.tid2eid + 1) % CFG.n_routed_experts)
        assert torch.equal(gate(x, ids)[1], (experts + 1) % CFG.n_routed_experts)
    finally:
        gate.weight.copy_(saved_w)
        gate.tid2eid.copy_(saved_t)


def test_scored_bias_changes_selection_not_weight_source(model):
    gate = model.layers[3].ffn.gate
    x, ids = randn(8, CFG.dim, seed=4), torch.zeros(8, dtype=torch.int64)
    saved = gate.bias.clone()
    try:
        gate.bias.zero_()
        gate.bias[[5, 6]] = 100.0  # forces experts 5 and 6
        weights, experts = gate(x, ids)
        assert experts.sort(-1).values.tolist() == [[5, 6]] * 8
        s = gate.scores(x).gather(1, experts)  # unbiased scores
        torch.testing.assert_close(weights, s / s.sum(-1, keepdim=True) * CFG.route_scale)
        gate.bias.zero_()
        assert not torch.equal(gate(x, ids)[1].sort(-1).values, experts.sort(-1).values)
    finally:
        gate.bias.copy_(saved)


def test_swiglu_clamps_up_both_sides_gate_above_only():
    D, I, L = 4, 6, 0.5
    ex = Expert(D, I, L, torch.float32)
    with torch.no_grad():
        ex.w1.weight.copy_(3 * randn(I, D, seed=1))
        ex.w3.weight.copy_(3 * randn(I, D, seed=2))
        ex.w2.weight.copy_(randn(D, I, seed=3))
    x, wts = randn(5, D, seed=4), torch.rand(5, generator=torch.Generator().manual_seed(5))
    gate, up = x @ ex.w1.weight.T, x @ ex.w3.weight.T
    assert (gate > L).any() and (gate < -L).any() and (up.abs() > L).any()  # the clamp is exercised
    h = torch.nn.functional.silu(gate.clamp(max=L)) * up.clamp(-L, L)
    torch.testing.assert_close(ex(x, wts), (wts[:, None] * h) @ ex.w2.weight.T)
    unclamped = (wts[:, None] * torch.nn.functional.silu(gate) * up) @ ex.w2.weight.T
    assert not torch.allclose(ex(x, wts), unclamped)


@pytest.fixture(scope="module")
def moe4():
    """A scored MoE layer with 4 routes per token (order matters for 3+ fp32 addends)."""
    cfg = tiny_config(n_activated_experts=4)
    m = Trunk(cfg, deterministic_reduce=True)
    m.load_weights(random_weights(cfg, "trunk", 1))
    return cfg, m.layers[3].ffn


def test_moe_combine_is_independent_of_routing_order(moe4):
    cfg, moe = moe4
    N = 48
    x = randn(N, cfg.dim, seed=8)
    weights, experts = moe.gate(x, torch.zeros(N, dtype=torch.int64))
    g = torch.Generator().manual_seed(9)
    perm = torch.stack([torch.randperm(4, generator=g) for _ in range(N)])  # per-token route order
    w_p, e_p = weights.gather(1, perm), experts.gather(1, perm)
    moe.deterministic_reduce = True
    try:
        assert torch.equal(moe.combine(x, weights, experts), moe.combine(x, w_p, e_p))
        ordered = moe.combine(x, weights, experts)
        moe.deterministic_reduce = False  # routing-order sum: the permutation shows in the bits
        unordered = moe.combine(x, w_p, e_p)
        assert not torch.equal(unordered, moe.combine(x, weights, experts))
        torch.testing.assert_close(unordered, ordered, rtol=1e-5, atol=1e-6)
    finally:
        moe.deterministic_reduce = True


def test_moe_combine_equals_weighted_expert_sum(moe4):
    cfg, moe = moe4
    x = randn(5, cfg.dim, seed=10)
    weights, experts = moe.gate(x, torch.zeros(5, dtype=torch.int64))
    y = moe(x, torch.zeros(5, dtype=torch.int64))
    expected = moe.shared_experts(x)
    for n in range(5):
        for j in range(4):
            expected[n] += moe.experts[int(experts[n, j])](x[n:n + 1], weights[n, j:j + 1])[0]
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)


def test_hash_moe_output_ignores_tid2eid_column_order():
    cfg = tiny_config(n_activated_experts=4)
    m = Trunk(cfg, deterministic_reduce=True)
    w = random_weights(cfg, "trunk", 2)
    m.load_weights(w)
    moe, x, ids = m.layers[0].ffn, randn(40, cfg.dim, seed=11), torch.arange(40) * 7
    before = moe(x, ids)
    moe.gate.tid2eid.copy_(moe.gate.tid2eid.flip(-1))
    assert torch.equal(moe(x, ids), before)
    assert math.isfinite(float(before.abs().sum()))
