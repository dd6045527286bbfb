"""DeepSeek-V4-Flash trunk: embedding, mHC blocks (attention + MoE), hc_head, norm, head
(docs/model.md §3). This module owns the modules and the per-sequence state protocol:
prefill, decode, and verify blocks as transactions with exact rollback (docs/architecture.md
§4), for one session or a batch of sessions (`forward_batch`). It holds no sessions and does
not validate request values (the serving engine, `services.verifier.engine`, does so once at
the boundary; here they are asserted); the forward loop lives in `dsv4.batch`, the numerics
recipe in `dsv4.numerics`, the state records in `dsv4.trunk_state`, and the per-call checks
with the job builders of `forward_batch` in `dsv4.trunk_jobs`.

Dimension legend: S = tokens in a call, C = hc_mult lanes, D = dim, V = vocab,
M = (2 + C) * C mHC logits, T = len(dspark_target_layer_ids), L = n_layers.

What the trunk itself checks, with a ValueError naming the value, is what any caller can get
wrong cheaply: the state machine (positions, empty state for prefill, open verify blocks,
undo records), the capacity of a state (max_seq_len) and of the numerics (exact blocks), the
weights and the constructor.

One sequence per `TrunkState`; positions are absolute (0-based). `prefill` runs a prompt at
positions 0..S-1 into an empty state; `decode` runs one token at `state.next_position`;
`forward_block` + `rollback` verify a draft block as one transaction (see `Trunk`);
`forward_batch` runs the decodes and verify blocks of several states in one pass. All go
through one loop, `dsv4.batch.run_pass`, parameterised by a numerics strategy
(`dsv4.numerics`: fast, or exact for prefill, decode and verify alike); a prompt may also
be fed in chunks (`BatchItem.prefill_chunk`) among other sessions' work. Logits are fp32.
Taps (docs/model.md §3, §9.2) are the lane mean of the block output of every `dspark_target_layer_ids` layer,
concatenated in ascending layer order: rows [S', T*D] fp32, computed only when asked (they
never change the logits).

Module and parameter names equal the logical weight names of `dsv4.inventory.trunk_params`.

Quantisation simulation (`quant_sim`, docs/model.md §2.4), where it is applied: the fp8 round trip
(per 64) of kv[:Dn] and of attention-compressor entries[:Dn]; Hadamard rotation + fp4 round
trip (per 32) of the indexer's queries and compressor entries; and, as the reference's fp8 /
fp4 GEMMs do, the fp8 round trip (per 128 along K) of the input of every fp8/fp4-stored
linear (wq_a, wq_b, wkv, wo_b, indexer.wq_b, shared and routed experts; not wo_a, which the
reference holds in bf16, nor the bf16-stored compressor, weights_proj, gate and head).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from dsv4.attention import Attention
from dsv4.batch import BatchItem, finish, join_pieces, layer, run_pass
from dsv4.config import ModelConfig
from dsv4.inventory import trunk_params
from dsv4.layers import Embedding, Linear, RMSNorm, copy_streamed, frozen_param
from dsv4.mhc import hc_head, hc_post, hc_pre
from dsv4.moe import MoE, Route
from dsv4.numerics import EXACT_ROWS, FastNumerics, numerics_for
from dsv4.quantised import pack_quantised, wire_quantised_gemms
from dsv4.settings import Settings
from dsv4.scalars import as_int
from dsv4.trunk_jobs import batch_jobs, check_rollback, check_state, id_tensor
from dsv4.trunk_state import BlockOutput, BlockUndo, ForwardOutput, TrunkState
from kernels.select import KernelConfig

DTYPES = (torch.float32, torch.bfloat16)
FLOAT_WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# The state records are imported from here by the engines and tests.
__all__ = ["Block", "BlockOutput", "BlockUndo", "DTYPES", "EXACT_ROWS", "ForwardOutput", "Trunk", "TrunkState"]


class Block(nn.Module):
    """One transformer block (docs/model.md §3.1) of trunk layer or DSpark stage `layer_id`.

    Parameters: attn_norm, ffn_norm [D]; hc_{attn,ffn}_fn [M, C*D], _base [M], _scale [3]
    (fp32); `attn` (Attention), `ffn` (MoE). The residual stream h [S, C, D] is in the
    model dtype. The trunk's forward loop calls the block over a whole pass (`forward`);
    DSpark stages run `attn_residual` with their own attention function, then `ffn_residual`.
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

    def ffn_residual(self, h: torch.Tensor, ids: torch.Tensor, route: Route | None = None) -> torch.Tensor:
        """h [S, C, D], ids [S] (hash routing) -> h after the MoE sublayer; `route`: see `MoE.forward`
        (None: the MoE's default, the only form DSpark stages' MoE takes)."""
        if route is None:
            return self._residual(h, "ffn", self.ffn_norm, lambda x: self.ffn(x, ids))
        return self._residual(h, "ffn", self.ffn_norm, lambda x: self.ffn(x, ids, route))

    def forward(self, h: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, calls: list, num: FastNumerics,
                small_m: bool) -> torch.Tensor:
        """The trunk block over one pass of the forward loop: see `dsv4.batch.layer`."""
        return layer(self, num, h, ids, pos, calls, small_m)


