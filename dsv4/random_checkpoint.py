"""A random checkpoint of any shape, written one tensor at a time: `write_random_checkpoint`.

Owns the random *stored* values of a DeepSeek-V4 + DSpark checkpoint folder of any
`ModelConfig` (the real layout of `dsv4.checkpoint`: config.json, shards, index), for device
checks at sizes no test model reaches (V4-Flash's hidden size, heads and 256 experts:
`bench.gpu_v4`). It never holds more than one tensor in host memory: each shard's header is
computed up front from the inventory (`dsv4.inventory`), then every tensor is drawn, written
and dropped. `safetensors` has no streaming writer (`save_file` takes every tensor of a
shard at once: 3.5 GB of one V4-Flash layer's experts), so the header is written here; the
format is the documented one (8-byte little-endian header length, JSON header, contiguous
data in header order) and the files are read back by `safetensors.safe_open` like any other.

Values. Quantised tensors are drawn as stored bytes, never encoded from floats (encoding
6.4e9 expert weights per layer would take minutes): fp8 weights are e4m3 bytes with
exponent field <= 7 (|v| < 2, never the NaN bytes 0x7F / 0xFF) and a 128x128 ue8m0 scale of
2^-round(log2 sqrt(K)); fp4 weights are uniform packed e2m1 nibbles with a 1x32 scale of
2^-(round(log2 sqrt(K)) + 2) (e2m1 codes have an RMS near 2^1.5), so each linear's output
keeps about the size of its input, as `dsv4.init`'s N(0, 1/sqrt(K)) does. bf16 matrices
(embedding, head, compressors, gates) are uniform with `dsv4.init`'s standard deviation,
drawn from bytes (a normal draw of V4-Flash's embedding takes tens of seconds); every other
tensor (norms, mHC, biases, `tid2eid`) is `dsv4.init.init_param`'s value cast to its
storage dtype. Deterministic in (config, seed).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np
import torch

from dsv4.checkpoint import CONFIG_NAME, INDEX_NAME, _ST_BYTES, confidence_head_name, params_for
from dsv4.codecs import E8M0_BIAS
from dsv4.config import ModelConfig
from dsv4.init import init_param, param_generator
from dsv4.inventory import Param, TensorSpec, drafter_params, trunk_params

_TORCH = {"BF16": torch.bfloat16, "F32": torch.float32, "I64": torch.int64}


def all_params(cfg: ModelConfig, confidence_head: bool = True) -> list[Param]:
    """Trunk and drafter parameters (embed and head once), in load order."""
    names = [p.name for p in trunk_params(cfg)] + [p.name for p in drafter_params(cfg, confidence_head)]
    if not confidence_head:
        names = [n for n in names if n != confidence_head_name(cfg)]
    return params_for(cfg, names)


def shard_groups(params: list[Param]) -> list[list[Param]]:
    """One shard per block (`layers.i.` / `mtp.s.`) in load order, and one for the rest."""
    groups: dict[str, list[Param]] = {}
    for p in params:
        parts = p.name.split(".")
        key = ".".join(parts[:2]) if parts[0] in ("layers", "mtp") else ""
        groups.setdefault(key, []).append(p)
    rest = groups.pop("", [])
    return [*groups.values(), rest] if rest else list(groups.values())


def write_random_checkpoint(path: str | Path, cfg: ModelConfig, seed: int = 0,
                            confidence_head: bool = True) -> int:
    """Write a random checkpoint of `cfg` (trunk and drafter) into folder `path`, one tensor at
    a time; returns the bytes of tensor data written.

    Host memory: one tensor (V4-Flash's largest: the [129280, 4096] embedding, drawn in fp32,
    2.1 GB). Disk: the stored sizes (V4-Flash: about 3.5 GB per block, 2.1 GB embed + head).
    Raises:
        OSError: the folder cannot be created or written.
    """
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    groups = shard_groups(all_params(cfg, confidence_head))
    files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map, total = {}, 0
    for file, group in zip(files, groups):
        total += _write_shard(folder / file, cfg, group, seed)
        weight_map.update({name: file for p in group for name in p.stored()})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    (folder / CONFIG_NAME).write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    return total


def _nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * _ST_BYTES[spec.dtype]


def _write_shard(file: Path, cfg: ModelConfig, group: list[Param], seed: int) -> int:
    """One safetensors file: the header from the specs, then each tensor's bytes in order."""
    specs = {name: spec for p in group for name, spec in p.stored().items()}
    header, at = {}, 0
    for name, spec in specs.items():
        header[name] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [at, at + _nbytes(spec)]}
        at += _nbytes(spec)
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with file.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, t in _stored_values(cfg, group, seed):
            _write_bytes(f, t, specs[name], name)
    return at


