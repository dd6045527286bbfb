"""Verifier gRPC servicer: a thin adapter from the wire to `VerifierEngine`.

It owns the message translation only: which operation a request holds, the verify-mode
enum, tensors to and from protos, timings and span attributes. The session's life cycle is
`services.common.session_stream.serve_session`; every rule about token ids, positions,
block sizes and committed rows is the engine's.

A request is admitted (validated, `VerifierEngine.admit_*`) on the event loop and its future
awaited: the forward runs in the step loop's next step (`services.verifier.batcher.StepLoop`),
batched with every other session's pending work (at TP > 1 too: every rank runs the same
batched step).
"""

from __future__ import annotations

import asyncio
import time

from opentelemetry.sdk.trace import TracerProvider

from dspark_proto.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from services.common.constraint_wire import constraint_from_proto
from services.common.controls_wire import controls_from_proto
from services.common.sampling_wire import logprob_to_proto, params_from_proto
from services.common.session_stream import SessionStreamServicer
from services.common.telemetry import message_span
from services.common.tensors import from_proto, to_proto
from services.verifier.batcher import StepLoop, StepStats
from services.verifier.engine import StepResult, VerifierEngine, VerifyResult
from services.verifier.step_table import LoadTracker

from dsv4.sampling import GREEDY

_MODES = {verifier_pb2.VERIFY_MODE_SEQUENTIAL: "sequential", verifier_pb2.VERIFY_MODE_BATCHED: "batched"}


def verifier_identity(engine: VerifierEngine, tp: int = 1, steps: StepStats | None = None,
                      prefill_chunk: int = 0, load: LoadTracker | None = None) -> common_pb2.ModelIdentity:
    """The model identity the gateway checks against the drafter's (docs/architecture.md §6),
    with the open sessions, the session limit, how it was chosen and the bytes one session
    holds, and, when a step loop runs, its steps (`steps`), prompt chunk (`prefill_chunk`,
    tokens; 0 without a loop) and load figures (`load`: the step-time table and committed
    tokens per ms, fields 29-34)."""
    cfg = engine.cfg
    steps = StepStats() if steps is None else steps
    identity = common_pb2.ModelIdentity(
        steps=steps.steps, batch_size_last=steps.batch_last, batch_size_mean=steps.batch_mean,
        step_ms_last=steps.ms_last, step_ms_mean=steps.ms_mean, prefill_steps=steps.prefill_steps,
        prefill_chunk=prefill_chunk, session_state_bytes=engine.per_session_bytes(),
        max_sessions_rule=engine.limit_rule,
        role="verifier", config_hash=cfg.config_hash(), vocab_size=cfg.vocab_size,
        block_size=cfg.dspark_block_size, window_size=cfg.window_size,
        target_layer_ids=list(cfg.dspark_target_layer_ids), row_width=cfg.tap_width, tp=tp,
        max_seq_len=cfg.max_seq_len, noise_token_id=cfg.dspark_noise_token_id,
        eos_token_id=cfg.eos_token_id, max_sessions=engine.max_sessions, open_sessions=engine.num_sessions)
    if load is not None:
        load.fill_identity(identity)
    return identity


