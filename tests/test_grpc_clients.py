"""What gRPC clients in other languages rely on (issue 36): seeds that survive JSON and
JavaScript numbers, reflection v1, the `x-request-id` metadata and trailers, a keepalive policy
that lets common clients ping, and what a cancel sent with the call itself costs.

Real servers on port 0 and real channels (`services_fixtures`); the HTTP round trip goes through
the real HTTP front with `urllib` and `json.loads(parse_int=float)`, which reads every JSON
number as a double the way `JSON.parse` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket
import time
import urllib.request

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import pytest
from google.protobuf import descriptor_pb2, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dspark_proto.v1 import gateway_pb2
from services.common.reflection import V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME, v1_file_descriptor
from services.common.server import MIN_CLIENT_PING_INTERVAL_MS, start_server
from services.gateway.servicer import DRAWN_SEED_LIMIT, request_sampling
from services.http.server import RANDOM_MODEL_ID
from tests.services_fixtures import (RPC_TIMEOUT_S, gen_request, oracle_stack, service_loop,  # noqa: F401 (fixture)
                                     start_stack)
from tests.test_http_api import _start_front, _stop_front

PROMPT = "seeds for every language"
HEX_ID = re.compile(r"[0-9a-f]{32}")


def _sampled(seed: int | None = None, max_tokens: int = 6) -> gateway_pb2.GenerateRequest:
    req = gen_request(PROMPT, max_tokens=max_tokens, spec="always", temperature=0.9)
    if seed is not None:
        req.seed = seed
    return req


def _as_double(value: int) -> int:
    """`value` after a JSON round trip that reads numbers as doubles (JavaScript, JSON.parse)."""
    return int(json.loads(json.dumps({"seed": value}), parse_int=float)["seed"])


# ---------------------------------------------------------------------------- seeds in 53 bits
def test_drawn_seeds_fit_in_53_bits():
    # 256 draws: were seeds drawn below 2**63 again, each would exceed 2**53 with probability
    # 1 - 2**-10, so this fails with probability 1 - 2**-2560.
    seeds = {request_sampling(_sampled(), "coupled").seed for _ in range(256)}
    assert len(seeds) == 256 and max(seeds) < DRAWN_SEED_LIMIT == 2 ** 53
    assert all(_as_double(s) == s for s in seeds)


def test_a_drawn_seed_survives_json_as_a_double_and_replays(oracle_stack):  # noqa: F811
    first = oracle_stack.generate(_sampled())
    seed = first.final.seed
    assert 0 < seed < 2 ** 53 and _as_double(seed) == seed
    again = oracle_stack.generate(_sampled(_as_double(seed)))
    assert again.token_ids == first.token_ids and len(first.token_ids) == 6 and again.final.seed == seed


def test_a_clients_own_seed_above_2_53_still_works(oracle_stack):  # noqa: F811
    big = 2 ** 63 - 1
    first, again = oracle_stack.generate(_sampled(big)), oracle_stack.generate(_sampled(big))
    assert first.final.seed == big and again.token_ids == first.token_ids
    assert _as_double(big) != big  # what a double would have made of it: another seed


def test_a_seed_drawn_behind_http_survives_json_parse_as_doubles(oracle_stack):  # noqa: F811
    front = _start_front(oracle_stack)
    body = {"model": RANDOM_MODEL_ID, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.9, "ignore_eos": True}

    def post(payload: dict) -> dict:
        req = urllib.request.Request(f"{front.base_url}/completions", json.dumps(payload).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=RPC_TIMEOUT_S) as r:
            return json.loads(r.read(), parse_int=float)  # every number a double, as JSON.parse reads it
    try:
        first = post(body)
        # sent back as JSON.stringify writes an integral double: its digits, no fraction
        again = post({**body, "seed": int(first["seed"])})
    finally:
        _stop_front(front)
    assert first["seed"] == again["seed"] and first["seed"] < 2 ** 53
    assert again["choices"][0]["text"] == first["choices"][0]["text"]


# ---------------------------------------------------------------------------- reflection v1
def _v1_reflect(target: str, *requests) -> list:
    """Responses of one grpc.reflection.v1 ServerReflectionInfo stream (v1's own message classes)."""
    file = v1_file_descriptor()
    req_cls = message_factory.GetMessageClass(file.message_types_by_name["ServerReflectionRequest"])
    resp_cls = message_factory.GetMessageClass(file.message_types_by_name["ServerReflectionResponse"])
    with grpc.insecure_channel(target) as channel:
        call = channel.stream_stream(f"/{V1_SERVICE_NAME}/ServerReflectionInfo",
                                     request_serializer=req_cls.SerializeToString,
                                     response_deserializer=resp_cls.FromString)
        return list(call(iter([req_cls(**r) for r in requests]), timeout=10))


def test_reflection_v1_lists_and_describes_the_services(oracle_stack):  # noqa: F811
    listed, described = _v1_reflect(oracle_stack.gateway().target, {"list_services": ""},
                                    {"file_containing_symbol": "dspark.v1.Gateway"})
    assert sorted(s.name for s in listed.list_services_response.service) == sorted(
        ["dspark.v1.Gateway", "grpc.health.v1.Health", V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME])
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in described.file_descriptor_response.file_descriptor_proto]
    gateway = next(f for f in files if f.name == "dspark_proto/v1/gateway.proto")
    assert {m.name for m in gateway.service[0].method} == {"Generate", "Stats", "Abort"}
    assert "dspark_proto/v1/common.proto" in {f.name for f in files}  # its import comes along