def _write_bytes(f: BinaryIO, t: torch.Tensor, spec: TensorSpec, name: str) -> None:
    raw = t.contiguous().view(torch.uint8).reshape(-1)
    if raw.numel() != _nbytes(spec):  # a drawing bug would shift every later tensor of the shard
        raise AssertionError(f"{name}: {raw.numel()} bytes drawn, its header says {_nbytes(spec)}")
    f.write(memoryview(raw.numpy()))


def _stored_values(cfg: ModelConfig, group: list[Param], seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(stored name, tensor) of every parameter of `group`, in `Param.stored()` order."""
    for p in group:
        specs = p.stored()
        rng = np.random.default_rng(param_generator(seed, p.name).initial_seed())
        if p.storage in ("fp8", "fp4"):
            weight, scale = specs
            yield weight, _quantised_bytes(p.storage, specs[weight].shape, rng)
            yield scale, _scale_bytes(p.storage, specs[scale].shape, p.shape[1])
        elif p.storage == "bf16" and len(p.shape) == 2:
            (name,) = specs
            std = 1.0 if p.name == "embed.weight" or "markov_w1" in p.name else p.shape[1] ** -0.5
            yield name, _uniform(p.shape, std, rng)
        else:
            (name,) = specs
            yield name, init_param(p, cfg, param_generator(seed, p.name)).to(_TORCH[specs[name].dtype])


def _random_bytes(shape: tuple[int, ...], rng: np.random.Generator) -> torch.Tensor:
    """Uniform uint8 of `shape` (numpy's bulk bytes: ~10x torch.randint's rate on one core)."""
    return torch.frombuffer(bytearray(rng.bytes(math.prod(shape))), dtype=torch.uint8).view(shape)


def _uniform(shape: tuple[int, ...], std: float, rng: np.random.Generator) -> torch.Tensor:
    """bf16 uniform on (-std*sqrt(3), std*sqrt(3)) in 256 steps (std `std`), from bytes: a
    [129280, 4096] embedding in a second or two, where a normal draw takes tens."""
    steps = _random_bytes(shape, rng).view(torch.int8).float() + 0.5  # symmetric: -127.5 .. 127.5
    return (steps * (std * math.sqrt(3) / 128)).to(torch.bfloat16)


def _quantised_bytes(storage: str, shape: tuple[int, ...], rng: np.random.Generator) -> torch.Tensor:
    """fp8: e4m3 bytes with bit 6 clear (|v| < 2, no NaN byte); fp4: any packed nibble pair."""
    raw = _random_bytes(shape, rng)
    return raw & 0xBF if storage == "fp8" else raw


def _scale_bytes(storage: str, shape: tuple[int, ...], in_features: int) -> torch.Tensor:
    """One ue8m0 exponent for the whole tensor (module docstring: output ~ input in size)."""
    exponent = -round(math.log2(math.sqrt(in_features))) - (2 if storage == "fp4" else 0)
    return torch.full(shape, E8M0_BIAS + exponent, dtype=torch.uint8)
