"""Gateway gRPC servicer: validates requests, opens backend streams, runs the scheduler.

This module owns the client-facing RPCs, request validation, the backend channels and the
start-up identity check. It must not run a round (the scheduler does) or read the environment
(its settings arrive as a `GatewaySettings`).

Client-facing: `Generate` (server streaming) and `Stats`. Each generation opens one verifier
`Session` stream and, when it speculates at all, one drafter `Session` stream (more after a
drafter failure, within `DSPARK_DRAFTER_FAILOVERS`); all are closed when the generation ends,
fails or the client cancels. `connect_backends` checks at start that the drafter and the
verifier serve the same model and refuses to pair them otherwise, naming the differing fields.
The backend channels reconnect at most `MAX_RECONNECT_BACKOFF_MS` apart, so a backend that
restarts is used again within about that long (see docs/services.md §4).
"""

from __future__ import annotations

import json
import logging
from typing import Sequence

import grpc
from opentelemetry.sdk.trace import TracerProvider

from dspark_proto.v1 import common_pb2, drafter_pb2_grpc, gateway_pb2, gateway_pb2_grpc, verifier_pb2_grpc
from services.common.server import channel_options
from services.common.settings import GatewaySettings, backend_target
from services.common.telemetry import client_interceptors
from services.gateway.backends import BackendError, GrpcDrafterSession, GrpcVerifierSession
from services.gateway.drafters import DrafterSupply
from services.gateway.record import RoundStats
from services.gateway.request_log import RequestLine, request_id_of
from services.gateway.scheduler import FinalEvent, ModelLimits, Scheduler

log = logging.getLogger("dspark.gateway")

_SPEC = {gateway_pb2.SPEC_MODE_DEFAULT: "", gateway_pb2.SPEC_MODE_OFF: "off",
         gateway_pb2.SPEC_MODE_ALWAYS: "always", gateway_pb2.SPEC_MODE_GATED: "gated"}
# Fields that must agree between the verifier and the drafter.
IDENTITY_FIELDS = ("config_hash", "vocab_size", "block_size", "window_size", "target_layer_ids",
                   "row_width", "max_seq_len", "noise_token_id")


# Reconnect pacing of the backend channels. gRPC's default backoff (1 s, growing x1.6 up to
# 120 s) left a restarted drafter unused for ~14 s, every generation meanwhile running plain.
# A dead backend costs one refused connect per channel and second at this pace; the connect
# timeout itself (`grpc.min_reconnect_backoff_ms`, 20 s) stays gRPC's, so a slow handshake
# over a real network is not cut short. gRPC adds up to 20 % jitter to each wait.
INITIAL_RECONNECT_BACKOFF_MS = 100
MAX_RECONNECT_BACKOFF_MS = 1000
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", INITIAL_RECONNECT_BACKOFF_MS),
                     ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS)]


class IdentityMismatch(RuntimeError):
    """The drafter and the verifier serve different models."""


def compare_identities(verifier: common_pb2.ModelIdentity, drafter: common_pb2.ModelIdentity) -> None:
    """Raise IdentityMismatch naming every field in IDENTITY_FIELDS that differs (with both values)."""
    diffs = [f"{f}: verifier {list(getattr(verifier, f)) if f == 'target_layer_ids' else getattr(verifier, f)!r}"
             f" != drafter {list(getattr(drafter, f)) if f == 'target_layer_ids' else getattr(drafter, f)!r}"
             for f in IDENTITY_FIELDS if getattr(verifier, f) != getattr(drafter, f)]
    if diffs:
        raise IdentityMismatch("drafter and verifier serve different models; " + "; ".join(diffs))


class Backends:
    """Channels and stubs to the verifier and (optionally) the drafter."""

    def __init__(self, settings: GatewaySettings, provider: TracerProvider | None = None,
                 credentials: grpc.ChannelCredentials | None = None, options: Sequence[tuple[str, object]] = ()):
        self.settings = settings
        # round_robin: a target that resolves to several addresses (`ipv4:a,b`, `dns:///` of a
        # headless Service) spreads the Session streams over the replicas, one stream each.
        opts = channel_options() + [("grpc.lb_policy_name", "round_robin"), *RECONNECT_OPTIONS, *options]
        inter = client_interceptors(provider)

        def channel(target: str) -> grpc.aio.Channel:
            if credentials is not None:
                return grpc.aio.secure_channel(target, credentials, options=opts, interceptors=inter)
            return grpc.aio.insecure_channel(target, options=opts, interceptors=inter)

        self.verifier_channel = channel(backend_target(settings.verifier_target, "verifier target"))
        self.verifier = verifier_pb2_grpc.VerifierStub(self.verifier_channel)
        self.drafter_channel = (channel(backend_target(settings.drafter_target, "drafter target"))
                                if settings.drafter_target else None)
        self.drafter = drafter_pb2_grpc.DrafterStub(self.drafter_channel) if self.drafter_channel else None

    async def close(self) -> None:
        for ch in (self.verifier_channel, self.drafter_channel):
            if ch is not None:
                await ch.close()


