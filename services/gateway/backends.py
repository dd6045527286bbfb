"""Backend sessions as the scheduler sees them: over gRPC streams, or in process; and the
channels they run on.

This module owns the gateway's channels and stubs to the verifier and the drafter (`Backends`:
round-robin over a target's addresses, reconnect pacing, TLS and tracing interceptors) and
every call the gateway makes to them during a generation: the session protocols, the
per-request deadlines, the mapping of a failed call to `BackendError` and the session/position
echo checks of a reply. It must not decide what to ask or when (the scheduler does) or judge a
draft's content (`drafters.DraftCheck` does).

A `VerifierSession` / `DrafterSession` is one generation's session on one backend. The gRPC
versions hold one bidirectional `Session` stream each (so the backend's state lives exactly as
long as the generation and a load balancer keeps it on one replica); every request carries the
trace context of the gateway's round span, and every reply is awaited with the per-round
timeout. The in-process versions call the engines directly (in a worker thread) and round
rows to bfloat16 exactly as the wire does, so both paths produce the same drafts.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass
from typing import Protocol, Sequence

import grpc
import torch
from opentelemetry.sdk.trace import TracerProvider

from dspark_proto.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from dsv4.sampling import GREEDY, SamplingParams, TokenLogprob
from services.common.constraint import Constraint
from services.common.constraint_wire import constraint_to_proto
from services.common.controls import LogitsControls
from services.common.controls_wire import controls_to_proto
from services.common.sampling_wire import logprob_from_proto, logprob_to_proto, params_to_proto
from services.common.server import channel_options
from services.common.settings import GatewaySettings, backend_target
from services.common.telemetry import client_interceptors
from services.common.tensors import from_proto, to_proto

_MODE_ENUM = {"sequential": verifier_pb2.VERIFY_MODE_SEQUENTIAL, "batched": verifier_pb2.VERIFY_MODE_BATCHED}


class BackendError(RuntimeError):
    """A backend failed, closed its stream or missed the round timeout (`code` = gRPC status)."""

    def __init__(self, backend: str, message: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE):
        super().__init__(f"{backend}: {message}")
        self.backend, self.code = backend, code


class InvalidDraftReply(BackendError):
    """A drafter reply that breaks the Drafter contract; `check` names the rule it broke
    (`DRAFT_CHECKS`). The gateway treats it as a failed drafter, never as the client's fault."""

    def __init__(self, check: str, message: str):
        if check not in DRAFT_CHECKS:
            raise ValueError(f"draft check {check!r}: must be one of {DRAFT_CHECKS}")
        super().__init__("drafter", f"invalid reply ({check}): {message}", grpc.StatusCode.DATA_LOSS)
        self.check = check


# The rules every drafter reply must meet (metric label `check`): token ids inside the
# vocabulary, no reserved id, at most block_size tokens, one finite confidence per token or
# none, the session and position the request asked about, and (rejection rule) one row of
# probabilities per token, finite, non-negative, over the vocabulary.
DRAFT_CHECKS = ("token_range", "reserved_token", "block_size", "confidence_count", "confidence_finite",
                "session", "position", "draft_probs")

# Drafter failures another replica may cure (the replica died, is unreachable, hung or is
# shutting down): the gateway re-primes a new drafter session on them (`DSPARK_DRAFTER_FAILOVERS`).
# An invalid reply is cured the same way (see `failure_reason`).
FAILOVER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                            grpc.StatusCode.CANCELLED})


def failure_reason(exc: BackendError) -> str:
    """Why a drafter call failed, for logs and metrics: "timeout" (no reply within the round
    timeout, DEADLINE_EXCEEDED), "dead" (stream broken, unreachable, shutting down),
    "invalid_reply" (`InvalidDraftReply`), "full" (RESOURCE_EXHAUSTED: the drafter is at its
    session limit, a capacity condition that passes), "error" (any other status the drafter
    answered, e.g. INTERNAL)."""
    if isinstance(exc, InvalidDraftReply):
        return "invalid_reply"
    if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return "full"
    if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "timeout"
    if exc.code in FAILOVER_CODES:
        return "dead"
    return "error"


def may_fail_over(exc: BackendError) -> bool:
    """True when another drafter replica may cure the failure at once (dead, timeout, invalid
    reply). A full drafter is retried later instead (`DrafterLink`), an error never."""
    return failure_reason(exc) not in ("error", "full")


