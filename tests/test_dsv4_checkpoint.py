"""Checkpoint read/write in the real layout, both consumer sets, errors (docs/model.md §7, docs/architecture.md §9)."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch
from safetensors.torch import save_file

from dsv4.checkpoint import (INDEX_NAME, CheckpointError, load_drafter_weights, load_trunk_weights,
                             read_config, read_header, read_stored, save_checkpoint, write_stored)
from dsv4.codecs import fp4_decode, fp4_encode, fp8_decode, fp8_encode
from dsv4.config import tiny_config
from dsv4.init import random_weights
from dsv4.inventory import drafter_inventory, drafter_params, trunk_inventory, trunk_params

CFG = tiny_config()
CONF = "mtp.2.confidence_head.proj.weight"


def quantised(cfg, weights):
    """One encode/decode pass per storage, so every value is exactly representable when stored."""
    storage = {p.name: p.storage for p in trunk_params(cfg) + drafter_params(cfg)}
    out = {}
    for name, w in weights.items():
        kind = storage[name]
        if kind == "fp8":
            out[name] = fp8_decode(*fp8_encode(w))
        elif kind == "fp4":
            out[name] = fp4_decode(*fp4_encode(w))
        elif kind == "bf16":
            out[name] = w.to(torch.bfloat16).float()
        else:
            out[name] = w.clone()
    return out


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These tensors are tiny: on the shared 2-core machine a second intra-op thread only adds
    wake-up latency (about 8 ms per op under load, 10x the test time)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def logical():
    return quantised(CFG, random_weights(CFG, "all", seed=1))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, logical):
    path = tmp_path_factory.mktemp("tiny")
    save_checkpoint(path, CFG, logical)
    return path


@pytest.fixture(scope="module")
def stored(ckpt):
    return read_stored(ckpt)


def _files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


# ----------------------------------------------------------------------------- round trips
def test_stored_layout_matches_inventory(stored):
    want = {**trunk_inventory(CFG), **drafter_inventory(CFG)}
    got = {n: (str(t.dtype), tuple(t.shape)) for n, t in stored.items()}
    dtypes = {"F8_E4M3": "torch.float8_e4m3fn", "F8_E8M0": "torch.float8_e8m0fnu", "I8": "torch.int8",
              "BF16": "torch.bfloat16", "F32": "torch.float32", "I64": "torch.int64"}
    assert got == {n: (dtypes[s.dtype], s.shape) for n, s in want.items()}


def test_rewriting_stored_tensors_is_bit_identical(tmp_path, ckpt, stored):
    write_stored(tmp_path, CFG, stored)
    assert _files(tmp_path) == _files(ckpt)


def test_save_of_loaded_weights_is_bit_identical(tmp_path, ckpt):
    _, trunk = load_trunk_weights(ckpt)
    _, drafter, _ = load_drafter_weights(ckpt)
    save_checkpoint(tmp_path, CFG, {**trunk, **drafter})
    assert _files(tmp_path) == _files(ckpt)


def test_trunk_loader_returns_logical_weights_exactly(ckpt, logical):
    cfg, weights = load_trunk_weights(ckpt)
    assert cfg == CFG
    names = [p.name for p in trunk_params(CFG)]
    assert list(weights) == names
    for name in names:
        assert weights[name].dtype == logical[name].dtype, name
        assert torch.equal(weights[name], logical[name]), name


def test_drafter_loader_returns_logical_weights_exactly(ckpt, logical):
    cfg, weights, has_conf = load_drafter_weights(ckpt)
    assert cfg == CFG and has_conf
    names = [p.name for p in drafter_params(CFG)]
    assert list(weights) == names
    for name in names:
        assert torch.equal(weights[name], logical[name]), name


def test_loader_casts_floats_to_requested_dtype_keeping_tid2eid_int64(ckpt, logical):
    _, weights = load_trunk_weights(ckpt, dtype=torch.bfloat16)
    assert weights["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert torch.equal(weights["layers.0.ffn.gate.tid2eid"], logical["layers.0.ffn.gate.tid2eid"])
    assert weights["layers.1.attn.wq_a.weight"].dtype == torch.bfloat16
    assert torch.equal(weights["embed.weight"], logical["embed.weight"].to(torch.bfloat16))
    with pytest.raises(ValueError, match="int32"):
        load_trunk_weights(ckpt, dtype=torch.int32)


def test_multiple_shards_have_valid_index(tmp_path, logical, stored):
    shards = save_checkpoint(tmp_path, CFG, logical, max_shard_bytes=1_000_000)
    n = len(shards)
    assert n > 3
    assert [p.name for p in shards] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    wm = index["weight_map"]
    assert set(wm) == set(stored)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in stored.values())
    for shard in shards:
        names = set(read_header(shard))
        assert names == {k for k, v in wm.items() if v == shard.name}
        assert sum(stored[k].numel() * stored[k].element_size() for k in names) <= 1_000_000
    for name in wm:  # a scale always sits beside its weight
        if name.endswith(".scale"):
            assert wm[name] == wm[name[: -len("scale")] + "weight"], name
    _, weights = load_trunk_weights(tmp_path)
    assert all(torch.equal(weights[k], logical[k]) for k in weights)


def test_weight_and_scale_in_different_shards_load(tmp_path, ckpt, stored, logical):
    split = {"layers.1.attn.wq_b.scale", "layers.2.ffn.experts.3.w2.scale"}
    files = {"model-00001-of-00002.safetensors": {n: t for n, t in stored.items() if n not in split},
             "model-00002-of-00002.safetensors": {n: stored[n] for n in split}}
    wm = {}
    for file, tensors in files.items():
        save_file(tensors, str(tmp_path / file))
        wm.update({n: file for n in tensors})
    (tmp_path / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    shutil.copy(ckpt / "config.json", tmp_path / "config.json")
    _, weights = load_trunk_weights(tmp_path)
    assert torch.equal(weights["layers.1.attn.wq_b.weight"], logical["layers.1.attn.wq_b.weight"])
    assert torch.equal(weights["layers.2.ffn.experts.3.w2.weight"], logical["layers.2.ffn.experts.3.w2.weight"])


def test_single_file_without_index_loads(tmp_path, ckpt, stored, logical):
    save_file(dict(stored), str(tmp_path / "model.safetensors"))
    shutil.copy(ckpt / "config.json", tmp_path / "config.json")
    cfg, weights, _ = load_drafter_weights(tmp_path)
    assert cfg == CFG
    assert all(torch.equal(weights[k], logical[k]) for k in weights)


# ----------------------------------------------------------------------------- config
def test_pruned_expert_count_comes_from_tensors(tmp_path):
    cfg6 = tiny_config(n_routed_experts=6)
    save_checkpoint(tmp_path, cfg6, random_weights(cfg6, "all"))
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["n_routed_experts"] = 8
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert read_config(tmp_path).n_routed_experts == 6
    cfg, weights = load_trunk_weights(tmp_path)
    assert cfg.n_routed_experts == 6
    assert weights["layers.2.ffn.gate.weight"].shape == (6, CFG.dim)
    assert "layers.2.ffn.experts.5.w1.weight" in weights
    assert "layers.2.ffn.experts.6.w1.weight" not in weights
    cfg_d, drafter, _ = load_drafter_weights(tmp_path)
    assert cfg_d.n_routed_experts == 6 and drafter["mtp.0.ffn.gate.bias"].shape == (6,)


def test_config_round_trips_and_ignores_nextn_layers(tmp_path, ckpt):
    path = tmp_path / "ck"
    shutil.copytree(ckpt, path)
    hf = json.loads((path / "config.json").read_text())
    assert hf["num_nextn_predict_layers"] == 3
    hf["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(hf))
    cfg = read_config(path)
    assert cfg == CFG and cfg.n_mtp_layers == 3


# ----------------------------------------------------------------------------- confidence head
def test_drafter_loader_reports_absent_confidence_head(tmp_path):
    w = quantised(CFG, random_weights(CFG, "all", confidence_head=False))
    save_checkpoint(tmp_path, CFG, w)
    _, weights, has_conf = load_drafter_weights(tmp_path)
    assert has_conf is False
    assert CONF not in weights
    assert "mtp.2.markov_head.markov_w1.weight" in weights


# ----------------------------------------------------------------------------- errors
def _broken(tmp_path, stored, edit):
    s = dict(stored)
    edit(s)
    write_stored(tmp_path, CFG, s, max_shard_bytes=2_000_000)
    return tmp_path


def _shard_of(path, name):
    return json.loads((path / INDEX_NAME).read_text())["weight_map"][name]


TRUNK_T = "layers.1.attn.wq_b.weight"
DRAFT_T = "mtp.1.attn.wkv.weight"


@pytest.mark.parametrize("loader,name", [(load_trunk_weights, TRUNK_T), (load_drafter_weights, DRAFT_T)])
def test_missing_tensor_is_named(tmp_path, stored, loader, name):
    path = _broken(tmp_path, stored, lambda s: s.pop(name))
    with pytest.raises(CheckpointError, match=re.escape(repr(name)) + ".*missing"):
        loader(path)


@pytest.mark.parametrize("loader,name", [(load_trunk_weights, "layers.0.attn.extra.weight"),
                                         (load_drafter_weights, "mtp.0.attn.extra.weight")])
def test_unexpected_tensor_is_named_with_its_shard(tmp_path, stored, loader, name):
    path = _broken(tmp_path, stored, lambda s: s.__setitem__(name, torch.zeros(3)))
    with pytest.raises(CheckpointError, match="unexpected") as e:
        loader(path)
    assert repr(name) in str(e.value) and _shard_of(path, name) in str(e.value)


@pytest.mark.parametrize("loader,name", [(load_trunk_weights, "layers.3.ffn.experts.1.w2.scale"),
                                         (load_drafter_weights, "mtp.2.norm.weight")])
def test_wrong_shape_is_named_with_its_shard(tmp_path, stored, loader, name):
    path = _broken(tmp_path, stored, lambda s: s.__setitem__(name, s[name][:1].clone()))
    with pytest.raises(CheckpointError, match="shape") as e:
        loader(path)
    assert repr(name) in str(e.value) and _shard_of(path, name) in str(e.value)


@pytest.mark.parametrize("loader,name,dtype", [
    (load_trunk_weights, "layers.0.attn_norm.weight", torch.float32),
    (load_trunk_weights, "layers.2.attn.wkv.weight", torch.bfloat16),
    (load_drafter_weights, "mtp.0.main_proj.scale", torch.uint8),
    (load_drafter_weights, "head.weight", torch.float16),
])
def test_wrong_dtype_is_named_with_its_shard(tmp_path, stored, loader, name, dtype):
    path = _broken(tmp_path, stored, lambda s: s.__setitem__(name, torch.zeros(s[name].shape, dtype=dtype)))
    with pytest.raises(CheckpointError, match="dtype") as e:
        loader(path)
    assert repr(name) in str(e.value) and _shard_of(path, name) in str(e.value)


def test_each_loader_ignores_the_other_sets_tensors(tmp_path, stored, logical):
    def corrupt(s):
        s["mtp.1.attn.wkv.weight"] = torch.zeros(2, dtype=torch.float32)  # drafter: wrong
        s["mtp.7.bogus"] = torch.zeros(1)  # drafter: unexpected
        s["layers.0.bogus"] = torch.zeros(1)  # trunk: unexpected
        s.pop("layers.3.attn.wo_b.scale")  # trunk: missing

    path = _broken(tmp_path, stored, corrupt)
    with pytest.raises(CheckpointError, match="layers"):
        load_trunk_weights(path)
    with pytest.raises(CheckpointError, match="mtp"):
        load_drafter_weights(path)

    trunk_only = _broken(tmp_path / "t", stored, lambda s: [s.pop(n) for n in list(s) if n.startswith("mtp.")])
    _, weights = load_trunk_weights(trunk_only)
    assert all(torch.equal(weights[k], logical[k]) for k in weights)

    def drafter_only(s):
        for n in list(s):
            if not n.startswith("mtp.") and n not in ("embed.weight", "head.weight"):
                s.pop(n)
        s["layers.0.attn.wkv.weight"] = torch.zeros(1)  # a trunk tensor the drafter must ignore
        # (experts are then counted from mtp.0.ffn.gate.weight)

    _, weights, _ = load_drafter_weights(_broken(tmp_path / "d", stored, drafter_only))
    assert all(torch.equal(weights[k], logical[k]) for k in weights)


def test_index_naming_a_shard_without_the_tensor_is_an_error(tmp_path, stored):
    path = _broken(tmp_path, stored, lambda s: None)
    index = json.loads((path / INDEX_NAME).read_text())
    name = "layers.0.attn.wkv.weight"
    other = next(f for f in set(index["weight_map"].values()) if f != index["weight_map"][name])
    index["weight_map"][name] = other
    (path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=re.escape(repr(name)) + ".*" + re.escape(other)):
        load_trunk_weights(path)


def test_save_rejects_mis_shaped_or_unknown_logical_weights(tmp_path, logical):
    bad = dict(logical)
    bad["layers.0.attn.wkv.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="layers.0.attn.wkv.weight"):
        save_checkpoint(tmp_path, CFG, bad)
    with pytest.raises(ValueError, match="layers.0.nope"):
        save_checkpoint(tmp_path, CFG, {**logical, "layers.0.nope": torch.zeros(1)})
    missing = dict(logical)
    missing.pop("norm.weight")
    with pytest.raises(ValueError, match="norm.weight"):
        save_checkpoint(tmp_path, CFG, missing)


def test_missing_folder_contents_raise(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(CFG.to_hf_dict()))
    with pytest.raises(CheckpointError, match=INDEX_NAME):
        load_trunk_weights(tmp_path)


# ----------------------------------------------------------------------------- corruption
def _copy(ckpt, tmp_path):
    path = tmp_path / "ck"
    shutil.copytree(ckpt, path)
    return path


def _only_shard(path):
    (shard,) = set(json.loads((path / INDEX_NAME).read_text())["weight_map"].values())
    return shard


@pytest.mark.parametrize("reader", [load_trunk_weights, lambda p: load_drafter_weights(p), read_stored])
def test_truncated_shard_is_a_checkpoint_error_naming_the_shard(tmp_path, ckpt, reader):
    path = _copy(ckpt, tmp_path)
    shard = path / _only_shard(path)
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated or corrupt shard|unreadable.*not fully covered") as e:
        reader(path)
    assert shard.name in str(e.value)


def test_shard_with_trailing_garbage_is_a_checkpoint_error_naming_the_shard(tmp_path, ckpt):
    """Offsets inside the file but not covering it: safetensors' own error, wrapped."""
    path = _copy(ckpt, tmp_path)
    shard = path / _only_shard(path)
    shard.write_bytes(shard.read_bytes() + b"\0" * 64)
    with pytest.raises(CheckpointError, match=re.escape(repr(shard.name)) + " is unreadable"):
        load_trunk_weights(path)
    with pytest.raises(CheckpointError, match="unreadable"):
        read_stored(path)


