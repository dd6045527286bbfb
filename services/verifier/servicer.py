"""Verifier gRPC servicer: a thin layer over `VerifierEngine` (one engine session per stream)."""

from __future__ import annotations

import asyncio
import collections
import time

import grpc
import torch
from opentelemetry.sdk.trace import TracerProvider

from dspark_proto.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from services.common.errors import message_for, status_for
from services.common.telemetry import message_span
from services.common.tensors import to_proto
from services.verifier.engine import VerifierEngine

_MODES = {verifier_pb2.VERIFY_MODE_SEQUENTIAL: "sequential", verifier_pb2.VERIFY_MODE_BATCHED: "batched"}


def verifier_identity(engine: VerifierEngine, tp: int = 1) -> common_pb2.ModelIdentity:
    """The model identity the gateway checks against the drafter's (DESIGN.md §6)."""
    cfg = engine.cfg
    return common_pb2.ModelIdentity(
        role="verifier", config_hash=cfg.config_hash(), vocab_size=cfg.vocab_size,
        block_size=cfg.dspark_block_size, window_size=cfg.window_size,
        target_layer_ids=list(cfg.dspark_target_layer_ids), row_width=cfg.tap_width, tp=tp,
        max_seq_len=cfg.max_seq_len, noise_token_id=cfg.dspark_noise_token_id,
        eos_token_id=cfg.eos_token_id, max_sessions=engine.max_sessions, open_sessions=engine.num_sessions)


class CommittedRows:
    """The last `window` committed tap rows of one session, kept (as bfloat16, the wire dtype,
    so a resend is bit-identical to the first send) to prime a new drafter replica after the
    session's drafter failed. Memory: window * row_width * 2 bytes per session."""

    def __init__(self, window: int):
        self._rows: collections.deque[torch.Tensor] = collections.deque(maxlen=window)
        self.next_position = 0  # position after the last kept row
        self.next_token, self.margin = 0, 0.0

    def add(self, rows: torch.Tensor, positions: range, next_token: int, margin: float) -> None:
        """Keep the rows of `positions` (consecutive, continuing the kept ones) and the new anchor."""
        self._rows.extend(rows.detach().to("cpu", torch.bfloat16).unbind(0))
        self.next_position = positions.stop
        self.next_token, self.margin = next_token, margin

    def last(self, count: int) -> tuple[torch.Tensor, int]:
        """The last min(count, kept) rows (count 0: all kept) as [R, row_width] and the position of rows[0].

        Raises:
            ValueError: count < 0, or nothing committed yet (both named).
        """
        if count < 0:
            raise ValueError(f"rows count={count}: must be >= 0 (0 = every kept row)")
        if not self._rows:
            raise ValueError("rows: the session has no committed positions yet: prefill first")
        n = len(self._rows) if count == 0 else min(count, len(self._rows))
        return torch.stack(list(self._rows)[-n:]), self.next_position - n


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    """Session: prefill / decode / verify messages in, one response each, in order.

    Args:
        engine: the verifier engine (thread-safe across sessions).
        default_mode: verify mode used when a request leaves it unspecified.
        provider: tracer provider for the per-message spans (None = no spans).
        tp: tensor-parallel world size reported in Info.
    """

    def __init__(self, engine: VerifierEngine, default_mode: str = "batched",
                 provider: TracerProvider | None = None, tp: int = 1):
        self.engine, self.default_mode, self.provider, self.tp = engine, default_mode, provider, tp

    async def Info(self, request, context):
        return verifier_identity(self.engine, self.tp)

    async def Session(self, request_iterator, context):
        try:
            sid = self.engine.open_session()
        except Exception as exc:  # the session limit
            await context.abort(status_for(exc), message_for(exc))
        kept = CommittedRows(self.engine.cfg.window_size)
        try:
            async for request in request_iterator:
                received = time.perf_counter()
                try:
                    response = await self._handle(sid, request, received, kept)
                except (ValueError, TypeError) as exc:
                    await context.abort(status_for(exc), message_for(exc))
                yield response
        finally:
            self.engine.close_session(sid)

    async def _handle(self, sid: int, request, received: float, kept: CommittedRows) -> verifier_pb2.VerifierResponse:
        op = request.WhichOneof("op")
        if op is None:
            raise ValueError("VerifierRequest has no operation: set prefill, decode, verify or rows")
        with message_span(self.provider, f"verifier.{op}", request.trace) as span:
            if op == "rows":
                rows, first = kept.last(request.rows.count)
                span.set_attribute("verifier.rows", rows.shape[0])
                return verifier_pb2.VerifierResponse(
                    next_token=kept.next_token, margin=kept.margin, rows=to_proto(rows), first_position=first,
                    next_position=kept.next_position)
            if op == "prefill":
                if not request.prefill.token_ids:
                    raise ValueError("empty prompt: PrefillRequest.token_ids has no tokens")
                res = await asyncio.to_thread(self.engine.prefill, sid, list(request.prefill.token_ids))
                response = self._step_response(res)
            elif op == "decode":
                d = request.decode
                res = await asyncio.to_thread(self.engine.decode, sid, d.token_id, d.position)
                response = self._step_response(res)
            else:
                v = request.verify
                if v.mode not in _MODES and v.mode != verifier_pb2.VERIFY_MODE_UNSPECIFIED:
                    raise ValueError(f"verify mode={v.mode}: not a VerifyMode (0 default, 1 sequential, 2 batched)")
                mode = _MODES.get(v.mode, self.default_mode)
                res = await asyncio.to_thread(self.engine.verify, sid, v.anchor, list(v.drafts), v.position, mode)
                response = verifier_pb2.VerifierResponse(
                    next_token=res.bonus_token, margin=res.margin, accepted=res.accepted,
                    rows=to_proto(res.rows), first_position=res.positions.start,
                    next_position=res.positions.stop)
                response.timing.rollback_bytes = res.rollback_bytes
                span.set_attribute("spec_decode.accepted", res.accepted)
                span.set_attribute("spec_decode.submitted", len(v.drafts))
                span.set_attribute("verifier.mode", mode)
            kept.add(res.rows, res.positions, response.next_token, response.margin)
            total_ms = (time.perf_counter() - received) * 1e3
            response.timing.forward_ms = res.forward_ms
            response.timing.queue_ms = max(0.0, total_ms - res.forward_ms)
            span.set_attribute("verifier.forward_ms", res.forward_ms)
            span.set_attribute("verifier.rollback_bytes", response.timing.rollback_bytes)
            span.set_attribute("verifier.queue_ms", response.timing.queue_ms)
            return response

    @staticmethod
    def _step_response(res) -> verifier_pb2.VerifierResponse:
        return verifier_pb2.VerifierResponse(
            next_token=res.next_token, margin=res.margin, accepted=0, rows=to_proto(res.rows),
            first_position=res.positions.start, next_position=res.positions.stop)
