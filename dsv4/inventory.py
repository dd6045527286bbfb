"""Expected tensor inventories of a DeepSeek-V4 + DSpark checkpoint (docs/model.md §7). This
module owns the names, dtypes and shapes a checkpoint must hold, for the trunk and the
drafter; it reads no files and holds no tensors (`dsv4.checkpoint` compares folders against it).

Two views of the same weights:

* **stored**: names, safetensors dtypes and shapes exactly as the sharded checkpoint holds
  them (fp8 linears as `F8_E4M3` weight + `F8_E8M0` 128x128 block scale, routed experts as
  packed fp4 `I8` [out, in/2] + `F8_E8M0` 1x32 scale, `tid2eid` as `I64`, the rest BF16/F32);
* **logical**: what the model consumes after dequantisation at load: every `X.weight` +
  `X.scale` pair becomes one float `X.weight` of shape [out, in]; `tid2eid` stays integer.

Two consumer sets (docs/model.md §7.4): the trunk consumes every non-`mtp.` tensor; the
drafter consumes `mtp.*` plus `embed.weight` and `head.weight`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

from dsv4.config import ModelConfig

SHARED_NAMES = ("embed.weight", "head.weight")  # consumed by both trunk and drafter


@dataclass(frozen=True)
class TensorSpec:
    """One stored tensor: safetensors dtype name (e.g. "F8_E4M3") and shape."""

    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Param:
    """One logical parameter and how it is stored.

    `storage` is "fp8" (e4m3 weight + 128x128 ue8m0 scale), "fp4" (packed e2m1 + 1x32 e8m0
    scale), "bf16", "f32" or "i64". `shape` is the logical (dequantised) shape.
    """

    name: str
    shape: tuple[int, ...]
    storage: str

    def stored(self) -> dict[str, TensorSpec]:
        """The stored tensors this parameter occupies (one, or weight + scale)."""
        out, *rest = self.shape
        if self.storage == "fp8":
            (inp,) = rest
            scale = self.name[: -len("weight")] + "scale"
            return {self.name: TensorSpec("F8_E4M3", self.shape),
                    scale: TensorSpec("F8_E8M0", (math.ceil(out / 128), math.ceil(inp / 128)))}
        if self.storage == "fp4":
            (inp,) = rest
            scale = self.name[: -len("weight")] + "scale"
            return {self.name: TensorSpec("I8", (out, inp // 2)),
                    scale: TensorSpec("F8_E8M0", (out, inp // 32))}
        dtype = {"bf16": "BF16", "f32": "F32", "i64": "I64"}[self.storage]
        return {self.name: TensorSpec(dtype, self.shape)}


def _dense(cfg: ModelConfig) -> str:
    return "fp8" if cfg.weight_dtype == "fp8" else "bf16"


def _expert(cfg: ModelConfig) -> str:
    return {"fp4": "fp4", "fp8": "fp8", "bf16": "bf16"}[cfg.expert_dtype]


def block_params(cfg: ModelConfig, prefix: str, layer_id: int) -> Iterator[Param]:
    """Parameters of one block (trunk layer or DSpark stage), docs/model.md §7.2–§7.3.

    `prefix` is "layers.{i}." or "mtp.{s}."; `layer_id` selects the compression ratio and
    hash vs scored routing (stages use n_layers + s).
    """
    D, C, fp8 = cfg.dim, cfg.hc_mult, _dense(cfg)
    M = (2 + C) * C
    H, Dh, G = cfg.n_heads, cfg.head_dim, cfg.o_groups
    E, I = cfg.n_routed_experts, cfg.moe_inter_dim
    p = prefix
    for part in ("attn", "ffn"):
        yield Param(f"{p}{part}_norm.weight", (D,), "bf16")
        yield Param(f"{p}hc_{part}_fn", (M, C * D), "f32")
        yield Param(f"{p}hc_{part}_base", (M,), "f32")
        yield Param(f"{p}hc_{part}_scale", (3,), "f32")
    a = f"{p}attn."
    yield Param(f"{a}wq_a.weight", (cfg.q_lora_rank, D), fp8)
    yield Param(f"{a}q_norm.weight", (cfg.q_lora_rank,), "bf16")
    yield Param(f"{a}wq_b.weight", (H * Dh, cfg.q_lora_rank), fp8)
    yield Param(f"{a}wkv.weight", (Dh, D), fp8)
    yield Param(f"{a}kv_norm.weight", (Dh,), "bf16")
    yield Param(f"{a}attn_sink", (H,), "f32")
    yield Param(f"{a}wo_a.weight", (G * cfg.o_lora_rank, H * Dh // G), fp8)
    yield Param(f"{a}wo_b.weight", (D, G * cfg.o_lora_rank), fp8)
    ratio = cfg.layer_ratio(layer_id)
    if ratio:
        k = 2 if ratio == 4 else 1  # overlapped compressor is twice as wide
        yield from _compressor(f"{a}compressor.", D, Dh, ratio, k)
    if ratio == 4:
        Hi, Di = cfg.index_n_heads, cfg.index_head_dim
        yield Param(f"{a}indexer.wq_b.weight", (Hi * Di, cfg.q_lora_rank), fp8)
        yield Param(f"{a}indexer.weights_proj.weight", (Hi, D), "bf16")
        yield from _compressor(f"{a}indexer.compressor.", D, Di, ratio, 2)
    f = f"{p}ffn."
    yield Param(f"{f}gate.weight", (E, D), "bf16")
    if cfg.is_hash_layer(layer_id):
        yield Param(f"{f}gate.tid2eid", (cfg.vocab_size, cfg.n_activated_experts), "i64")
    else:
        yield Param(f"{f}gate.bias", (E,), "f32")
    yield Param(f"{f}shared_experts.w1.weight", (I, D), fp8)
    yield Param(f"{f}shared_experts.w2.weight", (D, I), fp8)
    yield Param(f"{f}shared_experts.w3.weight", (I, D), fp8)
    ex = _expert(cfg)
    for e in range(E):
        yield Param(f"{f}experts.{e}.w1.weight", (I, D), ex)
        yield Param(f"{f}experts.{e}.w2.weight", (D, I), ex)
        yield Param(f"{f}experts.{e}.w3.weight", (I, D), ex)


def _compressor(prefix: str, D: int, d: int, ratio: int, k: int) -> Iterator[Param]:
    yield Param(f"{prefix}wkv.weight", (k * d, D), "bf16")
    yield Param(f"{prefix}wgate.weight", (k * d, D), "bf16")
    yield Param(f"{prefix}ape", (ratio, k * d), "f32")
    yield Param(f"{prefix}norm.weight", (d,), "bf16")


def trunk_params(cfg: ModelConfig) -> list[Param]:
    """Every logical parameter the trunk consumes (all non-`mtp.` tensors), in load order."""
    D, C = cfg.dim, cfg.hc_mult
    out = [Param("embed.weight", (cfg.vocab_size, D), "bf16")]
    for i in range(cfg.n_layers):
        out.extend(block_params(cfg, f"layers.{i}.", i))
    out += [
        Param("norm.weight", (D,), "bf16"),
        Param("hc_head_fn", (C, C * D), "f32"),
        Param("hc_head_base", (C,), "f32"),
        Param("hc_head_scale", (1,), "f32"),
        Param("head.weight", (cfg.vocab_size, D), "bf16"),
    ]
    return out


def drafter_params(cfg: ModelConfig, confidence_head: bool = True) -> list[Param]:
    """Every logical parameter the DSpark drafter consumes: `mtp.*` + embed + head (docs/model.md §7.4).

    `confidence_head=False` leaves out `mtp.{last}.confidence_head.proj.weight` (optional at
    load, docs/model.md §7.4 [UNCERTAIN]).
    """
    D, C, R = cfg.dim, cfg.hc_mult, cfg.dspark_markov_rank
    out = [Param("embed.weight", (cfg.vocab_size, D), "bf16")]
    last = cfg.n_mtp_layers - 1
    for s in range(cfg.n_mtp_layers):
        p = f"mtp.{s}."
        if s == 0:
            out.append(Param(f"{p}main_proj.weight", (D, cfg.tap_width), _dense(cfg)))
            out.append(Param(f"{p}main_norm.weight", (D,), "bf16"))
        out.extend(block_params(cfg, p, cfg.n_layers + s))
        if s == last:
            out += [
                Param(f"{p}norm.weight", (D,), "bf16"),
                Param(f"{p}hc_head_fn", (C, C * D), "f32"),
                Param(f"{p}hc_head_base", (C,), "f32"),
                Param(f"{p}hc_head_scale", (1,), "f32"),
                Param(f"{p}markov_head.markov_w1.weight", (cfg.vocab_size, R), "bf16"),
                Param(f"{p}markov_head.markov_w2.weight", (cfg.vocab_size, R), "bf16"),
            ]
            if confidence_head:
                out.append(Param(f"{p}confidence_head.proj.weight", (1, D + R), "bf16"))
    out.append(Param("head.weight", (cfg.vocab_size, D), "bf16"))
    return out


def stored_inventory(params: list[Param]) -> dict[str, TensorSpec]:
    """Stored name -> TensorSpec for a list of logical parameters."""
    out: dict[str, TensorSpec] = {}
    for p in params:
        out.update(p.stored())
    return out


def trunk_inventory(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Stored tensors the trunk consumes (docs/model.md §7.1–§7.3)."""
    return stored_inventory(trunk_params(cfg))


def drafter_inventory(cfg: ModelConfig, confidence_head: bool = True) -> dict[str, TensorSpec]:
    """Stored tensors the drafter consumes (docs/model.md §7.4 + embed/head)."""
    return stored_inventory(drafter_params(cfg, confidence_head))