@dataclass(frozen=True)
class VerifierReply:
    """next_token: the new anchor; margin: its top1 - top2 logit; accepted: drafts accepted;
    rows [R, T*D] fp32 (bf16-rounded) of positions first_position..; forward_ms: compute time;
    logprobs: one per token this call chose (prefill/decode: next_token; verify: the accepted
    drafts, then next_token), empty from a verifier that sends none. step_rows: rows (tokens)
    of the verifier batch step that completed a decode / verify; committed_tokens_per_ms: the
    verifier's recent committed tokens per wall ms (both 0 when the verifier reports none: no
    step loop, or an in-process session). prompt_logprobs: a prefill that asked for them, one
    record per prompt token after the first (else empty). admitted: a verify's drafts the
    verifier judged (fewer than submitted when its step's budget cut the block; None from a
    verifier that reports none, which judged them all)."""

    next_token: int
    margin: float
    accepted: int
    rows: torch.Tensor
    first_position: int
    forward_ms: float
    rollback_bytes: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    step_rows: int = 0
    committed_tokens_per_ms: float = 0.0
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    admitted: int | None = None


@dataclass(frozen=True)
class DraftReply:
    """tokens: up to block_size drafts (fewer near max_seq_len); confidence_logits: one per token,
    or None without a confidence head; forward_ms: compute time; probs [n, V] fp32: the
    distribution q each token was drawn from (rejection rule only, else None)."""

    tokens: list[int]
    confidence_logits: list[float] | None
    forward_ms: float
    probs: torch.Tensor | None = None


class VerifierSession(Protocol):
    # `sampling` is fixed for the session's life: decode and verify choose with it.
    # prompt_logprobs: None, or the top alternatives of the prompt logprobs the reply carries.
    async def prefill(self, token_ids: Sequence[int], trace: common_pb2.TraceContext,
                      sampling: SamplingParams = GREEDY, constraint: Constraint | None = None,
                      controls: LogitsControls | None = None,
                      prompt_logprobs: int | None = None) -> VerifierReply: ...
    async def decode(self, token_id: int, position: int, trace: common_pb2.TraceContext) -> VerifierReply: ...
    # draft_probs [k, V] fp32: the rejection rule's q of each draft (None otherwise)
    # survival: per draft, P(drafts 1..j all accepted), the gate's estimate; the verifier's
    # step budget may then judge only a prefix of the block (None: the whole block).
    async def verify(self, anchor: int, drafts: Sequence[int], position: int, mode: str,
                     trace: common_pb2.TraceContext, draft_probs: torch.Tensor | None = None,
                     survival: Sequence[float] | None = None) -> VerifierReply: ...
    # The last min(count, kept) committed rows (count 0: all kept, up to window_size); needed
    # only for drafter failover (the gRPC session has it, the in-process one does not).
    async def rows(self, count: int, trace: common_pb2.TraceContext) -> VerifierReply: ...
    async def close(self) -> None: ...


class DrafterSession(Protocol):
    # constraint / controls: (the generation's output constraint / logits controls, its first
    # output position), sent with a priming commit (token_first_position 0) so the drafter
    # drafts inside the grammar, from the rows the controls transform.
    async def commit(self, rows: torch.Tensor, first_position: int, token_ids: Sequence[int],
                     token_first_position: int, trace: common_pb2.TraceContext,
                     constraint: tuple[Constraint, int] | None = None,
                     controls: tuple[LogitsControls, int] | None = None) -> None: ...
    async def draft(self, anchor: int, seed_position: int, trace: common_pb2.TraceContext,
                    sampling: SamplingParams = GREEDY) -> DraftReply: ...
    async def close(self) -> None: ...


def wire_rows(rows: torch.Tensor) -> torch.Tensor:
    """Rows as they arrive over the wire: rounded to bfloat16, returned as fp32."""
    return rows.to(torch.bfloat16).float()


# ---------------------------------------------------------------------------- gRPC
_END = object()  # ends a `_Stream`'s request iterator


