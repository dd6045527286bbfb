"""Adversarial inputs against the HTTP front, Gateway.Abort, the request log line and `dspark stats`.

Real servers on port 0 (`services_fixtures`): a verifier, a live oracle drafter, a gateway
and its HTTP front. Each test pins a defect found by driving these surfaces with bad input,
disconnects and wrong targets; the HTTP side uses raw sockets and `http.client`, so nothing
between the test and the server smooths the input.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import time

import grpc
import pytest

from dspark_proto.v1 import gateway_pb2
from services.cli import main
from services.common.logs import FIELDS
from services.common.metrics import served_model_name
from services.http.server import model_id, start_http_front
from services_fixtures import RPC_TIMEOUT_S, gen_request, start_stack

TIMEOUT_S = 60.0
LONG = 200  # tokens: a generation far longer than the few messages a test waits for


@pytest.fixture(scope="module")
def front():
    stack = start_stack("oracle")
    gw = stack.loop.run(stack.start_gateway("sequential"))
    http = stack.loop.run(start_http_front(gw.server, gw.scheduler, None, 0, generate_timeout_s=TIMEOUT_S))
    stack.http_port, stack.gw = http.http.port, gw
    yield stack
    stack.loop.run(http.http.stop(1.0))
    stack.loop.run(gw.close())
    stack.close()


def _request(port: int, method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        conn.request(method, path, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _request_lines(caplog) -> list[dict]:
    return [getattr(r, FIELDS) for r in caplog.records if r.name == "dspark.requests"]


# ---------------------------------------------------------------------------- HTTP
def test_a_client_that_drops_a_whole_response_request_aborts_its_generation(front, caplog):
    body = json.dumps({"prompt": "gone", "max_tokens": LONG, "ignore_eos": True, "spec": "off"}).encode()
    with caplog.at_level(logging.INFO, logger="dspark.requests"):
        with socket.create_connection(("127.0.0.1", front.http_port), timeout=TIMEOUT_S) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            deadline = time.monotonic() + TIMEOUT_S  # closed once the generation holds a verifier session
            while not front.loop.run(front.aopen_sessions())["verifier_engine"] and time.monotonic() < deadline:
                time.sleep(0.02)
        deadline = time.monotonic() + TIMEOUT_S
        while not _request_lines(caplog) and time.monotonic() < deadline:  # the line is logged at the end
            time.sleep(0.05)
        counts = front.wait_idle(TIMEOUT_S)
    assert not any(counts.values()), counts
    (line,) = _request_lines(caplog)
    # cancelled with the connection, not generated to its last token for nobody
    assert line["finish_reason"] == "abort" and line["completion_tokens"] < LONG


@pytest.mark.parametrize("method, path, body, status, message", [
    ("GET", "/v1/completions", None, 405, "GET /v1/completions: Method Not Allowed"),
    ("POST", "/v1/completions", b"", 400, "request body: Field required"),
    ("POST", "/v1/completions", b"[1, 2]", 400, "request body: Input should be a valid dictionary"),
])
def test_client_faults_outside_the_status_table_are_typed_as_the_clients(front, method, path, body, status, message):
    code, reply = _request(front.http_port, method, path, body)
    assert code == status
    assert reply["error"]["type"] == "invalid_request_error"
    assert reply["error"]["message"].startswith(message)


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"prompt": "ab\udcff", "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": "ab", "max_tokens": 4, "stop": ["x\ud800"]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, "messages"),
])
def test_a_lone_surrogate_in_any_text_field_is_a_400_naming_the_field(front, path, body, field):
    # json.dumps writes the surrogate as an escape, which JSON allows and UTF-8 cannot encode
    code, reply = _request(front.http_port, "POST", path, json.dumps(body).encode())
    assert code == 400, reply
    assert reply["error"]["type"] == "invalid_request_error"
    assert field in reply["error"]["message"] and "lone surrogate" in reply["error"]["message"]
    assert not any(front.wait_idle(TIMEOUT_S).values())


def test_models_lists_the_name_the_metrics_label_carries(front):
    code, reply = _request(front.http_port, "GET", "/v1/models")
    assert code == 200 and [m["id"] for m in reply["data"]] == [served_model_name(None)]
    assert model_id("some/dir/dsv4-flash/") == served_model_name("some/dir/dsv4-flash/") == "dsv4-flash"


# ---------------------------------------------------------------------------- gRPC and the log line
def test_the_log_line_of_an_aborted_request_counts_the_tokens_it_streamed(front, caplog):
    req = gen_request("abort me", max_tokens=LONG)
    req.request_id = "adv-abort"

    async def run():
        messages = []
        async for msg in front.gw.stub.Generate(req, timeout=RPC_TIMEOUT_S):
            messages.append(msg)
            if len(messages) == 2:
                reply = await front.gw.stub.Abort(gateway_pb2.AbortRequest(request_id="adv-abort"), timeout=5)
                assert reply.found
        return messages[-1]

    with caplog.at_level(logging.INFO, logger="dspark.requests"):
        final = front.loop.run(run())
    assert final.finish_reason == "abort" and 0 < final.completion_tokens < LONG
    (line,) = _request_lines(caplog)
    assert (line["request_id"], line["finish_reason"]) == ("adv-abort", "abort")
    assert line["completion_tokens"] == final.completion_tokens
    assert line["ttft_ms"] is not None and line["ttft_ms"] <= line["duration_ms"]


@pytest.mark.parametrize("rid, fault", [("x" * 129, "at most 128"), ("a\nb", "printable")])
def test_abort_refuses_an_id_generate_would_refuse(front, rid, fault):
    async def run():
        await front.gw.stub.Abort(gateway_pb2.AbortRequest(request_id=rid), timeout=5)

    with pytest.raises(grpc.aio.AioRpcError) as err:
        front.loop.run(run())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and fault in err.value.details()


# ---------------------------------------------------------------------------- dspark stats
def test_stats_against_a_verifier_port_says_it_is_not_a_gateway(front, capsys):
    assert main(["stats", "--target", front.verifier_target, "--timeout", "5"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"dspark stats: {front.verifier_target}: UNIMPLEMENTED")
    assert "does not serve dspark.v1.Gateway" in err


def test_stats_refuses_an_empty_target_in_one_line(capsys):
    assert main(["stats", "--target", "", "--timeout", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "dspark stats: --target='': empty (a host:port or a gRPC target such as dns:///name:port)"