def test_reflection_v1_describes_itself(oracle_stack):  # noqa: F811
    (reply,) = _v1_reflect(oracle_stack.verifier_target, {"file_containing_symbol": V1_SERVICE_NAME})
    (file,) = [descriptor_pb2.FileDescriptorProto.FromString(b) for b in reply.file_descriptor_response.file_descriptor_proto]
    assert (file.package, file.service[0].method[0].input_type) == (
        "grpc.reflection.v1", ".grpc.reflection.v1.ServerReflectionRequest")


# ---------------------------------------------------------------------------- x-request-id
async def _call(stub, req, metadata=()):
    """(messages, trailing metadata as a dict) of one Generate; raises AioRpcError."""
    call = stub.Generate(req, timeout=RPC_TIMEOUT_S, metadata=metadata)
    messages = [m async for m in call]
    return messages, dict(await call.trailing_metadata())


def test_x_request_id_metadata_is_the_request_id_when_the_field_is_empty(oracle_stack):  # noqa: F811
    gw = oracle_stack.gateway()
    req = gen_request(PROMPT, max_tokens=4)
    messages, trailers = oracle_stack.loop.run(_call(gw.stub, req, (("x-request-id", "from-metadata-1"),)))
    assert {m.request_id for m in messages} == {"from-metadata-1"} and trailers["x-request-id"] == "from-metadata-1"
    req.request_id = "from-field-1"  # the field wins over the metadata
    messages, trailers = oracle_stack.loop.run(_call(gw.stub, req, (("x-request-id", "from-metadata-2"),)))
    assert {m.request_id for m in messages} == {"from-field-1"} and trailers["x-request-id"] == "from-field-1"


@pytest.mark.parametrize("client_id, max_tokens, echoed, named", [
    (None, 0, False, "max_tokens"),           # no id given: a generated one
    ("x" * 200, 4, False, "request_id"),      # an unusable id: refused, and a generated one names the refusal
    ("refused-7", 0, True, "max_tokens"),     # the client's own id
])
def test_a_refused_call_carries_its_request_id_in_trailers_and_the_log(oracle_stack, caplog, client_id,  # noqa: F811
                                                                       max_tokens, echoed, named):
    gw = oracle_stack.gateway()
    metadata = (("x-request-id", client_id),) if client_id else ()
    with caplog.at_level(logging.INFO, logger="dspark.requests"):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            oracle_stack.loop.run(_call(gw.stub, gen_request(PROMPT, max_tokens=max_tokens), metadata))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    rid = dict(err.value.trailing_metadata())["x-request-id"]
    assert rid == client_id if echoed else HEX_ID.fullmatch(rid)
    (line,) = [r.dspark_fields for r in caplog.records if r.getMessage() == "request refused"]
    assert (line["request_id"], line["status"], line["finish_reason"]) == (rid, "INVALID_ARGUMENT", "refused")
    assert named in line["message"]


def test_a_backend_failure_carries_the_request_id_in_trailers():
    stack = start_stack("none")
    try:
        async def run():
            gw = await stack.agateway()
            await stack.verifier.server.stop(0)  # the gateway's Session call then fails UNAVAILABLE
            try:
                return await _call(gw.stub, gen_request(PROMPT, max_tokens=4))
            except grpc.aio.AioRpcError as exc:
                return exc
        err = stack.loop.run(run())
    finally:
        stack.close()
    assert isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.UNAVAILABLE
    assert HEX_ID.fullmatch(dict(err.trailing_metadata())["x-request-id"])


# ---------------------------------------------------------------------------- keepalive
def test_a_client_pinging_every_second_on_an_idle_channel_is_not_sent_goaway():
    """gRPC's default server policy sends GOAWAY too_many_pings on the third such ping (the
    channel then drops to IDLE); the servers' policy permits it. grpc-core clients ping at most
    once a second, so this client pings as often as one can."""
    assert MIN_CLIENT_PING_INTERVAL_MS <= 1000 // 2  # a 1 s pinger has twice the floor: jitter never strikes

    async def run():
        running = await start_server("grpc.health.v1.Health", lambda server: None)
        options = [("grpc.keepalive_time_ms", 1000), ("grpc.keepalive_permit_without_calls", 1),
                   ("grpc.http2.max_pings_without_data", 0)]
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}", options=options) as channel:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                states, end = set(), time.monotonic() + 3.3  # pings at about 1, 2 and 3 s
                while (left := end - time.monotonic()) > 0:
                    states.add(channel.get_state())
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(channel.wait_for_state_change(channel.get_state()), left)
                states.add(channel.get_state())
                return states
        finally:
            await running.stop(0)
    assert service_loop().run(run(), 30) == {grpc.ChannelConnectivity.READY}