async def connect_backends(backends: Backends) -> tuple[ModelLimits, common_pb2.ModelIdentity]:
    """Fetch both identities (with the startup deadline) and derive the model limits.

    Raises:
        IdentityMismatch: the drafter serves another model (fields named).
        BackendError: the verifier is unreachable. An unreachable drafter only logs a
            warning: generations then run plain decode until it comes up.
    """
    timeout = backends.settings.startup_timeout_s
    try:
        v = await backends.verifier.Info(common_pb2.InfoRequest(), timeout=timeout, wait_for_ready=True)
    except grpc.aio.AioRpcError as e:
        target = f"DSPARK_VERIFIER_TARGET={backends.settings.verifier_target!r}"
        if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # something answered at once, but not a verifier
            raise BackendError("verifier", f"{target} does not serve dspark.v1.Verifier (UNIMPLEMENTED: "
                               f"{e.details()}): another service listens on that port", e.code()) from None
        raise BackendError("verifier", f"Info failed within DSPARK_STARTUP_TIMEOUT_S={timeout:g} s at "
                           f"{target}: {e.code().name}: {e.details()}", e.code()) from None
    confidence = False
    if backends.drafter is not None:
        try:
            d = await backends.drafter.Info(common_pb2.InfoRequest(), timeout=timeout, wait_for_ready=True)
            compare_identities(v, d)
            confidence = d.confidence_head
        except grpc.aio.AioRpcError as e:
            log.warning("drafter unreachable at start (%s); generations decode plainly until it is up",
                        e.code().name)
    # No reserved ids: the verifier's argmax spans the whole vocabulary, so it can emit any id,
    # the DSpark noise token included (the random tiny model does), and a draft of one is valid.
    limits = ModelLimits(v.vocab_size, v.max_seq_len, v.eos_token_id, v.block_size, confidence)
    return limits, v


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Generate and Stats over a `Scheduler` and the backend stubs."""

    def __init__(self, scheduler: Scheduler, backends: Backends):
        self.scheduler, self.backends = scheduler, backends

    async def Generate(self, request, context):
        if request.spec not in _SPEC:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"spec={request.spec}: not a SpecMode (0 default, 1 off, 2 always, 3 gated)")
        try:
            params = self.scheduler.params(
                request.prompt, list(request.prompt_token_ids), request.max_tokens, _SPEC.get(request.spec, ""),
                request.temperature, list(request.stop_token_ids), list(request.stop), request.ignore_eos,
                request.label)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        s = self.backends.settings
        verifier = GrpcVerifierSession(self.backends.verifier, s.round_timeout_s, s.generation_timeout_s)
        drafters = None
        if self.backends.drafter is not None:
            drafters = DrafterSupply(lambda: GrpcDrafterSession(self.backends.drafter, s.round_timeout_s,
                                                                s.generation_timeout_s),
                                     s.drafter_failovers)
        line = RequestLine(request_id_of(request), params)
        try:
            with line:
                async for event in self.scheduler.generate(params, verifier, drafters):
                    if isinstance(event, FinalEvent):
                        line.finished(event)
                    yield _response(event)
        except BackendError as exc:
            code = exc.code if exc.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED,
                                             grpc.StatusCode.INVALID_ARGUMENT) else grpc.StatusCode.UNAVAILABLE
            await context.abort(code, str(exc))
        finally:
            # A client's cancel may arrive again while these close: every stream must still be
            # closed or cancelled, or its backend session stays open until the generation deadline.
            await close_generation(verifier, drafters)

    async def Stats(self, request, context):
        stats = self.scheduler.stats.to_dict()
        stats["costs"] = self.scheduler.costs.to_dict()
        stats["verify_mode"] = self.scheduler.verify_mode
        stats["cost_mode"] = self.scheduler.cost_mode
        stats["drafter_failures"] = self.scheduler.drafter_faults.to_dict()
        return gateway_pb2.StatsResponse(json=json.dumps(stats, allow_nan=False))


async def close_generation(verifier, drafters: DrafterSupply | None) -> None:
    """Close `verifier` (a `VerifierSession`), then every session of `drafters`, the drafters
    even when closing the verifier raised (a cancel included, which is re-raised after)."""
    try:
        await verifier.close()
    finally:
        if drafters is not None:
            await drafters.close()


def _response(event) -> gateway_pb2.GenerateResponse:
    if not isinstance(event, FinalEvent):
        return gateway_pb2.GenerateResponse(token_ids=event.token_ids, text_delta=event.text_delta)
    return gateway_pb2.GenerateResponse(
        text_delta=event.text_delta, finished=True, finish_reason=event.finish_reason,
        usage=gateway_pb2.Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens),
        spec_stats=spec_stats(event.counters), text=event.text + event.text_delta,
        time_to_first_token_ms=event.time_to_first_token_ms)


def spec_stats(c: RoundStats) -> gateway_pb2.SpecStats:
    """A generation's round counters (folded from its round records) as the wire message."""
    return gateway_pb2.SpecStats(
        rounds=c.rounds, drafted=c.drafted, submitted=c.submitted, accepted=c.accepted,
        acceptance_rate=c.acceptance_rate, mean_acceptance_length=c.mean_acceptance_length,
        margin_skipped_rounds=c.margin_skipped_rounds, truncated_rounds=c.truncated_rounds,
        skipped_after_draft=c.skipped_after_draft, plain_rounds=c.plain_rounds, drafter_failed=c.drafter_failed,
        drafter_failovers=c.drafter_failovers)