def test_data_offsets_that_do_not_fit_the_tensor_are_named(tmp_path, ckpt):
    path = _copy(ckpt, tmp_path)
    shard = path / _only_shard(path)
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    name = "layers.0.attn.attn_sink"
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin, end - 4]
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(text) == n
    shard.write_bytes(raw[:8] + text + raw[8 + n:])
    with pytest.raises(CheckpointError, match=re.escape(repr(name)) + r" data_offsets .* span 12 bytes, .* needs 16"):
        read_header(shard)


def _set_byte(t, index, value):
    raw = t.view(torch.uint8).clone()
    raw[index] = value
    return raw.view(t.dtype)


@pytest.mark.parametrize("loader, edits, bad", [
    (load_trunk_weights, {"layers.1.attn.wq_b.scale": ((0, 0), 0xFF)}, "layers.1.attn.wq_b.weight"),
    (load_trunk_weights, {"layers.2.ffn.experts.3.w1.scale": ((5, 1), 0xFF)}, "layers.2.ffn.experts.3.w1.weight"),
    (load_trunk_weights, {"layers.1.attn.wq_b.weight": ((4, 9), 0x7F)}, "layers.1.attn.wq_b.weight"),
    (load_trunk_weights, {"layers.1.attn.wq_b.weight": ((4, 9), 0xFF)}, "layers.1.attn.wq_b.weight"),
    (load_trunk_weights, {"layers.1.attn.wq_b.weight": ((0, 0), 0x7E), "layers.1.attn.wq_b.scale": ((0, 0), 250)},
     "layers.1.attn.wq_b.weight"),  # 448 * 2^123 overflows float32
    (load_drafter_weights, {"mtp.0.attn.wkv.scale": ((0, 0), 0xFF)}, "mtp.0.attn.wkv.weight"),
])
def test_weights_that_decode_to_nan_or_inf_are_named_with_their_shard(tmp_path, stored, loader, edits, bad):
    def edit(s):
        for name, (index, value) in edits.items():
            s[name] = _set_byte(s[name], index, value)

    path = _broken(tmp_path, stored, edit)
    with pytest.raises(CheckpointError, match=re.escape(repr(bad)) + ".*decodes to (nan|inf)") as e:
        loader(path)
    assert _shard_of(path, bad) in str(e.value)


