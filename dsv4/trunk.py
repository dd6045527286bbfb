"""DeepSeek-V4-Flash trunk: embedding, mHC blocks (attention + MoE), hc_head, norm, head (spec §3).

Dimension legend: S = tokens in a call, C = hc_mult lanes, D = dim, V = vocab,
M = (2 + C) * C mHC logits, T = len(dspark_target_layer_ids), L = n_layers.

One sequence per `TrunkState`; positions are absolute (0-based). `prefill` runs a prompt at
positions 0..S-1 into an empty state; `decode` runs one token at `state.next_position`.
Both go through `Trunk._forward(state, ids, start_pos)` (decode is its S == 1 case), except
that with `verify_numerics="exact"` decode and forward_block go through `_forward_exact`.
`forward_block` + `rollback` verify a draft block as one transaction (see `Trunk`).
Logits are fp32 for the last position only. Taps (spec §3, §9.2) are the lane mean of the
block output of every `dspark_target_layer_ids` layer, concatenated in ascending layer order:
rows [S', T*D] fp32, computed only when asked (they never change the logits).

Module and parameter names equal the logical weight names of `dsv4.inventory.trunk_params`.

Quantisation simulation (`quant_sim`, spec §2.4), where it is applied: the fp8 round trip
(per 64) of kv[:Dn] and of attention-compressor entries[:Dn]; Hadamard rotation + fp4 round
trip (per 32) of the indexer's queries and compressor entries; and, as the reference's fp8 /
fp4 GEMMs do, the fp8 round trip (per 128 along K) of the input of every fp8/fp4-stored
linear (wq_a, wq_b, wkv, wo_b, indexer.wq_b, shared and routed experts; not wo_a, which the
reference holds in bf16, nor the bf16-stored compressor, weights_proj, gate and head).
"""

from __future__ import annotations

import numbers
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import torch
from torch import nn

from dsv4.attention import Attention, AttentionState, AttentionUndo
from dsv4.config import ModelConfig
from dsv4.layers import Embedding, Linear, RMSNorm, frozen_param
from dsv4.mhc import hc_head, hc_post, hc_pre
from dsv4.moe import MoE
from dsv4.settings import Settings
from kernels.select import KernelConfig

DTYPES = (torch.float32, torch.bfloat16)
VERIFY_NUMERICS = ("fast", "exact")
EXACT_ROWS = 8  # exact mode: rows of every dense forward (a decode, or a verify block of <= 8 tokens)


