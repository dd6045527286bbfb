"""Gateway gRPC servicer: validates requests, opens backend streams, runs the scheduler.

This module owns the client-facing RPCs, request validation, the start-up identity check and
the start-up cost profile's wiring. It must not run a round (the scheduler does), time one
(`services.gateway.profile` does), open a backend channel (`services.gateway.backends.Backends`
does) or read the environment (its settings arrive as a `GatewaySettings`).

Client-facing: `Generate` (server streaming), `Abort` and `Stats`. Every Generate has a
`request_id` (the client's, validated, or a generated uuid4 hex) echoed in every message, set
on the generation span and prefixed to the gateway's log lines about it; ids are scoped to
the caller's bearer token (`auth.tenant_of`). `Abort(request_id)` stops the caller's own
generation with that id (see `services.gateway.requests`): its stream ends with a final message
of finish_reason "abort" carrying the usage so far, and an unknown, finished or other
tenant's id answers found=false. Every message carries the cumulative prompt and completion token counts; the
final one also `matched_stop` and the speculation counts under their shared names
(`spec_draft_tokens` = `spec_stats.submitted`, `spec_accepted_tokens` = `spec_stats.accepted`)
and the `seed` used. Sampling fields are validated into a `SamplingParams` (`request_sampling`):
a bad one is INVALID_ARGUMENT naming the field; a sampled request without a seed gets one
drawn, and a rule left at DEFAULT takes `GatewaySettings.sampling_rule`. Each streamed token
carries its `TokenLogprob`. Each generation opens one verifier
`Session` stream and, when it speculates at all, one drafter `Session` stream (more after a
drafter failure, within `DSPARK_DRAFTER_FAILOVERS`); all are closed when the generation ends,
fails or the client cancels. `connect_backends` checks at start that the drafter and the
verifier serve the same model and refuses to pair them otherwise, naming the differing fields.
The backend channels (`services.gateway.backends.Backends`) reconnect at most
`MAX_RECONNECT_BACKOFF_MS` apart, so a backend that restarts is used again within about that
long (see docs/services.md §4). `measure_costs` runs
the start-up cost profile of `DSPARK_GATE_COSTS=measured` (docs/gate.md §12) after
`connect_backends`, before the gateway serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
from typing import Sequence

import grpc

from dspark_proto.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from dsv4.sampling import SamplingParams
from services.common.constraint_wire import constraint_from_proto
from services.common.controls import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, LogitsControls
from services.common.controls_wire import controls_from_proto
from services.common.sampling_wire import logprob_to_proto, params_from_proto
from services.gateway.auth import tenant_of
from services.gateway.backends import BackendError, Backends, GrpcDrafterSession, GrpcVerifierSession
from services.gateway.costs import CostTracker
from services.gateway.drafters import DrafterSupply
from services.gateway.profile import ProfileError, ProfileSettings, profile_backends
from services.gateway.record import RoundStats
from services.gateway.request_log import RequestLine, log_refusal
from services.gateway.requests import (CURRENT_REQUEST_ID, REQUEST_ID_METADATA, DuplicateRequestId,
                                       GenerationAborted, Registry, RequestIdLogFilter, metadata_request_id,
                                       request_id)
from services.gateway.scheduler import FinalEvent, ModelLimits, Scheduler, TokenEvent

log = logging.getLogger("dspark.gateway")
log.addFilter(RequestIdLogFilter())  # the scheduler logs on this logger too

_SPEC = {gateway_pb2.SPEC_MODE_DEFAULT: "", gateway_pb2.SPEC_MODE_OFF: "off",
         gateway_pb2.SPEC_MODE_ALWAYS: "always", gateway_pb2.SPEC_MODE_GATED: "gated"}
# Fields that must agree between the verifier and the drafter.
IDENTITY_FIELDS = ("config_hash", "vocab_size", "block_size", "window_size", "target_layer_ids",
                   "row_width", "max_seq_len", "noise_token_id")


# Seeds the gateway draws lie below 2**53: a JSON number read as a double (JavaScript,
# `JSON.parse`, most JSON libraries) holds every such integer exactly, so a drawn seed returned
# to any client replays the same tokens. A client's own seed may still use all of [0, 2**63).
DRAWN_SEED_LIMIT = 2 ** 53


class IdentityMismatch(RuntimeError):
    """The drafter and the verifier serve different models."""


def compare_identities(verifier: common_pb2.ModelIdentity, drafter: common_pb2.ModelIdentity) -> None:
    """Raise IdentityMismatch naming every field in IDENTITY_FIELDS that differs (with both values)."""
    diffs = [f"{f}: verifier {list(getattr(verifier, f)) if f == 'target_layer_ids' else getattr(verifier, f)!r}"
             f" != drafter {list(getattr(drafter, f)) if f == 'target_layer_ids' else getattr(drafter, f)!r}"
             for f in IDENTITY_FIELDS if getattr(verifier, f) != getattr(drafter, f)]
    if diffs:
        raise IdentityMismatch("drafter and verifier serve different models; " + "; ".join(diffs))


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


async def measure_costs(backends: Backends, limits: ModelLimits, prompt_ids: list[int], costs: CostTracker,
                        settings: ProfileSettings | None = None) -> bool:
    """Profile the backends' round costs into `costs` (`services.gateway.profile`); True when seeded.

    prompt_ids: the profile's prompt (token ids, cut to `settings.prompt_tokens`). settings:
    None = `ProfileSettings` with the gateway's verify mode and round timeout per call. A
    profile that fails (no drafter, a backend error or deadline, too little room) changes no
    cost: it logs a warning, `costs` records why, and the configured costs stay in force until
    live rounds measure them. Raises nothing of its own.
    """
    s = backends.settings
    settings = settings or ProfileSettings(call_timeout_s=s.round_timeout_s, verify_mode=s.verify_mode)
    try:
        profile = await profile_backends(backends, prompt_ids[:settings.prompt_tokens] or [0], limits.block_size,
                                         limits.max_seq_len, settings)
    except (BackendError, ProfileError) as exc:
        costs.profile_failed(str(exc))
        log.warning("gate cost profile failed (%s); configured costs until live rounds measure them", exc)
        return False
    costs.seed(profile)
    log.info("gate cost profile in %.1f s: draft %.1f ms, plain %.1f ms, commit %.1f ms, verify(k=1..%d) %s ms",
             profile.elapsed_s, profile.draft_ms, profile.plain_ms, profile.commit_ms, len(profile.verify_ms),
             " ".join(f"{ms:.1f}" for ms in profile.verify_ms))
    return True


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Generate, Abort and Stats over a `Scheduler`, the backend stubs and the registry of
    running generations (`running`, by request id)."""

    def __init__(self, scheduler: Scheduler, backends: Backends):
        self.scheduler, self.backends = scheduler, backends
        self.running = Registry()

    async def Generate(self, request, context):
        rid, params, running = await self._admit(request, context)
        s = self.backends.settings
        verifier = GrpcVerifierSession(self.backends.verifier, s.round_timeout_s, s.generation_timeout_s)
        drafters = None
        if self.backends.drafter is not None:
            drafters = DrafterSupply(lambda: GrpcDrafterSession(self.backends.drafter, s.round_timeout_s,
                                                                s.generation_timeout_s),
                                     s.drafter_failovers)
        events = None
        # Everything from the id's registration on sits in this try: a cancel or deadline can land
        # at any await (the load refresh below is the first), and must still free the id and
        # close the backend streams, or the verifier keeps the session until the generation
        # deadline and the id stays taken.
        try:
            if self.scheduler.load is not None:  # the step table the new generation snapshots
                await self.scheduler.load.refresh()
            events = self.scheduler.generate(dataclasses.replace(params, request_id=rid), verifier, drafters)
            stream = self._stream(rid, params, running, events, verifier, drafters, context)
            async with contextlib.aclosing(stream):  # its log line is written now, not at GC
                async for response in stream:
                    yield response
        finally:
            self.running.remove(running)
            # A client's cancel may arrive again while these close: every stream must still be
            # closed or cancelled, or its backend session stays open until the generation deadline.
            try:
                await close_generation(verifier, drafters)
            finally:
                if events is not None:
                    await events.aclose()  # a no-op unless this stream was closed at a yield

    async def _stream(self, rid: str, params, running, events, verifier, drafters, context):
        """The responses of one generation's `events`: its tokens, then its end (finished,
        aborted, or the call aborted with the backend's status); one log line per request."""
        out = ResponseStream(rid, len(params.prompt_ids), params.sampling.seed)
        with RequestLine(rid, params) as line:  # one log line per request, however it ends
            try:
                while (event := await running.next(events)) is not None:
                    if isinstance(event, FinalEvent):  # finished: from here on an abort finds nothing to stop
                        self.running.remove(running)
                        line.finished(event)
                    else:
                        line.streamed(len(event.token_ids))
                    yield out.response(event)
            except GenerationAborted:
                log.info("aborted after %d tokens", out.completion_tokens)
                await close_generation(verifier, drafters)  # freed before the client sees the end
                yield out.aborted()
            except BackendError as exc:
                code = exc.code if exc.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED,
                                                 grpc.StatusCode.INVALID_ARGUMENT) else grpc.StatusCode.UNAVAILABLE
                await context.abort(code, str(exc))

    async def _admit(self, request, context):
        """(request id, validated `GenerationParams`, registry entry) of a Generate call; the
        call is aborted with INVALID_ARGUMENT (a bad field, named) or ALREADY_EXISTS (an id
        that is running). The id is the request's field, else its `x-request-id` metadata, else
        generated; it goes into the call's trailing metadata before anything can refuse the
        call, so every ending (errors too) carries it, and a refusal logs a line with it (a
        generated id when the client's was unusable)."""
        try:
            rid = request_id(request.request_id or metadata_request_id(context.invocation_metadata()))
        except ValueError as exc:
            await refuse(context, request_id(""), grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        # Not reset at the end: the call's task, and so this context, ends with the call.
        CURRENT_REQUEST_ID.set(rid)
        context.set_trailing_metadata(((REQUEST_ID_METADATA, rid),))
        if request.spec not in _SPEC:
            await refuse(context, rid, grpc.StatusCode.INVALID_ARGUMENT,
                         f"spec={request.spec}: not a SpecMode (0 default, 1 off, 2 always, 3 gated)")
        try:
            sampling = request_sampling(request, self.backends.settings.sampling_rule)
            # Tokenizing a prompt or bad words and compiling a grammar take up to seconds: off the
            # event loop, which streams every other generation's tokens.
            params = await asyncio.to_thread(self._params, request, sampling)
            running = self.running.register(rid, tenant_of(context.invocation_metadata()))
        except DuplicateRequestId as exc:
            await refuse(context, rid, grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except ValueError as exc:
            await refuse(context, rid, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return rid, params, running

    def _params(self, request, sampling):
        """The request's `GenerationParams` (`Scheduler.params`). Raises ValueError naming a value."""
        return self.scheduler.params(
            request.prompt, list(request.prompt_token_ids), request.max_tokens, _SPEC[request.spec],
            request.temperature, list(request.stop_token_ids), list(request.stop), request.ignore_eos,
            request.label, sampling, request.max_draft_tokens,
            constraint_from_proto(request.constraint) if request.HasField("constraint") else None,
            request_controls(request, self.scheduler.tokenizer),
            request.prompt_logprobs if request.HasField("prompt_logprobs") else None)

    async def Abort(self, request, context):
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty: give the id to abort")
        try:  # an id Generate would refuse can name no generation; refused before it reaches the log
            request_id(request.request_id)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        found = self.running.abort(request.request_id, tenant_of(context.invocation_metadata()))
        log.info("abort of request_id=%r: %s", request.request_id, "stopping it" if found else "none running")
        return gateway_pb2.AbortResponse(found=found)

    async def Stats(self, request, context):
        stats = self.scheduler.stats.to_dict()
        stats["costs"] = self.scheduler.costs.to_dict(self.scheduler.cost_mode)
        stats["verify_mode"] = self.scheduler.verify_mode
        stats["cost_mode"] = self.scheduler.cost_mode
        stats["drafter_failures"] = self.scheduler.drafter_faults.to_dict()
        regime = self.scheduler.regime
        stats["regime"] = {"enabled": False} if regime is None else {"enabled": True, **regime.to_dict()}
        return gateway_pb2.StatsResponse(json=json.dumps(stats, allow_nan=False))


async def refuse(context, rid: str, code: grpc.StatusCode, message: str) -> None:
    """End a Generate call before it started: `rid` in its trailing metadata and in the gateway's
    refusal log line, then abort with `code` and `message` (raises grpc's AbortError)."""
    CURRENT_REQUEST_ID.set(rid)
    context.set_trailing_metadata(((REQUEST_ID_METADATA, rid),))
    log_refusal(rid, code.name, message)
    await context.abort(code, message)


def request_sampling(request: gateway_pb2.GenerateRequest, default_rule: str) -> SamplingParams:
    """The `SamplingParams` of a GenerateRequest, as every backend will read them (floats at
    their float32 wire values). A sampled request without a seed gets one drawn here, in
    [0, DRAWN_SEED_LIMIT) (from `secrets`: unpredictable, never shared between requests, and
    exact as a JSON double); a greedy one uses its seed or 0,
    since nothing is random then. Temperature 0 is greedy exactly as before sampling existed.

    Raises:
        ValueError: naming the GenerateRequest field and value: NaN or negative temperature,
            top_p outside (0, 1] (0 means unset), top_k < 0, min_p outside [0, 1], a seed
            >= 2**63, logprobs outside 0..20, a sampling_rule that is no SamplingRule.
    """
    if request.sampling_rule not in (common_pb2.SAMPLING_RULE_DEFAULT, common_pb2.SAMPLING_RULE_COUPLED,
                                     common_pb2.SAMPLING_RULE_REJECTION):
        raise ValueError(f"sampling_rule={request.sampling_rule}: not a SamplingRule "
                         f"(0 default, 1 coupled, 2 rejection)")
    if request.HasField("seed"):
        seed = request.seed
    else:
        sampled = request.temperature != 0  # NaN included: it is refused below, naming temperature
        seed = secrets.randbelow(DRAWN_SEED_LIMIT) if sampled else 0
    msg = common_pb2.SamplingParams(temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
                                    min_p=request.min_p, seed=seed, rule=request.sampling_rule,
                                    logprobs=request.logprobs)
    try:
        return params_from_proto(msg, default_rule, field="GenerateRequest")
    except ValueError as exc:  # "GenerateRequest.top_p=..." -> "top_p=...": the client's own field name
        raise ValueError(str(exc).removeprefix("GenerateRequest.")) from None


def request_controls(request: gateway_pb2.GenerateRequest, tokenizer) -> LogitsControls | None:
    """The logits controls of a GenerateRequest (None: every field neutral), floats at their
    float32 wire values; `bad_words` are tokenized here with the gateway's `tokenizer`, each
    as given and after a space (how it reads mid-text), as vLLM does.

    Raises:
        ValueError: naming the GenerateRequest field and value (`LogitsControls`' checks),
            a blank bad word, more than MAX_BAD_WORDS of them, or one of more than
            MAX_BAD_WORD_TOKENS tokens (refused as soon as it is tokenized, before the rest).
    """
    if len(request.bad_words) > MAX_BAD_WORDS:
        raise ValueError(f"bad_words: {len(request.bad_words)} words; at most {MAX_BAD_WORDS}")
    words: list[tuple[int, ...]] = []
    for i, word in enumerate(request.bad_words):
        if not word.strip():
            raise ValueError(f"bad_words[{i}]={word!r}: must hold text")
        for text in (word, " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text))
            if len(ids) > MAX_BAD_WORD_TOKENS:  # at once: the rest of a 4 MiB body is not tokenized for nothing
                raise ValueError(f"bad_words: a word of {len(ids)} tokens; each needs 1..{MAX_BAD_WORD_TOKENS}")
            if ids and ids not in words:
                words.append(ids)
    msg = common_pb2.LogitsControls(presence_penalty=request.presence_penalty,
                                    frequency_penalty=request.frequency_penalty,
                                    repetition_penalty=request.repetition_penalty, min_tokens=request.min_tokens)
    for token, bias in request.logit_bias.items():
        msg.logit_bias[token] = bias
    for ids in words:
        msg.bad_words.add(ids=list(ids))
    if msg == common_pb2.LogitsControls():
        return None
    try:
        return controls_from_proto(msg, field="GenerateRequest")
    except ValueError as exc:  # the client's own field name, as request_sampling's
        raise ValueError(str(exc).removeprefix("GenerateRequest.")) from None


async def close_generation(verifier, drafters: DrafterSupply | None) -> None:
    """Close `verifier` (a `VerifierSession`), then every session of `drafters`, the drafters
    even when closing the verifier raised (a cancel included, which is re-raised after)."""
    try:
        await verifier.close()
    finally:
        if drafters is not None:
            await drafters.close()


class ResponseStream:
    """The wire messages of one generation: every one carries the request id and the
    cumulative token counts (`prompt_tokens` = prompt length, `completion_tokens` = tokens
    streamed so far, this message's included)."""

    def __init__(self, request_id: str, prompt_tokens: int, seed: int = 0):
        self.request_id, self.prompt_tokens, self.seed = request_id, prompt_tokens, seed
        self.completion_tokens = 0
        self.text = ""  # the text streamed so far (the final message of an aborted generation)

    def _message(self, token_ids: Sequence[int], text_delta: str, logprobs=(), prompt_logprobs=(),
                 **final) -> gateway_pb2.GenerateResponse:
        self.completion_tokens += len(token_ids)
        self.text += text_delta
        if final.get("finished"):
            final["seed"] = self.seed
        return gateway_pb2.GenerateResponse(
            token_ids=token_ids, text_delta=text_delta, request_id=self.request_id,
            prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
            logprobs=[logprob_to_proto(r) for r in logprobs],
            prompt_logprobs=[logprob_to_proto(r) for r in prompt_logprobs], **final)

    def response(self, event: TokenEvent | FinalEvent) -> gateway_pb2.GenerateResponse:
        """A streamed message for a `TokenEvent` (with one `TokenLogprob` per token, and the
        prompt logprobs on the first), the final one for the `FinalEvent` (with the seed used,
        and the prompt logprobs of a prompt scored without generating)."""
        if not isinstance(event, FinalEvent):
            return self._message(event.token_ids, event.text_delta, event.logprobs, event.prompt_logprobs)
        matched = {}
        if isinstance(event.matched_stop, str):
            matched["matched_stop_str"] = event.matched_stop
        elif event.matched_stop is not None:
            matched["matched_token_id"] = event.matched_stop
        c = event.counters
        return self._message(
            [], event.text_delta, (), event.prompt_logprobs, finished=True, finish_reason=event.finish_reason,
            usage=gateway_pb2.Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens),
            spec_stats=spec_stats(c), text=event.text + event.text_delta,
            time_to_first_token_ms=event.time_to_first_token_ms,
            spec_draft_tokens=c.submitted, spec_accepted_tokens=c.accepted - c.unstreamed_accepted, **matched)

    def aborted(self) -> gateway_pb2.GenerateResponse:
        """The final message of an aborted generation: finish_reason "abort", the usage and
        text streamed so far; no spec_stats, matched_stop or speculation counts (its rounds
        are not folded, as for any generation that did not finish)."""
        return self._message([], "", finished=True, finish_reason="abort", text=self.text,
                             usage=gateway_pb2.Usage(prompt_tokens=self.prompt_tokens,
                                                     completion_tokens=self.completion_tokens))


def spec_stats(c: RoundStats) -> gateway_pb2.SpecStats:
    """A generation's round counters (folded from its round records) as the wire message."""
    return gateway_pb2.SpecStats(
        rounds=c.rounds, drafted=c.drafted, submitted=c.submitted, accepted=c.accepted,
        acceptance_rate=c.acceptance_rate, mean_acceptance_length=c.mean_acceptance_length,
        margin_skipped_rounds=c.margin_skipped_rounds, truncated_rounds=c.truncated_rounds,
        skipped_after_draft=c.skipped_after_draft, plain_rounds=c.plain_rounds, drafter_failed=c.drafter_failed,
        drafter_failovers=c.drafter_failovers, forced_rounds=c.forced_rounds, forced_tokens=c.forced_tokens)
