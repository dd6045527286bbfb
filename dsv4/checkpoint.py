"""Read and write checkpoints in the real DeepSeek-V4-Flash-0731 layout (docs/model.md §7,
docs/architecture.md §9). This module owns the folder format: files, index, headers, the
fp8/fp4 encode and decode at the boundary, and every error a broken folder can raise. It
never builds a model or keeps tensors beyond the call: the expected names come from
`dsv4.inventory`, and the loaded weights go to whoever asked.

A checkpoint folder holds `config.json` (HF long names), `model.safetensors.index.json`
(`weight_map`: stored name -> shard file, `metadata.total_size`) and the shards
`model-0000k-of-0000N.safetensors`; a single `model.safetensors` without index is also read.
Stored names, dtypes and shapes are those of `dsv4.inventory` (docs/model.md §7.1–§7.4).

Dimension legend: N, K = out and in features of a linear; E = routed experts.

Loading dequantises (docs/model.md §6.3): an fp8 or fp4 `X.weight` + `X.scale` pair becomes one float
`X.weight` [N, K]; BF16/F32 tensors become the requested float dtype; `tid2eid` stays int64.
Two consumer sets read the same folder: the trunk consumes every non-`mtp.` tensor, the
drafter `mtp.*` plus `embed.weight` and `head.weight`; each loader validates its own set
against the expected inventory and ignores the other set's names. Shards are streamed: one
open at a time, only the consumer's tensors read. `load_*_weights` return the whole logical
dict (peak: the decoded model); `stream_*_weights` yield one decoded parameter at a time, so a
model that copies each in and drops it (`Trunk.load_streamed`, as the services load) peaks at
itself plus one parameter, never twice its size.

Every way a folder can be broken raises `CheckpointError` (a ValueError) naming the file,
and the tensor and its shard where one is at fault: missing or unreadable files (a folder,
not UTF-8, truncated, data offsets outside the file), malformed index / header / config,
shard names that are not plain file names, missing / unexpected / mis-typed / mis-shaped
tensors, and weights that decode to NaN or inf (NaN / inf stored in a float tensor, an e4m3
NaN byte 0x7F / 0xFF, a ue8m0 scale byte 0xFF, or a scale that overflows float32).
"""

from __future__ import annotations

import contextlib
import json
import struct
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dsv4.codecs import fp4_decode, fp4_encode, fp8_decode, fp8_encode
from dsv4.config import ModelConfig
from dsv4.inventory import (SHARED_NAMES, Param, TensorSpec, drafter_params, stored_inventory,
                            trunk_params)

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 4 * 2**30
# The routed-expert count is read from these tensors' shape[0] (docs/model.md §14: REAP copies).
EXPERT_COUNT_TENSORS = ("layers.0.ffn.gate.weight", "mtp.0.ffn.gate.weight")
_MAX_HEADER_BYTES = 100 * 2**20
LOAD_DTYPES = (torch.float32, torch.bfloat16)  # what `Trunk` / `DSparkDraft` hold
# Bytes per element of the safetensors dtypes (for the data_offsets check of `read_header`).
_ST_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
             "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


class CheckpointError(ValueError):
    """A checkpoint folder is unreadable or does not match the expected tensor inventory."""


# ----------------------------------------------------------------------------- headers / index
def header_specs(header: Mapping[str, Any]) -> dict[str, TensorSpec]:
    """A parsed safetensors header (name -> {dtype, shape, data_offsets}) -> name -> TensorSpec.

    The `__metadata__` entry is skipped. Raises CheckpointError on a malformed entry.
    """
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            out[name] = TensorSpec(str(entry["dtype"]), tuple(int(n) for n in entry["shape"]))
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"header entry {name!r} is malformed: {entry!r}") from None
    return out


