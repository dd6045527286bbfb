"""gRPC conventions of the services: reflection, request ids, Abort, matched_stop, shared counts.

Everything runs against real servers on port 0 (`services_fixtures`): reflection is read with
grpcio-reflection's own client (`ProtoReflectionDescriptorDatabase`, what `grpcurl list` and
`describe` ask), generations stream through a real gateway over the live oracle drafter, and
an abort is sent while the generation's verify call is held inside the verifier engine, so it
lands mid-round every time without any timing guess.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dspark_proto.v1 import gateway_pb2
from services.gateway.requests import (CURRENT_REQUEST_ID, DuplicateRequestId, GenerationAborted, Registry,
                                      RequestIdLogFilter)
from services_fixtures import RPC_TIMEOUT_S, gen_request, start_stack, tiny_tokenizer

PROMPT = "conventions"
REF_TOKENS = 24
HEALTH = "grpc.health.v1.Health"
REFLECTION = ("grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection")


@pytest.fixture(scope="module")
def traced_stack():
    """Verifier + oracle drafter + gateway whose spans land in an in-memory exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    stack = start_stack("oracle", provider=provider)
    stack.exporter = exporter
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def reference(traced_stack):
    """The plain greedy continuation of PROMPT (token ids)."""
    gen = traced_stack.generate(gen_request(PROMPT, max_tokens=REF_TOKENS, spec="off"))
    assert len(gen.token_ids) == REF_TOKENS
    return gen.token_ids


def _messages(stack, req) -> list[gateway_pb2.GenerateResponse]:
    async def run():
        gw = await stack.agateway()
        return [m async for m in gw.stub.Generate(req, timeout=RPC_TIMEOUT_S)]
    return stack.loop.run(run())