@pytest.mark.parametrize("name, value", [("layers.0.attn_norm.weight", math.nan), ("mtp.1.attn_norm.weight", math.inf),
                                         ("layers.0.hc_attn_base", -math.inf)])
def test_nan_or_inf_in_plain_float_tensors_is_named(tmp_path, stored, name, value):
    def edit(s):
        s[name] = s[name].clone()
        s[name].view(-1)[3] = value

    path = _broken(tmp_path, stored, edit)
    loader = load_drafter_weights if name.startswith("mtp.") else load_trunk_weights
    with pytest.raises(CheckpointError, match=re.escape(repr(name)) + r".* decodes to .* at \[3\]") as e:
        loader(path)
    assert _shard_of(path, name) in str(e.value)


def test_missing_shard_file_is_named(tmp_path, ckpt):
    path = _copy(ckpt, tmp_path)
    shard = _only_shard(path)
    (path / shard).unlink()
    for reader in (load_trunk_weights, load_drafter_weights, read_stored):
        with pytest.raises(CheckpointError, match="missing") as e:
            reader(path)
        assert shard in str(e.value)


@pytest.mark.parametrize("content, why", [
    (b"[1]", "must be a JSON object"), (b"\xff\xfe", "not UTF-8"), (b"{", "not valid JSON"),
    (json.dumps({**CFG.to_hf_dict(), "rms_norm_eps": 1.0}).encode(), "'norm_eps'=1.0"),
    (json.dumps({**CFG.to_hf_dict(), "rope_scaling": "yarn"}).encode(), "'rope_scaling'='yarn'"),
])
def test_invalid_config_json_is_a_checkpoint_error_naming_the_file(tmp_path, ckpt, content, why):
    path = _copy(ckpt, tmp_path)
    (path / "config.json").write_bytes(content)
    with pytest.raises(CheckpointError, match=why) as e:
        load_trunk_weights(path)
    assert str(path / "config.json") in str(e.value)


