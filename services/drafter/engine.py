"""Drafter engine: per-generation DSpark rings, commit of the verifier's rows, draft, identity.

Owns one set of DSpark rings per generation and the commit and draft calls on them, plus the
identity the gateway checks against the verifier's; the rules for rows, positions and anchors
are `dsv4.draft_args`', and it never verifies, gates or touches gRPC.

Dimension legend: R = committed rows in one call, T = len(dspark_target_layer_ids), D = dim,
B = dspark_block_size.

Protocol (docs/architecture.md §3, docs/model.md §9.7). After the verifier's prefill of
x[0..n-1] the gateway commits the prompt's last min(n, W) tap rows (positions n-min(n,W)..n-1) and drafts with
the first anchor x[n] and seed position n-1. After each verify that accepted a drafts it
commits the rows of positions n..n+a (never rejected ones) and drafts from the bonus token
with seed position n+a. Plain decode steps commit their one row the same way.

At TP > 1 every rank holds its own engine over its `DSparkDraft` shard and must receive the
same calls in the same order (the module's all-reduces are collective); the driver that
fans calls out from rank 0 belongs to the service.
"""

from __future__ import annotations

from typing import ContextManager, Sequence

import torch

from services.common.sessions import (SessionHost, SessionLimitError, SessionTable,  # noqa: F401 (re-exported)
                                      UnknownSessionError)
from services.drafter.interface import Drafter, SampledDraft

from dsv4.config import ModelConfig
from dsv4.dspark import DraftState, DSparkDraft
from dsv4.sampling import DraftSampler, SamplingParams


def drafter_identity(cfg: ModelConfig, confidence_head: bool, tp: int, kind: str) -> dict:
    """What the gateway compares with the verifier's identity before pairing them (docs/architecture.md §6).

    Keys: kind ("dspark" | "oracle"), config_hash, vocab_size, block_size, window_size,
    target_layer_ids, row_width (= T*D, the width of a committed row), dim, max_seq_len,
    noise_token_id, confidence_head (bool), tp (world size).
    """
    return {
        "kind": kind,
        "config_hash": cfg.config_hash(),
        "vocab_size": cfg.vocab_size,
        "block_size": cfg.dspark_block_size,
        "window_size": cfg.window_size,
        "target_layer_ids": list(cfg.dspark_target_layer_ids),
        "row_width": cfg.tap_width,
        "dim": cfg.dim,
        "max_seq_len": cfg.max_seq_len,
        "noise_token_id": cfg.dspark_noise_token_id,
        "confidence_head": bool(confidence_head),
        "tp": tp,
    }


class DrafterEngine(SessionHost[DraftState], Drafter):
    """Sessions over one loaded `DSparkDraft` (this rank's shard at TP > 1).

    Args:
        module: a loaded `DSparkDraft`.
        max_sessions: open sessions allowed at once (an integer >= 1).
    Raises:
        ValueError: max_sessions not an integer >= 1.
    Thread safety: calls on different sessions may run concurrently; calls on one session
    are serialised by its lock. `services.drafter.steps.DraftStepLoop` batches the calls of
    many sessions into one module call per step.
    """

    def __init__(self, module: DSparkDraft, max_sessions: int = 16):
        self.module, self.cfg = module, module.cfg
        self._table: SessionTable[DraftState] = SessionTable(max_sessions)

    def identity(self) -> dict:
        """See `drafter_identity`; `confidence_head` says whether the module has one."""
        return drafter_identity(self.cfg, self.module.has_confidence_head, self.module.tp.world_size, "dspark")

    # ------------------------------------------------------------------ sessions
    def open_session(self) -> int:
        """Open a session with empty rings; returns its id. Raises SessionLimitError when full."""
        return self._table.open(self.module.new_state())

    def last_position(self, sid: int) -> int:
        """The session's last committed position (-1 before the first commit)."""
        return self._table.get(sid).last_position

    def session_bytes(self, sid: int) -> int:
        """Bytes of ring state held by session `sid`."""
        return self._table.get(sid).nbytes

    def session_state(self, sid: int) -> DraftState:
        """The session's rings (diagnostics and tests; do not modify)."""
        return self._table.get(sid)

    def hold(self, sid: int) -> ContextManager[DraftState]:
        """Hold session `sid`'s lock for a `with` body and yield its rings: how the step loop
        (`services.drafter.steps`) runs several sessions' calls in one batched call.

        Raises:
            UnknownSessionError: `sid` not open.
        """
        return self._table.locked(sid)

    # ------------------------------------------------------------------ commit / draft
    def commit(self, sid: int, rows: torch.Tensor, positions: Sequence[int]) -> None:
        """Write committed tap rows [R, T*D] (fp32 or bf16) of `positions` into the session's rings.

        See `DSparkDraft.write_main_kv` for the position rules (prefill priming, continuation,
        rewrites only with identical rows). Atomic: a rejected commit leaves the session as it was.
        Raises:
            ValueError: bad rows or positions (named), a gap after the last committed position,
                a committed position resent with a different row.
            UnknownSessionError: `sid` not open.
        """
        with self._table.locked(sid) as state:
            self.module.write_main_kv(state, rows, positions)

    def draft(self, sid: int, anchor: int, seed_position: int) -> tuple[list[int], torch.Tensor | None]:
        """Draft after `anchor` (the committed token at seed_position + 1).

        Returns (tokens for positions seed_position+2 .. up to seed_position+block_size+1,
        confidence logits [n] fp32 on CPU, or None when the module has no confidence head).
        n = block_size, or fewer near the end: only positions < max_seq_len are drafted
        (`dsv4.draft_args.draft_length`).
        Raises:
            ValueError: anchor or seed_position not an integer (bool and float included: never
                truncated), anchor out of range, nothing committed, seed_position not the last
                committed position (both named), no room for the anchor.
            UnknownSessionError: `sid` not open.
        """
        with self._table.locked(sid) as state:
            out = self.module.draft(state, anchor, seed_position)
        conf = None if out.confidence is None else out.confidence.detach().float().cpu()
        return out.tokens, conf

    def draft_sampled(self, sid: int, anchor: int, seed_position: int, params: SamplingParams) -> SampledDraft:
        """Probabilistic drafting: each slot's token is drawn, inside the Markov loop, from the
        draft's own distribution at that position (its logits after the Markov bias, then the
        request's temperature and filters) by `dsv4.sampling.DraftSampler`; greedy params give
        `draft`'s tokens. Returns the n tokens, confidences as `draft` (the confidence head
        still reads the chosen token's Markov embedding) and q [n, V] fp32 on CPU.

        Raises:
            ValueError, UnknownSessionError: as `draft`.
        """
        return self.draft_guided(sid, anchor, seed_position, params, None)

    def draft_guided(self, sid: int, anchor: int, seed_position: int, params: SamplingParams,
                     guide) -> SampledDraft:
        """`draft_sampled` inside a grammar: `guide` (`services.drafter.controls.DraftGuide`, or
        None) masks each slot's logits, after the Markov bias, before the slot is drawn; q is
        then the masked distribution. Raises: as `draft`."""
        sampler = DraftSampler(params, seed_position)
        with self._table.locked(sid) as state:
            out = self.module.draft(state, anchor, seed_position, sampler if guide is None else guide.wrap(sampler))
        conf = None if out.confidence is None else out.confidence.detach().float().cpu()
        return SampledDraft(out.tokens, conf, sampler.probs()[:len(out.tokens)])