def read_header(shard: str | Path) -> dict[str, TensorSpec]:
    """Name -> TensorSpec of one safetensors file, from its header only (no tensor data read).

    Also checks every entry's `data_offsets` against the file size and the tensor's byte
    size, so a truncated shard is reported here, before any tensor is read.
    Raises:
        CheckpointError: the file is missing or unreadable (e.g. a folder), its header is
            not valid safetensors JSON, or a tensor's data lies outside the file.
    """
    p = Path(shard)
    try:
        with p.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > _MAX_HEADER_BYTES:
                raise CheckpointError(f"{p}: header length {n} is implausible")
            header = json.loads(f.read(n))
            data_bytes = p.stat().st_size - 8 - n
    except FileNotFoundError:
        raise CheckpointError(f"shard file {p} is missing") from None
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{p}: not a safetensors file ({e})") from None
    except OSError as e:  # a folder, no permission, I/O error
        raise CheckpointError(f"{p}: cannot read shard file ({e.strerror or e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{p}: header is not a JSON object")
    specs = header_specs(header)
    for name, spec in specs.items():
        _check_offsets(p, name, spec, header[name], data_bytes)
    return specs


def _check_offsets(p: Path, name: str, spec: TensorSpec, entry: Mapping[str, Any], data_bytes: int) -> None:
    off = entry.get("data_offsets") if isinstance(entry, Mapping) else None
    if (not isinstance(off, list) or len(off) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in off)):
        raise CheckpointError(f"{p}: tensor {name!r} has malformed data_offsets {off!r}")
    begin, end = off
    if not 0 <= begin <= end <= data_bytes:
        raise CheckpointError(f"{p}: tensor {name!r} data_offsets {off} lie outside the {data_bytes} data "
                              "bytes of the file (truncated or corrupt shard)")
    item = _ST_BYTES.get(spec.dtype)
    numel = 1
    for d in spec.shape:
        numel *= d
    if item is not None and end - begin != numel * item:
        raise CheckpointError(f"{p}: tensor {name!r} data_offsets {off} span {end - begin} bytes, "
                              f"its {spec.dtype} shape {list(spec.shape)} needs {numel * item}")