class _Stream:
    """One bidirectional stream: send a request, await its reply within `timeout_s`.

    Requests go to the call through an iterator this object owns, never through
    `call.write`: grpcio consumes a stream's requests in a task of its own, and under a
    client interceptor (OpenTelemetry's) a write-style call gives that task a hidden
    iterator that nothing ends when the backend ends the stream first (a refused session),
    so the task was destroyed pending at GC. Ending our iterator on every exit path
    (`_end`) lets the task finish.
    """

    def __init__(self, name: str, method, timeout_s: float, deadline_s: float, metadata=None):
        self.name, self.timeout_s = name, timeout_s
        self._outbox: asyncio.Queue = asyncio.Queue()
        self.call = method(self._requests(), timeout=deadline_s, metadata=metadata)

    async def _requests(self):
        while (request := await self._outbox.get()) is not _END:
            yield request

    def _end(self) -> None:
        """End the request iterator (grpcio then half-closes the stream if it is still open)."""
        self._outbox.put_nowait(_END)

    async def _read(self):
        """The stream's next reply within `timeout_s` (asyncio.TimeoutError past it). The read
        runs as a task whose outcome is always retrieved: when the caller is cancelled just as
        the read fails (a client gone as its backend refuses), asyncio would otherwise log
        "Task exception was never retrieved"."""
        read = asyncio.ensure_future(self.call.read())
        read.add_done_callback(lambda t: t.cancelled() or t.exception())
        return await asyncio.wait_for(read, self.timeout_s)

    async def ask(self, request):
        self._outbox.put_nowait(request)
        try:
            reply = await self._read()
        except asyncio.TimeoutError:
            self._end()
            self.call.cancel()
            raise BackendError(self.name, f"no reply within the round timeout of {self.timeout_s:g} s",
                               grpc.StatusCode.DEADLINE_EXCEEDED) from None
        except grpc.aio.AioRpcError as e:
            self._end()
            raise BackendError(self.name, f"{e.code().name}: {e.details()}", e.code()) from None
        if reply is grpc.aio.EOF:
            self._end()
            raise BackendError(self.name, "stream closed by the backend")
        return reply

    async def close(self) -> None:
        """Half-close and read to the end: the backend ends its session normally and the OTel
        client span of the stream ends (a cancelled call leaves it open until GC). Cancels
        instead when that fails or takes longer than the round timeout."""
        self._end()
        if self.call.done():
            return
        try:
            while await self._read() is not grpc.aio.EOF:
                pass
        except (asyncio.TimeoutError, grpc.aio.AioRpcError):
            self.call.cancel()
        except asyncio.CancelledError:
            self.call.cancel()
            raise


class GrpcVerifierSession:
    """A verifier `Session` stream (see the module docstring)."""

    def __init__(self, stub, timeout_s: float, deadline_s: float, metadata=None):
        self._s = _Stream("verifier", stub.Session, timeout_s, deadline_s, metadata)

    async def _ask(self, trace, **op) -> VerifierReply:
        r = await self._s.ask(verifier_pb2.VerifierRequest(trace=trace, **op))
        try:
            logprobs = tuple(logprob_from_proto(m) for m in r.logprobs)
            prompt = tuple(logprob_from_proto(m) for m in r.prompt_logprobs)
            rows = from_proto(r.rows).float()
        except ValueError as exc:
            raise BackendError("verifier", f"invalid reply: {exc}", grpc.StatusCode.DATA_LOSS) from None
        return VerifierReply(r.next_token, r.margin, r.accepted, rows, r.first_position,
                             r.timing.forward_ms, r.timing.rollback_bytes, logprobs, r.step_rows,
                             r.committed_tokens_per_ms, prompt, r.admitted if r.HasField("admitted") else None)

    async def prefill(self, token_ids, trace, sampling=GREEDY, constraint=None, controls=None, prompt_logprobs=None):
        req = verifier_pb2.PrefillRequest(token_ids=list(token_ids), prompt_logprobs=prompt_logprobs)
        if controls is not None:
            req.controls.CopyFrom(controls_to_proto(controls))
        if sampling != GREEDY:  # unset is greedy: a plain request stays byte-identical to before
            req.sampling.CopyFrom(params_to_proto(sampling))
        if constraint is not None:
            req.constraint.CopyFrom(constraint_to_proto(constraint))
        return await self._ask(trace, prefill=req)

    async def decode(self, token_id, position, trace):
        return await self._ask(trace, decode=verifier_pb2.DecodeRequest(token_id=token_id, position=position))

    async def verify(self, anchor, drafts, position, mode, trace, draft_probs=None, survival=None):
        req = verifier_pb2.VerifyRequest(anchor=anchor, drafts=list(drafts), position=position, mode=_MODE_ENUM[mode],
                                         survival=survival or ())
        if draft_probs is not None:
            req.draft_probs.CopyFrom(to_proto(draft_probs, "float32"))
        reply = await self._ask(trace, verify=req)
        k = len(req.drafts)
        judged = k if reply.admitted is None else reply.admitted
        if not 0 <= reply.accepted <= judged <= k:  # the round would commit drafts nobody verified
            raise BackendError("verifier", f"invalid reply: accepted={reply.accepted}, admitted={reply.admitted} "
                               f"for a block of {k} drafts", grpc.StatusCode.DATA_LOSS)
        return reply

    async def rows(self, count, trace):
        return await self._ask(trace, rows=verifier_pb2.RowsRequest(count=count))

    async def close(self):
        await self._s.close()


