"""Adversarial checks of today's changes (HTTP front, gateway, verifier step loop): each test
pins a defect found by attacking a live stack."""

from __future__ import annotations

import http.client
import json
import socket

import pytest

from services.http.server import start_http_front
from services_fixtures import start_stack

TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def front():
    stack = start_stack("oracle")
    gw = stack.loop.run(stack.start_gateway("sequential"))
    http_front = stack.loop.run(start_http_front(gw.server, gw.scheduler, None, 0, generate_timeout_s=TIMEOUT_S))
    stack.http_port = http_front.http.port
    yield stack
    stack.loop.run(http_front.http.stop(1.0))
    stack.loop.run(gw.close())
    stack.close()


def _post(port: int, path: str, body: bytes) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": 123}, "prompt", "valid string"),
    ({"prompt": "ab\ud800"}, "prompt", "lone surrogate"),
    ({}, "prompt", "Field required"),
    ({"messages": []}, "messages", "at least 1 item"),
])
def test_tokenize_refusal_names_the_field_of_the_form_sent(front, body, param, words):
    # A bad text prompt used to be reported as the chat form's missing `messages`
    # (param "TokenizeChat"), never naming `prompt` or what was wrong with it.
    code, reply = _post(front.http_port, "/tokenize", json.dumps(body).encode())
    assert code == 400, reply
    assert reply["error"]["param"] == param, reply
    assert reply["error"]["message"].startswith(f"{param}:") and words in reply["error"]["message"], reply


def test_tokenize_both_forms_still_work(front):
    code, text = _post(front.http_port, "/tokenize", json.dumps({"prompt": "ab"}).encode())
    assert code == 200 and text["count"] == 2
    code, chat = _post(front.http_port, "/tokenize",
                       json.dumps({"messages": [{"role": "user", "content": "ab"}]}).encode())
    assert code == 200 and chat["count"] > 2


def _raw_post(port: int, path: str, body: bytes, extra_header: bytes) -> tuple[int, dict]:
    head = (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            + extra_header + b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
        sock.sendall(head + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1] or b"{}")


@pytest.mark.parametrize("header", [b"Authorization: Bearer caf\xc3\xa9", b"Authorization: Bearer a\x01b"])
@pytest.mark.parametrize("stream", [False, True])
def test_an_authorization_header_grpc_cannot_carry_is_a_400_not_a_500(front, header, stream):
    # Without a configured token the header is forwarded as gRPC metadata; a non-ASCII or
    # control character made the gRPC call fail before it started: 500 "Invalid metadata".
    body = json.dumps({"prompt": "ab", "max_tokens": 2, "stream": stream}).encode()
    code, reply = _raw_post(front.http_port, "/v1/completions", body, header)
    assert code == 400, reply
    assert reply["error"]["type"] == "invalid_request_error"
    assert reply["error"]["message"].startswith("Authorization header:"), reply
    assert "caf" not in reply["error"]["message"]  # the token is never echoed
    assert not any(front.wait_idle(TIMEOUT_S).values())
