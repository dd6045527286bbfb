"""The draft's training forward (training/draft_forward.py) computes what `DSparkDraft.draft` computes.

Error measure: `rel` = max |a - b| / max |b| over one block's logits (fp32, bound 1e-5).
The tiny config of docs/model.md §13 (window 8, so early seeds see a partial window and late ones a
full one), random weights with non-trivial norms, sinks and mHC biases, random tap rows.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.config import tiny_config
from dsv4.dspark import DSparkDraft
from dsv4.init import random_weights
from dsv4.inventory import drafter_params
from training.draft_forward import draft_blocks, trainable_parameters

TOL = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max())


def make_draft(cfg, seed=0) -> DSparkDraft:
    w = random_weights(cfg, "all", seed)
    g = torch.Generator().manual_seed(seed + 1)
    for name, t in w.items():
        if t.is_floating_point() and t.ndim == 1 and ("norm" in name or "sink" in name or "_base" in name):
            w[name] = t + 0.3 * torch.randn(t.shape, generator=g)
    module = DSparkDraft(cfg)
    module.load_weights({p.name: w[p.name] for p in drafter_params(cfg)})
    return module


def inference_blocks(module: DSparkDraft, taps: torch.Tensor, ids: torch.Tensor, seeds: list[int]):
    """(logits [B, V], confidence [B]) of `draft` at each seed, committing taps one round at a time."""
    out, st, last = {}, module.new_state(), -1
    for p in sorted(seeds):
        module.write_main_kv(st, taps[last + 1:p + 1], range(last + 1, p + 1))
        last = p
        d = module.draft(st, int(ids[p + 1]), p)
        out[p] = (d.logits, d.confidence, d.tokens)
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_training_forward_equals_inference_draft(seed):
    cfg = tiny_config()
    module = make_draft(cfg, seed)
    g = torch.Generator().manual_seed(10 + seed)
    S = 40
    taps = torch.randn(S, cfg.tap_width, generator=g)
    ids = torch.randint(0, cfg.vocab_size - 1, (S,), generator=g)
    seeds = [0, 1, 3, 6, 7, 8, 12, 20, 33]
    ref = inference_blocks(module, taps, ids, seeds)
    got = draft_blocks(module, taps, ids, torch.tensor(seeds), prev="draft")
    for n, p in enumerate(seeds):
        logits, conf, tokens = ref[p]
        assert rel(got.logits[n], logits) < TOL, (p, rel(got.logits[n], logits))
        assert rel(got.confidence[n], conf) < TOL, (p, rel(got.confidence[n], conf))
        assert got.drafts[n].tolist() == tokens


def test_teacher_forcing_equals_draft_when_previous_slots_match():
    """With prev="teacher", slot j equals inference whenever slots < j drafted the sequence's tokens."""
    cfg = tiny_config()
    module = make_draft(cfg, 2)
    g = torch.Generator().manual_seed(5)
    S = 30
    taps = torch.randn(S, cfg.tap_width, generator=g)
    ids = torch.randint(0, cfg.vocab_size - 1, (S,), generator=g)
    seeds = torch.tensor([2, 9, 17])
    free = draft_blocks(module, taps, ids, seeds, prev="draft")
    for n, p in enumerate(seeds.tolist()):  # make the sequence follow the drafts of this block
        ids[p + 2:p + 2 + cfg.dspark_block_size] = free.drafts[n]
        forced = draft_blocks(module, taps, ids, seeds[n:n + 1], prev="teacher")
        assert rel(forced.logits[0], free.logits[n]) < TOL
        assert rel(forced.confidence[0], free.confidence[n]) < TOL


def test_only_mtp_parameters_train_and_get_gradients():
    cfg = tiny_config()
    module = make_draft(cfg, 3)
    named = trainable_parameters(module)
    assert named and all(n.startswith("mtp.") and not n.endswith("gate.bias") for n, _ in named)
    assert not module.embed.weight.requires_grad and not module.head.weight.requires_grad
    g = torch.Generator().manual_seed(7)
    S = 24
    taps = torch.randn(S, cfg.tap_width, generator=g)
    ids = torch.randint(0, cfg.vocab_size - 1, (S,), generator=g)
    out = draft_blocks(module, taps, ids, torch.arange(0, S - cfg.dspark_block_size))
    (out.logits.logsumexp(-1).mean() + out.confidence.mean()).backward()
    names = dict(named)
    for key in ("mtp.0.main_proj.weight", "mtp.0.attn.wkv.weight", "mtp.2.markov_head.markov_w1.weight",
                "mtp.2.confidence_head.proj.weight", "mtp.1.attn.attn_sink"):
        assert names[key].grad is not None and bool(names[key].grad.abs().sum() > 0), key
