"""Model configuration for the DeepSeek-V4-Flash trunk and its DSpark draft module. This
module owns `ModelConfig`, its loading from JSON and the validation of every field; it never
touches tensors or checkpoint shards (the expert count read from them is applied by
`dsv4.checkpoint`) and never reads the process environment.

`ModelConfig` uses the reference implementation's short field names (docs/model.md §1.2). It loads
either the HF `config.json` (long names, docs/model.md §1.1) or a reference-style JSON (short names),
applying the corrections of docs/model.md §1.4:

1. the DSpark stage count is `n_mtp_layers` = 3 whatever `num_nextn_predict_layers` says;
2. `compress_ratios` has one entry per trunk layer *and* per DSpark stage
   (n_layers + n_mtp_layers = 46 for Flash; the trailing entries are the stages' and are 0);
3. the routed-expert count is read from the checkpoint's tensors by the loader
   (`dsv4.checkpoint`), which replaces `n_routed_experts` so pruned checkpoints load.

Every invalid value raises `ValueError` naming the field and the value, on every
construction path (`ModelConfig(...)`, `replace`, `from_dict`, `load`, `tiny_config`):
types are checked in `__post_init__` (integers are ints, not bools; an integral float such as
4.0 becomes 4, 4.9 is rejected; floats are finite numbers; `quant_sim` is a bool), then
ranges. Stated bounds: every integer field <= MAX_INT (2**31 - 1), `max_seq_len` <=
MAX_SEQ_LEN (2**24 tokens), `vocab_size` >= 2 (greedy margins need a runner-up),
`norm_eps`/`hc_eps` in (0, 0.1], `rope_theta`/`compress_rope_theta` in (1, 1e12],
`route_scale` in (0, 100], `rope_factor` in [1, 1e4], `beta_fast` > `beta_slow` > 0.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
WEIGHT_DTYPES = ("fp8", "bf16")  # storage of the dense linears
EXPERT_DTYPES = ("fp4", "fp8", "bf16")  # storage of the routed experts
DEFAULT_N_MTP_LAYERS = 3  # docs/model.md §1.4 (1): the 0731 checkpoint ships 3 DSpark stages
MAX_INT = 2**31 - 1  # bound of every integer field: sizes index int32 kernels and torch storages
MAX_SEQ_LEN = 2**24  # 16.7M tokens (Flash: 1M): every position is exact in fp32 (rope angles)
MAX_EPS = 0.1  # norm_eps / hc_eps beyond this no longer act as a stabiliser
MAX_THETA = 1e12  # rope bases; base**(2j/R) stays finite in fp32
MAX_ROUTE_SCALE = 100.0
MAX_ROPE_FACTOR = 1e4
KV_QUANT_BLOCK = 64  # fp8 sim block of kv[:head_dim - rope_head_dim] (docs/model.md §5.2)
ACT_QUANT_BLOCK = 128  # fp8 activation block before fp8/fp4-stored linears (docs/model.md §2.4)


@dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V4 trunk + DSpark hyper-parameters (docs/model.md §1, reference short names).

    Sizes are counts of elements; positions and lengths are in tokens. `compress_ratios[i]`
    is layer i's compression ratio r (0 = sliding window only, 4 = overlapped compressor
    with indexer, any other r >= 2 = plain compressor attending all entries); entries
    n_layers .. n_layers + n_mtp_layers - 1 belong to the DSpark stages and must be 0.

    `quant_sim` switches on the reference's fp8/fp4 activation fake-quantisation
    (docs/model.md §2.4): on for the real 0731 checkpoint (it was trained that way), as trained for
    the bundled model, off in unit tests.

    Raises:
        ValueError: naming the field and value, for any inconsistent setting.
    """

    vocab_size: int = 129280
    dim: int = 4096
    n_layers: int = 43
    n_mtp_layers: int = DEFAULT_N_MTP_LAYERS
    n_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    compress_ratios: tuple[int, ...] = (0, 0) + (4, 128) * 20 + (4, 0, 0, 0)
    compress_rope_theta: float = 160000.0
    rope_theta: float = 10000.0
    original_seq_len: int = 65536
    rope_factor: float = 16.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    n_activated_experts: int = 6
    n_shared_experts: int = 1
    moe_inter_dim: int = 2048
    n_hash_layers: int = 3
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (40, 41, 42)
    dspark_markov_rank: int = 256
    max_seq_len: int = 65536
    bos_token_id: int = 0
    eos_token_id: int = 1
    weight_dtype: str = "fp8"
    expert_dtype: str = "fp4"
    quant_sim: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _coerce(f.name, f.type, getattr(self, f.name)))
        self._validate()

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        self._validate_bounds()
        self._validate_layout()
        if self.quant_sim:
            self.check_quant_sim_blocks()

    def _validate_bounds(self) -> None:
        """Per-field ranges: integer bounds, positive sizes, finite and sane floats."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "int":
                _require(0 <= v <= MAX_INT, f.name, f"must lie in [0, {MAX_INT}]", v)
            elif f.type == "float":
                _require(math.isfinite(v), f.name, "must be finite", v)
        for name in ("compress_ratios", "dspark_target_layer_ids"):
            for i, v in enumerate(getattr(self, name)):
                _require(0 <= v <= MAX_INT, name, f"entry {i} = {v} must lie in [0, {MAX_INT}]")
        positive = (
            "vocab_size dim n_layers n_heads head_dim rope_head_dim q_lora_rank o_groups "
            "o_lora_rank window_size n_routed_experts n_activated_experts moe_inter_dim "
            "hc_mult hc_sinkhorn_iters max_seq_len index_n_heads index_head_dim index_topk"
        ).split()
        for name in positive:
            _require(getattr(self, name) > 0, name, "must be > 0", getattr(self, name))
        _require(self.vocab_size >= 2, "vocab_size", "must be >= 2 (greedy margins need a runner-up)", self.vocab_size)
        _require(self.max_seq_len <= MAX_SEQ_LEN, "max_seq_len", f"must be <= {MAX_SEQ_LEN}", self.max_seq_len)
        for name in ("norm_eps", "hc_eps"):
            _require(0 < getattr(self, name) <= MAX_EPS, name, f"must lie in (0, {MAX_EPS}]", getattr(self, name))
        for name in ("rope_theta", "compress_rope_theta"):
            _require(1 < getattr(self, name) <= MAX_THETA, name, f"must lie in (1, {MAX_THETA:g}]", getattr(self, name))
        _require(0 < self.route_scale <= MAX_ROUTE_SCALE, "route_scale",
                 f"must lie in (0, {MAX_ROUTE_SCALE:g}]", self.route_scale)
        _require(self.swiglu_limit >= 0, "swiglu_limit", "must be >= 0 (0 = no clamp)", self.swiglu_limit)
        _require(1 <= self.rope_factor <= MAX_ROPE_FACTOR, "rope_factor",
                 f"must lie in [1, {MAX_ROPE_FACTOR:g}]", self.rope_factor)
        # YaRN's correction range divides by beta and takes log(original_seq_len / beta): both
        # betas must be positive, and the fast one above the slow one (docs/model.md §2.2). Checked
        # even when YaRN is off (original_seq_len == 0) so a config never holds garbage.
        _require(self.beta_slow > 0, "beta_slow", "must be > 0", self.beta_slow)
        _require(self.beta_fast > self.beta_slow, "beta_fast", f"must be > beta_slow={self.beta_slow}", self.beta_fast)
        _require(self.score_func in SCORE_FUNCS, "score_func", f"must be one of {SCORE_FUNCS}", self.score_func)
        _require(self.weight_dtype in WEIGHT_DTYPES, "weight_dtype", f"must be one of {WEIGHT_DTYPES}", self.weight_dtype)
        _require(self.expert_dtype in EXPERT_DTYPES, "expert_dtype", f"must be one of {EXPERT_DTYPES}", self.expert_dtype)

    def _validate_layout(self) -> None:
        """Relations between fields: heads and groups, per-layer ratios, experts, DSpark ids."""
        _require(self.rope_head_dim % 2 == 0, "rope_head_dim", "must be even (interleaved pairs)")
        _require(self.rope_head_dim < self.head_dim, "rope_head_dim", f"must be < head_dim={self.head_dim}")
        _require(self.n_heads % self.o_groups == 0, "o_groups", f"must divide n_heads={self.n_heads}")
        n_ratios = self.n_layers + self.n_mtp_layers
        _require(len(self.compress_ratios) == n_ratios, "compress_ratios",
                 f"needs n_layers + n_mtp_layers = {n_ratios} entries, has {len(self.compress_ratios)}")
        for i, r in enumerate(self.compress_ratios):
            _require(r == 0 or r >= 2, "compress_ratios", f"entry {i} = {r}: must be 0 or >= 2")
            if i >= self.n_layers:
                _require(r == 0, "compress_ratios", f"entry {i} = {r}: DSpark stages have no compressor")
        if 4 in self.compress_ratios:
            d = self.index_head_dim
            _require(d & (d - 1) == 0, "index_head_dim", "must be a power of two (Hadamard rotation)")
            _require(d % 32 == 0, "index_head_dim", "must be a multiple of 32 (fp4 blocks)")
            _require(d > self.rope_head_dim, "index_head_dim", f"must be > rope_head_dim={self.rope_head_dim}")
        _require(self.n_activated_experts <= self.n_routed_experts, "n_activated_experts",
                 f"must be <= n_routed_experts={self.n_routed_experts}")
        _require(self.n_shared_experts == 1, "n_shared_experts", "the reference supports exactly 1")
        _require(0 <= self.n_hash_layers <= self.n_layers, "n_hash_layers", f"must be in [0, n_layers={self.n_layers}]")
        ids = self.dspark_target_layer_ids
        _require(list(ids) == sorted(set(ids)), "dspark_target_layer_ids", "must be ascending and unique")
        _require(all(0 <= i < self.n_layers for i in ids), "dspark_target_layer_ids",
                 f"must lie in [0, n_layers={self.n_layers})")
        if self.n_mtp_layers:
            _require(len(ids) > 0, "dspark_target_layer_ids", "must be non-empty when DSpark stages exist")
            _require(self.dspark_block_size >= 1, "dspark_block_size", "must be >= 1")
            _require(self.dspark_markov_rank >= 1, "dspark_markov_rank", "must be >= 1")
            _require(0 <= self.dspark_noise_token_id < self.vocab_size, "dspark_noise_token_id",
                     f"must lie in [0, vocab_size={self.vocab_size})")
        for name in ("bos_token_id", "eos_token_id"):
            _require(0 <= getattr(self, name) < self.vocab_size, name, f"must lie in [0, vocab_size={self.vocab_size})")

    def check_quant_sim_blocks(self) -> None:
        """Raise ValueError unless the sizes fit the quantisation simulation's blocks (docs/model.md §2.4).

        kv[:head_dim - rope_head_dim] and compressor entries go through fp8 blocks of 64;
        with fp8 dense weights the inputs of wq_a, wkv, shared experts (dim), wq_b,
        indexer.wq_b (q_lora_rank), wo_b (o_groups * o_lora_rank) and shared w2
        (moe_inter_dim) through fp8 blocks of 128; with fp4/fp8 experts the routed experts'
        inputs (dim, moe_inter_dim) too. Called at construction when `quant_sim` is on, and
        by `Trunk` when it turns the simulation on itself.
        """
        dn = self.head_dim - self.rope_head_dim
        _require(dn % KV_QUANT_BLOCK == 0, "head_dim",
                 f"head_dim - rope_head_dim = {dn} must be a multiple of {KV_QUANT_BLOCK} (fp8 sim blocks)")
        widths = {}
        if self.weight_dtype == "fp8":
            widths.update(dim=self.dim, q_lora_rank=self.q_lora_rank, moe_inter_dim=self.moe_inter_dim,
                          o_lora_rank=self.o_groups * self.o_lora_rank)
        if self.expert_dtype in ("fp4", "fp8"):
            widths.update(dim=self.dim, moe_inter_dim=self.moe_inter_dim)
        for name, width in widths.items():
            what = f"o_groups * o_lora_rank = {width}" if name == "o_lora_rank" else f"{name} = {width}"
            _require(width % ACT_QUANT_BLOCK == 0, name,
                     f"{what} must be a multiple of {ACT_QUANT_BLOCK} (fp8 activation sim blocks with quant_sim)")

    # ------------------------------------------------------------------ derived
    def layer_ratio(self, layer_id: int) -> int:
        """Compression ratio of trunk layer or DSpark stage `layer_id` (stages: n_layers + s)."""
        return self.compress_ratios[layer_id]

    def is_hash_layer(self, layer_id: int) -> bool:
        """True for the first `n_hash_layers` trunk layers, which route by `tid2eid` (docs/model.md §6.1)."""
        return layer_id < self.n_hash_layers

    @property
    def tap_width(self) -> int:
        """Width of one concatenated tap row: len(dspark_target_layer_ids) * dim."""
        return len(self.dspark_target_layer_ids) * self.dim

    def config_hash(self) -> str:
        """Short sha256 of the canonical reference-style JSON (model identity; `extra` excluded)."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with `changes` applied (type-checked and validated again).

        Raises:
            ValueError: an unknown field (named, with the closest known name) or a bad value.
        """
        _reject_unknown(changes)
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """Reference-style (short-name) dict, JSON-serialisable, without `extra`."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out["compress_ratios"] = list(self.compress_ratios)
        out["dspark_target_layer_ids"] = list(self.dspark_target_layer_ids)
        return out

    def hf_layer_types(self) -> dict[str, Any]:
        """transformers' spelling of the compress ratios: `layer_types` (ratio 0 a sliding
        layer, 4 compressed sparse attention with the indexer, any other heavily compressed)
        and `compress_rates` (the ratio of each compressed kind). transformers reads the
        legacy `compress_ratios` only for the released ratios 0, 4 and 128 and refuses others
        (the bundled small model's 16), so a config.json carries these beside it, and
        `AutoConfig` / `AutoTokenizer.from_pretrained` read the folder as this model. Empty
        when the heavily compressed layers use several ratios (transformers has one rate
        per kind); this model reads neither key back."""
        kinds = {0: "sliding_attention", 4: "compressed_sparse_attention"}
        heavy = sorted({r for r in self.compress_ratios if r not in kinds})
        if len(heavy) > 1:
            return {}
        rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": heavy[0] if heavy else 128}
        return {"layer_types": [kinds.get(r, "heavily_compressed_attention") for r in self.compress_ratios],
                "compress_rates": rates}

    def to_hf_dict(self) -> dict[str, Any]:
        """HF `config.json` (long names) with this project's extra keys, loadable by `from_dict`."""
        out: dict[str, Any] = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}
        for hf_key, short in _HF_TO_SHORT.items():
            out[hf_key] = getattr(self, short)
        out["compress_ratios"] = list(self.compress_ratios)
        out.update(self.hf_layer_types())
        out["dspark_target_layer_ids"] = list(self.dspark_target_layer_ids)
        out["num_nextn_predict_layers"] = self.n_mtp_layers
        out["num_key_value_heads"] = 1
        out["rope_scaling"] = {
            "type": "yarn", "factor": self.rope_factor, "beta_fast": self.beta_fast,
            "beta_slow": self.beta_slow, "original_max_position_embeddings": self.original_seq_len,
        }
        out["max_position_embeddings"] = self.max_seq_len
        out["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                      "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
        out["expert_dtype"] = self.expert_dtype
        out["n_mtp_layers"] = self.n_mtp_layers
        out["quant_sim"] = self.quant_sim
        out["weight_dtype"] = self.weight_dtype
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        """Build from an HF (long names) or reference-style (short names) dict.

        HF detection: presence of `hidden_size`. `num_nextn_predict_layers` is ignored
        (docs/model.md §1.4): stages = `n_mtp_layers` if given, else 3. `quant_sim` defaults to on when
        the dict describes fp8 quantisation without an explicit `quant_sim` key (the real
        0731 checkpoint), off otherwise.

        Unknown keys are kept in `extra`, not rejected: HF and reference JSON files carry many
        keys this model does not use (architectures, torch_dtype, quantization_config,
        dtype, scale_fmt, max_batch_size, temperature, ...). A misspelt field therefore ends up
        in `extra` here; `tiny_config` and `replace`, which take hand-written overrides,
        reject unknown names instead.
        Raises:
            ValueError: `d` is not a mapping, `rope_scaling` is not an object, or a field is
                invalid (named).
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"config must be a JSON object (a mapping of field names), got {type(d).__name__}: "
                             f"{_short_repr(d)}")
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {}
        if "hidden_size" in d:
            for hf_key, short in _HF_TO_SHORT.items():
                if hf_key in d:
                    kw[short] = d.pop(hf_key)
            rs = d.pop("rope_scaling", None)
            if rs is not None and not isinstance(rs, Mapping):
                raise ValueError(f"config field 'rope_scaling'={_short_repr(rs)}: must be an object "
                                 "({type, factor, original_max_position_embeddings, beta_fast, beta_slow}) or null")
            if rs:
                kw["original_seq_len"] = rs.get("original_max_position_embeddings", 0)
                kw["rope_factor"] = rs.get("factor", 1.0)
                kw["beta_fast"] = rs.get("beta_fast", 32.0)
                kw["beta_slow"] = rs.get("beta_slow", 1.0)
            else:
                kw["original_seq_len"] = 0
                kw["rope_factor"] = 1.0
            if "max_position_embeddings" in d and "max_seq_len" not in d:
                kw["max_seq_len"] = d.pop("max_position_embeddings")
        d.pop("num_nextn_predict_layers", None)
        if "quant_sim" not in d:
            kw["quant_sim"] = "quantization_config" in d or d.get("dtype") == "fp8"
        for k in list(d):
            if k in known and k != "extra":
                kw[k] = d.pop(k)
        kw.setdefault("n_mtp_layers", DEFAULT_N_MTP_LAYERS)
        if "n_layers" in kw and "compress_ratios" not in kw:
            raise ValueError("config field 'compress_ratios' is missing")
        return cls(**kw, extra=d)

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        """Read `config.json` (a file, or a checkpoint folder holding one).

        Raises:
            FileNotFoundError: the file does not exist.
            ValueError: naming the file: unreadable (not UTF-8, a folder), invalid JSON, not
                a JSON object, or an invalid field (named).
        """
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            d = json.loads(p.read_bytes().decode("utf-8"))
        except FileNotFoundError:
            raise
        except UnicodeDecodeError as e:
            raise ValueError(f"{p}: not UTF-8 text ({e})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: not valid JSON: {e}") from None
        except OSError as e:
            raise ValueError(f"{p}: cannot be read ({e.strerror or e})") from None
        try:
            return cls.from_dict(d)
        except ValueError as e:
            raise ValueError(f"{p}: {e}") from None


# HF key -> reference short name (docs/model.md §1.2). rope_scaling and max_position_embeddings are
# handled separately.
_HF_TO_SHORT = {
    "vocab_size": "vocab_size", "hidden_size": "dim", "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads", "head_dim": "head_dim", "qk_rope_head_dim": "rope_head_dim",
    "q_lora_rank": "q_lora_rank", "o_groups": "o_groups", "o_lora_rank": "o_lora_rank",
    "sliding_window": "window_size", "compress_ratios": "compress_ratios",
    "compress_rope_theta": "compress_rope_theta", "rope_theta": "rope_theta",
    "index_n_heads": "index_n_heads", "index_head_dim": "index_head_dim", "index_topk": "index_topk",
    "n_routed_experts": "n_routed_experts", "num_experts_per_tok": "n_activated_experts",
    "n_shared_experts": "n_shared_experts", "moe_intermediate_size": "moe_inter_dim",
    "num_hash_layers": "n_hash_layers", "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale", "swiglu_limit": "swiglu_limit", "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters", "hc_eps": "hc_eps", "rms_norm_eps": "norm_eps",
    "dspark_block_size": "dspark_block_size", "dspark_noise_token_id": "dspark_noise_token_id",
    "dspark_target_layer_ids": "dspark_target_layer_ids", "dspark_markov_rank": "dspark_markov_rank",
    "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id",
}

def _coerce(name: str, kind: str, v: Any) -> Any:
    """Type check of one field (its annotation `kind`); returns the canonical value."""
    if kind == "int":
        if isinstance(v, bool) or not isinstance(v, (numbers.Integral, float)):
            raise ValueError(f"config field {name!r}={_short_repr(v)}: must be an integer")
        if isinstance(v, float):
            if not v.is_integer():  # also rejects inf / nan
                raise ValueError(f"config field {name!r}={v!r}: must be an integer")
        return int(v)
    if kind == "float":
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise ValueError(f"config field {name!r}={_short_repr(v)}: must be a number")
        try:
            return float(v)
        except OverflowError:
            raise ValueError(f"config field {name!r}={_short_repr(v)}: must be a finite number") from None
    if kind == "bool":
        if not isinstance(v, bool):
            raise ValueError(f"config field {name!r}={_short_repr(v)}: must be true or false (a bool)")
        return v
    if kind == "str":
        if not isinstance(v, str):
            raise ValueError(f"config field {name!r}={_short_repr(v)}: must be a string")
        return v
    if kind.startswith("tuple"):
        if not isinstance(v, (list, tuple)) or not all(
                isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in v):
            raise ValueError(f"config field {name!r}={_short_repr(v)}: must be a list of integers")
        return tuple(int(x) for x in v)
    if name == "extra":
        if not isinstance(v, Mapping):
            raise ValueError(f"config field 'extra'={_short_repr(v)}: must be a mapping")
        return v
    raise AssertionError(f"unhandled field type {kind!r} of {name!r}")


def _short_repr(v: Any, limit: int = 80) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _reject_unknown(keys: Mapping[str, Any]) -> None:
    known = [f.name for f in dataclasses.fields(ModelConfig)]
    for k in keys:
        if k not in known:
            close = difflib.get_close_matches(str(k), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown config field {k!r}{hint}")


_NO_VALUE = object()


def _require(ok: bool, name: str, why: str, value: Any = _NO_VALUE) -> None:
    if not ok:
        shown = "" if value is _NO_VALUE else f"={value!r}"
        raise ValueError(f"config field {name!r}{shown}: {why}")


# The tiny test configuration of docs/model.md §13: exercises every path (SWA + hash routing in layer
# 0, ratio-4 overlap + indexer with hash routing in layer 1, ratio-8 plain compressor in
# layer 2, ratio-4 with scored routing in layer 3, three DSpark stages).
TINY = dict(
    vocab_size=512, dim=256, n_layers=4, n_mtp_layers=3, n_heads=4, head_dim=96, rope_head_dim=32,
    q_lora_rank=128, o_groups=2, o_lora_rank=64, window_size=8, compress_ratios=[0, 4, 8, 4, 0, 0, 0],
    compress_rope_theta=160000.0, rope_theta=10000.0, original_seq_len=32, rope_factor=4.0,
    beta_fast=32.0, beta_slow=1.0, index_n_heads=2, index_head_dim=64, index_topk=2,
    n_routed_experts=8, n_activated_experts=2, n_shared_experts=1, moe_inter_dim=128, n_hash_layers=2,
    score_func="sqrtsoftplus", route_scale=1.5, swiglu_limit=2.0, hc_mult=4, hc_sinkhorn_iters=20,
    hc_eps=1e-6, norm_eps=1e-6, dspark_block_size=5, dspark_noise_token_id=511,
    dspark_target_layer_ids=[1, 2, 3], dspark_markov_rank=16, max_seq_len=64,
    quant_sim=False,
)


def tiny_config(**overrides: Any) -> ModelConfig:
    """The tiny config of docs/model.md §13 (quantisation simulation off), with `overrides` applied.

    Raises:
        ValueError: an override names no `ModelConfig` field (a typo such as `windowsize`
            would otherwise be kept silently in `extra`), or makes the config invalid.
    """
    _reject_unknown(overrides)
    return ModelConfig.from_dict({**TINY, **overrides})