def weight_map(path: str | Path) -> dict[str, str]:
    """Stored name -> shard file name (relative to the folder), from the index or the single file.

    Raises:
        CheckpointError: neither `model.safetensors.index.json` nor `model.safetensors` exists,
            or the index is malformed.
    """
    folder = Path(path)
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            wm = json.loads(index.read_bytes().decode("utf-8"))["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, OSError) as e:
            raise CheckpointError(f"{index}: malformed index ({e!r})") from None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise CheckpointError(f"{index}: weight_map must map names to shard file names")
        for shard in set(wm.values()):
            if shard in ("", ".", "..") or Path(shard).name != shard:
                raise CheckpointError(f"{index}: shard {shard!r} is not a plain file name")
        return dict(wm)
    if (folder / SINGLE_NAME).is_file():
        return {name: SINGLE_NAME for name in read_header(folder / SINGLE_NAME)}
    raise CheckpointError(f"{folder}: neither {INDEX_NAME} nor {SINGLE_NAME} found")


def _by_shard(names: Iterable[str], wm: Mapping[str, str]) -> dict[str, list[str]]:
    """Group names by shard file, shards in sorted order (one open file at a time)."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(wm[name], []).append(name)
    return {shard: groups[shard] for shard in sorted(groups)}


# ----------------------------------------------------------------------------- config
def experts_from_tensors(cfg: ModelConfig, specs: Mapping[str, TensorSpec]) -> ModelConfig:
    """`cfg` with `n_routed_experts` = shape[0] of the first gate in EXPERT_COUNT_TENSORS.

    The tensors win over `config.json` (docs/model.md §1.4 (3)), so pruned checkpoints (e.g. REAP,
    160 experts) load. Raises CheckpointError if no gate is found or the count is invalid.
    """
    for name in EXPERT_COUNT_TENSORS:
        if name in specs:
            n = specs[name].shape[0] if specs[name].shape else 0
            if n == cfg.n_routed_experts:
                return cfg
            try:
                return cfg.replace(n_routed_experts=n)
            except ValueError as e:
                raise CheckpointError(f"{name} has {n} experts: {e}") from None
    raise CheckpointError(f"no gate tensor ({' or '.join(EXPERT_COUNT_TENSORS)}) to count experts")


def read_config(path: str | Path) -> ModelConfig:
    """`config.json` of a checkpoint folder, with `n_routed_experts` taken from the tensors.

    Only the header of the shard holding the gate is read. Raises CheckpointError if
    config.json, the index or the gate tensor is missing, or config.json is invalid
    (unreadable, not a JSON object, or a bad field: named).
    """
    folder = Path(path)
    if not (folder / CONFIG_NAME).is_file():
        raise CheckpointError(f"{folder}: {CONFIG_NAME} is missing")
    try:
        cfg = ModelConfig.load(folder / CONFIG_NAME)
    except ValueError as e:  # the message names the file and the field
        raise CheckpointError(str(e)) from None
    wm = weight_map(folder)
    gate = next((n for n in EXPERT_COUNT_TENSORS if n in wm), None)
    if gate is None:
        raise CheckpointError(f"{folder}: no gate tensor ({' or '.join(EXPERT_COUNT_TENSORS)}) in the index")
    return experts_from_tensors(cfg, read_header(folder / wm[gate]))


# ----------------------------------------------------------------------------- loading
def owns(part: str, name: str) -> bool:
    """Whether consumer `part` ("trunk" or "drafter") reads stored tensor `name`."""
    if part == "trunk":
        return not name.startswith("mtp.")
    return name.startswith("mtp.") or name in SHARED_NAMES


def confidence_head_name(cfg: ModelConfig) -> str:
    """Stored name of the optional DSpark confidence head (last stage, docs/model.md §7.4)."""
    return f"mtp.{cfg.n_mtp_layers - 1}.confidence_head.proj.weight"


def load_trunk_weights(
    path: str | Path, cfg: ModelConfig | None = None, dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load and dequantise every non-`mtp.` tensor (the trunk's consumer set).

    Args:
        path: checkpoint folder.
        cfg: the model config; default `read_config(path)` (experts counted from the tensors).
        dtype: torch.float32 or torch.bfloat16, of the returned weights (`tid2eid` stays int64).
        device: where the weights are read to and decoded: safetensors opens each shard on
            it, so a GPU load never makes a host copy of the model.
    Returns:
        (cfg, logical weights name -> tensor, in `trunk_params(cfg)` order).
    Raises:
        ValueError: another dtype.
        CheckpointError: a trunk tensor is missing, unexpected, has the wrong dtype or
            shape, or decodes to NaN / inf (the message names the tensor and its shard), or
            a file is unreadable (see the module docstring); `mtp.*` names are ignored.
    """
    cfg, items, _ = _load(Path(path), cfg, dtype, "trunk", device)
    order = [p.name for p in trunk_params(cfg)]
    weights = dict(items)
    return cfg, {name: weights[name] for name in order}


def load_drafter_weights(
    path: str | Path, cfg: ModelConfig | None = None, dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[ModelConfig, dict[str, torch.Tensor], bool]:
    """Load and dequantise the drafter's set: `mtp.*` + `embed.weight` + `head.weight`.

    Same arguments as `load_trunk_weights`. Returns (cfg, logical weights, confidence_head):
    the last flag says whether `mtp.{last}.confidence_head.proj.weight` was present (it is
    optional, docs/model.md §7.4). Raises CheckpointError like the trunk loader, for drafter tensors
    only; other non-`mtp.` names are ignored.
    """
    cfg, items, has_conf = _load(Path(path), cfg, dtype, "drafter", device)
    order = [p.name for p in drafter_params(cfg, has_conf)]
    weights = dict(items)
    return cfg, {name: weights[name] for name in order}, has_conf


def stream_trunk_weights(
    path: str | Path, cfg: ModelConfig | None = None, dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu", select: Callable[[str], bool] | None = None,
) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """`load_trunk_weights` one parameter at a time: (cfg, iterator of (logical name, tensor)).

    Names, dtypes and shapes of every shard are checked before this returns (the same
    CheckpointErrors as `load_trunk_weights`); the iterator then reads and decodes one
    parameter at a time onto `device`, so a consumer that copies each into its model and drops
    it (`Trunk.load_streamed`) holds the model plus one parameter, never two copies of the
    model. Decoding errors (NaN / inf) are raised by the iterator, naming tensor and shard.
    select(logical name): whether to read that parameter at all (default every one); a TP
    rank passes its own (`dsv4.tp.shard_name`), so other ranks' experts are never read from
    disk, and their values are checked by the rank that owns them.
    """
    cfg, items, _ = _load(Path(path), cfg, dtype, "trunk", device, select)
    return cfg, items


def stream_drafter_weights(
    path: str | Path, cfg: ModelConfig | None = None, dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]], bool]:
    """`load_drafter_weights` one parameter at a time, as `stream_trunk_weights`:
    (cfg, iterator of (logical name, tensor), confidence_head present)."""
    return _load(Path(path), cfg, dtype, "drafter", device)


