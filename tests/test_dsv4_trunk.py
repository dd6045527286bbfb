"""Trunk-level tests (spec §3, §5.4, §13 test plan): prefill/decode equivalence, state reset
and independence, taps, input validation, strict loading, meta construction, bf16.

Error measure: `rel` = max |a - b| / max |b| over the compared tensor.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from dsv4.config import ModelConfig, tiny_config
from dsv4.init import random_weights
from dsv4.inventory import trunk_params
from dsv4.mhc import lane_mean
from dsv4.trunk import ForwardOutput, Trunk

CFG = tiny_config()
N = 40  # ring of 8 wraps 5 times; 10 ratio-4 and 5 ratio-8 entries; top-2 of up to 10 entries
FP32_TOL = 1e-5
# quant_sim on: fp8/fp4 round trips turn ~1e-7 prefill-vs-decode rounding differences into
# occasional one-step code flips (e.g. 2^-4 relative in one element), which the random tiny
# model amplifies. Measured (relative L2, logits and tap row, 6 prompts x k in {3, 13}):
# 8 of 12 runs < 1e-6, the others 0.049 and 0.257 (one prompt each, both k). Bounds: every
# run <= 0.4, median <= 0.05 (a systematic prefill/decode mismatch moves every run).
QSIM_MAX, QSIM_MEDIAN = 0.4, 0.05
# bf16 vs fp32 last-position logits, relative L2. Measured over 12 prompts of 40 tokens:
# median 0.019, 10 of 12 in [0.011, 0.036]; two at 0.21 and 0.27, where bf16 rounding flips an
# indexer top-k choice (a discrete change, not drift). Bounds: every prompt <= 0.4, median <= 0.05.
BF16_MAX, BF16_MEDIAN = 0.4, 0.05
REF = Path(__file__).resolve().parents[2] / "shared" / "reference" / "deepseek-v4-flash-0731-reap160"


def varied_weights(cfg, seed=0):
    """random_weights with norm weights, sinks, hc biases and ape made non-trivial."""
    w = random_weights(cfg, "trunk", seed)
    g = torch.Generator().manual_seed(seed + 100)
    for name, t in w.items():
        if t.ndim == 1 and "norm" in name:
            w[name] = 1 + 0.3 * torch.randn(t.shape, generator=g)
        elif name.endswith("attn_sink") or name.endswith("_base"):
            w[name] = 0.5 * torch.randn(t.shape, generator=g)
        elif name.endswith("ape"):
            w[name] = torch.randn(t.shape, generator=g)
    return w


WEIGHTS = varied_weights(CFG)


def tokens(n, seed=0):
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def rel_l2(a, b):
    return float((a - b).norm() / b.norm())


def make(cfg=CFG, weights=None, **kw):
    m = Trunk(cfg, **kw)
    m.load_weights(WEIGHTS if weights is None else weights)
    return m


@pytest.fixture(scope="module")
def model():
    return make(dtype=torch.float32, quant_sim=False, deterministic_reduce=True)


def run_split(model, ids, k, tap_from):
    """prefill(ids[:k]) then decode the rest; returns the last output and the tap rows of
    positions >= tap_from."""
    st = model.new_state()
    out = model.prefill(st, ids[:k])
    rows = []
    for p in range(k, len(ids)):
        out = model.decode(st, int(ids[p]), p)
        if p >= tap_from:
            rows.append(out.taps)
    assert st.next_position == len(ids)
    return out, (torch.cat(rows) if rows else None)


# ----------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize("k", [1, 3, 6, 13])  # k = 1, k < r, k < W, k = 13 (> W, not a multiple of 4 or 8)
def test_prefill_then_decode_equals_full_prefill(model, k):
    ids = tokens(N)
    full = model.prefill(model.new_state(), ids)
    out, taps = run_split(model, ids, k, N - CFG.window_size)
    assert rel(out.logits, full.logits) <= FP32_TOL
    assert taps.shape == full.taps.shape == (CFG.window_size, CFG.tap_width)
    assert rel(taps, full.taps) <= FP32_TOL


def test_prefill_then_decode_with_quant_sim_within_stated_tolerance():
    model = make(quant_sim=True)
    errors = []
    for seed in range(6):
        ids = tokens(N, seed)
        full = model.prefill(model.new_state(), ids)
        for k in (3, 13):
            out, taps = run_split(model, ids, k, N - 1)
            errors.append(max(rel_l2(out.logits, full.logits), rel_l2(taps, full.taps[-1:])))
    assert max(errors) <= QSIM_MAX, errors
    assert statistics.median(errors) <= QSIM_MEDIAN, errors


def test_quant_sim_changes_the_numbers(model):
    ids = tokens(20)
    plain = model.prefill(model.new_state(), ids).logits
    qsim = make(quant_sim=True)
    assert rel_l2(qsim.prefill(qsim.new_state(), ids).logits, plain) > 1e-3


# ----------------------------------------------------------------------------- state handling
def test_shorter_prompt_on_reset_state_matches_fresh_state(model):
    st = model.new_state()
    model.prefill(st, tokens(37, seed=1))
    for p in range(37, 42):
        model.decode(st, p, p)
    st.reset()
    assert st.next_position == 0
    fresh = model.new_state()
    short = tokens(10, seed=2)
    a, b = model.prefill(st, short[:3]), model.prefill(fresh, short[:3])  # 3 < r: reads the "previous block"
    assert torch.equal(a.logits, b.logits) and torch.equal(a.taps, b.taps)
    for p in range(3, 10):
        a, b = model.decode(st, int(short[p]), p), model.decode(fresh, int(short[p]), p)
        assert torch.equal(a.logits, b.logits) and torch.equal(a.taps, b.taps)


def test_interleaved_states_equal_solo_runs(model):
    prompts = [tokens(11, seed=3), tokens(5, seed=4)]
    follow = [tokens(9, seed=5), tokens(9, seed=6)]

    def solo(i):
        st = model.new_state()
        outs = [model.prefill(st, prompts[i]).logits]
        for j, t in enumerate(follow[i]):
            outs.append(model.decode(st, int(t), len(prompts[i]) + j).logits)
        return outs

    expected = [solo(0), solo(1)]
    states = [model.new_state(), model.new_state()]
    got = [[model.prefill(states[i], prompts[i]).logits] for i in (0, 1)]
    for j in range(9):
        for i in (1, 0):
            got[i].append(model.decode(states[i], int(follow[i][j]), len(prompts[i]) + j).logits)
    for i in (0, 1):
        assert all(torch.equal(a, b) for a, b in zip(got[i], expected[i]))


def test_state_bytes_counts_rings_compressor_rows_and_caches(model):
    W, Dh, L, r_max = CFG.window_size, CFG.head_dim, CFG.n_layers, CFG.max_seq_len
    rings = L * W * Dh * 4
    comp = {4: 2 * (8 * 2 * Dh * 4) + (r_max // 4) * Dh * 4, 8: 2 * (8 * Dh * 4) + (r_max // 8) * Dh * 4}
    Di = CFG.index_head_dim
    indexer = 2 * (8 * 2 * Di * 4) + (r_max // 4) * Di * 4
    expected = rings + comp[4] + comp[8] + comp[4] + 2 * indexer  # layers 1 (r4), 2 (r8), 3 (r4)
    assert model.state_bytes(model.new_state()) == expected


def test_prefill_requires_empty_state(model):
    st = model.new_state()
    model.prefill(st, tokens(4))
    with pytest.raises(ValueError, match="next_position=4"):
        model.prefill(st, tokens(4))


# ----------------------------------------------------------------------------- taps
def test_requesting_taps_leaves_logits_bitwise_unchanged(model):
    ids = tokens(17)
    s1, s2 = model.new_state(), model.new_state()
    with_taps, without = model.prefill(s1, ids, taps=True), model.prefill(s2, ids, taps=False)
    assert without.taps is None and with_taps.taps is not None
    assert torch.equal(with_taps.logits, without.logits)
    for p in range(17, 21):
        a, b = model.decode(s1, p, p, taps=True), model.decode(s2, p, p, taps=False)
        assert b.taps is None and a.taps.shape == (1, CFG.tap_width)
        assert torch.equal(a.logits, b.logits)


@pytest.mark.parametrize("S, keep, rows", [(20, None, 8), (20, 3, 3), (5, None, 5), (20, 50, 20), (20, 0, 0)])
def test_prefill_tap_rows_are_the_last_keep_positions(model, S, keep, rows):
    ids = tokens(S)
    out = model.prefill(model.new_state(), ids, keep_rows=keep)
    assert isinstance(out, ForwardOutput) and out.logits.shape == (CFG.vocab_size,)
    assert out.logits.dtype == torch.float32 and out.taps.dtype == torch.float32
    assert out.taps.shape == (rows, CFG.tap_width)
    all_rows = model.prefill(model.new_state(), ids, keep_rows=S).taps
    assert torch.equal(out.taps, all_rows[S - rows:])


def test_tap_slots_are_lane_means_in_ascending_layer_order():
    cfg = tiny_config(dspark_target_layer_ids=[0, 2])
    m = make(cfg, varied_weights(cfg))
    seen = {}
    hooks = [m.layers[i].register_forward_hook(lambda mod, args, out, i=i: seen.__setitem__(i, out))
             for i in range(cfg.n_layers)]
    try:
        taps = m.prefill(m.new_state(), tokens(12), keep_rows=5).taps
    finally:
        for h in hooks:
            h.remove()
    D = cfg.dim
    assert taps.shape == (5, 2 * D)
    assert torch.equal(taps[:, :D], lane_mean(seen[0][-5:]))
    assert torch.equal(taps[:, D:], lane_mean(seen[2][-5:]))


# ----------------------------------------------------------------------------- validation
def test_decode_position_mismatch_names_both(model):
    st = model.new_state()
    model.prefill(st, tokens(4))
    with pytest.raises(ValueError, match=r"position=6.*next_position=4"):
        model.decode(st, 1, 6)


@pytest.mark.parametrize("bad", [CFG.vocab_size, -1, 100000])
def test_out_of_range_token_ids_raise_naming_the_id(model, bad):
    ids = tokens(6)
    ids[2] = bad
    with pytest.raises(ValueError, match=f"token id {bad}"):
        model.prefill(model.new_state(), ids)
    st = model.new_state()
    model.prefill(st, tokens(3))
    with pytest.raises(ValueError, match=f"token id {bad}"):
        model.decode(st, bad, 3)
    assert st.next_position == 3


def test_prompt_shape_and_length_are_checked(model):
    with pytest.raises(ValueError, match="empty prompt"):
        model.prefill(model.new_state(), torch.tensor([], dtype=torch.int64))
    with pytest.raises(ValueError, match=f"{CFG.max_seq_len + 1}.*max_seq_len"):
        model.prefill(model.new_state(), tokens(CFG.max_seq_len + 1))
    with pytest.raises(ValueError, match="1-D integer"):
        model.prefill(model.new_state(), torch.ones(3))
    with pytest.raises(ValueError, match="keep_rows=-1"):
        model.prefill(model.new_state(), tokens(3), keep_rows=-1)
    st = model.new_state()
    model.prefill(st, tokens(3))
    st.next_position = CFG.max_seq_len
    with pytest.raises(ValueError, match=f"position={CFG.max_seq_len}.*max_seq_len"):
        model.decode(st, 1, CFG.max_seq_len)


def test_forward_before_loading_raises():
    with pytest.raises(RuntimeError, match="load_weights"):
        m = Trunk(CFG)
        m.prefill(m.new_state(), tokens(3))


def test_load_weights_is_strict_and_names_the_tensor():
    m = Trunk(CFG)
    w = dict(WEIGHTS)
    del w["layers.1.attn.compressor.ape"]
    w["layers.0.attn.bogus"] = torch.zeros(1)
    w["layers.2.attn.wkv.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError) as e:
        m.load_weights(w)
    msg = str(e.value)
    assert "layers.1.attn.compressor.ape" in msg and "layers.0.attn.bogus" in msg
    assert "layers.2.attn.wkv.weight: got (3, 3), expected (96, 256)" in msg
    w = dict(WEIGHTS)
    w["layers.0.ffn.gate.tid2eid"] = WEIGHTS["layers.0.ffn.gate.tid2eid"] + CFG.n_routed_experts
    with pytest.raises(ValueError, match="layers.0.ffn.gate.tid2eid"):
        m.load_weights(w)


def test_load_weights_casts_to_model_dtype():
    m = make(dtype=torch.bfloat16)
    assert m.layers[0].attn.wq_a.weight.dtype == torch.bfloat16
    assert m.layers[0].attn_norm.weight.dtype == torch.float32  # norms stay fp32
    assert m.layers[1].attn.compressor.wkv.weight.dtype == torch.float32  # spec §5.6: fp32
    assert m.head.weight.dtype == torch.float32 and m.layers[3].ffn.gate.bias.dtype == torch.float32
    assert torch.equal(m.layers[0].ffn.gate.tid2eid, WEIGHTS["layers.0.ffn.gate.tid2eid"])


def test_state_dict_equals_tiny_inventory():
    names = {k: tuple(v.shape) for k, v in Trunk(CFG, device="meta").state_dict().items()}
    assert names == {p.name: p.shape for p in trunk_params(CFG)}


@pytest.mark.skipif(not REF.is_dir(), reason=f"reference checkpoint metadata not found at {REF}")
def test_meta_flash_trunk_matches_inventory():
    cfg = ModelConfig.load(REF).replace(n_routed_experts=160)
    m = Trunk(cfg, dtype=torch.bfloat16, device="meta")
    sd = m.state_dict()
    assert all(t.device.type == "meta" for t in sd.values())
    assert {k: tuple(v.shape) for k, v in sd.items()} == {p.name: p.shape for p in trunk_params(cfg)}


# ----------------------------------------------------------------------------- bf16
def test_bf16_logits_agree_with_fp32(model):
    bf = make(dtype=torch.bfloat16)
    errors = []
    for seed in range(6):
        ids = tokens(N, seed)
        out, ref = bf.prefill(bf.new_state(), ids), model.prefill(model.new_state(), ids)
        assert out.logits.dtype == torch.float32
        errors.append(rel_l2(out.logits, ref.logits))
    ids = tokens(N, seed=7)  # and through decode
    out, _ = run_split(bf, ids, 30, N)
    ref, _ = run_split(model, ids, 30, N)
    errors.append(rel_l2(out.logits, ref.logits))
    assert max(errors) <= BF16_MAX, errors
    assert statistics.median(errors) <= BF16_MEDIAN, errors
