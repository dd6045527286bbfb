"""The CI-sized dry run of `bench.gpu_check --services`' V4-Flash-shaped stage: its random
checkpoint (`dsv4.random_checkpoint`, V4-Flash's structure and fp8 / fp4 formats at toy
sizes) written tensor by tensor, read back by safetensors, streamed into the services' models,
and served by a real verifier, drafter and gateway (in-process gRPC servers on port 0), with
the stage's own checks: the four prompts off / always / gated equal to plain decode, one
always-speculated stream, the step tables. The full dry run (three `dspark serve` processes
per stack, the bundled model too) is tests/test_gpu_check_services.py, marked slow."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors import safe_open

from bench.gpu_check import Report
from bench.gpu_services import Targets, run_checks
from bench.gpu_v4 import ensure_checkpoint, toy_shaped
from dsv4.checkpoint import load_trunk_weights, weight_map
from model_fixtures import each_dropped_before_the_next
from services.app import drafter_engine, load_drafter, load_trunk, start_drafter, start_gateway, start_verifier, \
    verifier_engine
from services.common.settings import BackendSettings, GatewaySettings


@pytest.fixture(scope="module")
def toy_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v4toy")
    total, written = ensure_checkpoint(folder, toy_shaped())
    assert written and total > 0
    return folder


def test_random_checkpoint_is_complete_valid_safetensors_and_reused(toy_checkpoint):
    cfg = toy_shaped()
    wm = weight_map(toy_checkpoint)
    for shard in sorted(set(wm.values())):  # safetensors' own reader accepts the hand-written headers
        with safe_open(str(toy_checkpoint / shard), framework="pt") as f:
            assert set(f.keys()) == {n for n, s in wm.items() if s == shard}
    got_cfg, weights = load_trunk_weights(toy_checkpoint)  # every name, dtype, shape; every value finite
    assert got_cfg == cfg
    experts = weights["layers.0.ffn.experts.3.w1.weight"]
    assert experts.shape == (cfg.moe_inter_dim, cfg.dim) and 0.2 < float(experts.std()) * cfg.dim ** 0.5 < 5
    assert ensure_checkpoint(toy_checkpoint, cfg)[1] is False  # complete: not written again
    assert ensure_checkpoint(toy_checkpoint, cfg.replace(max_seq_len=128))[1] is True  # another config is
    ensure_checkpoint(toy_checkpoint, cfg)


def test_streamed_load_equals_the_dict_load(toy_checkpoint):
    from dsv4.checkpoint import stream_trunk_weights
    from dsv4.trunk import Trunk

    cfg, weights = load_trunk_weights(toy_checkpoint)
    a, b = Trunk(cfg), Trunk(cfg)
    a.load_weights(weights)
    b.load_streamed(each_dropped_before_the_next(stream_trunk_weights(toy_checkpoint)[1]))
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    c = Trunk(cfg)
    with pytest.raises(ValueError, match=r"missing: \['hc_head_base', 'hc_head_scale', 'head.weight'\]"):
        c.load_streamed(list(weights.items())[:-3])
    assert not c.loaded


async def _serve_and_check(folder) -> Report:
    trunk = load_trunk(folder, verify_numerics="exact")
    verifier = await start_verifier(verifier_engine(trunk, BackendSettings(max_sessions=8)))
    drafter = await start_drafter(drafter_engine(load_drafter(folder), settings=BackendSettings(max_sessions=8)))
    targets = Targets("", f"127.0.0.1:{verifier.port}", f"127.0.0.1:{drafter.port}")
    settings = GatewaySettings(verifier_target=targets.verifier_target, drafter_target=targets.drafter_target,
                               cost_mode="configured", startup_timeout_s=10.0)
    gateway, _, backends = await start_gateway(settings, checkpoint=folder)
    rep = Report()
    try:
        await run_checks(Targets(f"127.0.0.1:{gateway.port}", targets.verifier_target, targets.drafter_target),
                         rep, [1], 4)
    finally:
        await gateway.stop(0)
        await backends.close()
        await drafter.stop(0)
        await verifier.stop(0)
    return rep


def test_v4_shaped_toy_stack_serves_speculation_equal_to_plain(toy_checkpoint):
    rep = asyncio.run(_serve_and_check(toy_checkpoint))
    rows = {r[0]: r for r in rep.rows}
    assert rep.failed == 0, rep.rows
    for name in ("repeat", "code", "prose", "math"):
        assert rows[f"services: {name}: always, gated == plain"][1:] == ("4 tokens", "equal", "ok")
    assert rows["services: 1 streams, always == plain"][3] == "ok"


def test_flash_shaped_keeps_v4_flash_sizes_and_takes_its_layers_from_layer_2():
    from bench.gpu_v4 import flash_shaped
    from dsv4.config import ModelConfig

    flash, one, two = ModelConfig(), flash_shaped(1), flash_shaped(2)
    same = ("dim", "n_heads", "head_dim", "n_routed_experts", "n_activated_experts", "moe_inter_dim", "vocab_size",
            "index_topk", "window_size", "o_groups", "weight_dtype", "expert_dtype", "n_mtp_layers")
    assert all(getattr(two, f) == getattr(flash, f) for f in same)
    assert one.compress_ratios == (4, 0, 0, 0) and two.compress_ratios == (4, 128, 0, 0, 0)
    assert (one.n_hash_layers, two.n_hash_layers) == (1, 1)  # Flash's layer 2 is its last hash-routed one
    assert two.dspark_target_layer_ids == (0, 1) and one.quant_sim
    with pytest.raises(ValueError, match="n_layers=0"):
        flash_shaped(0)