class Block(nn.Module):
    """One transformer block (spec §3.1) of trunk layer or DSpark stage `layer_id`.

    Parameters: attn_norm, ffn_norm [D]; hc_{attn,ffn}_fn [M, C*D], _base [M], _scale [3]
    (fp32); `attn` (Attention), `ffn` (MoE). The residual stream h [S, C, D] is in the
    model dtype. DSpark stages reuse `attn_residual` with their own attention function.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype = torch.float32,
                 quant_sim: bool = False, deterministic_reduce: bool = True, device: torch.device | str = "cpu",
                 kernels: KernelConfig | None = None):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        D, C = cfg.dim, cfg.hc_mult
        M = (2 + C) * C
        self.attn_norm = RMSNorm(D, cfg.norm_eps, device)
        self.ffn_norm = RMSNorm(D, cfg.norm_eps, device)
        for part in ("attn", "ffn"):
            setattr(self, f"hc_{part}_fn", frozen_param((M, C * D), torch.float32, device))
            setattr(self, f"hc_{part}_base", frozen_param((M,), torch.float32, device))
            setattr(self, f"hc_{part}_scale", frozen_param((3,), torch.float32, device))
        self.attn = Attention(cfg, layer_id, dtype, quant_sim, device,
                              attend=(kernels or KernelConfig()).op("sparse_attn"))
        self.ffn = MoE(cfg, layer_id, dtype, quant_sim, deterministic_reduce, device)

    def _residual(self, h: torch.Tensor, part: str, norm: RMSNorm,
                  sublayer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        cfg = self.cfg
        fn, scale, base = (getattr(self, f"hc_{part}_{n}") for n in ("fn", "scale", "base"))
        x, post, comb = hc_pre(h, fn, scale, base, cfg.norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)
        return hc_post(sublayer(norm(x)), h, post, comb)

    def attn_residual(self, h: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """h [S, C, D] -> hc_post(attend(attn_norm(hc_pre(h))), h); `attend`: [S, D] -> [S, D]."""
        return self._residual(h, "attn", self.attn_norm, attend)

    def ffn_residual(self, h: torch.Tensor, ids: torch.Tensor, n_real: int | None = None) -> torch.Tensor:
        """h [S, C, D], ids [S] (hash routing) -> h after the MoE sublayer (`n_real`: exact mode)."""
        if n_real is None:  # DSpark stages' MoE takes (x, ids) only
            return self._residual(h, "ffn", self.ffn_norm, lambda x: self.ffn(x, ids))
        return self._residual(h, "ffn", self.ffn_norm, lambda x: self.ffn(x, ids, n_real))

    def forward(self, h: torch.Tensor, ids: torch.Tensor, start_pos: int, st: AttentionState,
                undo: list[AttentionUndo] | None = None, n_real: int | None = None) -> torch.Tensor:
        """Trunk block: h [S, C, D], ids [S] at positions start_pos.. -> [S, C, D]; updates `st`.

        `undo`: for a verify block, the list this layer's `AttentionUndo` is appended to.
        `n_real`: exact mode, h is an EXACT_ROWS tile whose first n_real rows are tokens.
        """
        h = self.attn_residual(h, lambda x: self.attn(x, start_pos, st, undo, n_real))
        return self.ffn_residual(h, ids, n_real)


class TrunkState:
    """Per-sequence trunk state: one `AttentionState` per layer (ring, compressor and indexer
    states, compressed caches) and `next_position`, the position the next token takes.
    Several states can be used with one model side by side.

    `open_block` is the `BlockUndo` of a verify block (`Trunk.forward_block`) that has not
    been closed by `Trunk.rollback` yet, else None. While a block is open the state takes no
    other forward (see `Trunk`).
    """

    def __init__(self, layers: list[AttentionState]):
        self.layers = layers
        self.next_position = 0
        self.open_block: BlockUndo | None = None
        self._token = object()  # identity every undo record of this state is bound to
        self._fits: weakref.ref | None = None  # the model whose shape check this state passed

    def reset(self) -> None:
        """Back to empty: rings and caches zeroed, compressor kv 0 / scores -inf, next_position 0,
        no open block (an outstanding undo record becomes unusable)."""
        for st in self.layers:
            st.reset()
        self.next_position = 0
        self.open_block = None


@dataclass(frozen=True, eq=False)
class BlockUndo:
    """Everything a verify block changed in a `TrunkState`: its positions and one
    `AttentionUndo` per layer (ring slots, compressor and indexer journals).

    Single use and bound to the state that made it: `state_token` is that state's identity,
    and the state's `open_block` is this record until `Trunk.rollback` consumes it.
    """

    start_pos: int
    n_tokens: int
    layers: list[AttentionUndo]
    state_token: object = field(default=None, repr=False)


@dataclass(frozen=True)
class BlockOutput:
    """Result of `Trunk.forward_block`: logits [S, V] fp32 and taps [S, T*D] fp32 of every
    block position, and the undo record `Trunk.rollback` needs."""

    logits: torch.Tensor
    taps: torch.Tensor
    undo: BlockUndo


@dataclass(frozen=True)
class ForwardOutput:
    """logits [V] fp32 of the last position; taps [rows, T*D] fp32 or None."""

    logits: torch.Tensor
    taps: torch.Tensor | None


def as_int(value: Any, name: str) -> int:
    """`value` as a Python int: an int, a numpy integer, or a one-element integer torch tensor
    / numpy array (e.g. `torch.tensor(20)`, `np.int64(20)`).

    Raises:
        ValueError: naming `name` and the value (repr), for a bool, float, str, None, a
            multi-element tensor or anything else.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: must be an integer, not a bool")
    if isinstance(value, numbers.Integral):
        return int(value)
    if torch.is_tensor(value) or isinstance(value, np.ndarray):
        t = torch.as_tensor(value)
        if t.numel() == 1 and t.ndim <= 1 and t.dtype != torch.bool and not (t.is_floating_point() or t.is_complex()):
            return int(t.reshape(()).item())
        raise ValueError(f"{name}={_short_repr(value)}: must be an integer scalar, got a {t.dtype} tensor "
                         f"of shape {tuple(t.shape)}")
    raise ValueError(f"{name}={_short_repr(value)}: must be an integer, not {type(value).__name__}")


