"""ModelConfig validation (docs/model.md §1): types on every construction path, finite and sane
ranges, YaRN betas, quant-sim block sizes, size bounds, unknown keys, JSON documents."""

from __future__ import annotations

import json
import math
import re

import pytest

from dsv4.config import MAX_INT, MAX_SEQ_LEN, TINY, ModelConfig, tiny_config
from dsv4.trunk import Trunk

CFG = tiny_config()


# ----------------------------------------------------------------------------- floats
@pytest.mark.parametrize("field, value", [
    ("hc_eps", math.inf), ("hc_eps", 1e300), ("hc_eps", 0.5), ("hc_eps", 0.0),
    ("norm_eps", math.nan), ("norm_eps", 1.0), ("norm_eps", -1e-6),
    ("route_scale", 1e300), ("route_scale", math.inf), ("route_scale", 0.0),
    ("rope_theta", math.inf), ("rope_theta", 1e300), ("rope_theta", 1.0), ("rope_theta", 0.5),
    ("compress_rope_theta", 1.0), ("compress_rope_theta", math.nan),
    ("rope_factor", math.inf), ("rope_factor", 0.5), ("swiglu_limit", math.inf), ("swiglu_limit", -1.0),
])
def test_non_finite_or_absurd_float_fields_are_rejected_naming_field_and_value(field, value):
    with pytest.raises(ValueError, match=re.escape(f"'{field}'={value!r}")):
        tiny_config(**{field: value})


@pytest.mark.parametrize("fast, slow", [(32.0, 0.0), (32.0, -1.0), (0.0, 1.0), (1.0, 1.0), (0.5, 1.0),
                                        (math.nan, 1.0), (32.0, math.nan), (math.inf, 1.0)])
def test_yarn_betas_must_be_finite_positive_and_ordered(fast, slow):
    """beta_fast = 0 used to divide by zero at Trunk(), beta_slow = -1 hit a math domain error."""
    with pytest.raises(ValueError, match="beta_"):
        tiny_config(beta_fast=fast, beta_slow=slow)