class VerifierServicer(SessionStreamServicer, verifier_pb2_grpc.VerifierServicer):
    """Session: prefill / decode / verify messages in, one response each, in order.

    Args:
        engine: the verifier engine (thread-safe across sessions).
        default_mode: verify mode used when a request leaves it unspecified.
        provider: tracer provider for the per-message spans (None = no spans).
        tp: tensor-parallel world size reported in Info.
        metrics: a `services.common.metrics.VerifierMetrics` fed each answered forward (None: none).
        steps: the step loop that runs every forward.
        load: the step loop's load figures, reported in Info and in every decode / verify
            response (None: not reported).
    """

    def __init__(self, engine: VerifierEngine, default_mode: str = "batched",
                 provider: TracerProvider | None = None, tp: int = 1, metrics=None, steps: StepLoop | None = None,
                 load: LoadTracker | None = None):
        if steps is None:
            raise ValueError("VerifierServicer needs the step loop that runs its forwards (steps=None)")
        self.engine, self.default_mode, self.provider, self.tp = engine, default_mode, provider, tp
        self.metrics, self.steps, self.load = metrics, steps, load

    async def Info(self, request, context):
        return verifier_identity(self.engine, self.tp, self.steps.stats(), self.steps.prefill_chunk, self.load)

    async def _run(self, op: str, sid: int, *args):
        """The result of `op` ("prefill" | "decode" | "verify") on `sid` with `args`: admitted
        here into the session's record and run in the step loop's next steps.
        Raises what admission or the step raises (ValueError for bad values, UnknownSessionError)."""
        record = getattr(self.engine, f"admit_{op}")(sid, *args)
        return await asyncio.wrap_future(self.steps.submit(record))

    async def _handle(self, sid: int, request, received: float) -> verifier_pb2.VerifierResponse:
        op = request.WhichOneof("op")
        if op is None:
            raise ValueError("VerifierRequest has no operation: set prefill, decode, verify or rows")
        with message_span(self.provider, f"verifier.{op}", request.trace) as span:
            if op == "rows":
                return self._rows(sid, request.rows.count, span)
            if op == "prefill":
                p = request.prefill
                ids = list(p.token_ids)
                sampling = GREEDY  # an unset message is greedy, as before sampling existed
                if p.HasField("sampling"):
                    sampling = params_from_proto(p.sampling, field="prefill.sampling")
                constraint = constraint_from_proto(p.constraint, field="prefill.constraint")
                controls = controls_from_proto(p.controls, "prefill.controls") if p.HasField("controls") else None
                scored = p.prompt_logprobs if p.HasField("prompt_logprobs") else None
                res = await self._run("prefill", sid, ids, sampling, constraint, controls, scored)
                response, rows = self._step_response(res), len(ids)
                response.prompt_logprobs.extend(logprob_to_proto(r) for r in res.prompt_logprobs)
            elif op == "decode":
                d = request.decode
                res = await self._run("decode", sid, d.token_id, d.position)
                response, rows = self._step_response(res), 1
            else:
                res, response = await self._verify(sid, request.verify, span)
                rows = res.forwarded
            response.logprobs.extend(logprob_to_proto(r) for r in res.logprobs)
            if op != "prefill" and self.load is not None:
                response.step_rows = res.step_rows
                response.committed_tokens_per_ms = self.load.tokens_per_ms()
            total_ms = (time.perf_counter() - received) * 1e3
            response.timing.forward_ms = res.forward_ms
            response.timing.queue_ms = max(0.0, total_ms - res.forward_ms)
            span.set_attribute("verifier.forward_ms", res.forward_ms)
            span.set_attribute("verifier.rollback_bytes", response.timing.rollback_bytes)
            span.set_attribute("verifier.queue_ms", response.timing.queue_ms)
            if self.metrics is not None:
                self.metrics.record_forward(op, rows, res.forward_ms, response.timing.queue_ms)
            return response

    def _rows(self, sid: int, count: int, span) -> verifier_pb2.VerifierResponse:
        tail = self.engine.committed_tail(sid, count)
        span.set_attribute("verifier.rows", tail.rows.shape[0])
        return verifier_pb2.VerifierResponse(
            next_token=tail.next_token, margin=tail.margin, rows=to_proto(tail.rows),
            first_position=tail.first_position, next_position=tail.next_position)

    async def _verify(self, sid: int, v, span) -> tuple[VerifyResult, verifier_pb2.VerifierResponse]:
        if v.mode not in _MODES and v.mode != verifier_pb2.VERIFY_MODE_UNSPECIFIED:
            raise ValueError(f"verify mode={v.mode}: not a VerifyMode (0 default, 1 sequential, 2 batched)")
        mode = _MODES.get(v.mode, self.default_mode)
        q = None
        if v.HasField("draft_probs"):
            try:
                q = from_proto(v.draft_probs, max_elements=len(v.drafts) * self.engine.cfg.vocab_size)
            except ValueError as exc:
                raise ValueError(f"verify.draft_probs: {exc}") from None
        survival = list(v.survival) or None
        res = await self._run("verify", sid, v.anchor, list(v.drafts), v.position, mode, q, survival)
        response = verifier_pb2.VerifierResponse(
            next_token=res.bonus_token, margin=res.margin, accepted=res.accepted, admitted=res.admitted,
            rows=to_proto(res.rows), first_position=res.positions.start, next_position=res.positions.stop)
        response.timing.rollback_bytes = res.rollback_bytes
        span.set_attribute("spec_decode.accepted", res.accepted)
        span.set_attribute("spec_decode.submitted", len(v.drafts))
        span.set_attribute("spec_decode.admitted", res.admitted)
        span.set_attribute("verifier.mode", mode)
        return res, response

    @staticmethod
    def _step_response(res: StepResult) -> verifier_pb2.VerifierResponse:
        return verifier_pb2.VerifierResponse(
            next_token=res.next_token, margin=res.margin, accepted=0, rows=to_proto(res.rows),
            first_position=res.positions.start, next_position=res.positions.stop)
