"""DSpark draft module: three mHC blocks that draft a block of tokens from one committed token
(docs/model.md §9). This module owns the draft math, the per-sequence rings (`DraftState`,
written by `write_main_kv`; their layout and the commit path are `dsv4.dspark_rings`'s,
re-exported here) and the checks that keep them in step with the trunk. It holds no
sessions (`services.drafter`), never decides which rows are committed (the caller sends only
accepted ones) and does not shard itself (`dsv4.dspark_tp`); its layers are `dsv4.dspark_stage`'s.

Dimension legend: B = dspark_block_size (block slots), N = sessions in one batched call,
R = committed rows in one write, T = len(dspark_target_layer_ids), D = dim, C = hc_mult,
H = heads (this TP rank's), Dh = head_dim, W = window_size, V = vocab, Rm =
dspark_markov_rank, k = n_activated_experts.

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

Batching (`draft_batch`, `write_main_kv_batch`): several sessions in one call. A batched
draft runs the dense ops once over all N*B block rows and the attention as one gather over
the N rings, each block seeing only its own ring and its own rows; it equals `draft` to
rounding (bitwise at N = 1). A batched write is exact: it computes every key one row at a
time as `write_main_kv` does, so rings never depend on what else was in the batch.

End of the sequence: `draft` returns only the drafts of positions < max_seq_len, i.e.
min(B, max_seq_len - p - 2) of them (0 when the anchor is the last position), and raises
when the anchor itself lies at or past max_seq_len (`draft_length`). The block is computed
in full either way, so the drafts it does return equal those of an unbounded sequence.

Head (docs/model.md §9.5). y = hc_head(h) of the last stage (pre-norm), base logits = head(norm(y))
for every slot, then strictly sequentially: logits[j] += markov_w2(markov_w1[prev]) with
prev the previous token (the anchor for slot 0), draft j = argmax (under sampling, a
`Chooser`'s pick: dsv4.sampling.DraftSampler draws it at its position). Confidence logits
(raw; sigmoid = acceptance probability) = proj([y_j ; markov_w1[prev_j]]).

Tensor parallelism: see `dsv4.dspark_tp` (heads and routed experts sharded, two bf16
all-reduces per stage). Parameter names equal `dsv4.inventory.drafter_params(cfg)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from dsv4.config import ModelConfig
from dsv4.draft_args import check_draft_args, check_seed, draft_length, listed, weight_problem
from dsv4.dspark_rings import DraftState, check_rings, check_state, new_rings, write_commits
from dsv4.dspark_stage import ConfidenceHead, DraftMoE, DSparkStage, MarkovHead
from dsv4.dspark_tp import DraftTP
from dsv4.host_sync import host_copy
from dsv4.layers import Embedding, Linear, copy_streamed
from dsv4.mhc import hc_head
from dsv4.settings import Settings
from dsv4.trunk import DTYPES

# Picks slot j's tokens inside the Markov loop: (j, logits [N, V] fp32 of slot j in each of the
# N blocks, Markov bias included) -> [N] int64. None everywhere below means the argmax.
Chooser = Callable[[int, torch.Tensor], torch.Tensor]

__all__ = ["Chooser", "ConfidenceHead", "DSparkDraft", "DSparkStage", "DraftMoE", "DraftOutput", "DraftState",
           "MarkovHead", "load_draft_module"]


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

    def load_streamed(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the full logical drafter weights one at a time as `items` yields them
        (`dsv4.checkpoint.stream_drafter_weights`), each sharded for this TP rank (other ranks'
        experts never copied): the device holds the module plus one decoded parameter. Each
        tensor gets `load_weights`' checks (at TP > 1 the finiteness check sees this rank's
        slice only). Not atomic: the module is unloaded from the call until the last tensor
        is in, and stays so on failure.

        Raises:
            ValueError: the first unexpected, repeated, mis-shaped or failing tensor, or the
                missing names.
        """
        self._loaded = False
        copy_streamed(self.state_dict(keep_vars=True), self._local(items), _stream_problem)
        self._loaded = True

    def _local(self, items: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """This rank's slice of each full tensor of `items` (none for another rank's expert)."""
        for name, t in items:
            if not torch.is_tensor(t):
                raise ValueError(f"load_streamed: {weight_problem(name, t)}")
            yield from self.tp.shard_weights(self.cfg, {name: t}).items()

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
        return new_rings(self.cfg, len(self.mtp), self.embed.weight)

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
        [error] = self.write_main_kv_batch([state], [rows], [positions])
        if error is not None:
            raise error

    @torch.no_grad()
    def write_main_kv_batch(self, states: Sequence[DraftState], rows: Sequence[torch.Tensor],
                            positions: Sequence[Sequence[int]]) -> list[ValueError | None]:
        """`write_main_kv` of N sessions' commits in one call: rows[i] [R_i, T*D] of positions[i]
        into states[i], each commit checked and applied on its own (atomic per session).

        Exact: every key is computed one row at a time exactly as `write_main_kv` computes it,
        so the rings end bitwise equal to N separate calls (a resent row is compared bitwise
        with the ring, so its keys must not depend on which commits share the call). What the
        batch saves is the per-call overhead and all but one host sync of the finiteness checks.
        Returns one entry per commit: None when it was written, else the ValueError
        `write_main_kv` would raise (that session's state is unchanged; the others land).
        Raises:
            ValueError: the three sequences of different lengths, or one state twice (a
                session commits at most once per batch); nothing is written then.
            RuntimeError: weights not loaded.
        """
        self._require_loaded()
        return write_commits(self.cfg, self.mtp, self.embed.weight, states, rows, positions)

    # ------------------------------------------------------------------ draft
    @torch.no_grad()
    def draft(self, state: DraftState, anchor: int, seed_position: int, choose: Chooser | None = None) -> DraftOutput:
        """Draft from `anchor` (the committed token at seed_position + 1): the drafts of positions
        p+2.. that lie before max_seq_len, min(B, max_seq_len - p - 2) of them (`draft_length`).

        anchor, seed_position: integers (int, numpy or torch integer; never bool or float,
        which would otherwise be truncated). The same computation as `draft_batch` of one
        session, so the two are bitwise equal. choose: the slot chooser (None: argmax).
        Raises:
            ValueError: a state not from this module; a non-integer anchor or seed_position;
                anchor outside [0, vocab_size); nothing committed; seed_position not the last
                committed position (both named); no room for the anchor (seed_position + 1 >=
                max_seq_len).
            RuntimeError: weights not loaded.
        """
        self._require_loaded()
        anchor, p, n = self.check_draft(state, anchor, seed_position)
        return _cut(self._draft_rows([state.rings], [anchor], [p], choose)[0], n)

    @torch.no_grad()
    def draft_batch(self, states: Sequence[DraftState], anchors: Sequence[int], seed_positions: Sequence[int],
                    choosers: Sequence[Chooser | None] | None = None) -> list[DraftOutput]:
        """`draft` for N sessions in one forward: states[i] drafts from anchors[i] at seed_positions[i].

        Dense ops (projections, norms, mHC, MoE, head) run once over all N*B block rows;
        attention is one gather over the N rings stacked, each block seeing only its own
        ring's live slots and its own B rows. Numerics: N = 1 is `draft` bitwise. For N > 1
        the rows of a block are computed in a larger matmul, so logits, confidences and
        hidden states agree with `draft` to rounding (fp32 ~1e-6 relative, bf16 ~1e-2), not
        bitwise; a drafted token can differ only where two logits tie within that rounding.
        Rings are read, never written. Returns one DraftOutput per session, in order, each
        cut to that session's `draft_length`; [] for N = 0. choosers: one slot chooser per
        session, each called with its own block's logits [1, V] (None: all argmax).
        Raises:
            ValueError: the three sequences of different lengths, or any session's argument
                as `draft` raises it, prefixed "session i:"; nothing is computed then.
            RuntimeError: weights not loaded.
        """
        self._require_loaded()
        if not len(states) == len(anchors) == len(seed_positions):
            raise ValueError(f"draft_batch: {len(states)} states, {len(anchors)} anchors and "
                             f"{len(seed_positions)} seed positions: need one of each per session")
        if choosers is not None and len(choosers) != len(states):
            raise ValueError(f"draft_batch: {len(choosers)} choosers for {len(states)} sessions")
        checked = []
        for i, (state, anchor, seed) in enumerate(zip(states, anchors, seed_positions)):
            try:
                checked.append(self.check_draft(state, anchor, seed))
            except ValueError as exc:
                raise ValueError(f"session {i}: {exc}") from None
        if not checked:
            return []
        choose = None if choosers is None or all(c is None for c in choosers) else _per_block(list(choosers))
        outs = self._draft_rows([s.rings for s in states], [a for a, _, _ in checked], [p for _, p, _ in checked],
                                choose)
        return [_cut(out, n) for out, (_, _, n) in zip(outs, checked)]

    def check_draft(self, state: DraftState, anchor: int, seed_position: int) -> tuple[int, int, int]:
        """Validate one draft's arguments against its state; returns (anchor, seed_position,
        draft_length) as ints. Computes nothing. Raises ValueError as `draft` does."""
        self._check_state(state)
        anchor, p = check_draft_args(self.cfg, anchor, seed_position)
        check_seed(state.last_position, p)
        return anchor, p, draft_length(self.cfg, p)

    @torch.no_grad()
    def draft_from_rings(self, rings: list[torch.Tensor], anchor: int, seed_position: int,
                         choose: Chooser | None = None) -> DraftOutput:
        """The draft forward over given rings (docs/model.md §9.3), all B slots: rings[s] [W, Dh] must hold
        positions max(0, p-W+1)..p at slots q % W (not checked against any state). For probes
        that perturb one input at a time. Raises ValueError like `draft` (anchor, seed range,
        ring count/shape)."""
        self._require_loaded()
        self._check_rings(rings)
        anchor, p = check_draft_args(self.cfg, anchor, seed_position)
        draft_length(self.cfg, p)
        return self._draft_rows([rings], [anchor], [p], choose)[0]

    def _draft_rows(self, rings: list[Sequence[torch.Tensor]], anchors: list[int], seeds: list[int],
                    choose: Chooser | None = None) -> list[DraftOutput]:
        """The forward of N checked blocks, all B slots each: rings[n][s] [W, Dh], anchors and
        seeds N ints. Row n*B + j of every dense op is slot j of block n."""
        cfg, dev = self.cfg, self.embed.weight.device
        N, B, W = len(anchors), cfg.dspark_block_size, cfg.window_size
        ids = torch.full((N, B), cfg.dspark_noise_token_id, dtype=torch.int64, device=dev)  # [N, B]
        ids[:, 0] = torch.tensor(anchors, device=dev)
        ids = ids.flatten()  # [N*B]
        seed = torch.tensor(seeds, device=dev)
        pos = (seed[:, None] + 1 + torch.arange(B, device=dev)).flatten()  # [N*B] block positions p+1..p+B
        n_ctx = [min(W, p + 1) for p in seeds]
        K = max(n_ctx) + B  # blocks with a shorter window pad their list with masked (-1) columns
        idx = torch.full((N, K), -1, dtype=torch.int64, device=dev)  # [N, K] into [N rings | N*B own rows]
        for n, c in enumerate(n_ctx):
            idx[n, :c] = n * W + torch.arange(c, device=dev)
            idx[n, c:c + B] = N * W + n * B + torch.arange(B, device=dev)
        h = self.embed(ids).unsqueeze(1).repeat(1, cfg.hc_mult, 1)  # [N*B, C, D]
        for s, stage in enumerate(self.mtp):
            ctx = torch.cat([r[s] for r in rings])  # [N*W, Dh]
            h = stage.attn_residual(h, lambda x, st=stage, c=ctx: st.draft_attention_batch(x, c, idx, pos))
            h = stage.ffn_residual(h, ids)
        return self.head_forward_batch(h, ids[::B], choose)

    def head_forward(self, h: torch.Tensor, anchor: torch.Tensor, choose: Chooser | None = None) -> DraftOutput:
        """Last-stage head (docs/model.md §9.5) of one block: h [B, C, D], anchor [1] int64 ->
        DraftOutput of B slots (`head_forward_batch` with N = 1)."""
        return self.head_forward_batch(h, anchor, choose)[0]

    def head_forward_batch(self, h: torch.Tensor, anchors: torch.Tensor,
                           choose: Chooser | None = None) -> list[DraftOutput]:
        """Last-stage head (docs/model.md §9.5) of N blocks: h [N*B, C, D], anchors [N] int64 ->
        N DraftOutputs of B slots each.

        Sequential Markov loop over the B slots, all blocks at once, on device (one host sync
        at the end): the bias of slot j is markov_w2(markov_w1[prev]) with prev the previous
        slot's draft (the anchor for slot 0). `choose` picks slot j's tokens (None: argmax); it
        must run inside the loop, since slot j's pick is slot j+1's Markov input.
        """
        cfg, last = self.cfg, self.mtp[-1]
        N = anchors.shape[0]
        y = hc_head(h, last.hc_head_fn, last.hc_head_scale, last.hc_head_base, cfg.norm_eps, cfg.hc_eps)  # [N*B, D]
        logits = self.head(last.norm(y).float()).unflatten(0, (N, -1))  # [N, B, V] fp32
        prev, drafted, emb = anchors, [], []
        for j in range(logits.shape[1]):
            e = last.markov_head.markov_w1(prev)  # [N, Rm] embedding of the previous token
            logits[:, j] += last.markov_head.markov_w2(e)
            prev = logits[:, j].argmax(-1) if choose is None else choose(j, logits[:, j])  # [N]
            drafted.append(prev)
            emb.append(e)
        conf = None
        if self.has_confidence_head:
            feats = torch.cat((y.float(), torch.stack(emb, 1).flatten(0, 1)), dim=-1)  # [N*B, D + Rm]
            conf = last.confidence_head.proj(feats)[:, 0].unflatten(0, (N, -1))  # [N, B]
        with host_copy():  # [N][B]: the step's one crossing to the host
            tokens = torch.stack(drafted, 1).tolist()
        ys = y.unflatten(0, (N, -1))
        return [DraftOutput(tokens[n], logits[n], None if conf is None else conf[n], ys[n]) for n in range(N)]

    def _require_loaded(self) -> None:
        if not self._loaded:
            raise RuntimeError("DSparkDraft weights are not loaded: call load_weights first")

    def _check_state(self, state: DraftState) -> None:
        check_state(self.cfg, state, len(self.mtp), self.embed.weight)

    def _check_rings(self, rings: Sequence[torch.Tensor]) -> None:
        """One [W, Dh] ring per stage in the module's dtype and device (`new_state`'s), or ValueError."""
        check_rings(self.cfg, rings, len(self.mtp), self.embed.weight)

def _per_block(choosers: list[Chooser | None]) -> Chooser:
    """One chooser over N blocks from each block's own (None: argmax), each given its row [1, V]."""
    def choose(j: int, logits: torch.Tensor) -> torch.Tensor:
        return torch.cat([logits[n:n + 1].argmax(-1) if c is None else c(j, logits[n:n + 1]).reshape(1)
                          for n, c in enumerate(choosers)])
    return choose


def _cut(out: DraftOutput, n: int) -> DraftOutput:
    """`out` restricted to its first n slots (the drafts before max_seq_len)."""
    conf = None if out.confidence is None else out.confidence[:n]
    return DraftOutput(out.tokens[:n], out.logits[:n], conf, out.hidden[:n])


def _stream_problem(name: str, t: torch.Tensor, own: torch.Tensor) -> str | None:
    """`DSparkDraft.load_weights`' checks of one streamed tensor (None: loadable)."""
    why = weight_problem(name, t)
    if not why and tuple(t.shape) != tuple(own.shape):
        why = f"mis-shaped {name}: got {tuple(t.shape)}, expected {tuple(own.shape)}"
    return why or None


def load_draft_module(path, dtype: torch.dtype = torch.float32, tp: DraftTP | None = None,
                      device: torch.device | str = "cpu", deterministic_reduce: bool | None = None,
                      decode_dtype: torch.dtype = torch.float32) -> DSparkDraft:
    """The drafter process's loader: read the drafter's consumer set (`mtp.*`, embed, head) of a
    checkpoint folder (`dsv4.checkpoint.load_drafter_weights`) straight onto `device` into a
    `DSparkDraft`, with the confidence head iff the checkpoint has one; sharded for `tp`.
    `deterministic_reduce`: as `DSparkDraft`'s; decode_dtype: what fp8 / fp4 tensors decode
    to before the module's cast (fp32 or bf16).

    Raises:
        ValueError: dtype not float32/bfloat16 (checked before reading anything), or a tensor
            with NaN or Inf (named, by the checkpoint reader or `DSparkDraft.load_weights`).
        CheckpointError: a drafter tensor missing, unexpected or mis-shaped.
    """
    from dsv4.checkpoint import stream_drafter_weights

    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype}: must be torch.float32 or torch.bfloat16")
    cfg, weights, has_conf = stream_drafter_weights(path, dtype=decode_dtype, device=device)
    module = DSparkDraft(cfg, dtype=dtype, deterministic_reduce=deterministic_reduce, confidence_head=has_conf,
                         tp=tp, device=device)
    module.load_streamed(weights)  # one decoded tensor at a time: never the module twice
    return module
