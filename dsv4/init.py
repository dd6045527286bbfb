"""Random initialisation of logical (dequantised) weights, for tests, training and the
weight-less smoke-test server. This module owns `random_weights`, deterministic in
(config, part, seed); it writes no files and knows no storage format (`dsv4.checkpoint`).

Follows docs/model.md §13: linear weights N(0, 1/sqrt(in)), norms 1, `hc_*_fn`
N(0, 0.02), `hc_*_base` 0, `hc_*_scale` 1 (Sinkhorn starts near uniform), `ape` N(0, 0.1),
`attn_sink` 0, gate bias N(0, 0.1), `tid2eid` rows = distinct random experts.
"""

from __future__ import annotations

import torch

from dsv4.config import ModelConfig
from dsv4.inventory import Param, drafter_params, trunk_params


def init_param(p: Param, cfg: ModelConfig, g: torch.Generator) -> torch.Tensor:
    """One logical parameter's random value (module docstring's rules): p.shape, fp32
    (int64 for `tid2eid`), drawn from `g`."""
    name, shape = p.name, p.shape
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("tid2eid"):
        # [V, k] distinct experts per row: argsort of uniform noise, first k columns.
        noise = torch.rand(shape[0], cfg.n_routed_experts, generator=g)
        return noise.argsort(dim=-1)[:, : shape[1]].to(torch.int64)
    if "norm" in name and name.endswith("weight") and len(shape) == 1:
        return torch.ones(shape)
    if leaf.endswith("_base"):
        return torch.zeros(shape)
    if leaf.endswith("_scale"):
        return torch.ones(shape)
    if leaf.endswith("_fn"):
        return torch.randn(shape, generator=g) * 0.02
    if leaf == "ape":
        return torch.randn(shape, generator=g) * 0.1
    if leaf == "attn_sink":
        return torch.zeros(shape)
    if leaf == "bias":
        return torch.randn(shape, generator=g) * 0.1
    if name in ("embed.weight",) or "markov_w1" in name:
        return torch.randn(shape, generator=g)
    # linear [out, in]
    return torch.randn(shape, generator=g) / shape[-1] ** 0.5


def random_weights(
    cfg: ModelConfig, part: str = "all", seed: int = 0, confidence_head: bool = True
) -> dict[str, torch.Tensor]:
    """Random logical weights: name -> fp32 tensor (int64 for `tid2eid`).

    Args:
        part: "trunk", "drafter" or "all" (the union; embed/head shared).
        seed: torch generator seed; the same (cfg, part, seed) gives the same tensors, and a
            name shared by two parts gets the same value in both.
    Raises:
        ValueError: unknown `part`.
    """
    if part not in ("trunk", "drafter", "all"):
        raise ValueError(f"part={part!r}: must be 'trunk', 'drafter' or 'all'")
    params: dict[str, Param] = {}
    if part in ("trunk", "all"):
        params.update({p.name: p for p in trunk_params(cfg)})
    if part in ("drafter", "all"):
        params.update({p.name: p for p in drafter_params(cfg, confidence_head)})
    out = {}
    for name in sorted(params):
        # One generator per tensor, seeded from (seed, name): values do not depend on part.
        g = param_generator(seed, name)
        out[name] = init_param(params[name], cfg, g)
    return out


def param_generator(seed: int, name: str) -> torch.Generator:
    """The generator of parameter `name`'s values under `seed` (independent of the others)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + _stable_hash(name)) % 2**63)


def _stable_hash(s: str) -> int:
    h = 1469598103934665603
    for ch in s.encode():
        h = ((h ^ ch) * 1099511628211) % 2**64
    return h
