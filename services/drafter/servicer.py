"""Drafter gRPC servicer: a thin adapter from the wire to a `Drafter` engine.

It owns the message translation only: a commit's rows tensor and positions, a draft's
sampling parameters, tokens, confidences and (rejection rule) draft probabilities, the timings; with a step loop (`services.drafter.steps`) a call is
awaited from the loop's next step, batched with every other session's, else it runs on a
thread of its own; the session's life cycle is
`services.common.session_stream.serve_session` and every rule about rows, positions and
anchors is the engine's (`services.drafter.interface.Drafter`: the DSpark module or an oracle).
"""

from __future__ import annotations

import asyncio
import time

import torch

from opentelemetry.sdk.trace import TracerProvider

from dspark_proto.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from services.common.session_stream import SessionStreamServicer
from services.common.telemetry import message_span
from services.common.sampling_wire import params_from_proto
from services.common.device import to_pinned
from services.common.tensors import from_proto, to_proto
from services.drafter.interface import Drafter, SampledDraft, feed_tokens
from services.drafter.controls import DraftControls
from services.drafter.steps import DraftStepLoop, DraftStepStats


def identity_message(ident: dict, max_sessions: int, open_sessions: int,
                     steps: DraftStepStats | None = None) -> common_pb2.ModelIdentity:
    """The engine's identity dict (see `drafter_identity`) as a `ModelIdentity`, with the step
    loop's figures (`steps`; None: no loop, all 0)."""
    steps = DraftStepStats() if steps is None else steps
    return common_pb2.ModelIdentity(
        drafter_steps=steps.steps, drafter_batch_size_mean=steps.batch_mean,
        drafter_batch_size_max=steps.batch_max, drafter_step_ms_mean=steps.ms_mean,
        role="drafter", config_hash=ident["config_hash"], vocab_size=ident["vocab_size"],
        block_size=ident["block_size"], window_size=ident["window_size"],
        target_layer_ids=ident["target_layer_ids"], row_width=ident["row_width"], tp=ident["tp"],
        max_seq_len=ident["max_seq_len"], confidence_head=ident["confidence_head"],
        noise_token_id=ident["noise_token_id"], max_sessions=max_sessions, open_sessions=open_sessions,
        drafter_kind=ident["kind"])