# ---------------------------------------------------------------------------- a cancel sent with the call
class RawCalls:
    """Generate calls written as raw HTTP/2 frames (the `h2` library) on one connection, so a
    test decides exactly which frames share one TCP write: a call, its RST_STREAM, or none."""

    def __init__(self, port: int):
        self.port = port
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="ascii"))
        self.conn.initiate_connection()
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=RPC_TIMEOUT_S)

    def call(self, request: gateway_pb2.GenerateRequest, timeout: str, cancel: bool) -> int:
        """Queue a Generate call's HEADERS (grpc-timeout `timeout`, e.g. "500m") and its request
        DATA, then RST_STREAM(CANCEL) when `cancel`; returns the stream id. Nothing is sent yet."""
        stream = self.conn.get_next_available_stream_id()
        self.conn.send_headers(stream, [
            (":method", "POST"), (":scheme", "http"), (":path", "/dspark.v1.Gateway/Generate"),
            (":authority", f"127.0.0.1:{self.port}"), ("content-type", "application/grpc"), ("te", "trailers"),
            ("grpc-timeout", timeout)])
        body = request.SerializeToString()
        self.conn.send_data(stream, b"\x00" + len(body).to_bytes(4, "big") + body, end_stream=True)
        if cancel:
            self.conn.reset_stream(stream, h2.errors.ErrorCodes.CANCEL)
        return stream

    def send(self) -> None:
        """Write everything queued in one `sendall`."""
        self.sock.sendall(self.conn.data_to_send())

    def trailers(self, stream: int) -> dict:
        """Read until `stream` ends; its trailers (grpc-status ...). Raises TimeoutError (socket)."""
        while True:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("the server closed the connection")
            for event in self.conn.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                if isinstance(event, h2.events.TrailersReceived) and event.stream_id == stream:
                    return dict(event.headers)
            self.send()  # settings and ping acks, window updates

    def close(self) -> None:
        self.sock.close()


def _finished_lines(caplog, rid: str) -> list[dict]:
    return [r.dspark_fields for r in caplog.records
            if r.getMessage() == "request finished" and r.dspark_fields["request_id"] == rid]


def test_a_cancel_written_with_the_call_is_seen_before_anything_runs(oracle_stack, caplog):  # noqa: F811
    """A RST_STREAM in the same write as the call's HEADERS (the earliest a cancel can arrive):
    grpcio never starts the handler, so no generation, session or log line exists for it. A
    second call behind it on the same connection runs normally."""
    gw = oracle_stack.gateway()
    cancelled, kept = gen_request(PROMPT, max_tokens=200, spec="off"), gen_request(PROMPT, max_tokens=4)
    cancelled.request_id, kept.request_id = "cancelled-with-the-call", "sent-after-it"
    raw = RawCalls(gw.server.port)
    with caplog.at_level(logging.INFO, logger="dspark.requests"):
        try:
            raw.call(cancelled, "60S", cancel=True)
            second = raw.call(kept, "60S", cancel=False)
            raw.send()
            assert raw.trailers(second)["grpc-status"] == "0"
        finally:
            raw.close()
        # had the cancelled call started, it would still be generating: idle means it ended, with its line
        assert oracle_stack.wait_idle() == {"verifier_info": 0, "verifier_engine": 0, "drafter_info": 0,
                                            "drafter_engine": 0}
    assert _finished_lines(caplog, "cancelled-with-the-call") == []
    assert _finished_lines(caplog, "sent-after-it")[0]["completion_tokens"] == 4


def test_a_cancel_grpc_js_never_sends_costs_at_most_the_calls_deadline(oracle_stack, caplog):  # noqa: F811
    """grpc-js 1.14 sends no RST_STREAM at all for `call.cancel()` in the tick that started the
    call (HEADERS and DATA go out, the cancel is dropped in the client; a later tick's cancel is
    sent), so no server can see it. The call's deadline bounds what it costs: the server
    enforces grpc-timeout, the generation ends there ("abort") long before its max_tokens, and
    its sessions are freed (docs/services.md §10)."""
    gw = oracle_stack.gateway()
    req = gen_request(PROMPT, max_tokens=220, spec="off")
    req.request_id = "cancel-never-sent"
    raw = RawCalls(gw.server.port)
    with caplog.at_level(logging.INFO, logger="dspark.requests"):
        try:
            stream = raw.call(req, "500m", cancel=False)  # what grpc-js writes: the call, no cancel
            raw.send()
            assert raw.trailers(stream)["grpc-status"] == str(grpc.StatusCode.DEADLINE_EXCEEDED.value[0])
        finally:
            raw.close()
        assert oracle_stack.wait_idle() == {"verifier_info": 0, "verifier_engine": 0, "drafter_info": 0,
                                            "drafter_engine": 0}
    (line,) = _finished_lines(caplog, req.request_id)
    assert line["finish_reason"] == "abort" and line["completion_tokens"] < req.max_tokens
