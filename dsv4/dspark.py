"""DSpark draft module: three mHC blocks that draft a block of tokens from one committed token
(docs/model.md §9). This module owns the draft math, the per-sequence rings (`DraftState`,
written by `write_main_kv`) and the checks that keep them in step with the trunk. It holds no
sessions (`services.drafter`), never decides which rows are committed (the caller sends only
accepted ones) and does not shard itself (`dsv4.dspark_tp`).

Dimension legend: B = dspark_block_size (block slots), R = committed rows in one write,
T = len(dspark_target_layer_ids), D = dim, C = hc_mult, H = heads (this TP rank's),
Dh = head_dim, W = window_size, V = vocab, Rm = dspark_markov_rank, k = n_activated_experts.

Positions (docs/model.md §9.2, which warns of the off-by-one). The seed position p is the
last committed position whose target row (tap row) is known. The anchor, the committed
token at p+1 that the target has not consumed yet, takes block slot 0 and is roped at p+1;
the block [anchor, noise x (B-1)] occupies positions p+1..p+B, and slot j predicts the
token at p+2+j. Drafted tokens: B ids for positions p+2..p+B+1.

Rings (docs/model.md §9.4, §9.6). Every stage keeps, per sequence, a ring [W, Dh] of context keys
(= values) computed from the target's rows with its own wkv/kv_norm and rope at the row's
position: position q lives in slot q % W. `write_main_kv` writes every newly committed
position into every stage's ring in one call; rows are processed one at a time so a batch
write equals successive single writes bitwise. A draft attends (non-causally, one index
list for every slot) over the ring's positions max(0, p-W+1)..p plus the whole block; the
block's own keys never enter the ring, and rejected positions are never written (a write
at q evicts q-W, which may still be inside the next window). A commit may repeat positions
still in the window only with rows that give the same keys (the protocol only ever resends
identical rows); one that would change a ring is rejected (see `write_main_kv`).

End of the sequence: `draft` returns only the drafts of positions < max_seq_len, i.e.
min(B, max_seq_len - p - 2) of them (0 when the anchor is the last position), and raises
when the anchor itself lies at or past max_seq_len (`draft_length`). The block is computed
in full either way, so the drafts it does return equal those of an unbounded sequence.

Head (docs/model.md §9.5). y = hc_head(h) of the last stage (pre-norm), base logits = head(norm(y))
for every slot, then strictly sequentially: logits[j] += markov_w2(markov_w1[prev]) with
prev the previous token (the anchor for slot 0), draft j = argmax. Confidence logits
(raw; sigmoid = acceptance probability) = proj([y_j ; markov_w1[prev_j]]).

Tensor parallelism: see `dsv4.dspark_tp` (heads and routed experts sharded, two bf16
all-reduces per stage). Parameter names equal `dsv4.inventory.drafter_params(cfg)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from dsv4.attention import sparse_attn
from dsv4.config import ModelConfig
from dsv4.draft_args import check_commit, check_draft_args, check_seed, draft_length, listed, weight_problem
from dsv4.dspark_tp import DraftTP
from dsv4.layers import Embedding, Linear, RMSNorm, frozen_param
from dsv4.mhc import hc_head
from dsv4.moe import Expert, Gate, reduce_routes
from dsv4.rope import Rope
from dsv4.settings import Settings
from dsv4.trunk import DTYPES, Block

Reduce = Callable[[torch.Tensor], torch.Tensor]
# Picks a draft slot's token inside the Markov loop: (slot j, logits [V] fp32) -> token [1] int64.
Chooser = Callable[[int, torch.Tensor], torch.Tensor]


class DraftMoE(nn.Module):
    """A stage's MoE with this rank's routed experts (docs/model.md §6, docs/architecture.md §10).

    gate (replicated, routes over all E experts), `experts` = ModuleDict of the local experts
    keyed by global id, `shared_experts` (replicated). forward(x [N, D], ids [N]) -> [N, D]:
    routed sum over local experts (fp32, a token's partials folded in ascending expert id as
    `dsv4.moe.MoE` does), `reduce` (the TP all-reduce) of that sum, THEN + shared expert.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, quant_sim: bool,
                 deterministic_reduce: bool, experts: range, reduce: Reduce, device: torch.device | str):
        super().__init__()
        D, I, L = cfg.dim, cfg.moe_inter_dim, cfg.swiglu_limit
        self.deterministic_reduce, self.reduce = deterministic_reduce, reduce
        self.gate = Gate(cfg, layer_id, device)
        routed_aq = quant_sim and cfg.expert_dtype in ("fp4", "fp8")
        self.experts = nn.ModuleDict({str(e): Expert(D, I, L, dtype, device, routed_aq) for e in experts})
        self.shared_experts = Expert(D, I, L, dtype, device, quant_sim and cfg.weight_dtype == "fp8")

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x, ids)
        routed = self.reduce(self.routed(x, weights, experts))  # before the shared expert: counted once
        return (routed + self.shared_experts(x).float()).to(x.dtype)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [N, D], weights [N, k] fp32, experts [N, k] -> [N, D] fp32; routes to non-local experts add 0."""
        N, k = experts.shape
        partial = x.new_zeros(N, k, x.shape[1], dtype=torch.float32)  # [N, k, D] one row per route
        for e in torch.unique(experts).tolist():  # ascending expert id
            if str(e) not in self.experts:
                continue
            tok, slot = torch.nonzero(experts == e, as_tuple=True)  # ascending token
            partial[tok, slot] = self.experts[str(e)](x[tok], weights[tok, slot]).float()
        return reduce_routes(partial, experts, self.deterministic_reduce)


class MarkovHead(nn.Module):
    """markov_w1 [V, Rm] (embedding of the previous token), markov_w2 [V, Rm] (rank-Rm bigram
    bias head), fp32 (docs/model.md §9.1, §9.5)."""

    def __init__(self, vocab_size: int, rank: int, device: torch.device | str):
        super().__init__()
        self.markov_w1 = Embedding(vocab_size, rank, torch.float32, device)
        self.markov_w2 = Linear(rank, vocab_size, torch.float32, device)


class ConfidenceHead(nn.Module):
    """proj [1, D + Rm] fp32, no bias: confidence logit of [hidden ; markov embedding] (docs/model.md §9.5)."""

    def __init__(self, dim: int, rank: int, device: torch.device | str):
        super().__init__()
        self.proj = Linear(dim + rank, 1, torch.float32, device)


class DSparkStage(Block):
    """Stage s = a full `Block` with layer id n_layers + s (ratio 0, rope theta without YaRN,
    scored gate) whose MoE is a `DraftMoE`; stage 0 adds main_proj [D, T*D] + main_norm [D];
    the last stage adds norm [D], hc_head_fn [C, C*D] / _base [C] / _scale [1], markov_head
    and (optionally) confidence_head (docs/model.md §9.1). Built on the meta device, then materialised
    on `device` so non-local experts never allocate memory.
    """

    def __init__(self, cfg: ModelConfig, local_cfg: ModelConfig, stage: int, dtype: torch.dtype,
                 quant_sim: bool, deterministic_reduce: bool, tp: DraftTP, confidence_head: bool,
                 device: torch.device | str):
        layer_id = cfg.n_layers + stage
        super().__init__(local_cfg, layer_id, dtype, quant_sim, deterministic_reduce, device="meta")
        self.reduce = tp.all_reduce
        self.ffn = DraftMoE(local_cfg, layer_id, dtype, quant_sim, deterministic_reduce,
                            tp.local_experts(cfg), tp.all_reduce, "meta")
        D, C, meta = cfg.dim, cfg.hc_mult, "meta"
        if stage == 0:
            self.main_proj = Linear(cfg.tap_width, D, dtype, meta, act_quant=quant_sim and cfg.weight_dtype == "fp8")
            self.main_norm = RMSNorm(D, cfg.norm_eps, meta)
        if stage == cfg.n_mtp_layers - 1:
            self.norm = RMSNorm(D, cfg.norm_eps, meta)
            self.hc_head_fn = frozen_param((C, C * D), torch.float32, meta)
            self.hc_head_base = frozen_param((C,), torch.float32, meta)
            self.hc_head_scale = frozen_param((1,), torch.float32, meta)
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank, meta)
            if confidence_head:
                self.confidence_head = ConfidenceHead(D, cfg.dspark_markov_rank, meta)
        self.to_empty(device=device)
        self.attn.rope = Rope.for_layer(cfg, layer_id, device)  # to_empty left the table uninitialised
        stray = [n for n, _ in self.named_buffers() if n != "attn.rope.inv_freq"]
        assert not stray, f"buffers {stray} would be uninitialised after to_empty"

    def draft_attention(self, x: torch.Tensor, ring: torch.Tensor, n_ctx: int, pos: torch.Tensor) -> torch.Tensor:
        """DSparkAttention (docs/model.md §9.4): x [B, D] (normed sublayer input) at block positions pos [B].

        Keys = [ring [W, Dh] | the block's own kv [B, Dh]]; every slot attends the first
        `n_ctx` ring slots (positions max(0, p-W+1)..p) and the whole block (non-causal).
        Returns [B, D] after the output projection and the first all-reduce.
        """
        attn, B, W = self.attn, x.shape[0], ring.shape[0]
        q, _ = attn.project_q(x, pos)  # [B, H, Dh]
        keys = torch.cat((ring, attn.project_kv(x, pos)))  # [W + B, Dh]
        idx = torch.cat((torch.arange(n_ctx, device=x.device), W + torch.arange(B, device=x.device)))
        o = sparse_attn(q, keys, attn.attn_sink, idx.expand(B, -1), attn.softmax_scale)  # [B, H, Dh]
        return self.reduce(attn.project_out(o, pos))


@dataclass
class DraftState:
    """One sequence's rings: rings[s] [W, Dh] (position q in slot q % W), and
    last_position, the last committed position written (-1: nothing yet)."""

    rings: list[torch.Tensor]
    last_position: int = -1

    def reset(self) -> None:
        for ring in self.rings:
            ring.zero_()
        self.last_position = -1

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rings)


@dataclass(frozen=True)
class DraftOutput:
    """tokens: n drafted ids (positions p+2..p+n+1; n = B, or fewer from `draft` near
    max_seq_len, see `draft_length`); logits [n, V] fp32 with the Markov bias; confidence [n]
    fp32 raw logits (None without a confidence head); hidden [n, D] the pre-norm hc_head output."""

    tokens: list[int]
    logits: torch.Tensor
    confidence: torch.Tensor | None
    hidden: torch.Tensor


class DSparkDraft(nn.Module):
    """The DSpark draft module (docs/model.md §9); see the module docstring for positions and rings.

    Args:
        dtype: linears, embedding and rings (torch.float32 or torch.bfloat16); norms, mHC
            parameters, attn_sink, gate, head, Markov and confidence heads stay fp32.
        quant_sim: fp8 activation simulation (docs/model.md §2.4); None -> cfg.quant_sim.
        deterministic_reduce: MoE combine order; None -> `Settings()`'s (ascending expert id).
        confidence_head: whether the module has (and its weights include) the confidence head.
        tp: this rank's `DraftTP` (default: TP=1).
    Raises:
        ValueError: dtype not float32/bfloat16, no DSpark stages, or a config the TP world
            size does not divide.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, quant_sim: bool | None = None,
                 deterministic_reduce: bool | None = None, confidence_head: bool = True,
                 tp: DraftTP | None = None, device: torch.device | str = "cpu"):
        super().__init__()
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype}: must be torch.float32 or torch.bfloat16")
        if cfg.n_mtp_layers < 1:
            raise ValueError(f"n_mtp_layers={cfg.n_mtp_layers}: the draft module needs >= 1 stage")
        self.cfg, self.dtype, self.tp = cfg, dtype, tp if tp is not None else DraftTP()
        self.quant_sim = cfg.quant_sim if quant_sim is None else bool(quant_sim)
        if deterministic_reduce is None:
            deterministic_reduce = Settings().moe_deterministic_reduce
        self.has_confidence_head = confidence_head
        local_cfg = self.tp.local_config(cfg)
        self.embed = Embedding(cfg.vocab_size, cfg.dim, dtype, device)
        self.mtp = nn.ModuleList(
            DSparkStage(cfg, local_cfg, s, dtype, self.quant_sim, bool(deterministic_reduce), self.tp,
                        confidence_head, device) for s in range(cfg.n_mtp_layers))
        self.head = Linear(cfg.dim, cfg.vocab_size, torch.float32, device)
        self._loaded = False

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy the FULL logical drafter weights (`drafter_params` names) into the module, sharded
        for this TP rank and cast to each parameter's dtype. Strict and atomic: every tensor is
        checked (type, floating dtype, finite values, over all ranks' tensors so the ranks of a
        TP group agree; then names and shapes) before the first copy, so a rejected call leaves
        the module exactly as it was (loaded or not).

        Raises:
            ValueError: naming every value that is not a torch floating-point tensor (an
                integer tensor would be cast silently, a numpy array fail mid-copy), every
                tensor holding NaN or Inf, and every missing, unexpected or mis-shaped tensor
                (a confidence head present in the weights but not in the module, or vice
                versa, is one).
        """
        if not isinstance(weights, Mapping):
            raise ValueError(f"load_weights: weights must be a mapping name -> tensor, got {type(weights).__name__}")
        problems = [weight_problem(n, t) for n, t in weights.items()]
        problems = [p for p in problems if p]
        if problems:
            raise ValueError("load_weights: " + listed(problems))
        local = self.tp.shard_weights(self.cfg, weights)
        own = self.state_dict(keep_vars=True)
        problems = [f"missing: {sorted(set(own) - set(local))}"] if set(own) - set(local) else []
        problems += [f"unexpected: {sorted(set(local) - set(own))}"] if set(local) - set(own) else []
        problems += [f"mis-shaped {n}: got {tuple(local[n].shape)}, expected {tuple(own[n].shape)}"
                     for n in sorted(set(own) & set(local)) if tuple(local[n].shape) != tuple(own[n].shape)]
        if problems:
            raise ValueError("load_weights: " + "; ".join(problems))
        with torch.no_grad():
            for n, t in own.items():
                t.copy_(local[n].to(device=t.device, dtype=t.dtype))
        self._loaded = True

    def share_embed_head(self, embed: Embedding, head: Linear) -> None:
        """In-process setups only: use the trunk's `embed` and `head` modules instead of own copies.

        Raises:
            ValueError: dtype/shape differ, or the values differ from the loaded ones (not the
                same checkpoint).
        """
        for name, mine, theirs in (("embed", self.embed, embed), ("head", self.head, head)):
            a, b = mine.weight, theirs.weight
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
                raise ValueError(f"{name}: the trunk's {tuple(b.shape)} {b.dtype} tensor differs from the "
                                 f"drafter's {tuple(a.shape)} {a.dtype}")
        self.embed, self.head = embed, head

    # ------------------------------------------------------------------ rings
    def new_state(self) -> DraftState:
        """Empty rings (zeros) for one sequence, on the module's device, in its dtype."""
        w = self.embed.weight
        return DraftState([torch.zeros(self.cfg.window_size, self.cfg.head_dim, dtype=w.dtype, device=w.device)
                           for _ in self.mtp])

    def main_features(self, rows: torch.Tensor) -> torch.Tensor:
        """main_norm(main_proj(rows)): rows [R, T*D] -> [R, D] in the model dtype (docs/model.md §9.3)."""
        stage0 = self.mtp[0]
        return stage0.main_norm(stage0.main_proj(rows))

    @torch.no_grad()
    def write_main_kv(self, state: DraftState, rows: torch.Tensor, positions: Sequence[int]) -> None:
        """Write committed rows [R, T*D] (fp32/bf16) of `positions` into every stage's ring (docs/model.md §9.6).

        positions: R consecutive ascending integer positions (a range, a list of ints or a 1-D
        integer tensor). The first write of a sequence must start at 0 or hold >= W rows
        (prefill priming: the prompt's last min(n, W) rows); later writes must continue the
        last committed position (start <= last + 1). A position already committed and still
        in the window must come with a row whose keys equal the ring's (the protocol only
        resends identical rows; a different row is a caller bug that would silently change
        the context of later drafts). The check costs no memory and no extra compute: the
        keys of a resent row are computed anyway and compared bitwise with the ring's, so a
        different row whose keys still come out bitwise equal (e.g. a difference rounded
        away by a bf16 module) is accepted as the no-op it is. Positions that end up outside
        the window are skipped unchecked (they can no longer reach a draft).

        Atomic: everything (rows, positions, the keys of every row to write) is checked
        before the first ring write; a rejected call leaves the state unchanged.
        Raises:
            ValueError: a state not from this module; bad type/shape/width/dtype or non-finite
                rows; non-integer, non-consecutive or out-of-range positions, R !=
                len(positions); a gap after the last committed position; a first write that
                leaves part of the window unknown; a row too large for main_norm (finite rows
                whose main_proj output overflows the norm's mean square would give zero or
                NaN keys) or with non-finite keys; a committed position rewritten with a
                different row (named).
            RuntimeError: weights not loaded.
        """
        self._require_loaded()
        self._check_state(state)
        pos = check_commit(self.cfg, state.last_position, rows, positions)
        rows = rows.to(self.embed.weight.device)
        old_last = state.last_position
        last = max(old_last, pos[-1])
        W = self.cfg.window_size
        todo = [(i, p) for i, p in enumerate(pos) if p > last - W]
        # Keys of every row to write, one row at a time (batch-size invariant), checked before any write.
        computed = [self._row_keys(rows[i:i + 1], p) for i, p in todo]
        finite = torch.stack([ok for _, ok in computed]) if computed else torch.ones(0, 1, dtype=torch.bool)
        if not bool(finite.all()):  # [n, 1 + stages]: one host sync for all rows
            j, s = (int(x) for x in (~finite).nonzero()[0])
            i, p = todo[j]
            if s == 0:  # rsqrt(inf) = 0 in main_norm: a finite but huge row would give zero (or NaN) keys
                raise ValueError(f"rows[{i}] (position {p}) is out of range: its main_proj output overflows "
                                 f"main_norm's mean square (|x| up to ~1e19 in fp32)")
            raise ValueError(f"rows[{i}] (position {p}) gives a non-finite key in stage {s - 1}")
        for (i, p), (keys, _) in zip(todo, computed):
            if p <= old_last:  # still in the window, so slot p % W holds position p
                changed = [s for s, (k, ring) in enumerate(zip(keys, state.rings))
                           if not torch.equal(k.to(ring.dtype), ring[p % W])]
                if changed:
                    raise ValueError(f"position {p} is already committed with a different row: rows[{i}] "
                                     f"would change stage {changed[0]}'s key (committed positions may only "
                                     f"be resent with identical rows)")
        for (i, p), (keys, _) in zip(todo, computed):
            if p > old_last:
                for ring, k in zip(state.rings, keys):
                    ring[p % W] = k
        state.last_position = last

    def _row_keys(self, row: torch.Tensor, p: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Keys [Dh] of one committed row [1, T*D] at position p, one per stage, and on-device flags
        [1 + stages]: main_norm's mean square is finite, then each stage's key is finite."""
        stage0 = self.mtp[0]
        proj = stage0.main_proj(row)  # [1, D]
        mx = stage0.main_norm(proj)
        at = torch.tensor([p], device=mx.device)
        keys = [stage.attn.project_kv(mx, at)[0] for stage in self.mtp]
        ok = [torch.isfinite(proj.float().square().mean())] + [torch.isfinite(k).all() for k in keys]
        return keys, torch.stack(ok)

    # ------------------------------------------------------------------ draft
    @torch.no_grad()
    def draft(self, state: DraftState, anchor: int, seed_position: int, choose: Chooser | None = None) -> DraftOutput:
        """Draft from `anchor` (the committed token at seed_position + 1): the drafts of positions
        p+2.. that lie before max_seq_len, min(B, max_seq_len - p - 2) of them (`draft_length`).

        anchor, seed_position: integers (int, numpy or torch integer; never bool or float,
        which would otherwise be truncated). choose: slot chooser of `head_forward` (None: argmax).
        Raises:
            ValueError: a state not from this module; a non-integer anchor or seed_position;
                anchor outside [0, vocab_size); nothing committed; seed_position not the last
                committed position (both named); no room for the anchor (seed_position + 1 >=
                max_seq_len).
            RuntimeError: weights not loaded.
        """
        self._require_loaded()
        self._check_state(state)
        anchor, p = check_draft_args(self.cfg, anchor, seed_position)
        check_seed(state.last_position, p)
        n = draft_length(self.cfg, p)
        out = self.draft_from_rings(state.rings, anchor, p, choose)
        conf = None if out.confidence is None else out.confidence[:n]
        return DraftOutput(out.tokens[:n], out.logits[:n], conf, out.hidden[:n])

    @torch.no_grad()
    def draft_from_rings(self, rings: list[torch.Tensor], anchor: int, seed_position: int,
                         choose: Chooser | None = None) -> DraftOutput:
        """The draft forward over given rings (docs/model.md §9.3), all B slots: rings[s] [W, Dh] must hold
        positions max(0, p-W+1)..p at slots q % W (not checked against any state). For probes
        that perturb one input at a time. Raises ValueError like `draft` (anchor, seed range,
        ring count/shape)."""
        self._require_loaded()
        self._check_rings(rings)
        cfg = self.cfg
        anchor, p = check_draft_args(cfg, anchor, seed_position)
        B = cfg.dspark_block_size
        draft_length(cfg, p)
        dev = self.embed.weight.device
        ids = torch.full((B,), cfg.dspark_noise_token_id, dtype=torch.int64, device=dev)  # [B]
        ids[0] = anchor
        pos = torch.arange(p + 1, p + 1 + B, device=dev)  # [B] block positions
        n_ctx = min(cfg.window_size, p + 1)
        h = self.embed(ids).unsqueeze(1).repeat(1, cfg.hc_mult, 1)  # (B, C, D)
        for stage, ring in zip(self.mtp, rings):
            h = stage.attn_residual(h, lambda x, st=stage, r=ring: st.draft_attention(x, r, n_ctx, pos))
            h = stage.ffn_residual(h, ids)
        return self.head_forward(h, ids[:1], choose)

    def head_forward(self, h: torch.Tensor, anchor: torch.Tensor, choose: Chooser | None = None) -> DraftOutput:
        """Last-stage head (docs/model.md §9.5): h [B, C, D], anchor [1] int64 -> DraftOutput.

        Sequential Markov loop on device (no host sync until the end): the bias of slot j is
        markov_w2(markov_w1[prev]) with prev the previous slot's draft (the anchor for slot 0).
        choose(j, logits_j [V] fp32 with the bias) -> [1] int64 picks slot j's draft; None is
        the argmax. It must run inside the loop: slot j's pick is slot j+1's Markov input.
        """
        cfg, last = self.cfg, self.mtp[-1]
        y = hc_head(h, last.hc_head_fn, last.hc_head_scale, last.hc_head_base, cfg.norm_eps, cfg.hc_eps)  # [B, D]
        logits = self.head(last.norm(y).float())  # [B, V] fp32
        prev, drafted, emb = anchor, [], []
        for j in range(h.shape[0]):
            e = last.markov_head.markov_w1(prev)  # [1, Rm] embedding of the previous token
            logits[j] += last.markov_head.markov_w2(e)[0]
            prev = logits[j].argmax().reshape(1) if choose is None else choose(j, logits[j])
            drafted.append(prev)
            emb.append(e)
        conf = None
        if self.has_confidence_head:
            conf = last.confidence_head.proj(torch.cat((y.float(), torch.cat(emb)), dim=-1))[:, 0]  # [B]
        return DraftOutput(torch.cat(drafted).tolist(), logits, conf, y)

    def _require_loaded(self) -> None:
        if not self._loaded:
            raise RuntimeError("DSparkDraft weights are not loaded: call load_weights first")

    def _check_state(self, state: DraftState) -> None:
        if not isinstance(state, DraftState):
            raise ValueError(f"state must be a DraftState, got {type(state).__name__}: use module.new_state()")
        self._check_rings(state.rings)

    def _check_rings(self, rings: Sequence[torch.Tensor]) -> None:
        """One [W, Dh] ring per stage in the module's dtype and device (`new_state`'s), or ValueError."""
        w, n = self.embed.weight, len(self.mtp)
        shape = (self.cfg.window_size, self.cfg.head_dim)
        if not isinstance(rings, (list, tuple)) or len(rings) != n:
            got = len(rings) if isinstance(rings, (list, tuple)) else type(rings).__name__
            raise ValueError(f"state has {got} rings, the module {n} stages: use module.new_state()")
        for s, r in enumerate(rings):
            if not torch.is_tensor(r) or tuple(r.shape) != shape or r.dtype != w.dtype or r.device != w.device:
                got = f"{tuple(r.shape)} {r.dtype} on {r.device}" if torch.is_tensor(r) else type(r).__name__
                raise ValueError(f"rings[{s}] is {got}, the module needs {shape} (window_size, head_dim) "
                                 f"{w.dtype} on {w.device}: use module.new_state()")


def load_draft_module(path, dtype: torch.dtype = torch.float32, tp: DraftTP | None = None,
                      device: torch.device | str = "cpu", deterministic_reduce: bool | None = None) -> DSparkDraft:
    """The drafter process's loader: read the drafter's consumer set (`mtp.*`, embed, head) of a
    checkpoint folder (`dsv4.checkpoint.load_drafter_weights`) into a `DSparkDraft`, with the
    confidence head iff the checkpoint has one; sharded for `tp`. `deterministic_reduce`: as
    `DSparkDraft`'s.

    Raises:
        ValueError: dtype not float32/bfloat16 (checked before reading anything), or a tensor
            with NaN or Inf (named, by the checkpoint reader or `DSparkDraft.load_weights`).
        CheckpointError: a drafter tensor missing, unexpected or mis-shaped.
    """
    from dsv4.checkpoint import load_drafter_weights

    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype}: must be torch.float32 or torch.bfloat16")
    cfg, weights, has_conf = load_drafter_weights(path)
    module = DSparkDraft(cfg, dtype=dtype, deterministic_reduce=deterministic_reduce, confidence_head=has_conf,
                         tp=tp, device=device)
    module.load_weights(weights)
    return module
