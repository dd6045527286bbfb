"""Drafter gRPC servicer: a thin layer over a drafter engine (one engine session per stream).

The engine is a `DrafterEngine` (the DSpark module) or the oracle drafter service; both have
`open_session`, `close_session`, `commit`, `draft`, `identity`; an engine that also has
`observe_tokens(sid, first_position, token_ids)` receives the committed token ids.
"""

from __future__ import annotations

import asyncio
import time

from opentelemetry.sdk.trace import TracerProvider

from dspark_proto.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from services.common.errors import message_for, status_for
from services.common.telemetry import message_span
from services.common.tensors import from_proto


def identity_message(ident: dict, max_sessions: int, open_sessions: int) -> common_pb2.ModelIdentity:
    """The engine's identity dict (see `drafter_identity`) as a `ModelIdentity`."""
    return common_pb2.ModelIdentity(
        role="drafter", config_hash=ident["config_hash"], vocab_size=ident["vocab_size"],
        block_size=ident["block_size"], window_size=ident["window_size"],
        target_layer_ids=ident["target_layer_ids"], row_width=ident["row_width"], tp=ident["tp"],
        max_seq_len=ident["max_seq_len"], confidence_head=ident["confidence_head"],
        noise_token_id=ident["noise_token_id"], max_sessions=max_sessions, open_sessions=open_sessions,
        drafter_kind=ident["kind"])


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    """Session: commit / draft messages in, one response each, in order."""

    def __init__(self, engine, provider: TracerProvider | None = None):
        self.engine, self.provider = engine, provider
        ident = engine.identity()
        self.row_width = ident["row_width"]

    async def Info(self, request, context):
        return identity_message(self.engine.identity(), self.engine.max_sessions, self.engine.num_sessions)

    async def Session(self, request_iterator, context):
        try:
            sid = self.engine.open_session()
        except Exception as exc:  # the session limit
            await context.abort(status_for(exc), message_for(exc))
        try:
            async for request in request_iterator:
                received = time.perf_counter()
                try:
                    response = await self._handle(sid, request, received)
                except (ValueError, TypeError) as exc:
                    await context.abort(status_for(exc), message_for(exc))
                yield response
        finally:
            self.engine.close_session(sid)

    async def _handle(self, sid: int, request, received: float) -> drafter_pb2.DrafterResponse:
        op = request.WhichOneof("op")
        if op is None:
            raise ValueError("DrafterRequest has no operation: set commit or draft")
        with message_span(self.provider, f"drafter.{op}", request.trace) as span:
            t0 = time.perf_counter()
            if op == "commit":
                response = await asyncio.to_thread(self._commit, sid, request.commit)
            else:
                d = request.draft
                tokens, conf = await asyncio.to_thread(self.engine.draft, sid, d.anchor, d.seed_position)
                response = drafter_pb2.DrafterResponse(
                    tokens=tokens, confidence_logits=[] if conf is None else conf.tolist(),
                    committed_through=d.seed_position)
                span.set_attribute("spec_decode.drafted", len(tokens))
            forward_ms = (time.perf_counter() - t0) * 1e3
            response.timing.forward_ms = forward_ms
            response.timing.queue_ms = max(0.0, (t0 - received) * 1e3)
            response.session_tag = request.session_tag  # the gateway checks the echo
            span.set_attribute("drafter.forward_ms", forward_ms)
            return response

    def _commit(self, sid: int, commit) -> drafter_pb2.DrafterResponse:
        rows = from_proto(commit.rows, max_elements=1 << 26)
        if rows.ndim != 2 or rows.shape[1] != self.row_width:
            raise ValueError(f"commit rows have shape {list(rows.shape)}, expected [R, row_width={self.row_width}]")
        if not rows.is_floating_point():
            raise ValueError(f"commit rows have dtype {commit.rows.dtype!r}, expected bfloat16 or float32")
        first = commit.first_position
        if first < 0:
            raise ValueError(f"commit first_position={first}: must be >= 0")
        observe = getattr(self.engine, "observe_tokens", None)
        if observe is not None and commit.token_ids:
            observe(sid, commit.token_first_position, list(commit.token_ids))
        self.engine.commit(sid, rows.float(), range(first, first + rows.shape[0]))
        return drafter_pb2.DrafterResponse(committed_through=first + rows.shape[0] - 1)
