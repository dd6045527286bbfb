"""The training forward (training/forward.py) computes what `Trunk.prefill` computes.

Error measure: `rel` = max |a - b| / max |b| over the compared logits (fp32, bound 1e-5).
Configs: the tiny config of docs/model.md §13 and the bundled model's layout shrunk to test size (same
layer kinds, ratios 4 and 16, hash and scored gates), random weights with non-trivial norms,
sinks, mHC biases and ape. Every check is on real values; nothing is trained.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv4.attention import sparse_attn
from dsv4.compressor import Compressor
from dsv4.config import tiny_config
from dsv4.rope import Rope
from dsv4.trunk import Trunk
from model_fixtures import varied_weights
from training.forward import (ForwardStats, compress, lm_loss, masked_attn, trainable_parameters,
                              trunk_logits, update_gate_biases)
from training.model_config import bundled_config

TOL = 1e-5
# The bundled layer layout at test size: vocab 512, dim 128, 64-token window and index_topk 2.
SMALL_BUNDLED = dict(vocab_size=512, dspark_noise_token_id=511, dim=128, q_lora_rank=128, o_lora_rank=64,
                     moe_inter_dim=64, window_size=8, index_topk=2, max_seq_len=96, dspark_markov_rank=8)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max())


def make_trunk(cfg, seed=0) -> Trunk:
    w = varied_weights(cfg, seed, noise_seed=seed + 1)
    trunk = Trunk(cfg)
    trunk.load_weights(w)
    return trunk


@pytest.mark.parametrize("cfg", [tiny_config(), bundled_config(**SMALL_BUNDLED)], ids=["tiny", "bundled-layout"])
def test_training_logits_equal_prefill_of_every_prefix(cfg):
    trunk = make_trunk(cfg)
    trainable_parameters(trunk)  # grads on must not change values
    ids = torch.randint(0, cfg.vocab_size, (45,), generator=torch.Generator().manual_seed(3))
    logits = trunk_logits(trunk, ids)
    assert logits.shape == (45, cfg.vocab_size) and logits.dtype == torch.float32
    assert logits.requires_grad
    # prefixes below the window, below a ratio, 13 (not a multiple of 4 or 8), and ring wraps
    for n in (1, 3, 8, 13, 17, 32, 45):
        ref = trunk.prefill(trunk.new_state(), ids[:n], taps=False).logits
        assert rel(logits[n - 1].detach(), ref) < TOL, n


def test_compress_equals_compressor_prefill():
    torch.manual_seed(0)
    cfg = tiny_config()
    for ratio, width in ((4, 64), (8, 96)):
        comp = Compressor(cfg.dim, width, ratio, Rope.for_layer(cfg, 1), cfg.norm_eps, torch.float32, False, False)
        with torch.no_grad():
            for p in comp.parameters():
                p.copy_(torch.randn(p.shape))
        x = torch.randn(23, cfg.dim)
        st = comp.new_state(64)
        comp.prefill(x, st)
        got = compress(comp, x)
        assert got.shape == (23 // ratio, width)
        assert rel(got, st.entries()) < TOL


def test_compress_of_a_prompt_shorter_than_the_ratio_is_empty():
    cfg = tiny_config()
    comp = Compressor(cfg.dim, 32, 8, Rope.for_layer(cfg, 2), cfg.norm_eps, torch.float32, False, False)
    assert compress(comp, torch.randn(7, cfg.dim)).shape == (0, 32)


def test_masked_attn_equals_sparse_attn_and_its_gradient_flows():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(6, 3, 16, generator=g, requires_grad=True)
    keys = torch.randn(10, 16, generator=g)
    sink = torch.randn(3, generator=g)
    idx = torch.tensor([[0, -1, 4, 9], [1, 2, 3, -1], [5, -1, -1, -1], [9, 8, 7, 6], [0, 1, 2, 3], [4, 6, 8, -1]])
    ref = sparse_attn(q, keys, sink, idx, 0.25)
    got = masked_attn(q, keys, sink, idx, 0.25)
    assert rel(got, ref) < TOL
    (gq,) = torch.autograd.grad(got.square().sum(), q)
    (rq,) = torch.autograd.grad(ref.square().sum(), q)
    assert rel(gq, rq) < 1e-4


def test_gradients_reach_parameters_and_indexer_trains_only_through_its_loss():
    cfg = tiny_config()
    trunk = make_trunk(cfg)
    params = dict(trainable_parameters(trunk))
    assert not any(n.endswith("gate.bias") for n in params)
    ids = torch.randint(0, cfg.vocab_size, (32,), generator=torch.Generator().manual_seed(5))
    stats = ForwardStats()
    loss = lm_loss(trunk_logits(trunk, ids, stats), ids)
    assert len(stats.index_kl) == 2  # layers 1 and 3 have ratio 4
    assert all(float(kl.detach()) >= 0 for kl in stats.index_kl)
    lm_grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True, retain_graph=True)
    by_name = dict(zip(params, lm_grads))
    assert by_name["layers.1.attn.indexer.wq_b.weight"] is None  # top-k is discrete, inputs detached
    assert by_name["layers.1.attn.wq_a.weight"].abs().sum() > 0
    assert by_name["layers.3.ffn.gate.weight"].abs().sum() > 0
    assert by_name["head.weight"].abs().sum() > 0
    kl_grads = torch.autograd.grad(sum(stats.index_kl), list(params.values()), allow_unused=True)
    kl_by_name = {n: gr for n, gr in zip(params, kl_grads) if gr is not None and gr.abs().sum() > 0}
    assert {n.split(".attn.")[-1].split(".")[0] for n in kl_by_name} == {"indexer"}
    assert "layers.1.attn.indexer.compressor.wkv.weight" in kl_by_name


def test_expert_loads_count_every_route_and_bias_update_favours_underloaded_experts():
    cfg = tiny_config()
    trunk = make_trunk(cfg)
    ids = torch.randint(0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(2))
    stats = ForwardStats()
    with torch.no_grad():
        trunk_logits(trunk, ids, stats)
    assert sorted(stats.expert_load) == [0, 1, 2, 3]
    assert all(int(load.sum()) == 20 * cfg.n_activated_experts for load in stats.expert_load.values())
    before = trunk.layers[3].ffn.gate.bias.clone()
    load = torch.tensor([9, 1, 5, 5, 0, 10, 5, 5])  # mean 5
    update_gate_biases(trunk, {3: load, 0: load}, gamma=0.01)  # layer 0 is a hash layer: no bias
    delta = trunk.layers[3].ffn.gate.bias - before
    assert torch.allclose(delta, torch.tensor([-1, 1, 0, 0, 1, -1, 0, 0]) * 0.01)


def test_bad_ids_raise():
    cfg = tiny_config()
    trunk = make_trunk(cfg)
    with pytest.raises(ValueError, match="token ids must lie"):
        trunk_logits(trunk, torch.tensor([1, cfg.vocab_size]))
    with pytest.raises(ValueError, match="1-D"):
        trunk_logits(trunk, torch.zeros(2, 3, dtype=torch.int64))


# ----------------------------------------------------------------------------- training-loop pieces
def test_balanced_tid2eid_spreads_token_mass_evenly():
    from training.train_trunk import balanced_tid2eid

    counts = (10_000 / np.arange(1, 513)).astype(np.int64)  # Zipf-like token counts
    counts[-50:] = 0  # unseen tokens still get experts
    table = balanced_tid2eid(counts, n_experts=8, k=2, seed=0, layer=0)
    assert table.shape == (512, 2) and table.dtype == torch.int64
    assert bool((table[:, 0] != table[:, 1]).all()) and int(table.min()) >= 0 and int(table.max()) < 8
    load = np.zeros(8)
    np.add.at(load, table.numpy().ravel(), np.repeat(np.maximum(counts, 1), 2))
    assert load.max() / load.mean() < 1.05
    uniform = torch.randint(0, 8, (512, 2), generator=torch.Generator().manual_seed(0)).numpy()
    rand_load = np.zeros(8)
    np.add.at(rand_load, uniform.ravel(), np.repeat(np.maximum(counts, 1), 2))
    assert rand_load.max() / rand_load.mean() > load.max() / load.mean()
    assert torch.equal(table, balanced_tid2eid(counts, 8, 2, 0, 0))
    assert not torch.equal(table, balanced_tid2eid(counts, 8, 2, 0, 1))  # layers relabel experts


def test_batches_are_a_pure_function_of_seed_and_step():
    from training.train_trunk import batch_windows

    streams = {d: np.arange(1000, dtype=np.uint16) + 1000 * i for i, d in enumerate(("code", "prose", "math", "repeat"))}
    mix = {"code": 0.5, "prose": 0.5, "math": 0.0, "repeat": 0.0}
    a = batch_windows(streams, mix, step=7, batch=6, seq_len=32, seed=1)
    b = batch_windows(streams, mix, step=7, batch=6, seq_len=32, seed=1)
    assert [d for d, _ in a] == [d for d, _ in b] and all(torch.equal(x, y) for (_, x), (_, y) in zip(a, b))
    assert {d for d, _ in a} <= {"code", "prose"}
    for d, ids in a:  # consecutive tokens of the chosen stream
        assert ids.shape == (32,) and bool((ids.diff() == 1).all()) and int(ids[0]) // 1000 == ("code", "prose").index(d)
    c = batch_windows(streams, mix, step=8, batch=6, seq_len=32, seed=1)
    assert not all(torch.equal(x, y) for (_, x), (_, y) in zip(a, c))


def test_learning_rate_schedule():
    from training.train_trunk import TrainConfig, lr_at

    tc = TrainConfig(steps=100, warmup=10, lr=1e-3, min_lr_frac=0.1)
    assert lr_at(0, tc) == pytest.approx(1e-4) and lr_at(9, tc) == pytest.approx(1e-3)
    assert lr_at(55, tc) == pytest.approx(0.55e-3)  # half way through the cosine
    assert lr_at(100, tc) == pytest.approx(1e-4) and lr_at(500, tc) == pytest.approx(1e-4)


def test_stored_weights_round_trip_inside_and_restore_masters():
    from training.train_trunk import stored_roundtrip, stored_weights

    cfg = tiny_config()
    trunk = make_trunk(cfg)
    before = {n: p.detach().clone() for n, p in trunk.named_parameters()}
    names = ("layers.0.attn.wq_a.weight", "layers.3.ffn.experts.1.w2.weight", "embed.weight", "layers.0.hc_attn_fn")
    storage = ("fp8", "fp4", "bf16", "f32")
    with stored_weights(trunk, True):
        params = dict(trunk.named_parameters())
        for name, kind in zip(names, storage):
            assert torch.equal(params[name], stored_roundtrip(kind, before[name]))
        assert not torch.equal(params[names[1]], before[names[1]])  # fp4 really changed it
        assert torch.equal(params[names[3]], before[names[3]])  # f32 stays
    assert all(torch.equal(p, before[n]) for n, p in trunk.named_parameters())


def test_init_reads_an_exported_folder_back_dequantised(tmp_path):
    from dsv4.checkpoint import load_trunk_weights, save_checkpoint
    from dsv4.init import random_weights
    from training.train_trunk import exported_weights

    cfg = tiny_config()
    logical = random_weights(cfg, "all", seed=1)
    save_checkpoint(tmp_path, cfg, logical)
    got = exported_weights(tmp_path, cfg)
    _, served = load_trunk_weights(tmp_path)
    assert got.keys() == served.keys() and all(torch.equal(got[n], served[n]) for n in got)
    fp8 = "layers.0.attn.wq_a.weight"
    assert got[fp8].dtype == torch.float32 and not torch.equal(got[fp8], logical[fp8])  # the stored values
    assert rel(got[fp8], logical[fp8]) < 0.1
    trunk = Trunk(cfg)
    trunk.load_weights(got)  # loads into the training model as is
    ids = torch.tensor([5, 9, 2, 7, 7, 3])
    served_trunk = Trunk(cfg)
    served_trunk.load_weights(served)
    assert rel(trunk_logits(trunk, ids)[-1], served_trunk.prefill(served_trunk.new_state(), ids).logits) < TOL
    with pytest.raises(ValueError, match=f"its model config {cfg.config_hash()} is not the run's .*rope_theta"):
        exported_weights(tmp_path, cfg.replace(rope_theta=5000.0))


def test_draft_data_prompts_begin_documents_when_asked():
    import numpy as np

    from training.draft_data import document_starts, sample_prompt
    # Two documents per domain: bos a.. eos bos b.. eos (ids >= 2 are text).
    doc = lambda first, n: [0, *range(first, first + n), 1]  # noqa: E731
    streams = {d: np.array(doc(10, 6) + doc(100, 30) + doc(200, 40), dtype=np.uint16)
               for d in ("code", "prose", "math", "repeat")}
    starts = document_starts(streams)
    assert starts["code"].tolist() == [1, 9, 41]
    mix = {"code": 1.0}
    firsts = set()
    for i in range(40):
        d, ids = sample_prompt(streams, mix, 0, "train", i, 4, 12, doc_start=1.0, starts=starts)
        assert d == "code" and 2 <= len(ids) <= 12
        assert int(ids[0]) in (10, 100, 200) and not (ids <= 1).any()  # a document's first token, no bos/eos
        firsts.add(int(ids[0]))
    assert firsts == {10, 100, 200}
    # The short first document ends the prompt before its eos.
    short = [ids for i in range(40) for d, ids in [sample_prompt(streams, mix, 0, "train", i, 8, 12, 1.0, starts)]
             if int(ids[0]) == 10]
    assert short and all(ids.tolist() == list(range(10, 16)) for ids in short)
    # doc_start = 0 keeps the old draw (a pure function of seed, split and index).
    a = sample_prompt(streams, mix, 3, "train", 5, 4, 12)
    b = sample_prompt(streams, mix, 3, "train", 5, 4, 12, 0.0, starts)
    assert a[0] == b[0] and torch.equal(a[1], b[1])
