"""Conformance of `dsv4.trunk.Trunk` (fp32, quant_sim off) with the float64 reference.

The reference (`tests/reference_dsv4.py`) is written straight from docs/model.md and shares no
code with `dsv4/`. Error measure everywhere: per-row relative L2 error
||model - ref|| / ||ref||, maximum over the rows compared (`rel_err`).

Test inputs: the tiny config of docs/model.md §13 and `random_weights`, made less symmetric so that
every parameter matters (nonzero sinks, random mHC biases and norm weights, larger ape and
gate bias) and so that the indexer's top-k has no exact ties (the indexer heads come in
sign-opposite pairs, so no score is exactly relu(.) = 0 for every head; docs/model.md §5.7 leaves
tie-breaking open). Prompts wrap the W = 8 window and cross several ratio-4 and ratio-8
block boundaries; with index_topk = 2 every query from position 11 on prunes.
"""

from __future__ import annotations

import functools

import pytest
import torch

from dsv4.config import tiny_config
from dsv4.init import random_weights
from reference_dsv4 import BREAKS, reference_forward

TOL = 1e-5  # fp32 model vs float64 reference
MIN_MARGIN = 1e-4  # top-k gaps below this could flip under fp32 rounding
SEED = 0
PROMPT_LEN = 40
CFG = tiny_config()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max over rows of ||a - b|| / ||b|| (rows = last dim), computed in float64."""
    a, b = a.to(torch.float64).reshape(-1, b.shape[-1]), b.to(torch.float64).reshape(-1, b.shape[-1])
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max())


def conformance_weights(cfg, seed: int) -> dict[str, torch.Tensor]:
    """`random_weights` with the symmetric parts randomised (see the module docstring)."""
    w = random_weights(cfg, "trunk", seed)
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
        elif leaf == "ape":
            w[name] = 0.5 * torch.randn(t.shape, generator=g)
        elif leaf == "bias":
            w[name] = 0.3 * torch.randn(t.shape, generator=g)
        elif name.endswith("indexer.wq_b.weight"):
            heads = t.view(cfg.index_n_heads // 2, 2, cfg.index_head_dim, -1).clone()  # (Hi/2, 2, Di, Lq)
            heads[:, 1] = -heads[:, 0]
            w[name] = heads.reshape(t.shape)
    return w


WEIGHTS = conformance_weights(CFG, SEED)
TOKENS = torch.randint(0, CFG.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(11))


@functools.lru_cache(maxsize=None)
def reference(n: int, tap_reduce: str = "mean"):
    """Reference output for the prompt TOKENS[:n]."""
    return reference_forward(CFG, WEIGHTS, TOKENS[:n], tap_reduce=tap_reduce)


@pytest.fixture(scope="module")
def trunk_cls():
    from dsv4.trunk import Trunk  # the model under test; imported here so the reference tests run alone

    return Trunk


def make_model(trunk_cls, cfg=CFG):
    model = trunk_cls(cfg, dtype=torch.float32)
    model.load_weights(WEIGHTS)
    return model


def prefill(model, n: int, taps: bool = True):
    return model.prefill(model.new_state(), TOKENS[:n].clone(), keep_rows=n, taps=taps)


# ------------------------------------------------------------------ the inputs are well posed
def test_topk_choices_have_clear_margins():
    ref = reference(PROMPT_LEN)
    for layer, margins in ref.index_margins.items():
        assert min(margins) > MIN_MARGIN, f"indexer of layer {layer}: near-tie {min(margins)}"
    for layer, margins in ref.route_margins.items():
        assert float(margins.min()) > MIN_MARGIN, f"gate of layer {layer}: near-tie {float(margins.min())}"


def test_indexer_prunes_visible_entries():
    ref = reference(PROMPT_LEN)
    for layer in (1, 3):  # the ratio-4 layers of the tiny config
        sel = ref.selections[layer]
        for t, chosen in enumerate(sel):
            n_visible = (t + 1) // 4
            assert len(chosen) == min(CFG.index_topk, n_visible)
            assert all(0 <= j < n_visible for j in chosen)
        pruned = [t for t in range(PROMPT_LEN) if (t + 1) // 4 > CFG.index_topk]
        assert pruned[0] == 11
        # Selection follows the scores, not recency: some query skips its newest entries.
        assert any(sel[t] != [(t + 1) // 4 - 2, (t + 1) // 4 - 1] for t in pruned)
    unpruned = reference_forward(CFG.replace(index_topk=64), WEIGHTS, TOKENS)
    assert rel_err(unpruned.logits[11:], ref.logits[11:]) > 100 * TOL
    assert rel_err(unpruned.logits[:11], ref.logits[:11]) < 1e-12


def test_activations_not_degenerate():
    ref = reference(PROMPT_LEN)
    assert torch.isfinite(ref.logits).all()
    assert 0.1 < float(ref.logits.std()) < 100
    stds = ref.layer_taps.std(dim=-1)  # [L, S]
    assert float(stds.min()) > 0.1 and float(stds.max()) < 100


# ------------------------------------------------------------------ the reference itself
@pytest.mark.parametrize("n", [1, 4, 12, 27])
def test_reference_is_causal(n):
    full, prefix = reference(PROMPT_LEN), reference(n)
    assert rel_err(prefix.logits[-1], full.logits[n - 1]) < 1e-12
    assert rel_err(prefix.taps, full.taps[:n]) < 1e-12


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_reference_breaks_are_detectable(name):
    broken = reference_forward(CFG, WEIGHTS, TOKENS[:27], breaks={name})
    assert rel_err(broken.logits, reference(27).logits) > 100 * TOL


def test_reference_sum_taps_are_hc_mult_times_mean():
    mean, summed = reference(13).taps, reference(13, "sum").taps
    assert rel_err(summed, CFG.hc_mult * mean) < 1e-12


def test_reference_rejects_bad_input():
    with pytest.raises(ValueError, match="tokens"):
        reference_forward(CFG, WEIGHTS, [])
    with pytest.raises(ValueError, match="tokens"):
        reference_forward(CFG, WEIGHTS, [CFG.vocab_size])
    partial = {k: v for k, v in WEIGHTS.items() if k != "layers.2.attn.compressor.ape"}
    with pytest.raises(ValueError, match="missing"):
        reference_forward(CFG, partial, [1, 2])


# ------------------------------------------------------------------ model vs reference
@pytest.mark.parametrize("n", [5, 13, 27, 40])
def test_prefill_matches_reference(trunk_cls, n):
    out = prefill(make_model(trunk_cls), n)
    ref = reference(n)
    assert out.logits.shape == (CFG.vocab_size,) and out.logits.dtype == torch.float32
    assert out.taps.shape == (n, CFG.tap_width)
    assert rel_err(out.logits, ref.logits[-1]) < TOL
    assert rel_err(out.taps, ref.taps) < TOL


@pytest.mark.parametrize("k", [1, 3, 6, 13])
def test_decode_matches_reference(trunk_cls, k):
    model = make_model(trunk_cls)
    state = model.new_state()
    model.prefill(state, TOKENS[:k].clone(), keep_rows=k, taps=True)
    ref = reference(PROMPT_LEN)
    for pos in range(k, PROMPT_LEN):
        out = model.decode(state, int(TOKENS[pos]), pos, taps=True)
        assert out.taps.shape == (1, CFG.tap_width)
        assert rel_err(out.logits, ref.logits[pos]) < TOL, f"logits at position {pos}"
        assert rel_err(out.taps, ref.taps[pos]) < TOL, f"taps at position {pos}"


def test_taps_are_lane_mean_not_sum(trunk_cls):
    taps = prefill(make_model(trunk_cls), 13).taps.to(torch.float64)
    mean, summed = reference(13).taps, reference(13, "sum").taps
    assert rel_err(taps, mean) < TOL
    assert rel_err(taps, summed) > 0.7  # sum = hc_mult · mean: a clean factor 4 away
    factor = float((taps * mean).sum() / (mean * mean).sum())
    assert abs(factor - 1) < TOL


@pytest.mark.parametrize("ids", [(0,), (3,), (0, 2), (1, 3), (0, 1, 2, 3)])
def test_tap_slots_follow_layer_ids(trunk_cls, ids):
    cfg = CFG.replace(dspark_target_layer_ids=ids)
    taps = prefill(make_model(trunk_cls, cfg), 27).taps  # [S, T·D]
    assert taps.shape == (27, len(ids) * CFG.dim)
    layer_taps = reference(27).layer_taps  # [L, S, D]
    for slot, layer in enumerate(ids):
        got = taps[:, slot * CFG.dim:(slot + 1) * CFG.dim]
        assert rel_err(got, layer_taps[layer]) < TOL, f"slot {slot} vs layer {layer}"
        for other in set(range(CFG.n_layers)) - {layer}:
            assert rel_err(got, layer_taps[other]) > 0.1, f"slot {slot} also matches layer {other}"


def test_taps_leave_logits_bitwise_unchanged(trunk_cls):
    model = make_model(trunk_cls)
    with_taps, without = model.new_state(), model.new_state()
    a = model.prefill(with_taps, TOKENS[:13].clone(), keep_rows=13, taps=True)
    b = model.prefill(without, TOKENS[:13].clone(), keep_rows=13, taps=False)
    assert torch.equal(a.logits, b.logits)
    for pos in range(13, 22):
        a = model.decode(with_taps, int(TOKENS[pos]), pos, taps=True)
        b = model.decode(without, int(TOKENS[pos]), pos, taps=False)
        assert torch.equal(a.logits, b.logits), f"position {pos}"