class Trunk(nn.Module):
    """The trunk model (docs/model.md §3). See the module docstring for what is checked where.

    Argument checks raise ValueError naming the bad value BEFORE any state changes;
    `next_position` advances only once a forward has fully succeeded. Integer scalars
    (positions, keep counts, a decode's token) accept Python ints and numpy / torch integer
    scalars (see `dsv4.scalars.as_int`), never bools, floats or strings.

    Verify blocks are transactions. `forward_block` opens one (`state.open_block`); the
    caller must close it with `rollback(state, out.undo, keep)` (keep = n_tokens commits the
    whole block) before anything else forwards on that state: prefill, decode and another
    forward_block on a state with an open block raise ValueError ("rollback first"). Raising
    was chosen over an implicit commit because a forgotten rollback would otherwise commit
    unverified drafts silently, and later decodes would keep appending to the block's
    journals. `state.reset()` also discards an open block.

    Verify numerics (`dsv4.numerics`): "fast" (default) computes rows in the pass's own
    shape, equal to rounding; "exact" makes a decode or verify row bitwise the same alone,
    in a block or in any batch (fixed 16-row tiles, prompt rows on their own fixed 64-row
    tiles, fixed key lists and reductions, fixed expert tiles, pinned threads), at most
    EXACT_ROWS tokens per block.

    Args:
        cfg: the model config.
        dtype: storage/compute dtype of the linears and the residual stream (torch.float32
            or torch.bfloat16); norms, mHC parameters, attn_sink, ape, compressor linears,
            gate and head stay fp32.
        quant_sim: fp8/fp4 activation simulation (docs/model.md §2.4); None -> cfg.quant_sim.
        deterministic_reduce: MoE combine order (`dsv4.moe`); None -> `Settings()`'s (ascending
            expert id). The process value (`Settings.moe_deterministic_reduce`) is passed by
            the model's builder; the trunk never reads the environment.
        device: where parameters and states live; "meta" builds the module tree without memory.
        verify_numerics: "fast" or "exact" (above).
        kernels: implementation of the `kernels/` ops the model uses: sparse attention of the
            fast path, tap pooling, and with the triton backend the fp8 / fp4 GEMMs of the
            quantised linears (`dsv4.quantised`); `dsv4.settings.Settings.kernel_config` builds it from
            the process settings. None -> `KernelConfig()`: torch everywhere.
    Raises:
        ValueError: cfg not a ModelConfig, dtype not float32/bfloat16, verify_numerics not
            "fast"/"exact", quant_sim on with sizes that do not fit its blocks
            (`ModelConfig.check_quant_sim_blocks`), or the triton backend with nowhere to run
            (`KernelConfig.op`).
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, quant_sim: bool | None = None,
                 deterministic_reduce: bool | None = None, device: torch.device | str = "cpu",
                 verify_numerics: str = "fast", kernels: KernelConfig | None = None):
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype}: must be torch.float32 or torch.bfloat16")
        if deterministic_reduce is None:
            deterministic_reduce = Settings().moe_deterministic_reduce
        self.numerics = numerics_for(verify_numerics)
        self.kernels = kernels = KernelConfig() if kernels is None else kernels
        self._lane_mean = kernels.op("lane_mean")
        self.cfg, self.dtype, self.deterministic_reduce = cfg, dtype, bool(deterministic_reduce)
        self.quant_sim = cfg.quant_sim if quant_sim is None else bool(quant_sim)
        if self.quant_sim:
            cfg.check_quant_sim_blocks()
        D, C = cfg.dim, cfg.hc_mult
        self.embed = Embedding(cfg.vocab_size, D, dtype, device)
        self.layers = nn.ModuleList(
            Block(cfg, i, dtype, self.quant_sim, self.deterministic_reduce, device, kernels)
            for i in range(cfg.n_layers))
        self.norm = RMSNorm(D, cfg.norm_eps, device)
        self.hc_head_fn = frozen_param((C, C * D), torch.float32, device)
        self.hc_head_base = frozen_param((C,), torch.float32, device)
        self.hc_head_scale = frozen_param((1,), torch.float32, device)
        self.head = Linear(D, cfg.vocab_size, torch.float32, device)
        wire_quantised_gemms(self, trunk_params(cfg), kernels)
        self._loaded = False

    @property
    def verify_numerics(self) -> str:
        """The numerics strategy's name: "fast" or "exact"."""
        return self.numerics.name

    @property
    def exact_threads(self) -> int | None:
        """Intra-op threads every exact forward runs with (None in fast mode)."""
        return self.numerics.threads

    @property
    def loaded(self) -> bool:
        """Whether `load_weights` has succeeded (every forward needs it)."""
        return self._loaded

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
        pack_quantised(self)
        self._loaded = True

    def load_streamed(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy logical weights into the model one at a time as `items` yields them
        (`dsv4.checkpoint.stream_trunk_weights`): the device holds the model plus one decoded
        parameter, never the model twice. Each tensor gets `load_weights`' checks. Not atomic:
        the model is unloaded from the call until the last tensor is in, and stays so on failure.

        Raises:
            ValueError: the first unexpected, repeated or failing tensor, or the missing names.
        """
        self._loaded = False
        copy_streamed(self.state_dict(keep_vars=True), items, self._weight_problem)
        pack_quantised(self)
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
        """Run a prompt token_ids [S] (a 1-D integer tensor / array or a list of ints, each in
        [0, vocab_size): asserted) at positions 0..S-1 into an empty state.

        Returns logits [V] fp32 of position S-1 and, when `taps`, the tap rows
        [min(keep_rows, S), T*D] of positions S-keep..S-1 (keep_rows default: window_size;
        T = 0 target layers gives [rows, 0]). This is `forward_batch` of one
        `BatchItem.prefill_chunk` holding the whole prompt: in fast mode one pass over the
        prompt's rows; in exact mode pieces of PROMPT_ROWS tokens, bitwise what any chunking
        of the prompt inside any batch gives (`dsv4.numerics.ExactNumerics`).
        Raises:
            ValueError: state not empty, from another model or with an open block, a prompt
                longer than max_seq_len, keep_rows not an integer.
            RuntimeError: weights not loaded.
        """
        check_state(self, state)
        if state.next_position != 0:
            raise ValueError(f"prefill needs an empty state, got next_position={state.next_position}: "
                             "call state.reset() first")
        ids = id_tensor(self, token_ids)
        S = ids.shape[0]
        if S > self.cfg.max_seq_len:
            raise ValueError(f"prompt length {S} exceeds max_seq_len={self.cfg.max_seq_len}")
        keep = self.cfg.window_size if keep_rows is None else as_int("keep_rows", keep_rows)
        assert keep >= 0, f"keep_rows={keep}"
        return self.forward_batch([BatchItem.prefill_chunk(state, ids, 0, keep if taps else None)])[0]

    def decode(self, state: TrunkState, token_id: int, position: int, taps: bool = True) -> ForwardOutput:
        """Run one token (in [0, vocab_size): asserted) at `position` (= state.next_position).

        Returns logits [V] fp32 and, when `taps`, the tap row [1, T*D] of `position`.
        Raises:
            ValueError: position or token_id not an integer (see `as_int`), position !=
                state.next_position (both named), position >= max_seq_len, an open verify
                block, or a state from another model.
            RuntimeError: weights not loaded.
        """
        return self.forward_batch([BatchItem.decode(state, token_id, position, taps)])[0]

    def forward_block(self, state: TrunkState, token_ids: Any, start_pos: int) -> BlockOutput:
        """Verify forward: ids [S] (the anchor and k = S-1 drafts; in [0, vocab_size):
        asserted) at start_pos..start_pos+S-1 in one multi-position pass, with every state
        change journaled.

        Each query sees only its own causal window and the compressed entries complete at
        its position; compressors step token by token (see `Attention._block_keys`). The
        state advances to start_pos + S with the block open (`state.open_block`); call
        `rollback(state, out.undo, keep)` next to keep the first `keep` positions (the anchor
        plus the accepted drafts). T = 0 target layers gives taps [S, 0].
        Raises:
            ValueError: start_pos not an integer, start_pos != state.next_position or
                start_pos == 0 (prefill first), the block runs past max_seq_len or holds more
                than EXACT_ROWS tokens in exact mode, an open verify block, or a state from
                another model.
            RuntimeError: weights not loaded.
        """
        return self.forward_batch([BatchItem.block(state, token_ids, start_pos)])[0]

    def forward_batch(self, items: Sequence[BatchItem]) -> list[ForwardOutput | BlockOutput]:
        """Run the pending work of several sessions in one pass (`dsv4.batch`): decodes,
        verify blocks and prompt chunks, each on its own state, at any positions.

        Dense ops run once over the rows of every item; attention per item on its state.
        Returns per item, in order, what `decode` (ForwardOutput: logits [V] fp32, taps [1, T*D]
        or None) or `forward_block` (BlockOutput, the item's block left open) returns for it,
        or for a prompt chunk (`BatchItem.prefill_chunk`) a ForwardOutput of its last
        position (logits [V] fp32, taps [min(keep_rows, S), T*D] or None, and with
        `all_logits` prompt_logits [S, V] fp32 of every position), its positions committed:
        equal to rounding in fast mode, bitwise in exact mode whatever the other items are
        (and, for a prompt, however it was cut into chunks).
        Raises (every item checked before any state changes):
            ValueError: an empty batch, an item that is not a BatchItem, one state in two
                items, any item that `decode` / `forward_block` would reject, or a prompt
                chunk that does not start at its state's next position, runs past
                max_seq_len or has keep_rows < 0 (its index named).
            RuntimeError: weights not loaded.
        """
        groups = batch_jobs(self, items)  # every item checked before any state changes
        results = iter(run_pass(self, self.numerics, [job for group in groups for job in group]))
        outs = []
        for item, group in zip(items, groups):
            parts = [next(results) for _ in group]
            outs.append(join_pieces(parts, item.all_logits) if item.prefill else finish(group[0], *parts[0]))
        return outs

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
            ValueError: keep not an integer (bools rejected) or outside [1, n_tokens]; `undo`
                not a BlockUndo, made by another state, or stale (already rolled back, or the
                state was reset since); the state moved since the block; a state from
                another model.
        """
        keep = check_rollback(self, state, undo, keep)
        copied = sum(layer.attn.rollback(st, u, keep, ring, compressor)
                     for layer, u, st in zip(self.layers, undo.layers, state.layers))
        state.next_position = undo.start_pos + keep
        state.open_block = None
        return copied

    # ------------------------------------------------------------------ row-wise ops of the loop
    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """h [R, C, D] -> logits [R, V] fp32: hc_head, norm, head."""
        cfg = self.cfg
        x = hc_head(h, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, cfg.norm_eps, cfg.hc_eps)
        return self.head(self.norm(x).float())
