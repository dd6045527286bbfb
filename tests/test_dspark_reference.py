"""Conformance of `dsv4.dspark.DSparkDraft` (fp32, quant_sim off) with the float64 reference.

The reference (`tests/reference_dspark.py`) is written from docs/model.md §9 and shares no code with
`dsv4/`. Error measure: per-row relative L2 error, maximum over rows (`rel_err`). Inputs:
the tiny config of docs/model.md §13, `conformance_weights` (random weights with nonzero sinks, random
mHC biases, norm weights and gate biases) and synthetic tap rows for positions 0..23.
Rounds at seed positions 0 (a one-token prompt), 3 (ring partly filled), 15 and 23 (ring
wrapped once and twice). Tolerances are checked against plausible mistakes: each of
`reference_dspark.BREAKS` must exceed the tolerance by >= 10x and, over the rounds, change
at least one drafted token.
"""

from __future__ import annotations

import functools

import pytest
import torch

from dsv4.config import tiny_config
from dsv4.dspark import DSparkDraft
from dsv4.inventory import drafter_params
from reference_dspark import (BREAKS, context_keys, conformance_weights, draft_attention, draft_head,
                              draft_moe, reference_draft, rel_err, synthetic_rows, to_f64)

TOL = 1e-5
MIN_MARGIN = 1e-4  # top-k / argmax gaps below this could flip under fp32 rounding
CFG = tiny_config()
B = CFG.dspark_block_size
WEIGHTS = conformance_weights(CFG, 0)
W64 = to_f64(WEIGHTS)
ROWS = synthetic_rows(CFG, 24, seed=1)  # tap rows of positions 0..23
SEEDS = (0, 3, 15, 23)
ANCHOR = 7


@functools.lru_cache(maxsize=None)
def model(confidence_head: bool = True, dtype: torch.dtype = torch.float32) -> DSparkDraft:
    m = DSparkDraft(CFG, dtype=dtype, confidence_head=confidence_head)
    m.load_weights(WEIGHTS if confidence_head else conformance_weights(CFG, 0, confidence_head=False))
    return m


def primed_state(m: DSparkDraft, p: int):
    state = m.new_state()
    m.write_main_kv(state, ROWS[:p + 1], range(p + 1))
    return state


@functools.lru_cache(maxsize=None)
def reference(p: int, breaks: frozenset = frozenset()):
    return reference_draft(CFG, WEIGHTS, {q: ROWS[q] for q in range(p + 1)}, ANCHOR, p, breaks)


def randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ structure and well-posed inputs
@pytest.mark.parametrize("conf", [True, False])
def test_parameter_names_equal_drafter_params(conf):
    names = set(DSparkDraft(CFG, confidence_head=conf, device="meta").state_dict())
    assert names == {p.name for p in drafter_params(CFG, confidence_head=conf)}


def test_rounds_have_clear_margins():
    for p in SEEDS:
        ref = reference(p)
        assert float(ref.margins.min()) > MIN_MARGIN, f"seed {p}: near-tie between drafted tokens"
        for s, gaps in ref.route_margins.items():
            assert float(gaps.min()) > MIN_MARGIN, f"seed {p}, stage {s}: near-tie in the gate"


# ------------------------------------------------------------------ components
@pytest.mark.parametrize("p", SEEDS)
def test_draft_attention_matches_reference(p):
    m = model()
    state = primed_state(m, p)
    x = randn(B, CFG.dim, seed=p)
    pos = torch.arange(p + 1, p + 1 + B)
    for s, stage in enumerate(m.mtp):
        got = stage.draft_attention(x, state.rings[s], min(CFG.window_size, p + 1), pos)
        ref = draft_attention(x.double(), context_keys(dict(enumerate(ROWS)), p, W64, s, CFG), p, W64, s, CFG)
        assert rel_err(got, ref) < TOL, f"stage {s}"


@pytest.mark.parametrize("mistake", ["causal_block", "block_at_seed"])
def test_draft_attention_mistakes_exceed_tolerance(mistake):
    m, p, s = model(), 15, 1
    state = primed_state(m, p)
    x = randn(B, CFG.dim, seed=p)
    got = m.mtp[s].draft_attention(x, state.rings[s], CFG.window_size, torch.arange(p + 1, p + 1 + B))
    ctx = context_keys(dict(enumerate(ROWS)), p, W64, s, CFG)
    broken = draft_attention(x.double(), ctx, p, W64, s, CFG, frozenset({mistake}))
    assert rel_err(got, broken) > 10 * TOL


