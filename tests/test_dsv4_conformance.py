"""The expected inventories for the real 0731 config equal the real shard headers (docs/model.md §7, §1.4).

Reads the public REAP-160 checkpoint metadata in ../shared/reference (config.json, the index
and all 48 shard headers as JSON; no tensor data) and skips when that folder is absent.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv4.checkpoint import experts_from_tensors, header_specs, owns
from dsv4.config import ModelConfig
from dsv4.inventory import SHARED_NAMES, drafter_inventory, trunk_inventory

REF = Path(__file__).resolve().parents[2] / "shared" / "reference" / "deepseek-v4-flash-0731-reap160"
N_TENSORS = 45_821  # tensor entries in the 48 shard headers of this checkpoint

pytestmark = pytest.mark.skipif(not REF.is_dir(), reason=f"reference checkpoint metadata not found at {REF}")


@pytest.fixture(scope="module")
def headers():
    """Shard file name -> name -> TensorSpec, from hdrs/<shard>.json."""
    return {p.name[: -len(".json")]: header_specs(json.loads(p.read_text()))
            for p in sorted((REF / "hdrs").glob("*.safetensors.json"))}


@pytest.fixture(scope="module")
def specs(headers):
    out = {}
    for shard in headers.values():
        assert not set(shard) & set(out)  # no tensor stored twice
        out.update(shard)
    return out


@pytest.fixture(scope="module")
def cfg(specs):
    """config.json with the expert count read from the tensors, as `read_config` does."""
    return experts_from_tensors(ModelConfig.load(REF / "config.json"), specs)


def test_headers_hold_all_tensors(headers, specs):
    assert len(headers) == 48
    assert len(specs) == N_TENSORS


def test_expert_count_is_read_from_tensors(cfg, specs):
    assert cfg.n_routed_experts == specs["layers.0.ffn.gate.weight"].shape[0] == 160
    stale = ModelConfig.load(REF / "config.json").replace(n_routed_experts=256)
    assert experts_from_tensors(stale, specs).n_routed_experts == 160


def test_nextn_predict_layers_is_ignored_and_ratios_cover_stages(cfg):
    assert json.loads((REF / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert cfg.n_mtp_layers == 3
    assert len(cfg.compress_ratios) == 46 == cfg.n_layers + cfg.n_mtp_layers
    assert cfg.compress_ratios[cfg.n_layers:] == (0, 0, 0)


def test_trunk_and_drafter_inventories_cover_the_headers_exactly(cfg, specs):
    trunk, drafter = trunk_inventory(cfg), drafter_inventory(cfg)
    assert set(trunk) & set(drafter) == set(SHARED_NAMES)
    for name in SHARED_NAMES:
        assert trunk[name] == drafter[name]
    union = {**trunk, **drafter}
    missing = sorted(set(specs) - set(union))[:5]
    extra = sorted(set(union) - set(specs))[:5]
    assert not missing and not extra, (missing, extra)
    wrong = [(n, specs[n], union[n]) for n in specs if specs[n] != union[n]][:5]
    assert not wrong
    assert len(union) == N_TENSORS


def test_consumer_sets_split_the_headers_as_the_loaders_do(cfg, specs):
    trunk = {n for n in specs if owns("trunk", n)}
    drafter = {n for n in specs if owns("drafter", n)}
    assert trunk == set(trunk_inventory(cfg))
    assert drafter == set(drafter_inventory(cfg, confidence_head=True))
    assert trunk | drafter == set(specs) and trunk & drafter == set(SHARED_NAMES)


def test_index_weight_map_names_exist_in_their_shard_headers(headers, specs):
    wm = json.loads((REF / "model.safetensors.index.json").read_text())["weight_map"]
    absent = [n for n in wm if n not in specs][:5]
    assert not absent
    misplaced = [(n, f) for n, f in wm.items() if n not in headers.get(f, {})][:5]
    assert not misplaced
    assert set(wm) == set(specs)