# ---------------------------------------------------------------------------- reflection
def _reflect(target: str, service: str):
    """(listed services, the described service) through the reflection service at `target`."""
    with grpc.insecure_channel(target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        return sorted(db.get_services()), DescriptorPool(db).FindServiceByName(service)


@pytest.mark.parametrize("role, service, methods", [
    ("verifier", "dspark.v1.Verifier", {"Info", "Session"}),
    ("drafter", "dspark.v1.Drafter", {"Info", "Session"}),
    ("gateway", "dspark.v1.Gateway", {"Generate", "Stats", "Abort"}),
])
def test_reflection_lists_and_describes_each_service(traced_stack, role, service, methods):
    target = traced_stack.gateway().target if role == "gateway" else getattr(traced_stack, f"{role}_target")
    listed, described = _reflect(target, service)
    assert listed == sorted([service, HEALTH, *REFLECTION])
    assert {m.name for m in described.methods} == methods


def test_reflection_describes_the_generate_messages(traced_stack):
    _, gateway = _reflect(traced_stack.gateway().target, "dspark.v1.Gateway")
    generate = gateway.methods_by_name["Generate"]
    assert generate.server_streaming and not generate.client_streaming
    assert generate.input_type.fields_by_name["request_id"].number == 10
    out = generate.output_type
    assert out.full_name == "dspark.v1.GenerateResponse"
    assert {f.name: f.number for f in out.oneofs_by_name["matched_stop"].fields} == {
        "matched_token_id": 12, "matched_stop_str": 13}
    assert (out.fields_by_name["spec_draft_tokens"].number, out.fields_by_name["spec_accepted_tokens"].number) == (14, 15)
    abort = gateway.methods_by_name["Abort"]
    assert (abort.input_type.full_name, abort.output_type.full_name) == ("dspark.v1.AbortRequest",
                                                                         "dspark.v1.AbortResponse")


# ---------------------------------------------------------------------------- request ids
def test_client_request_id_is_echoed_in_every_message_and_on_the_span(traced_stack):
    traced_stack.exporter.clear()
    req = gen_request(PROMPT, max_tokens=12)
    req.request_id = "client-42 ok"
    messages = _messages(traced_stack, req)
    assert len(messages) > 2
    assert {m.request_id for m in messages} == {"client-42 ok"}
    spans = [s for s in traced_stack.exporter.get_finished_spans() if s.name == "gateway.generate"]
    assert [s.attributes["gen_ai.response.id"] for s in spans] == ["client-42 ok"]


def test_request_id_is_generated_when_absent(traced_stack):
    first = _messages(traced_stack, gen_request(PROMPT, max_tokens=4))
    second = _messages(traced_stack, gen_request(PROMPT, max_tokens=4))
    ids = {m.request_id for m in first}
    assert len(ids) == 1 and len(next(iter(ids))) == 32 and int(next(iter(ids)), 16) >= 0  # uuid4 hex
    assert {m.request_id for m in second} != ids


@pytest.mark.parametrize("bad, words", [("x" * 129, "at most 128"), ("line\nbreak", "printable"),
                                        ("bell\x07", "printable")])
def test_bad_request_id_is_invalid_argument_naming_it(traced_stack, bad, words):
    req = gen_request(PROMPT, max_tokens=4)
    req.request_id = bad
    with pytest.raises(grpc.aio.AioRpcError) as err:
        _messages(traced_stack, req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id" in err.value.details() and words in err.value.details()


def test_log_filter_tags_lines_of_a_request(caplog):
    log = logging.getLogger("dspark.test.request_ids")
    log.addFilter(RequestIdLogFilter())
    with caplog.at_level(logging.INFO, logger="dspark.test.request_ids"):
        log.info("outside %d", 1)
        token = CURRENT_REQUEST_ID.set("id%s-100%")
        try:
            log.info("inside %d%%", 2)
        finally:
            CURRENT_REQUEST_ID.reset(token)
    assert [r.getMessage() for r in caplog.records] == ["outside 1", "[request id%s-100%] inside 2%"]
    assert getattr(caplog.records[1], "request_id") == "id%s-100%"


# ---------------------------------------------------------------------------- counts
def test_cumulative_counts_and_shared_speculation_names(traced_stack):
    messages = _messages(traced_stack, gen_request(PROMPT, max_tokens=REF_TOKENS, spec="always"))
    streamed = 0
    for m in messages:
        streamed += len(m.token_ids)
        assert (m.prompt_tokens, m.completion_tokens) == (len(PROMPT), streamed)
    final = messages[-1]
    assert final.finished and final.finish_reason == "length" and final.WhichOneof("matched_stop") is None
    assert final.usage.completion_tokens == final.completion_tokens == REF_TOKENS
    assert final.spec_draft_tokens == final.spec_stats.submitted > 0
    assert final.spec_accepted_tokens == final.spec_stats.accepted == final.spec_stats.submitted  # oracle


def test_shared_counts_equal_spec_stats_when_drafts_are_rejected():
    stack = start_stack("oracle", corrupt_every=3)
    try:
        final = _messages(stack, gen_request(PROMPT, max_tokens=REF_TOKENS, spec="always"))[-1]
    finally:
        stack.close()
    assert final.spec_draft_tokens == final.spec_stats.submitted > final.spec_stats.accepted
    assert final.spec_accepted_tokens == final.spec_stats.accepted


# ---------------------------------------------------------------------------- matched_stop
def test_matched_stop_names_the_stop_token(traced_stack, reference):
    i = next(i for i in range(8, REF_TOKENS) if reference[i] not in reference[:i])
    final = _messages(traced_stack, gen_request(PROMPT, max_tokens=REF_TOKENS, stop_token_ids=[reference[i]]))[-1]
    assert final.finish_reason == "stop" and final.completion_tokens == i + 1
    assert final.WhichOneof("matched_stop") == "matched_token_id"
    assert final.matched_token_id == reference[i]


def test_matched_stop_names_the_stop_string(traced_stack, reference):
    text = tiny_tokenizer().decode(reference)
    j = next(j for j in range(3, len(text) - 2) if "\ufffd" not in text[: j + 2] and text.find(text[j:j + 2]) == j)
    stop = text[j:j + 2]
    final = _messages(traced_stack, gen_request(PROMPT, max_tokens=REF_TOKENS, stop=["never-in-it", stop]))[-1]
    assert final.finish_reason == "stop" and final.text == text[:j]
    assert final.WhichOneof("matched_stop") == "matched_stop_str"
    assert final.matched_stop_str == stop


# ---------------------------------------------------------------------------- abort
class HeldVerify:
    """Holds the verifier's batched forwards that carry a decode or verify (the step loop runs
    every request, prompt chunks included, through `forward_batch`; a step of prompt chunks
    alone passes) until `release()`; `entered` is set when one waits."""

    def __init__(self, engine):
        self.model, self.original = engine.model, engine.model.forward_batch
        self.entered, self.go = threading.Event(), threading.Event()
        self.model.forward_batch = self._forward_batch

    def _forward_batch(self, items, *args, **kwargs):
        if not all(item.prefill for item in items):
            self.entered.set()
            self.go.wait(RPC_TIMEOUT_S)
        return self.original(items, *args, **kwargs)

    def release(self) -> None:
        self.go.set()
        del self.model.forward_batch  # the instance attribute: the class's method again


def test_abort_mid_generation_ends_the_stream_and_frees_the_sessions(traced_stack, caplog):
    gw = traced_stack.gateway()
    req = gen_request(PROMPT, max_tokens=64, spec="always")
    req.request_id = "abort-me"

    async def scenario():
        hold = HeldVerify(traced_stack.verifier_engine)
        try:
            call = gw.stub.Generate(req, timeout=RPC_TIMEOUT_S)
            first = await call.read()  # the prefill's anchor; round 1's verify is then held
            assert await asyncio.to_thread(hold.entered.wait, RPC_TIMEOUT_S)
            with pytest.raises(grpc.aio.AioRpcError) as dup:
                await gw.stub.Generate(req, timeout=RPC_TIMEOUT_S).read()
            reply = await gw.stub.Abort(gateway_pb2.AbortRequest(request_id="abort-me"), timeout=RPC_TIMEOUT_S)
        finally:
            hold.release()
        rest = []
        while (msg := await call.read()) is not grpc.aio.EOF:
            rest.append(msg)
        again = await gw.stub.Abort(gateway_pb2.AbortRequest(request_id="abort-me"), timeout=RPC_TIMEOUT_S)
        return first, dup.value, reply, rest, again, await call.code()

    with caplog.at_level(logging.INFO, logger="dspark.gateway"):
        first, dup, reply, rest, again, code = traced_stack.loop.run(scenario())
    assert dup.code() == grpc.StatusCode.ALREADY_EXISTS and "abort-me" in dup.details()
    assert reply.found and not again.found  # the registry forgot it when the generation ended
    assert code == grpc.StatusCode.OK
    assert len(first.token_ids) == 1 and len(rest) == 1
    final = rest[0]
    assert final.finished and final.finish_reason == "abort" and final.request_id == "abort-me"
    assert final.usage.completion_tokens == final.completion_tokens == 1  # round 1 never streamed
    assert final.text == first.text_delta and final.WhichOneof("matched_stop") is None
    assert traced_stack.wait_idle() == {"verifier_info": 0, "verifier_engine": 0,
                                        "drafter_info": 0, "drafter_engine": 0}
    assert any(r.getMessage().startswith("[request abort-me] aborted after 1 tokens") for r in caplog.records)
    after = _messages(traced_stack, gen_request(PROMPT, max_tokens=8))  # the gateway serves on
    assert after[-1].finish_reason == "length"


def test_abort_of_an_unknown_id_answers_not_found(traced_stack):
    gw = traced_stack.gateway()

    async def abort(rid: str):
        return await gw.stub.Abort(gateway_pb2.AbortRequest(request_id=rid), timeout=RPC_TIMEOUT_S)

    assert traced_stack.loop.run(abort("nobody")).found is False
    with pytest.raises(grpc.aio.AioRpcError) as err:
        traced_stack.loop.run(abort(""))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in err.value.details()


# ---------------------------------------------------------------------------- the registry
async def _counting(started: asyncio.Event, hold: asyncio.Event, closed: list):
    """Yields 0, then waits on `hold` before yielding 1 (as a generation awaits a backend)."""
    try:
        yield 0
        started.set()
        await hold.wait()
        yield 1
    finally:
        closed.append(True)


def test_registry_abort_between_and_during_steps(traced_stack):
    async def scenario():
        registry, closed = Registry(), []
        started, hold = asyncio.Event(), asyncio.Event()
        # during a step: the awaited step is cancelled and the generator ends through its finally
        running = registry.register("a")
        events = _counting(started, hold, closed)
        assert await running.next(events) == 0
        step = asyncio.ensure_future(running.next(events))
        await started.wait()
        assert registry.abort("a") and not registry.abort("b")
        with pytest.raises(GenerationAborted):
            await step
        during = list(closed)
        # between steps: the next call raises without touching the generator
        again = Registry().register("c")
        other = _counting(asyncio.Event(), asyncio.Event(), closed)
        assert await again.next(other) == 0
        again.abort()
        with pytest.raises(GenerationAborted):
            await again.next(other)
        await other.aclose()
        registry.remove(running)
        registry.register("x")
        with pytest.raises(DuplicateRequestId, match="'x'"):
            registry.register("x")
        registry.remove(registry.register("y"))
        return during, closed, len(registry), registry.abort("a")

    during, closed, left, found = traced_stack.loop.run(scenario())
    assert during == [True] and closed == [True, True] and left == 1 and found is False  # "x" remains


def test_a_cancel_of_the_caller_is_not_an_abort(traced_stack):
    async def scenario():
        started, hold, closed = asyncio.Event(), asyncio.Event(), []
        running = Registry().register("z")
        events = _counting(started, hold, closed)
        await running.next(events)
        task = asyncio.ensure_future(running.next(events))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return closed, running.aborted

    closed, aborted = traced_stack.loop.run(scenario())
    assert closed == [True] and aborted is False


def test_abort_after_the_final_message_finds_nothing_and_adds_no_message(traced_stack):
    gw = traced_stack.gateway()
    req = gen_request(PROMPT, max_tokens=8)
    req.request_id = "late"

    async def scenario():
        call = gw.stub.Generate(req, timeout=RPC_TIMEOUT_S)
        messages = [await call.read()]
        while not messages[-1].finished:
            messages.append(await call.read())
        reply = await gw.stub.Abort(gateway_pb2.AbortRequest(request_id="late"), timeout=RPC_TIMEOUT_S)
        return messages, reply, await call.read(), await call.code()

    messages, reply, after, code = traced_stack.loop.run(scenario())
    assert messages[-1].finish_reason == "length" and reply.found is False
    assert after is grpc.aio.EOF and code == grpc.StatusCode.OK
