"""DeepSeek-V4-Flash trunk: embedding, mHC blocks (attention + MoE), hc_head, norm, head (spec §3).

Dimension legend: S = tokens in a call, C = hc_mult lanes, D = dim, V = vocab,
M = (2 + C) * C mHC logits, T = len(dspark_target_layer_ids), L = n_layers.

One sequence per `TrunkState`; positions are absolute (0-based). `prefill` runs a prompt at
positions 0..S-1 into an empty state; `decode` runs one token at `state.next_position`.
Both go through `Trunk._forward(state, ids, start_pos)` (decode is its S == 1 case).
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

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from dsv4.attention import Attention, AttentionState, AttentionUndo
from dsv4.config import ModelConfig
from dsv4.layers import Embedding, Linear, RMSNorm, frozen_param
from dsv4.mhc import hc_head, hc_post, hc_pre, lane_mean
from dsv4.moe import MoE
from dsv4.settings import Settings

DTYPES = (torch.float32, torch.bfloat16)


class Block(nn.Module):
    """One transformer block (spec §3.1) of trunk layer or DSpark stage `layer_id`.

    Parameters: attn_norm, ffn_norm [D]; hc_{attn,ffn}_fn [M, C*D], _base [M], _scale [3]
    (fp32); `attn` (Attention), `ffn` (MoE). The residual stream h [S, C, D] is in the
    model dtype. DSpark stages reuse `attn_residual` with their own attention function.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype = torch.float32,
                 quant_sim: bool = False, deterministic_reduce: bool = True, device: torch.device | str = "cpu"):
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
        self.attn = Attention(cfg, layer_id, dtype, quant_sim, device)
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

    def ffn_residual(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """h [S, C, D], ids [S] (hash routing) -> h after the MoE sublayer."""
        return self._residual(h, "ffn", self.ffn_norm, lambda x: self.ffn(x, ids))

    def forward(self, h: torch.Tensor, ids: torch.Tensor, start_pos: int, st: AttentionState,
                undo: list[AttentionUndo] | None = None) -> torch.Tensor:
        """Trunk block: h [S, C, D], ids [S] at positions start_pos.. -> [S, C, D]; updates `st`.

        `undo`: for a verify block, the list this layer's `AttentionUndo` is appended to.
        """
        h = self.attn_residual(h, lambda x: self.attn(x, start_pos, st, undo))
        return self.ffn_residual(h, ids)


class TrunkState:
    """Per-sequence trunk state: one `AttentionState` per layer (ring, compressor and indexer
    states, compressed caches) and `next_position`, the position the next token takes.
    Several states can be used with one model side by side."""

    def __init__(self, layers: list[AttentionState]):
        self.layers = layers
        self.next_position = 0

    def reset(self) -> None:
        """Back to empty: rings and caches zeroed, compressor kv 0 / scores -inf, next_position 0."""
        for st in self.layers:
            st.reset()
        self.next_position = 0


@dataclass(frozen=True)
class BlockUndo:
    """Everything a verify block changed in a `TrunkState`: its positions and one
    `AttentionUndo` per layer (ring slots, compressor and indexer journals)."""

    start_pos: int
    n_tokens: int
    layers: list[AttentionUndo]


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


class Trunk(nn.Module):
    """The trunk model (spec §3). See the module docstring for the call protocol.

    Args:
        dtype: storage/compute dtype of the linears and the residual stream (torch.float32
            or torch.bfloat16); norms, mHC parameters, attn_sink, ape, compressor linears,
            gate and head stay fp32.
        quant_sim: fp8/fp4 activation simulation (spec §2.4); None -> cfg.quant_sim.
        deterministic_reduce: MoE combine order; None -> `Settings.from_env()`.
        device: where parameters and states live; "meta" builds the module tree without memory.
    Raises:
        ValueError: dtype not float32/bfloat16.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, quant_sim: bool | None = None,
                 deterministic_reduce: bool | None = None, device: torch.device | str = "cpu"):
        super().__init__()
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype}: must be torch.float32 or torch.bfloat16")
        self.cfg, self.dtype = cfg, dtype
        self.quant_sim = cfg.quant_sim if quant_sim is None else bool(quant_sim)
        if deterministic_reduce is None:
            deterministic_reduce = Settings.from_env().moe_deterministic_reduce
        self.deterministic_reduce = bool(deterministic_reduce)
        D, C = cfg.dim, cfg.hc_mult
        self.embed = Embedding(cfg.vocab_size, D, dtype, device)
        self.layers = nn.ModuleList(
            Block(cfg, i, dtype, self.quant_sim, self.deterministic_reduce, device) for i in range(cfg.n_layers))
        self.norm = RMSNorm(D, cfg.norm_eps, device)
        self.hc_head_fn = frozen_param((C, C * D), torch.float32, device)
        self.hc_head_base = frozen_param((C,), torch.float32, device)
        self.hc_head_scale = frozen_param((1,), torch.float32, device)
        self.head = Linear(D, cfg.vocab_size, torch.float32, device)
        self._loaded = False

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy logical weights (name -> tensor, `trunk_params` names) into the model, cast to
        each parameter's dtype. Strict.

        Raises:
            ValueError: naming every missing, unexpected or mis-shaped tensor, or a tid2eid
                that is not integer or holds an expert id outside [0, n_routed_experts).
        """
        own = self.state_dict(keep_vars=True)
        missing = sorted(set(own) - set(weights))
        unexpected = sorted(set(weights) - set(own))
        bad_shape = [f"{n}: got {tuple(weights[n].shape)}, expected {tuple(own[n].shape)}"
                     for n in sorted(set(own) & set(weights)) if tuple(weights[n].shape) != tuple(own[n].shape)]
        problems = ([f"missing: {missing}"] if missing else []) + ([f"unexpected: {unexpected}"] if unexpected else [])
        problems += [f"mis-shaped {s}" for s in bad_shape]
        for n, w in weights.items():
            if n.endswith("tid2eid") and n in own:
                if w.is_floating_point() or w.is_complex():
                    problems.append(f"{n}: dtype {w.dtype} is not integer")
                elif w.numel() and (int(w.min()) < 0 or int(w.max()) >= self.cfg.n_routed_experts):
                    problems.append(f"{n}: expert ids must lie in [0, {self.cfg.n_routed_experts}), "
                                    f"got range [{int(w.min())}, {int(w.max())}]")
        if problems:
            raise ValueError("load_weights: " + "; ".join(problems))
        with torch.no_grad():
            for n, t in own.items():
                t.copy_(weights[n].to(device=t.device, dtype=t.dtype))
        self._loaded = True

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

    def prefill(self, state: TrunkState, token_ids: torch.Tensor, keep_rows: int | None = None,
                taps: bool = True) -> ForwardOutput:
        """Run a prompt token_ids [S] at positions 0..S-1 into an empty state.

        Returns logits [V] fp32 of position S-1 and, when `taps`, the tap rows
        [min(keep_rows, S), T*D] of positions S-keep..S-1 (keep_rows default: window_size).
        Raises:
            ValueError: state not empty, empty prompt, prompt longer than max_seq_len, a
                token id outside [0, vocab_size), non-integer ids, or keep_rows < 0.
            RuntimeError: weights not loaded.
        """
        if state.next_position != 0:
            raise ValueError(f"prefill needs an empty state, got next_position={state.next_position}: "
                             "call state.reset() first")
        ids = self._check_ids(token_ids)
        if ids.shape[0] > self.cfg.max_seq_len:
            raise ValueError(f"prompt length {ids.shape[0]} exceeds max_seq_len={self.cfg.max_seq_len}")
        keep = self.cfg.window_size if keep_rows is None else keep_rows
        if keep < 0:
            raise ValueError(f"keep_rows={keep_rows}: must be >= 0")
        return self._forward(state, ids, 0, min(keep, ids.shape[0]) if taps else None)

    def decode(self, state: TrunkState, token_id: int, position: int, taps: bool = True) -> ForwardOutput:
        """Run one token at `position` (must equal state.next_position).

        Returns logits [V] fp32 and, when `taps`, the tap row [1, T*D] of `position`.
        Raises:
            ValueError: position != state.next_position (both named), position >= max_seq_len,
                or a token id outside [0, vocab_size).
            RuntimeError: weights not loaded.
        """
        if position != state.next_position:
            raise ValueError(f"decode position={position} does not match state.next_position="
                             f"{state.next_position}")
        if position >= self.cfg.max_seq_len:
            raise ValueError(f"decode position={position}: must be < max_seq_len={self.cfg.max_seq_len}")
        ids = self._check_ids(torch.as_tensor([token_id]) if not torch.is_tensor(token_id) else token_id.reshape(1))
        return self._forward(state, ids, position, 1 if taps else None)

    def forward_block(self, state: TrunkState, token_ids: torch.Tensor, start_pos: int) -> BlockOutput:
        """Verify forward: ids [S] (the anchor and k = S-1 drafts) at start_pos..start_pos+S-1
        in one multi-position pass (issue #4 "batched"), with every state change journaled.

        Each query sees only its own causal window and the compressed entries complete at
        its position; compressors step token by token (see `Attention._block_keys`). The
        state advances to start_pos + S; call `rollback(state, out.undo, keep)` next to keep
        the first `keep` positions (the anchor plus the accepted drafts).
        Raises:
            ValueError: start_pos != state.next_position or start_pos == 0 (prefill first),
                the block runs past max_seq_len, or a bad token id.
        """
        if start_pos != state.next_position or start_pos == 0:
            raise ValueError(f"verify block at start_pos={start_pos} needs a prefilled state at that "
                             f"position, got next_position={state.next_position}")
        ids = self._check_ids(token_ids)
        S = ids.shape[0]
        if start_pos + S > self.cfg.max_seq_len:
            raise ValueError(f"verify block of {S} tokens at {start_pos} runs past max_seq_len={self.cfg.max_seq_len}")
        self._check_state(state)
        cfg, undo = self.cfg, []
        h = self.embed(ids).unsqueeze(1).repeat(1, cfg.hc_mult, 1)  # (S, C, D)
        rows = []
        with torch.no_grad():
            for i, block in enumerate(self.layers):
                h = block(h, ids, start_pos, state.layers[i], undo)
                if i in cfg.dspark_target_layer_ids:
                    rows.append(lane_mean(h))  # [S, D]
            x = hc_head(h, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, cfg.norm_eps, cfg.hc_eps)
            logits = self.head(self.norm(x).float())  # [S, V] fp32
        state.next_position = start_pos + S
        return BlockOutput(logits, torch.cat(rows, dim=-1), BlockUndo(start_pos, S, undo))

    def rollback(self, state: TrunkState, undo: BlockUndo, keep: int, ring: bool = True,
                 compressor: bool = True) -> int:
        """Keep the first `keep` positions of a verify block and undo the rest exactly.

        Restores the ring slots the rejected positions overwrote, the compressor and indexer
        accumulators (replaying the kept tokens' projections after the destructive boundary
        shift), and the compressed-entry counts; the state then equals one that forwarded
        only the kept positions. Returns the bytes copied (saves + restores). `ring=False` /
        `compressor=False` disable one part (tests show each is needed).
        Raises:
            ValueError: keep outside [1, n_tokens], or the state moved since the block.
        """
        if not 1 <= keep <= undo.n_tokens:
            raise ValueError(f"rollback keep={keep}: must lie in [1, {undo.n_tokens}]")
        if state.next_position != undo.start_pos + undo.n_tokens:
            raise ValueError(f"rollback: state is at position {state.next_position}, the block ended at "
                             f"{undo.start_pos + undo.n_tokens}")
        copied = sum(layer.attn.rollback(st, u, keep, ring, compressor)
                     for layer, u, st in zip(self.layers, undo.layers, state.layers))
        state.next_position = undo.start_pos + keep
        return copied

    # ------------------------------------------------------------------ internals
    def _check_ids(self, token_ids: torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(token_ids)
        if ids.ndim != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(f"token ids must be a 1-D integer tensor, got shape {tuple(ids.shape)} dtype {ids.dtype}")
        if ids.numel() == 0:
            raise ValueError("empty prompt: token_ids has no tokens")
        bad = ((ids < 0) | (ids >= self.cfg.vocab_size)).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            raise ValueError(f"token id {int(ids[i])} at index {i} outside [0, vocab_size={self.cfg.vocab_size})")
        return ids.to(device=self.embed.weight.device, dtype=torch.int64)

    def _check_state(self, state: TrunkState) -> None:
        if not self._loaded:
            raise RuntimeError("Trunk weights are not loaded: call load_weights first")
        if len(state.layers) != len(self.layers):
            raise ValueError(f"state has {len(state.layers)} layers, the model {len(self.layers)}: "
                             "use model.new_state()")

    @torch.no_grad()
    def _forward(self, state: TrunkState, ids: torch.Tensor, start_pos: int,
                 keep: int | None = None) -> ForwardOutput:
        """Forward ids [S] at positions start_pos.. (start_pos == 0: prefill; else S == 1).

        keep: number of trailing tap rows to return, None for no taps.
        """
        self._check_state(state)
        cfg = self.cfg
        S = ids.shape[0]
        h = self.embed(ids).unsqueeze(1).repeat(1, cfg.hc_mult, 1)  # (S, C, D)
        rows = []
        for i, block in enumerate(self.layers):
            h = block(h, ids, start_pos, state.layers[i])
            if keep is not None and i in cfg.dspark_target_layer_ids:
                rows.append(lane_mean(h[S - keep:]))  # [keep, D]
        x = hc_head(h[-1:], self.hc_head_fn, self.hc_head_scale, self.hc_head_base, cfg.norm_eps, cfg.hc_eps)
        logits = self.head(self.norm(x).float())[0]  # [V] fp32
        state.next_position = start_pos + S
        return ForwardOutput(logits=logits, taps=torch.cat(rows, dim=-1) if keep is not None else None)