def test_sane_rope_values_still_build_a_trunk():
    cfg = tiny_config(beta_fast=2.0, beta_slow=0.5, compress_rope_theta=1.5, rope_theta=1e6)
    inv = Trunk(cfg, device="meta").layers[1].attn.rope.inv_freq
    assert inv.shape == (cfg.rope_head_dim // 2,)


# ----------------------------------------------------------------------------- types
@pytest.mark.parametrize("value", ["false", 1, 0, None])
def test_quant_sim_must_be_a_bool(value):
    with pytest.raises(ValueError, match=re.escape(f"'quant_sim'={value!r}")):
        tiny_config(quant_sim=value)


@pytest.mark.parametrize("field, value", [
    ("n_heads", True), ("dim", "256"), ("window_size", 8.5), ("vocab_size", None),
    ("compress_ratios", [0, 4.9, 8, 4, 0, 0, 0]), ("compress_ratios", [0, "4", 8, 4, 0, 0, 0]),
    ("compress_ratios", "0480"), ("dspark_target_layer_ids", [1, True, 3]), ("score_func", 3),
    ("route_scale", "1.5"), ("hc_eps", True),
])
def test_every_construction_path_type_checks(field, value):
    """The constructor and `replace` used to skip the type checks (4.9 truncated to 4)."""
    paths = {
        "constructor": lambda: ModelConfig(**{**TINY, field: value}),
        "replace": lambda: CFG.replace(**{field: value}),
        "from_dict": lambda: ModelConfig.from_dict({**TINY, field: value}),
        "from_dict HF": lambda: ModelConfig.from_dict({**CFG.to_hf_dict(), **{field: value}}),
    }
    for path, build in paths.items():
        with pytest.raises(ValueError, match=f"'{field}'"):
            build()


def test_integral_floats_become_ints_and_ints_become_floats():
    cfg = CFG.replace(dim=256.0, rope_theta=20000)
    assert cfg.dim == 256 and type(cfg.dim) is int
    assert cfg.rope_theta == 20000.0 and type(cfg.rope_theta) is float
    assert cfg.compress_ratios == (0, 4, 8, 4, 0, 0, 0) and isinstance(cfg.compress_ratios, tuple)


def test_tiny_config_rejects_unknown_overrides_naming_the_close_field():
    with pytest.raises(ValueError, match=r"unknown config field 'windowsize' \(did you mean 'window_size'\?\)"):
        tiny_config(windowsize=16)
    with pytest.raises(ValueError, match="unknown config field 'n_kv_heads'"):
        CFG.replace(n_kv_heads=1)


def test_from_dict_keeps_unknown_keys_in_extra():
    """Documented decision: HF / reference JSON carry many unused keys, so from_dict keeps
    them (typos included) in `extra` instead of rejecting the file."""
    cfg = ModelConfig.from_dict({**TINY, "torch_dtype": "bfloat16", "windowsize": 16})
    assert cfg.extra == {"torch_dtype": "bfloat16", "windowsize": 16}
    assert cfg.window_size == 8 and cfg == CFG


# ----------------------------------------------------------------------------- derived constraints
def test_quant_sim_requires_block_aligned_sizes():
    with pytest.raises(ValueError, match="head_dim - rope_head_dim = 66 must be a multiple of 64"):
        tiny_config(quant_sim=True, head_dim=98)
    cfg = tiny_config(head_dim=98)  # fine without the simulation
    with pytest.raises(ValueError, match="head_dim - rope_head_dim = 66"):
        Trunk(cfg, quant_sim=True, device="meta")  # the Trunk switch is checked too
    with pytest.raises(ValueError, match="'q_lora_rank'.*96 must be a multiple of 128"):
        tiny_config(quant_sim=True, q_lora_rank=96)
    assert tiny_config(quant_sim=True, q_lora_rank=96, weight_dtype="bf16").q_lora_rank == 96


@pytest.mark.parametrize("field, value, bound", [
    ("vocab_size", 2**70, MAX_INT), ("dim", 2**31, MAX_INT), ("max_seq_len", 2**62, MAX_INT),
    ("max_seq_len", MAX_SEQ_LEN + 1, MAX_SEQ_LEN), ("original_seq_len", 2**40, MAX_INT),
])
def test_sizes_have_stated_upper_bounds(field, value, bound):
    with pytest.raises(ValueError, match=f"'{field}'={value}: must .*{bound}"):
        tiny_config(**{field: value})


def test_vocab_size_needs_a_runner_up_token():
    with pytest.raises(ValueError, match="'vocab_size'=1: must be >= 2"):
        tiny_config(vocab_size=1, dspark_noise_token_id=0, n_mtp_layers=0, compress_ratios=[0, 4, 8, 4],
                    dspark_target_layer_ids=[], eos_token_id=0)


def test_config_without_tap_layers_has_zero_tap_width():
    cfg = tiny_config(n_mtp_layers=0, dspark_target_layer_ids=[], compress_ratios=[0, 4, 8, 4])
    assert cfg.tap_width == 0


# ----------------------------------------------------------------------------- JSON documents
@pytest.mark.parametrize("doc", [[1, 2], None, 3, "abc", ["ab"]])
def test_from_dict_rejects_non_object_documents(doc):
    """["ab"] used to load the default Flash config (dict(["ab"]) == {"a": "b"})."""
    with pytest.raises(ValueError, match="must be a JSON object"):
        ModelConfig.from_dict(doc)


@pytest.mark.parametrize("rope_scaling", ["yarn", [1], 4.0])
def test_hf_rope_scaling_must_be_an_object(rope_scaling):
    with pytest.raises(ValueError, match=re.escape(f"'rope_scaling'={rope_scaling!r}: must be an object")):
        ModelConfig.from_dict({**CFG.to_hf_dict(), "rope_scaling": rope_scaling})


@pytest.mark.parametrize("content, why", [
    (b"[1, 2]", "must be a JSON object"), (b"null", "must be a JSON object"),
    (b"\xff\xfe{}", "not UTF-8"), (b"{", "not valid JSON"),
    (json.dumps({**TINY, "hc_eps": 1.0}).encode(), "'hc_eps'=1.0"),
])
def test_load_names_the_file_for_every_bad_document(tmp_path, content, why):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=why) as e:
        ModelConfig.load(tmp_path)
    assert str(path) in str(e.value)


def test_load_round_trips_the_hf_dict(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CFG.to_hf_dict()))
    assert ModelConfig.load(tmp_path) == CFG