def _load(folder: Path, cfg: ModelConfig | None, dtype: torch.dtype, part: str, device: torch.device | str = "cpu",
          select: Callable[[str], bool] | None = None):
    """(cfg, iterator of decoded (name, tensor), confidence head present), after every check
    that needs no tensor data."""
    if dtype not in LOAD_DTYPES:
        raise ValueError(f"dtype={dtype!r}: must be torch.float32 or torch.bfloat16")
    cfg = cfg if cfg is not None else read_config(folder)
    wm = weight_map(folder)
    own = {name: shard for name, shard in wm.items() if owns(part, name)}
    has_conf = confidence_head_name(cfg) in own
    params = trunk_params(cfg) if part == "trunk" else drafter_params(cfg, has_conf)
    expected = stored_inventory(params)
    _check_names(folder, part, expected, own)
    _check_headers(folder, part, expected, own)
    if select is not None:  # unread parameters: every stored part of theirs left out
        params = [p for p in params if select(p.name)]
        kept = {s for p in params for s in p.stored()}
        own = {name: shard for name, shard in own.items() if name in kept}
    return cfg, _stream(folder, params, own, dtype, device), has_conf


def _check_names(folder: Path, part: str, expected: Mapping[str, TensorSpec], own: Mapping[str, str]) -> None:
    missing = [n for n in expected if n not in own]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{folder}: {part} tensor {missing[0]!r} is missing{more}")
    for name, shard in own.items():
        if name not in expected:
            raise CheckpointError(f"{folder}: unexpected {part} tensor {name!r} in shard {shard!r}")


def _check_headers(folder: Path, part: str, expected: Mapping[str, TensorSpec], own: Mapping[str, str]) -> None:
    """Every own tensor is in its shard's header with the expected dtype and shape."""
    for shard, names in _by_shard(own, own).items():
        specs = read_header(folder / shard)
        for name in names:
            got, want = specs.get(name), expected[name]
            if got is None:
                raise CheckpointError(f"{folder}: index maps {name!r} to shard {shard!r}, which lacks it")
            if got.dtype != want.dtype:
                raise CheckpointError(f"{part} tensor {name!r} in shard {shard!r}: dtype {got.dtype}, expected {want.dtype}")
            if got.shape != want.shape:
                raise CheckpointError(
                    f"{part} tensor {name!r} in shard {shard!r}: shape {list(got.shape)}, expected {list(want.shape)}")