class DrafterServicer(SessionStreamServicer, drafter_pb2_grpc.DrafterServicer):
    """Session: commit / draft messages in, one response each, in order.

    Args:
        engine: the drafter engine (thread-safe across sessions).
        provider: tracer provider for the per-message spans (None = no spans).
        metrics: a `services.common.metrics.DrafterMetrics` fed each answered call (None: none).
        steps: the step loop over `engine` that runs every commit and draft (None: one thread
            per call).
        vocab: the `GrammarVocab` a constrained session compiles against, a callable making it
            on first use, or None (the byte vocabulary of the model's vocab_size).
        mask_drafts: draft from the rows each session's grammar and logits controls leave
            (docs/structured.md, docs/sampling.md); False drafts blind, which only benchmarks
            want (acceptance with and without).
    """

    def __init__(self, engine: Drafter, provider: TracerProvider | None = None, metrics=None,
                 steps: DraftStepLoop | None = None, vocab=None, mask_drafts: bool = True):
        self.engine, self.provider, self.metrics, self.steps = engine, provider, metrics, steps
        ident = engine.identity()
        self.row_width = ident["row_width"]
        module = getattr(engine, "module", None)  # a DSpark module; the oracle drafter runs on the CPU
        self.device = module.embed.weight.device if module is not None else torch.device("cpu")
        cfg = getattr(engine, "cfg", None) or getattr(getattr(engine, "module", None), "cfg", None)
        eos = 1 if cfg is None else cfg.eos_token_id  # 1: the DeepSeek convention, for engines without a config
        self.controls = DraftControls(ident["vocab_size"], eos, vocab) if mask_drafts else None

    async def Info(self, request, context):
        return identity_message(self.engine.identity(), self.engine.max_sessions, self.engine.num_sessions,
                                None if self.steps is None else self.steps.stats())

    async def _handle(self, sid: int, request, received: float) -> drafter_pb2.DrafterResponse:
        op = request.WhichOneof("op")
        if op is None:
            raise ValueError("DrafterRequest has no operation: set commit or draft")
        with message_span(self.provider, f"drafter.{op}", request.trace) as span:
            t0 = time.perf_counter()
            if op == "commit":
                response, step_ms = await self._commit(sid, request.commit)
            else:
                response, step_ms = await self._draft(sid, request.draft)
                span.set_attribute("spec_decode.drafted", len(response.tokens))
            waited_ms = (time.perf_counter() - t0) * 1e3
            forward_ms = waited_ms if step_ms is None else step_ms  # in a loop: the step's own time
            response.timing.forward_ms = forward_ms
            response.timing.queue_ms = max(0.0, (t0 - received) * 1e3 + waited_ms - forward_ms)
            response.session_tag = request.session_tag  # the gateway checks the echo
            span.set_attribute("drafter.forward_ms", forward_ms)
            if self.metrics is not None:
                if op == "commit":
                    self.metrics.record_commit(forward_ms)
                else:
                    self.metrics.record_draft(len(response.tokens), forward_ms)
            return response

    async def _draft(self, sid: int, d: drafter_pb2.DraftRequest) -> tuple[drafter_pb2.DrafterResponse, float | None]:
        """The engine's draft in the step loop's next step, or on a thread of its own; returns
        (the response, the step's ms or None without a loop). Without `sampling` the draft is
        greedy; sampled, it is drawn at each position (`DrafterEngine.draft_sampled`), and
        under the rejection rule the reply carries q (float32 [n, V]).
        Raises ValueError for a bad sampling value (the field named) or a bad draft."""
        params = params_from_proto(d.sampling, field="draft.sampling")  # unset: all zero, greedy
        step_ms = None
        guide = None if self.controls is None else self.controls.guide(sid, d.anchor, d.seed_position)
        try:
            value, step_ms = await self._drafted(sid, d, params, guide)
        finally:
            if guide is not None:
                guide.end()
        sampled = isinstance(value, SampledDraft)
        tokens, conf = (value.tokens, value.confidence) if sampled else value
        response = drafter_pb2.DrafterResponse(tokens=tokens, confidence_logits=[] if conf is None else conf.tolist(),
                                               committed_through=d.seed_position)
        if sampled and params.rule == "rejection" and not params.greedy:  # the coupled rule never reads q
            response.draft_probs.CopyFrom(to_proto(value.probs, "float32"))
        return response, step_ms

    async def _drafted(self, sid: int, d, params, guide) -> tuple[object, float | None]:
        """(the engine's draft value, the step's ms or None) in the step loop or on a thread."""
        step_ms = None
        if self.steps is not None:
            reply = await asyncio.wrap_future(
                self.steps.submit_draft(sid, d.anchor, d.seed_position, None if params.greedy else params, guide))
            value, step_ms = reply.value, reply.step_ms
        elif guide is not None:
            value = await asyncio.to_thread(self.engine.draft_guided, sid, d.anchor, d.seed_position, params, guide)
        elif params.greedy:
            value = await asyncio.to_thread(self.engine.draft, sid, d.anchor, d.seed_position)
        else:
            value = await asyncio.to_thread(self.engine.draft_sampled, sid, d.anchor, d.seed_position, params)
        return value, step_ms

    async def _commit(self, sid: int, commit) -> tuple[drafter_pb2.DrafterResponse, float | None]:
        """A commit in the step loop's next step, or on a thread of its own; returns (the
        response, the step's ms or None without a loop)."""
        if self.steps is None:
            response = await asyncio.to_thread(self._commit_now, sid, commit)
            self._observe(sid, commit)
            return response, None
        rows, positions = self._commit_rows(commit)
        feed_tokens(self.engine, sid, commit.token_first_position, commit.token_ids)  # a no-op: DSpark only
        reply = await asyncio.wrap_future(self.steps.submit_commit(sid, rows, positions))
        self._observe(sid, commit)
        return drafter_pb2.DrafterResponse(committed_through=positions[-1]), reply.step_ms

    def _observe(self, sid: int, commit) -> None:
        """A commit that landed: the session's controls follow its tokens (a priming commit, the
        one with tokens from position 0, sets the session's constraint and logits controls or
        clears them)."""
        if self.controls is not None:
            self.controls.commit(sid, commit)

    def _commit_now(self, sid: int, commit) -> drafter_pb2.DrafterResponse:
        # The rows' wire shape is checked before the token ids are fed: an observing drafter
        # advances its state on them, so a commit rejected afterwards would leave it ahead.
        rows, positions = self._commit_rows(commit)
        feed_tokens(self.engine, sid, commit.token_first_position, commit.token_ids)
        self.engine.commit(sid, rows, positions)
        return drafter_pb2.DrafterResponse(committed_through=positions[-1])

    def _commit_rows(self, commit) -> tuple[torch.Tensor, range]:
        """A commit's rows [R, row_width] fp32 and positions first..first+R-1, wire-checked.
        Raises ValueError naming the shape, dtype or first position."""
        rows = from_proto(commit.rows, max_elements=1 << 26)  # a new CPU tensor
        if rows.ndim != 2 or rows.shape[1] != self.row_width:
            raise ValueError(f"commit rows have shape {list(rows.shape)}, expected [R, row_width={self.row_width}]")
        if not rows.is_floating_point():
            raise ValueError(f"commit rows have dtype {commit.rows.dtype!r}, expected bfloat16 or float32")
        first = commit.first_position
        if first < 0:
            raise ValueError(f"commit first_position={first}: must be >= 0")
        # pinned when the module is on a GPU: the rings' commit step copies it over in one DMA
        return to_pinned(rows.float(), self.device), range(first, first + rows.shape[0])