class GrpcDrafterSession:
    """A drafter `Session` stream (see the module docstring).

    Every request carries this stream's random non-zero `session_tag`; every reply must echo
    it (0 is accepted from a drafter built before the field existed) and report as
    `committed_through` the position the request asked about (a commit's last row, a draft's
    seed position). A reply that does not raises `InvalidDraftReply` ("session" / "position").
    """

    def __init__(self, stub, timeout_s: float, deadline_s: float, metadata=None):
        self._s = _Stream("drafter", stub.Session, timeout_s, deadline_s, metadata)
        self.tag = secrets.randbits(63) + 1

    async def _ask(self, request: drafter_pb2.DrafterRequest, position: int) -> drafter_pb2.DrafterResponse:
        request.session_tag = self.tag
        r = await self._s.ask(request)
        if r.session_tag not in (0, self.tag):
            raise InvalidDraftReply("session", f"reply tagged session {r.session_tag:#x}, this stream is {self.tag:#x}")
        if r.committed_through != position:
            raise InvalidDraftReply("position", f"reply answers position {r.committed_through}, "
                                                f"the request's is {position}")
        return r

    async def commit(self, rows, first_position, token_ids, token_first_position, trace, constraint=None,
                     controls=None):
        req = drafter_pb2.CommitRequest(rows=to_proto(rows), first_position=first_position,
                                        token_ids=list(token_ids), token_first_position=token_first_position)
        if controls is not None:
            req.controls.CopyFrom(controls_to_proto(controls[0]))
            req.controls_first_position = controls[1]
        if constraint is not None:
            req.constraint.CopyFrom(constraint_to_proto(constraint[0]))
            req.constraint_first_position = constraint[1]
        await self._ask(drafter_pb2.DrafterRequest(trace=trace, commit=req), first_position + rows.shape[0] - 1)

    async def draft(self, anchor, seed_position, trace, sampling=GREEDY):
        req = drafter_pb2.DraftRequest(anchor=anchor, seed_position=seed_position)
        if sampling != GREEDY:
            req.sampling.CopyFrom(params_to_proto(sampling))
        r = await self._ask(drafter_pb2.DrafterRequest(trace=trace, draft=req), seed_position)
        conf = list(r.confidence_logits) if len(r.confidence_logits) else None
        return DraftReply(list(r.tokens), conf, r.timing.forward_ms, _draft_probs(r))

    async def close(self):
        await self._s.close()


def _draft_probs(r: drafter_pb2.DrafterResponse) -> torch.Tensor | None:
    """The reply's q [n, V] fp32, None when it sent none. A q that does not decode is an
    invalid reply (the drafter is at fault); its shape is `DraftCheck`'s to judge."""
    if not r.HasField("draft_probs"):
        return None
    try:
        return from_proto(r.draft_probs, max_elements=1 << 26).float()
    except ValueError as exc:
        raise InvalidDraftReply("draft_probs", str(exc)) from None