def _stream(folder: Path, params: list[Param], own: Mapping[str, str], dtype: torch.dtype,
            device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Read the checked tensors shard by shard onto `device`, yielding each parameter (logical
    name, decoded tensor) once its stored parts are in; only a split pair's first part waits."""
    owner = {stored: p for p in params for stored in p.stored()}
    pending: dict[str, torch.Tensor] = {}  # parts of parameters not yet complete (split pairs)
    shard_of: dict[str, str] = {}
    for shard, names in _by_shard(own, own).items():
        with _open_shard(folder, shard, device) as f:
            for name in names:
                try:
                    pending[name] = f.get_tensor(name)
                except SafetensorError as e:
                    raise CheckpointError(f"{folder}: tensor {name!r} in shard {shard!r} is unreadable: {e}") from None
                shard_of[name] = shard
                p = owner[name]
                parts = p.stored()
                if all(s in pending for s in parts):
                    try:
                        value = decode_param(p, {s: pending.pop(s) for s in parts}, dtype)
                    except CheckpointError as e:
                        where = " and ".join(sorted({repr(shard_of[s]) for s in parts}))
                        raise CheckpointError(f"{folder}: shard {where}: {e}") from None
                    yield p.name, value
                    del value  # the consumer holds it now, or has dropped it


@contextlib.contextmanager
def _open_shard(folder: Path, shard: str, device: torch.device | str = "cpu") -> Iterator[Any]:
    """`safe_open` of one shard, its tensors read onto `device`, with safetensors' errors
    (truncated file, bad offsets) as CheckpointError naming the shard."""
    try:
        handle = safe_open(str(folder / shard), framework="pt", device=str(device))
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: shard file {shard!r} is missing") from None
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{folder}: shard {shard!r} is unreadable: {e}") from None
    with handle as f:
        yield f


def decode_param(p: Param, stored: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored tensor(s) of parameter `p` -> its logical tensor (docs/model.md §6.3).

    fp8/fp4 pairs are dequantised to `dtype` [N, K]; bf16/f32 tensors cast to `dtype`;
    i64 stays int64.
    Raises:
        CheckpointError: naming the tensor and the first bad element, when a float result
            holds NaN or inf (stored NaN/inf, an e4m3 NaN byte, a ue8m0 scale byte 0xFF or a
            scale that overflows float32 / `dtype`).
    """
    if p.storage in ("fp8", "fp4"):
        decode = fp8_decode if p.storage == "fp8" else fp4_decode
        scale = p.name[: -len("weight")] + "scale"
        out = decode(stored[p.name], stored[scale]).to(dtype)
    else:
        t = stored[p.name]
        if p.storage == "i64":
            return t.to(torch.int64)
        out = t.to(dtype)
    bad = ~torch.isfinite(out)
    if bool(bad.any()):
        pos = [int(i) for i in bad.nonzero()[0]]
        raise CheckpointError(f"tensor {p.name!r} ({p.storage}) decodes to {float(out[tuple(pos)])} at {pos}: "
                              "non-finite weights (NaN/inf stored, an e4m3 NaN byte, a scale byte 0xFF or "
                              "a scale that overflows)")
    return out


def read_stored(path: str | Path) -> dict[str, torch.Tensor]:
    """Every stored tensor of a checkpoint folder, as stored (fp8/e8m0/int8/bf16/f32/int64).

    No decoding, so no finiteness check. Raises CheckpointError for a missing, truncated or
    otherwise unreadable shard, or an index entry its shard lacks.
    """
    folder = Path(path)
    wm = weight_map(folder)
    out = {}
    for shard, names in _by_shard(wm, wm).items():
        if not (folder / shard).is_file():
            raise CheckpointError(f"{folder}: shard file {shard!r} is missing")
        with _open_shard(folder, shard) as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(f"{folder}: index maps {name!r} to shard {shard!r}, which lacks it")
                try:
                    out[name] = f.get_tensor(name)
                except SafetensorError as e:
                    raise CheckpointError(f"{folder}: tensor {name!r} in shard {shard!r} is unreadable: {e}") from None
    return {name: out[name] for name in wm}


# ----------------------------------------------------------------------------- writing
def params_for(cfg: ModelConfig, names: Iterable[str]) -> list[Param]:
    """The logical parameters a set of logical names covers: trunk and/or drafter, in load order.

    The trunk's parameters are included when any non-`mtp.` name other than embed/head is
    present, the drafter's when any `mtp.` name is; the confidence head is optional.
    Raises ValueError when the names hold neither part.
    """
    names = set(names)
    has_trunk = any(owns("trunk", n) and n not in SHARED_NAMES for n in names)
    has_drafter = any(n.startswith("mtp.") for n in names)
    if not (has_trunk or has_drafter):
        raise ValueError("weights hold neither trunk (layers.*) nor drafter (mtp.*) tensors")
    params = trunk_params(cfg) if has_trunk else []
    if has_drafter:
        seen = {p.name for p in params}
        conf = confidence_head_name(cfg) in names
        params += [p for p in drafter_params(cfg, conf) if p.name not in seen]
    return params


def encode_weights(cfg: ModelConfig, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Logical weights -> stored tensors, quantised per `Param.storage` (docs/model.md §6.3, §7).

    Raises:
        ValueError: naming a missing, unknown, mis-shaped or mis-typed logical tensor.
    """
    params = params_for(cfg, weights)
    known = {p.name for p in params}
    for name in weights:
        if name not in known:
            raise ValueError(f"logical weight {name!r} is not a parameter of this config")
    for p in params:  # validate everything before the (slower) encoding
        t = weights.get(p.name)
        if t is None:
            raise ValueError(f"logical weight {p.name!r} is missing")
        if tuple(t.shape) != p.shape:
            raise ValueError(f"logical weight {p.name!r}: shape {list(t.shape)}, expected {list(p.shape)}")
        if t.is_floating_point() == (p.storage == "i64"):
            raise ValueError(f"logical weight {p.name!r}: dtype {t.dtype} does not suit storage {p.storage}")
    out: dict[str, torch.Tensor] = {}
    for p in params:
        out.update(_encode_param(p, weights[p.name].detach().cpu()))
    return out


def _encode_param(p: Param, t: torch.Tensor) -> dict[str, torch.Tensor]:
    if p.storage in ("fp8", "fp4"):
        weight, scale = (fp8_encode if p.storage == "fp8" else fp4_encode)(t)
        return {p.name: weight, p.name[: -len("weight")] + "scale": scale}
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32, "i64": torch.int64}[p.storage]
    return {p.name: t.to(dtype).contiguous()}


def save_checkpoint(
    path: str | Path, cfg: ModelConfig, weights: Mapping[str, torch.Tensor],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[Path]:
    """Quantise logical `weights` (trunk, drafter or both) and write them in the real layout.

    Writes `config.json` (`cfg.to_hf_dict()`), shards `model-0000k-of-0000N.safetensors` of
    at most `max_shard_bytes` of tensor data each (a single larger parameter gets its own
    shard) and `model.safetensors.index.json`. Returns the shard paths.
    Raises:
        ValueError: as `encode_weights`, or max_shard_bytes <= 0.
    """
    return write_stored(path, cfg, encode_weights(cfg, weights), max_shard_bytes)


def write_stored(
    path: str | Path, cfg: ModelConfig, stored: Mapping[str, torch.Tensor],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[Path]:
    """Write already-stored tensors (as `read_stored` returns them) as shards + index + config.

    Tensors go into shards in the order given, an `X.scale` always beside its `X.weight`.
    No inventory check: this also writes deliberately broken checkpoints for tests.
    Raises:
        ValueError: max_shard_bytes <= 0 or no tensors.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes}: must be > 0")
    if not stored:
        raise ValueError("no tensors to write")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    shards = _pack(stored, max_shard_bytes)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    wm = {}
    for file, names in zip(files, shards):
        save_file({n: stored[n].contiguous() for n in names}, str(folder / file), metadata={"format": "pt"})
        wm.update({n: file for n in names})
    total = sum(_nbytes(t) for t in stored.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(wm.items()))}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    (folder / CONFIG_NAME).write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    return [folder / f for f in files]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _pack(stored: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Greedy shard packing of name groups (a `.scale` joins its `.weight`) in first-seen order."""
    groups: dict[str, list[str]] = {}
    for name in stored:
        key = name[: -len("scale")] + "weight" if name.endswith(".scale") else name
        groups.setdefault(key, []).append(name)
    shards: list[list[str]] = [[]]
    size = 0
    for names in groups.values():
        n = sum(_nbytes(stored[x]) for x in names)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(names)
        size += n
    return shards
