"""Weights shared by the model tests: random weights with non-trivial norms, sinks, mHC biases
and ape (`varied_weights`), and the same rounded to their checkpoint storage formats
(`quantised_weights`)."""

from __future__ import annotations

import weakref
from typing import Iterable, Iterator

import torch

from dsv4.codecs import fp4_decode, fp4_encode, fp8_decode, fp8_encode
from dsv4.config import ModelConfig, tiny_config
from dsv4.init import random_weights
from dsv4.inventory import trunk_params
from dsv4.trunk import Trunk


def varied_weights(cfg: ModelConfig, seed: int = 0, noise_seed: int | None = None) -> dict[str, torch.Tensor]:
    """`random_weights(cfg, "trunk", seed)` with norm weights 1 + 0.3 N(0, 1), attn sinks and
    mHC biases 0.5 N(0, 1) and ape N(0, 1) (logit std ~1); `noise_seed` (default seed + 100)
    seeds those draws."""
    w = random_weights(cfg, "trunk", seed)
    g = torch.Generator().manual_seed(seed + 100 if noise_seed is None else noise_seed)
    for name, t in w.items():
        if t.ndim == 1 and "norm" in name:
            w[name] = 1 + 0.3 * torch.randn(t.shape, generator=g)
        elif name.endswith("attn_sink") or name.endswith("_base"):
            w[name] = 0.5 * torch.randn(t.shape, generator=g)
        elif name.endswith("ape"):
            w[name] = torch.randn(t.shape, generator=g)
    return w


def quantised_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` with every fp8- / fp4-stored trunk parameter replaced by its decoded encoding,
    i.e. what a real checkpoint's dequantised tensors look like."""
    codecs = {"fp8": (fp8_encode, fp8_decode), "fp4": (fp4_encode, fp4_decode)}
    out = dict(weights)
    for p in trunk_params(cfg):
        if p.storage in codecs:
            encode, decode = codecs[p.storage]
            out[p.name] = decode(*encode(weights[p.name].float()))
    return out


def state_tensors(state):
    """Every tensor of a `TrunkState` a forward writes: rings, compressor and indexer state."""
    for st in state.layers:
        yield st.ring
        for c in (st.compressor, st.indexer):
            if c is not None:
                yield from (c.kv, c.score, c.cache[: c.n_entries])


def tiny_trunk_with(numerics: str) -> Trunk:
    """The tiny config (max_seq_len 128) trunk with random weights (seed 3) and the given verify
    numerics ("fast" | "exact"): the model of the step-loop and chunked-prefill tests."""
    cfg = tiny_config(max_seq_len=128)
    model = Trunk(cfg, verify_numerics=numerics)
    model.load_weights(random_weights(cfg, "trunk", seed=3))
    return model


def each_dropped_before_the_next(items: Iterable[tuple[str, torch.Tensor]],
                                 names: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) stream `items`, asserting that nobody (reader, slicer, loader, model)
    still holds a tensor once the next one is read: the device never holds the decoded model
    beside the loaded one. `names`, when given, records every name read, in order."""
    last = None
    for name, t in items:
        assert last is None or last[1]() is None, f"{last[0]} is still referenced when {name} is read"
        last = (name, weakref.ref(t))
        if names is not None:
            names.append(name)
        yield name, t
        del t
