"""Drafter gRPC servicer: a thin adapter from the wire to a `Drafter` engine.

It owns the message translation only: a commit's rows tensor and positions, a draft's
sampling parameters, tokens, confidences and (rejection rule) draft probabilities, the timings; the session's life cycle is
`services.common.session_stream.serve_session` and every rule about rows, positions and
anchors is the engine's (`services.drafter.interface.Drafter`: the DSpark module or an oracle).
"""

from __future__ import annotations

import asyncio
import time

from opentelemetry.sdk.trace import TracerProvider

from dspark_proto.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from services.common.session_stream import SessionStreamServicer
from services.common.telemetry import message_span
from services.common.sampling_wire import params_from_proto
from services.common.tensors import from_proto, to_proto
from services.drafter.interface import Drafter, feed_tokens


def identity_message(ident: dict, max_sessions: int, open_sessions: int) -> common_pb2.ModelIdentity:
    """The engine's identity dict (see `drafter_identity`) as a `ModelIdentity`."""
    return common_pb2.ModelIdentity(
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
    """

    def __init__(self, engine: Drafter, provider: TracerProvider | None = None, metrics=None):
        self.engine, self.provider, self.metrics = engine, provider, metrics
        ident = engine.identity()
        self.row_width = ident["row_width"]

    async def Info(self, request, context):
        return identity_message(self.engine.identity(), self.engine.max_sessions, self.engine.num_sessions)

    async def _handle(self, sid: int, request, received: float) -> drafter_pb2.DrafterResponse:
        op = request.WhichOneof("op")
        if op is None:
            raise ValueError("DrafterRequest has no operation: set commit or draft")
        with message_span(self.provider, f"drafter.{op}", request.trace) as span:
            t0 = time.perf_counter()
            if op == "commit":
                response = await asyncio.to_thread(self._commit, sid, request.commit)
            else:
                response = await asyncio.to_thread(self._draft, sid, request.draft)
                span.set_attribute("spec_decode.drafted", len(response.tokens))
            forward_ms = (time.perf_counter() - t0) * 1e3
            response.timing.forward_ms = forward_ms
            response.timing.queue_ms = max(0.0, (t0 - received) * 1e3)
            response.session_tag = request.session_tag  # the gateway checks the echo
            span.set_attribute("drafter.forward_ms", forward_ms)
            if self.metrics is not None:
                if op == "commit":
                    self.metrics.record_commit(forward_ms)
                else:
                    self.metrics.record_draft(len(response.tokens), forward_ms)
            return response

    def _draft(self, sid: int, d: drafter_pb2.DraftRequest) -> drafter_pb2.DrafterResponse:
        """A draft, greedy without `sampling`; under the rejection rule the reply carries q
        (float32 [n, V]). Raises ValueError for bad sampling values (the field named)."""
        params = params_from_proto(d.sampling, field="draft.sampling")  # unset: all zero, greedy
        probs = None
        if params.greedy:
            tokens, conf = self.engine.draft(sid, d.anchor, d.seed_position)
        else:
            out = self.engine.draft_sampled(sid, d.anchor, d.seed_position, params)
            tokens, conf, probs = out.tokens, out.confidence, out.probs
        response = drafter_pb2.DrafterResponse(tokens=tokens, confidence_logits=[] if conf is None else conf.tolist(),
                                               committed_through=d.seed_position)
        if probs is not None and params.rule == "rejection":  # the coupled rule never reads q
            response.draft_probs.CopyFrom(to_proto(probs, "float32"))
        return response

    def _commit(self, sid: int, commit) -> drafter_pb2.DrafterResponse:
        # The rows' wire shape is checked before the token ids are fed: an observing drafter
        # advances its state on them, so a commit rejected afterwards would leave it ahead.
        rows = from_proto(commit.rows, max_elements=1 << 26)
        if rows.ndim != 2 or rows.shape[1] != self.row_width:
            raise ValueError(f"commit rows have shape {list(rows.shape)}, expected [R, row_width={self.row_width}]")
        if not rows.is_floating_point():
            raise ValueError(f"commit rows have dtype {commit.rows.dtype!r}, expected bfloat16 or float32")
        first = commit.first_position
        if first < 0:
            raise ValueError(f"commit first_position={first}: must be >= 0")
        feed_tokens(self.engine, sid, commit.token_first_position, commit.token_ids)
        self.engine.commit(sid, rows.float(), range(first, first + rows.shape[0]))
        return drafter_pb2.DrafterResponse(committed_through=first + rows.shape[0] - 1)
