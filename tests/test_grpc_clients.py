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
import time
import urllib.request

import grpc
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


@pytest.mark.parametrize("metadata, given", [((), None), ((("x-request-id", "x" * 200),), None),
                                              ((("x-request-id", "refused-7"),), "refused-7")])
def test_a_refused_call_carries_its_request_id_in_trailers_and_the_log(oracle_stack, caplog, metadata, given):  # noqa: F811
    gw = oracle_stack.gateway()
    bad = gen_request(PROMPT, max_tokens=0) if given or not metadata else gen_request(PROMPT, max_tokens=4)
    with caplog.at_level(logging.INFO, logger="dspark.requests"):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            oracle_stack.loop.run(_call(gw.stub, bad, metadata))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    rid = dict(err.value.trailing_metadata())["x-request-id"]
    assert rid == given if given else HEX_ID.fullmatch(rid)  # a bad client id is replaced, not echoed
    (line,) = [r for r in caplog.records if r.getMessage() == "request refused"]
    fields = line.dspark_fields
    assert (fields["request_id"], fields["status"], fields["finish_reason"]) == (rid, "INVALID_ARGUMENT", "refused")
    assert ("max_tokens" if not metadata or given else "request_id") in fields["message"]


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