# ---------------------------------------------------------------------------- in process
class LocalVerifierSession:
    """A session on an in-process verifier: a `services.verifier.batcher.StepLoop` over its
    `VerifierEngine` (every request runs in the loop's steps, as a served one does)."""

    def __init__(self, steps):
        self.steps, self.engine = steps, steps.engine
        self.sid = self.engine.open_session()

    async def _run(self, record):
        return await asyncio.wrap_future(self.steps.submit(record))

    async def prefill(self, token_ids, trace, sampling=GREEDY, constraint=None, controls=None, prompt_logprobs=None):
        r = await self._run(self.engine.admit_prefill(self.sid, list(token_ids), sampling, constraint, controls,
                                                      prompt_logprobs))
        return VerifierReply(r.next_token, r.margin, 0, wire_rows(r.rows), r.positions.start, r.forward_ms,
                             logprobs=_wire_logprobs(r.logprobs), prompt_logprobs=_wire_logprobs(r.prompt_logprobs))

    async def decode(self, token_id, position, trace):
        r = await self._run(self.engine.admit_decode(self.sid, token_id, position))
        return VerifierReply(r.next_token, r.margin, 0, wire_rows(r.rows), r.positions.start, r.forward_ms,
                             logprobs=_wire_logprobs(r.logprobs))

    async def verify(self, anchor, drafts, position, mode, trace, draft_probs=None, survival=None):
        r = await self._run(self.engine.admit_verify(self.sid, anchor, list(drafts), position, mode, draft_probs,
                                                     survival))
        return VerifierReply(r.bonus_token, r.margin, r.accepted, wire_rows(r.rows), r.positions.start,
                             r.forward_ms, r.rollback_bytes, _wire_logprobs(r.logprobs), r.step_rows,
                             admitted=r.admitted)

    async def close(self):
        self.engine.close_session(self.sid)


def _wire_logprobs(records: Sequence[TokenLogprob]) -> tuple[TokenLogprob, ...]:
    """Logprob records as they arrive over the wire (float32), so both paths stream the same values."""
    return tuple(logprob_from_proto(logprob_to_proto(r)) for r in records)


class LocalDrafterSession:
    """A session on an in-process drafter engine (DSpark or oracle)."""

    def __init__(self, engine):
        self.engine, self.sid = engine, engine.open_session()

    async def commit(self, rows, first_position, token_ids, token_first_position, trace, constraint=None,
                     controls=None):
        # in process the drafter drafts blind: the verifier's mask alone keeps the output exact
        def run():
            if self.engine.observes_tokens and token_ids:  # services.drafter.interface.Drafter
                self.engine.observe_tokens(self.sid, token_first_position, list(token_ids))
            self.engine.commit(self.sid, wire_rows(rows), range(first_position, first_position + rows.shape[0]))
        await asyncio.to_thread(run)

    async def draft(self, anchor, seed_position, trace, sampling=GREEDY):
        import time
        t0 = time.perf_counter()
        probs = None
        if sampling.greedy:
            tokens, conf = await asyncio.to_thread(self.engine.draft, self.sid, anchor, seed_position)
        else:
            out = await asyncio.to_thread(self.engine.draft_sampled, self.sid, anchor, seed_position, sampling)
            tokens, conf = out.tokens, out.confidence
            probs = out.probs if sampling.rule == "rejection" else None  # as the gRPC drafter sends it
        return DraftReply(list(tokens), None if conf is None else [float(c) for c in conf],
                          (time.perf_counter() - t0) * 1e3, probs)

    async def close(self):
        self.engine.close_session(self.sid)


# Reconnect pacing of the backend channels. gRPC's default backoff (1 s, growing x1.6 up to
# 120 s) left a restarted drafter unused for ~14 s, every generation meanwhile running plain.
# A dead backend costs one refused connect per channel and second at this pace; the connect
# timeout itself (`grpc.min_reconnect_backoff_ms`, 20 s) stays gRPC's, so a slow handshake
# over a real network is not cut short. gRPC adds up to 20 % jitter to each wait.
INITIAL_RECONNECT_BACKOFF_MS = 100
MAX_RECONNECT_BACKOFF_MS = 1000
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", INITIAL_RECONNECT_BACKOFF_MS),
                     ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS)]


class Backends:
    """Channels and stubs to the verifier and (optionally) the drafter.

    settings: the targets and deadlines (`GatewaySettings`); provider: the tracer provider of
    the client interceptors; credentials / options: TLS and extra channel options. The
    channels connect lazily; a target that `backend_target` rejects raises its ValueError.
    """

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