def _short_repr(value: Any, limit: int = 60) -> str:
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _require_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={_short_repr(value)}: must be True or False")
    return value


FLOAT_WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class Trunk(nn.Module):
    """The trunk model (spec §3). See the module docstring for the call protocol.

    Argument checks: every public call validates all its arguments (token ids, positions,
    keep counts, flags, the state's shapes against this model) and raises ValueError naming
    the bad value BEFORE it changes any state; `next_position` advances only once a forward
    has fully succeeded. Integer arguments accept Python ints and numpy / torch integer
    scalars (see `as_int`), never bools, floats or strings.

    Verify blocks are transactions. `forward_block` opens one (`state.open_block`); the
    caller must close it with `rollback(state, out.undo, keep)` (keep = n_tokens commits the
    whole block) before anything else forwards on that state: prefill, decode and another
    forward_block on a state with an open block raise ValueError ("rollback first"). Raising
    was chosen over an implicit commit because a forgotten rollback would otherwise commit
    unverified drafts silently, and later decodes would keep appending to the block's
    journals. `state.reset()` also discards an open block.

    Verify numerics (`verify_numerics`, DESIGN.md §4). "fast" (default): decode runs one
    row, a verify block k+1 rows; their logits agree to rounding (~1e-6 relative in fp32, ~5e-3
in bf16), not bitwise. "exact":
    decode and forward_block compute a position's logits and taps bitwise alike, so a
    batched speculative chain equals the plain greedy chain token for token. Recipe
    (`_forward_exact`): every decode and verify block runs as a tile of EXACT_ROWS = 8 rows
    (the tokens, then padding), so every dense op (linears, mHC, norms, rope, head) has one
    fixed shape and a row's result does not depend on the other rows; attention keys per
    query are the same list in decode and verify, reduced in fixed chunks
    (`dsv4.attention.sparse_attn_chunked`), the indexer scores fixed chunks of entries and
    always returns index_topk columns; routed experts run one 1-row call per route (never a
    group by expert); compressors already step token by token; intra-op threads are pinned to
    the count at construction (`exact_threads`) during each exact forward. Prefill is
    unchanged (plain and speculative runs share it). Blocks hold at most EXACT_ROWS tokens.
    Cost on CPU (bench/bench_exact.py, fp32, 1 thread; the shared machine moves ratios by
    ~10%): tiny config, exact plain decode 0.86-0.88x the tok/s of fast plain decode and exact
    always-k 0.92-0.94x fast always-k; dim-1024 config (16 experts, top-4), 0.75-0.81x and
    0.73-0.83x. Where it comes from (dim 1024, profiled): a decode runs mHC, the attention
    projections and the head on 8 rows instead of 1 (+35%; its routed experts cost the same,
    one token either way); a verify(5) evaluates 24 one-row expert calls instead of <= 16
    grouped ones (+28% in all, nearly all of it in the routed experts); padding 6 -> 8 rows
    and the chunked attention and indexer cost little. On a GPU decode is memory-bound, so
    the padded rows are nearly free and per-route experts are the small-batch fp4 path
    (`kernels.fp4_gemm`); bench/gpu_check.py measures both when a device is lent.

    Args:
        dtype: storage/compute dtype of the linears and the residual stream (torch.float32
            or torch.bfloat16); norms, mHC parameters, attn_sink, ape, compressor linears,
            gate and head stay fp32.
        quant_sim: fp8/fp4 activation simulation (spec §2.4); None -> cfg.quant_sim.
        deterministic_reduce: MoE combine order; None -> `Settings()`'s (ascending expert id).
        device: where parameters and states live; "meta" builds the module tree without memory.
        verify_numerics: "fast" or "exact" (above).
        kernels: implementation of the `kernels/` ops the model uses (sparse attention of the
            fast path, tap pooling); None -> `KernelConfig()` (torch).
    Raises:
        ValueError: dtype not float32/bfloat16, verify_numerics not "fast"/"exact", or
            quant_sim on with sizes that do not fit its blocks (`ModelConfig.check_quant_sim_blocks`).
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, quant_sim: bool | None = None,
                 deterministic_reduce: bool | None = None, device: torch.device | str = "cpu",
                 verify_numerics: str = "fast", kernels: KernelConfig | None = None):
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype}: must be torch.float32 or torch.bfloat16")
        if verify_numerics not in VERIFY_NUMERICS:
            raise ValueError(f"verify_numerics={verify_numerics!r}: must be one of {VERIFY_NUMERICS}")
        self.verify_numerics = verify_numerics
        self.exact_threads = torch.get_num_threads() if verify_numerics == "exact" else None
        self.kernels = KernelConfig() if kernels is None else kernels
        self._lane_mean = self.kernels.op("lane_mean")
        self.cfg, self.dtype = cfg, dtype
        self.quant_sim = cfg.quant_sim if quant_sim is None else bool(quant_sim)
        if self.quant_sim:
            cfg.check_quant_sim_blocks()
        if deterministic_reduce is None:
            deterministic_reduce = Settings().moe_deterministic_reduce
        self.deterministic_reduce = bool(deterministic_reduce)
        D, C = cfg.dim, cfg.hc_mult
        self.embed = Embedding(cfg.vocab_size, D, dtype, device)
        self.layers = nn.ModuleList(
            Block(cfg, i, dtype, self.quant_sim, self.deterministic_reduce, device, self.kernels)
            for i in range(cfg.n_layers))
        self.norm = RMSNorm(D, cfg.norm_eps, device)
        self.hc_head_fn = frozen_param((C, C * D), torch.float32, device)
        self.hc_head_base = frozen_param((C,), torch.float32, device)
        self.hc_head_scale = frozen_param((1,), torch.float32, device)
        self.head = Linear(D, cfg.vocab_size, torch.float32, device)
        self._loaded = False

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy logical weights (name -> tensor, `trunk_params` names) into the model, cast to
        each parameter's dtype. Strict and atomic: every value is checked first, and only a
        fully valid dict is copied, so a rejected call leaves the model as it was (loaded or not).

        Checks per tensor: a torch.Tensor with data (not meta), the parameter's shape; float
        parameters: a float16/bfloat16/float32/float64 tensor (not bool, integer, complex or
        fp8), every value finite; `tid2eid`: an integer tensor (not bool, not float), expert
        ids in [0, n_routed_experts), no expert repeated within a row.
        Raises:
            ValueError: naming every missing, unexpected or failing tensor.
        """
        if not isinstance(weights, Mapping):
            raise ValueError(f"load_weights takes a mapping name -> tensor, got {type(weights).__name__}")
        own = self.state_dict(keep_vars=True)
        missing = sorted(set(own) - set(weights))
        unexpected = sorted(set(weights) - set(own))
        problems = ([f"missing: {missing}"] if missing else []) + ([f"unexpected: {unexpected}"] if unexpected else [])
        for n in sorted(set(own) & set(weights)):
            problem = self._weight_problem(n, weights[n], own[n])
            if problem:
                problems.append(problem)
        if problems:
            raise ValueError("load_weights: " + "; ".join(problems))
        with torch.no_grad():
            for n, t in own.items():
                t.copy_(weights[n])  # casts dtype and device; cannot fail on validated input
        self._loaded = True

    def _weight_problem(self, n: str, w: Any, own: torch.Tensor) -> str | None:
        """Why weight `n` cannot be loaded into parameter/buffer `own`, or None."""
        if not torch.is_tensor(w):
            return f"{n}: not a torch.Tensor (got {type(w).__name__})"
        if w.device.type == "meta":
            return f"{n}: a meta tensor holds no data"
        if tuple(w.shape) != tuple(own.shape):
            return f"mis-shaped {n}: got {tuple(w.shape)}, expected {tuple(own.shape)}"
        if n.endswith("tid2eid"):
            if w.is_floating_point() or w.is_complex() or w.dtype == torch.bool:
                return f"{n}: dtype {w.dtype} is not integer"
            e = w.to(torch.int64)
            E = self.cfg.n_routed_experts
            if e.numel() and (int(e.min()) < 0 or int(e.max()) >= E):
                return f"{n}: expert ids must lie in [0, {E}), got range [{int(e.min())}, {int(e.max())}]"
            srt = e.sort(dim=-1).values
            dup = (srt[:, 1:] == srt[:, :-1]).any(dim=-1).nonzero()
            if dup.numel():
                row = int(dup[0, 0])
                return f"{n}: row {row} repeats an expert: {e[row].tolist()}"
            return None
        if w.dtype not in FLOAT_WEIGHT_DTYPES:
            return f"{n}: dtype {w.dtype} is not a float dtype ({', '.join(map(str, FLOAT_WEIGHT_DTYPES))})"
        bad = (~torch.isfinite(w)).nonzero()
        if bad.numel():
            pos = [int(i) for i in bad[0]]
            return f"{n}: non-finite value {float(w[tuple(pos)])} at {pos}"
        return None

    # ------------------------------------------------------------------ public calls
    def new_state(self) -> TrunkState:
        """A fresh, empty per-sequence state on the model's device."""
        return TrunkState([layer.attn.new_state() for layer in self.layers])

    def state_bytes(self, state: TrunkState) -> int:
        """Bytes held by `state`: rings, compressor kv/score rows, compressed and indexer caches."""
        total = 0
        for st in state.layers:
            total += st.ring.nbytes
            for comp in (st.compressor, st.indexer):
                if comp is not None:
                    total += comp.kv.nbytes + comp.score.nbytes + comp.cache.nbytes
        return total

    def prefill(self, state: TrunkState, token_ids: Any, keep_rows: int | None = None,
                taps: bool = True) -> ForwardOutput:
        """Run a prompt token_ids [S] (1-D integer tensor / array, or list of ints) at
        positions 0..S-1 into an empty state.

        Returns logits [V] fp32 of position S-1 and, when `taps`, the tap rows
        [min(keep_rows, S), T*D] of positions S-keep..S-1 (keep_rows default: window_size;
        T = 0 target layers gives [rows, 0]).
        Raises:
            ValueError: state not empty or from another model, empty prompt, prompt longer
                than max_seq_len, a token id outside [0, vocab_size), non-integer ids,
                keep_rows not an integer >= 0, taps not a bool.
            RuntimeError: weights not loaded.
        """
        self._check_state(state)
        if state.next_position != 0:
            raise ValueError(f"prefill needs an empty state, got next_position={state.next_position}: "
                             "call state.reset() first")
        ids = self._check_ids(token_ids)
        if ids.shape[0] > self.cfg.max_seq_len:
            raise ValueError(f"prompt length {ids.shape[0]} exceeds max_seq_len={self.cfg.max_seq_len}")
        keep = self.cfg.window_size if keep_rows is None else as_int(keep_rows, "keep_rows")
        if keep < 0:
            raise ValueError(f"keep_rows={keep_rows!r}: must be >= 0")
        _require_bool(taps, "taps")
        return self._forward(state, ids, 0, min(keep, ids.shape[0]) if taps else None)

    def decode(self, state: TrunkState, token_id: int, position: int, taps: bool = True) -> ForwardOutput:
        """Run one token at `position` (must equal state.next_position).

        Returns logits [V] fp32 and, when `taps`, the tap row [1, T*D] of `position`.
        Raises:
            ValueError: position or token_id not an integer (see `as_int`), position !=
                state.next_position (both named), position >= max_seq_len, a token id outside
                [0, vocab_size), an open verify block, or a state from another model.
            RuntimeError: weights not loaded.
        """
        self._check_state(state)
        position = as_int(position, "decode position")
        tok = as_int(token_id, "token_id")
        if position != state.next_position:
            raise ValueError(f"decode position={position} does not match state.next_position="
                             f"{state.next_position}")
        if position >= self.cfg.max_seq_len:
            raise ValueError(f"decode position={position}: must be < max_seq_len={self.cfg.max_seq_len}")
        ids = self._check_ids([tok])
        _require_bool(taps, "taps")
        if self.verify_numerics == "exact":
            logits, rows = self._forward_exact(state, ids, position, None)
            return ForwardOutput(logits=logits[0], taps=rows if taps else None)
        return self._forward(state, ids, position, 1 if taps else None)

    def forward_block(self, state: TrunkState, token_ids: Any, start_pos: int) -> BlockOutput:
        """Verify forward: ids [S] (the anchor and k = S-1 drafts) at start_pos..start_pos+S-1
        in one multi-position pass (issue #4 "batched"), with every state change journaled.

        Each query sees only its own causal window and the compressed entries complete at
        its position; compressors step token by token (see `Attention._block_keys`). The
        state advances to start_pos + S with the block open (`state.open_block`); call
        `rollback(state, out.undo, keep)` next to keep the first `keep` positions (the anchor
        plus the accepted drafts). T = 0 target layers gives taps [S, 0].
        Raises:
            ValueError: start_pos not an integer, start_pos != state.next_position or
                start_pos == 0 (prefill first), the block runs past max_seq_len, a bad token
                id, an open verify block, or a state from another model.
            RuntimeError: weights not loaded.
        """
        self._check_state(state)
        start_pos = as_int(start_pos, "start_pos")
        if start_pos != state.next_position or start_pos == 0:
            raise ValueError(f"verify block at start_pos={start_pos} needs a prefilled state at that "
                             f"position, got next_position={state.next_position}")
        ids = self._check_ids(token_ids)
        S = ids.shape[0]
        if start_pos + S > self.cfg.max_seq_len:
            raise ValueError(f"verify block of {S} tokens at {start_pos} runs past max_seq_len={self.cfg.max_seq_len}")
        if self.verify_numerics == "exact":
            if S > EXACT_ROWS:
                raise ValueError(f"verify block of {S} tokens: exact mode verifies at most {EXACT_ROWS} "
                                 f"(k <= {EXACT_ROWS - 1} drafts)")
            undo = []
            logits, taps = self._forward_exact(state, ids, start_pos, undo)
            return self._open_block(state, logits, taps, undo, start_pos, S)
        cfg, undo = self.cfg, []
        rows = []
        with torch.no_grad():
            h = self.embed(ids).unsqueeze(1).repeat(1, cfg.hc_mult, 1)  # (S, C, D)
            for i, block in enumerate(self.layers):
                h = block(h, ids, start_pos, state.layers[i], undo)
                if i in cfg.dspark_target_layer_ids:
                    rows.append(self._lane_mean(h))  # [S, D]
            x = hc_head(h, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, cfg.norm_eps, cfg.hc_eps)
            logits = self.head(self.norm(x).float())  # [S, V] fp32
        taps = torch.cat(rows, dim=-1) if rows else logits.new_zeros(S, 0)  # [S, T*D]
        return self._open_block(state, logits, taps, undo, start_pos, S)

    def _open_block(self, state: TrunkState, logits: torch.Tensor, taps: torch.Tensor,
                    undo: list[AttentionUndo], start_pos: int, S: int) -> BlockOutput:
        """Record the block's undo on `state` (now open) and advance it to start_pos + S."""
        record = BlockUndo(start_pos, S, undo, state._token)
        state.next_position = start_pos + S
        state.open_block = record
        return BlockOutput(logits, taps, record)

    def rollback(self, state: TrunkState, undo: BlockUndo, keep: int, ring: bool = True,
                 compressor: bool = True) -> int:
        """Keep the first `keep` positions of a verify block and undo the rest exactly; closes
        the block (keep = undo.n_tokens commits all of it).

        Restores the ring slots the rejected positions overwrote, the compressor and indexer
        accumulators (replaying the kept tokens' projections after the destructive boundary
        shift), and the compressed-entry counts; the state then equals one that forwarded
        only the kept positions. Returns the bytes copied (saves + restores). `ring=False` /
        `compressor=False` disable one part (tests show each is needed).

        Undo records are single use and bound to their state: `undo` must be
        `state.open_block`, the record of the state's latest forward_block, not yet used.
        Raises (all before any change):
            ValueError: keep not an integer (bools rejected) or outside [1, n_tokens]; ring /
                compressor not bools; `undo` not a BlockUndo, made by another state, or stale
                (already rolled back, or the state was reset since); the state moved since
                the block; a state from another model.
        """
        self._check_state(state, open_block_ok=True)
        if not isinstance(undo, BlockUndo):
            raise ValueError(f"rollback: undo={_short_repr(undo)} is not a BlockUndo (use forward_block(...).undo)")
        keep = as_int(keep, "rollback keep")
        if not 1 <= keep <= undo.n_tokens:
            raise ValueError(f"rollback keep={keep}: must lie in [1, {undo.n_tokens}]")
        _require_bool(ring, "ring")
        _require_bool(compressor, "compressor")
        if undo.state_token is not state._token:
            raise ValueError("rollback: the undo record belongs to another state")
        if state.open_block is not undo:
            raise ValueError(f"rollback: stale undo record of the block at {undo.start_pos}..."
                             f"{undo.start_pos + undo.n_tokens - 1}: it was already rolled back, or the state "
                             "was reset (records are single use)")
        if state.next_position != undo.start_pos + undo.n_tokens:
            raise ValueError(f"rollback: state is at position {state.next_position}, the block ended at "
                             f"{undo.start_pos + undo.n_tokens}")
        copied = sum(layer.attn.rollback(st, u, keep, ring, compressor)
                     for layer, u, st in zip(self.layers, undo.layers, state.layers))
        state.next_position = undo.start_pos + keep
        state.open_block = None
        return copied

    # ------------------------------------------------------------------ internals
    def _check_ids(self, token_ids: Any) -> torch.Tensor:
        """token_ids (1-D integer tensor / numpy array, or list / tuple of ints) -> int64 [S] on
        the model's device. The range check runs on int64 values, so small dtypes (uint8,
        int16) and uint64 are judged by their true values, not wrapped ones."""
        if isinstance(token_ids, (list, tuple)):
            if not token_ids:
                raise ValueError("empty prompt: token_ids has no tokens")
            values = [as_int(t, f"token_ids[{i}]") for i, t in enumerate(token_ids)]
        elif torch.is_tensor(token_ids) or isinstance(token_ids, np.ndarray):
            ids = torch.as_tensor(token_ids)
            if ids.ndim == 1 and ids.numel() == 0:
                raise ValueError("empty prompt: token_ids has no tokens")
            if ids.ndim != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
                raise ValueError(f"token ids must be a 1-D integer tensor, got shape {tuple(ids.shape)} "
                                 f"dtype {ids.dtype}")
            if ids.dtype != torch.uint64:
                ids = ids.to(torch.int64)
                bad = ((ids < 0) | (ids >= self.cfg.vocab_size)).nonzero()
                if bad.numel():
                    i = int(bad[0, 0])
                    raise ValueError(f"token id {int(ids[i])} at index {i} outside [0, vocab_size={self.cfg.vocab_size})")
                return ids.to(device=self.embed.weight.device)
            values = ids.tolist()  # uint64 above 2**63 would wrap in int64
        else:
            raise ValueError(f"token ids must be a 1-D integer tensor or a list of ints, got "
                             f"{type(token_ids).__name__}: {_short_repr(token_ids)}")
        for i, v in enumerate(values):
            if not 0 <= v < self.cfg.vocab_size:
                raise ValueError(f"token id {v} at index {i} outside [0, vocab_size={self.cfg.vocab_size})")
        return torch.tensor(values, dtype=torch.int64, device=self.embed.weight.device)

    def _check_state(self, state: TrunkState, open_block_ok: bool = False) -> None:
        """Loaded model, a state made by this model's `new_state` (or one of the same shapes),
        and no open verify block unless `open_block_ok` (rollback)."""
        if not isinstance(state, TrunkState):
            raise ValueError(f"state must be a TrunkState (model.new_state()), got {type(state).__name__}")
        if not self._loaded:
            raise RuntimeError("Trunk weights are not loaded: call load_weights first")
        if len(state.layers) != len(self.layers):
            raise ValueError(f"state has {len(state.layers)} layers, the model {len(self.layers)}: "
                             "use model.new_state()")
        if state._fits is None or state._fits() is not self:  # ~10 us per layer: once per (state, model)
            for i, (layer, st) in enumerate(zip(self.layers, state.layers)):
                problem = layer.attn.state_mismatch(st)
                if problem:
                    raise ValueError(f"state does not fit this model: layer {i}: {problem}; use model.new_state()")
            state._fits = weakref.ref(self)
        block = state.open_block
        if block is not None and not open_block_ok:
            raise ValueError(f"state has an open verify block at positions {block.start_pos}.."
                             f"{block.start_pos + block.n_tokens - 1}: call rollback(state, undo, keep) first "
                             f"(keep={block.n_tokens} commits the whole block)")

    @torch.no_grad()
    def _forward(self, state: TrunkState, ids: torch.Tensor, start_pos: int,
                 keep: int | None = None) -> ForwardOutput:
        """Forward ids [S] at positions start_pos.. (start_pos == 0: prefill; else S == 1).

        keep: number of trailing tap rows to return, None for no taps. The caller has checked
        every argument and the state.
        """
        cfg = self.cfg
        S = ids.shape[0]
        h = self.embed(ids).unsqueeze(1).repeat(1, cfg.hc_mult, 1)  # (S, C, D)
        rows = []
        for i, block in enumerate(self.layers):
            h = block(h, ids, start_pos, state.layers[i])
            if keep is not None and i in cfg.dspark_target_layer_ids:
                rows.append(self._lane_mean(h[S - keep:]))  # [keep, D]
        x = hc_head(h[-1:], self.hc_head_fn, self.hc_head_scale, self.hc_head_base, cfg.norm_eps, cfg.hc_eps)
        logits = self.head(self.norm(x).float())[0]  # [V] fp32
        taps = None
        if keep is not None:
            taps = torch.cat(rows, dim=-1) if rows else logits.new_zeros(keep, 0)  # [keep, T*D]
        state.next_position = start_pos + S  # only once everything above succeeded
        return ForwardOutput(logits=logits, taps=taps)

    @torch.no_grad()
    def _forward_exact(self, state: TrunkState, ids: torch.Tensor, start_pos: int,
                       undo: list[AttentionUndo] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact mode (class docstring): ids [S] (S <= EXACT_ROWS) at start_pos.. as one
        EXACT_ROWS-row tile (padding rows: token 0, never written to the state) ->
        (logits [S, V] fp32, taps [S, T*D] fp32). `undo`: a verify block's journal list, or None
        for a decode. The caller has checked every argument and the state."""
        cfg, S = self.cfg, ids.shape[0]
        tile = torch.nn.functional.pad(ids, (0, EXACT_ROWS - S))  # [R]
        with _pinned_threads(self.exact_threads):
            h = self.embed(tile).unsqueeze(1).repeat(1, cfg.hc_mult, 1)  # (R, C, D)
            rows = []
            for i, block in enumerate(self.layers):
                h = block(h, tile, start_pos, state.layers[i], undo, n_real=S)
                if i in cfg.dspark_target_layer_ids:
                    rows.append(self._lane_mean(h))  # [R, D]
            x = hc_head(h, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, cfg.norm_eps, cfg.hc_eps)
            logits = self.head(self.norm(x).float())  # [R, V] fp32
        taps = torch.cat(rows, dim=-1) if rows else logits.new_zeros(EXACT_ROWS, 0)  # [R, T*D]
        state.next_position = start_pos + S
        return logits[:S], taps[:S]


@contextmanager
def _pinned_threads(n: int):
    """Run the body with `n` torch intra-op threads, restoring the count after (exact mode:
    a GEMM may split its work, and so its sums, differently with another thread count)."""
    before = torch.get_num_threads()
    if before != n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if before != n:
            torch.set_num_threads(before)