def test_draft_moe_matches_reference_and_expert_swap_does_not():
    m = model()
    for s, stage in enumerate(m.mtp):
        x = randn(B, CFG.dim, seed=10 + s)
        got = stage.ffn(x, torch.zeros(B, dtype=torch.int64))
        ref, gaps = draft_moe(x.double(), W64, s, CFG)
        assert float(gaps.min()) > MIN_MARGIN
        assert rel_err(got, ref) < TOL, f"stage {s}"
        swapped, _ = draft_moe(x.double(), W64, s, CFG, swap_token=0)
        err = rel_err(got, swapped)
        print(f"stage {s}: MoE rel err {rel_err(got, ref):.2e}, with one expert swapped {err:.2e}")
        assert err > 10 * TOL


def test_head_and_markov_match_reference():
    m = model()
    h = randn(B, CFG.hc_mult, CFG.dim, seed=3)
    out = m.head_forward(h, torch.tensor([ANCHOR]))
    tokens, logits, conf, y = draft_head(h.double(), ANCHOR, W64, CFG)
    assert out.tokens == tokens
    assert rel_err(out.logits, logits) < TOL
    assert rel_err(out.hidden, y) < TOL
    assert rel_err(out.confidence[None], conf[None]) < TOL
    for mistake in ("no_markov_bias", "markov_from_anchor", "lane_mean_head"):
        bt, bl, bc, _ = draft_head(h.double(), ANCHOR, W64, CFG, frozenset({mistake}))
        changed = sum(a != b for a, b in zip(bt, out.tokens))
        print(f"{mistake}: {changed}/{B} tokens changed, logits rel err {rel_err(out.logits, bl):.2e}")
        assert changed >= 1 or rel_err(out.logits, bl) > 10 * TOL


def test_drafts_are_greedy_over_biased_logits():
    m = model()
    out = m.draft(primed_state(m, 15), ANCHOR, 15)
    assert out.logits.shape == (B, CFG.vocab_size) and out.logits.dtype == torch.float32
    assert out.tokens == out.logits.argmax(-1).tolist()
    w1 = WEIGHTS["mtp.2.markov_head.markov_w1.weight"]
    prevs = [ANCHOR] + out.tokens[:-1]
    proj = WEIGHTS["mtp.2.confidence_head.proj.weight"][0]
    want = torch.cat((out.hidden.float(), w1[prevs]), -1) @ proj  # conf of slot j uses token j-1
    assert rel_err(out.confidence[None], want[None]) < TOL


# ------------------------------------------------------------------ whole round
@pytest.mark.parametrize("p", SEEDS)
def test_draft_matches_reference(p):
    m = model()
    out = m.draft(primed_state(m, p), ANCHOR, p)
    ref = reference(p)
    assert out.tokens == ref.tokens
    assert rel_err(out.logits, ref.logits) < TOL
    assert rel_err(out.hidden, ref.hidden) < TOL
    assert rel_err(out.confidence[None], ref.confidence[None]) < TOL


@pytest.mark.parametrize("mistake", ["no_markov_bias", "markov_from_anchor", "lane_mean_head", "swap_expert",
                                     "causal_block", "block_at_seed"])
def test_plausible_mistakes_are_far_outside_tolerance(mistake):
    assert mistake in BREAKS
    m = model()
    changed, errs = 0, []
    for p in SEEDS:
        out = m.draft(primed_state(m, p), ANCHOR, p)
        broken = reference(p, frozenset({mistake}))
        changed += sum(a != b for a, b in zip(out.tokens, broken.tokens))
        errs.append(rel_err(out.logits, broken.logits))
    print(f"{mistake}: {changed}/{B * len(SEEDS)} drafted tokens changed, min logits rel err {min(errs):.2e}")
    assert changed >= 1
    assert min(errs) > 10 * TOL


def test_without_confidence_head_drafts_the_same_tokens():
    plain = model(confidence_head=False)
    out = plain.draft(primed_state(plain, 15), ANCHOR, 15)
    assert out.confidence is None
    assert out.tokens == reference(15).tokens
    with pytest.raises(ValueError, match="unexpected.*confidence_head"):
        DSparkDraft(CFG, confidence_head=False).load_weights(WEIGHTS)
    with pytest.raises(ValueError, match="missing.*confidence_head"):
        DSparkDraft(CFG).load_weights(conformance_weights(CFG, 0, confidence_head=False))


def test_bf16_module_stays_close_to_reference():
    m = model(dtype=torch.bfloat16)
    for p in (3, 23):
        out = m.draft(primed_state(m, p), ANCHOR, p)
        err = rel_err(out.logits, reference(p).logits)
        print(f"bf16 seed {p}: logits rel err {err:.2e}, tokens {out.tokens} vs {reference(p).tokens}")
        assert err < 0.05