@pytest.mark.parametrize("shard", ["", ".", "..", "sub/model.safetensors", "../model.safetensors"])
def test_index_shard_names_must_be_plain_file_names(tmp_path, ckpt, shard):
    path = _copy(ckpt, tmp_path)
    index = json.loads((path / INDEX_NAME).read_text())
    index["weight_map"]["layers.0.attn.wkv.weight"] = shard
    (path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=re.escape(repr(shard)) + " is not a plain file name"):
        load_trunk_weights(path)


def test_non_utf8_index_is_a_checkpoint_error(tmp_path, ckpt):
    path = _copy(ckpt, tmp_path)
    (path / INDEX_NAME).write_bytes(b'{"weight_map": {"\xff": "x"}}')
    with pytest.raises(CheckpointError, match="malformed index"):
        load_trunk_weights(path)


def test_read_header_of_a_folder_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="cannot read shard file"):
        read_header(tmp_path)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float16, torch.float64, torch.int32])
def test_loaders_only_produce_fp32_or_bf16(ckpt, dtype):
    for loader in (load_trunk_weights, load_drafter_weights):
        with pytest.raises(ValueError, match=re.escape(f"dtype={dtype!r}: must be torch.float32 or torch.bfloat16")):
            loader(ckpt, dtype=dtype)
