"""The OpenAI-compatible HTTP front, driven by the official `openai` client and by raw HTTP.

Real servers on port 0: a verifier, a live oracle drafter that corrupts some draft slots (so
both accepted and rejected prediction tokens occur), a gateway (sequential verify: exact, so
repeated runs agree) and its HTTP front, which reaches the gateway over a real gRPC channel.
The gRPC side of each comparison goes through the same gateway's stub.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from google.protobuf.json_format import MessageToDict

from services.http.routes import MISSING_HEADER
from services.http.server import GatewayWithHttp, RANDOM_MODEL_ID, start_http_front
from services.settings import http_port, read_settings
from tests.services_fixtures import GatewayHandle, ServiceStack, collect, gen_request, start_stack

REPO = Path(__file__).resolve().parents[1]
TOKEN = "http-Token_0123"
PROMPT = "The quick brown fox"
TIMEOUT_S = 60.0
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@dataclass
class Front:
    stack: ServiceStack
    gateway: GatewayHandle
    http: GatewayWithHttp

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http.http.port}/v1"

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=TIMEOUT_S)

    def grpc(self, prompt: str = PROMPT, **kwargs):
        """The same generation through the gateway's gRPC API (a `Generation`)."""
        return self.stack.loop.run(collect(self.gateway.stub, gen_request(prompt, **kwargs)))


def _start_front(stack: ServiceStack, checkpoint: str | None = None, token: str = "") -> Front:
    gw = stack.loop.run(stack.start_gateway("sequential", token=token))
    http = stack.loop.run(start_http_front(gw.server, gw.scheduler, checkpoint, 0, token=token,
                                           generate_timeout_s=TIMEOUT_S))
    return Front(stack, gw, http)


def _stop_front(front: Front) -> None:
    front.stack.loop.run(front.http.http.stop(1.0))
    front.stack.loop.run(front.gateway.close())


@pytest.fixture(scope="module")
def stack():
    s = start_stack("oracle", corrupt_every=3)
    yield s
    s.close()


@pytest.fixture(scope="module")
def front(stack):
    f = _start_front(stack)
    yield f
    _stop_front(f)


def _post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict, str]:
    """(status, headers, body text) of a raw POST (no client library in between)."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json",
                                                                  **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            return resp.status, dict(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read().decode()


# ---------------------------------------------------------------------------- completions
def test_completion_matches_grpc_tokens_usage_and_stats(front):
    r = front.client().completions.create(model=RANDOM_MODEL_ID, prompt=PROMPT, max_tokens=20, temperature=0,
                                          extra_body={"ignore_eos": True, "spec": "always",
                                                      "return_token_ids": True})
    g = front.grpc(max_tokens=20, spec="always")
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == g.token_ids and len(g.token_ids) == 20
    assert choice.text == g.final.text and choice.finish_reason == "length" == g.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(PROMPT.encode()), 20)
    assert r.usage.total_tokens == len(PROMPT.encode()) + 20
    stats = g.final.spec_stats
    details = r.usage.completion_tokens_details
    assert details.accepted_prediction_tokens == stats.accepted > 0
    assert details.rejected_prediction_tokens == stats.submitted - stats.accepted > 0
    dspark = r.model_extra["dspark"]
    assert {k: dspark[k] for k in ("rounds", "drafted", "submitted", "accepted", "plain_rounds")} == \
        {"rounds": stats.rounds, "drafted": stats.drafted, "submitted": stats.submitted,
         "accepted": stats.accepted, "plain_rounds": stats.plain_rounds}
    assert r.object == "text_completion" and r.model == RANDOM_MODEL_ID and r.id.startswith("cmpl-")


def test_accepted_prediction_tokens_count_only_what_the_completion_holds(front):
    """A stop token inside a round's accepted block cuts the completion there: the drafts
    accepted after it were verified (spec_stats.accepted counts them, as the gate learns) but
    never streamed, so OpenAI's accepted_prediction_tokens leaves them out and never exceeds
    the completion's drafted tokens (all but the first, which the prefill chose)."""
    full = front.grpc(max_tokens=20, spec="always", ignore_eos=True).token_ids
    cut_inside = 0
    for i in range(2, 12):
        if full[i] in full[:i]:
            continue  # the stop must first appear at position i
        r = front.client().completions.create(
            model=RANDOM_MODEL_ID, prompt=PROMPT, max_tokens=20, temperature=0,
            extra_body={"ignore_eos": True, "spec": "always", "stop_token_ids": [full[i]]})
        g = front.grpc(max_tokens=20, spec="always", ignore_eos=True, stop_token_ids=[full[i]])
        details, stats = r.usage.completion_tokens_details, g.final.spec_stats
        assert r.usage.completion_tokens == i + 1 == len(g.token_ids)
        assert details.accepted_prediction_tokens == g.final.spec_accepted_tokens <= i
        assert details.rejected_prediction_tokens == stats.submitted - details.accepted_prediction_tokens
        cut_inside += stats.accepted > details.accepted_prediction_tokens
    assert cut_inside > 0  # some stop did land inside an accepted block


def test_token_id_prompt_and_one_element_batch_give_the_same_completion(front):
    ids = list(PROMPT.encode())
    ids = [b + 2 for b in ids]  # the random model's byte tokenizer: byte + 2
    client = front.client()
    by_text = client.completions.create(model=RANDOM_MODEL_ID, prompt=PROMPT, max_tokens=6,
                                        extra_body={"ignore_eos": True})
    by_ids = client.completions.create(model=RANDOM_MODEL_ID, prompt=ids, max_tokens=6,
                                       extra_body={"ignore_eos": True})
    batch_of_one = client.completions.create(model=RANDOM_MODEL_ID, prompt=[PROMPT], max_tokens=6,
                                             extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == by_text.choices[0].text == batch_of_one.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_streaming_matches_the_whole_response_and_ends_with_usage(front):
    client = front.client()
    whole = client.completions.create(model=RANDOM_MODEL_ID, prompt=PROMPT, max_tokens=16,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    chunks = list(client.completions.create(model=RANDOM_MODEL_ID, prompt=PROMPT, max_tokens=16, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True, "return_token_ids": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [t for c in text_chunks for t in c.choices[0].model_extra["token_ids"]] == \
        whole.choices[0].model_extra["token_ids"]
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert text_chunks[-1].model_extra["dspark"] == whole.model_extra["dspark"] | {
        "time_to_first_token_ms": text_chunks[-1].model_extra["dspark"]["time_to_first_token_ms"]}
    last = chunks[-1]
    assert last.choices == [] and last.usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_sse_framing(front):
    status, headers, body = _post(front.base_url + "/completions",
                                  {"prompt": PROMPT, "max_tokens": 4, "stream": True, "ignore_eos": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = body.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert len({p["id"] for p in payloads}) == 1 and "usage" not in payloads[0]


def test_stop_string_and_max_tokens(front):
    client = front.client()
    full = client.completions.create(model=RANDOM_MODEL_ID, prompt=PROMPT, max_tokens=24,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[10:13]
    cut = client.completions.create(model=RANDOM_MODEL_ID, prompt=PROMPT, max_tokens=24, stop=[stop, "\x00zz"],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].text == full[:full.find(stop)] and cut.choices[0].finish_reason == "stop"
    g = front.grpc(max_tokens=24, stop=[stop, "\x00zz"], spec="default")
    assert cut.usage.completion_tokens == g.final.usage.completion_tokens < 24
    short = client.completions.create(model=RANDOM_MODEL_ID, prompt=PROMPT, max_tokens=3,
                                      extra_body={"ignore_eos": True})
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize("kwargs, param, words", [
    ({"temperature": -0.7}, "temperature", "temperature=-0.7: must be >= 0"),
    ({"top_p": 1.5}, "top_p", "top_p=1.5: must lie in (0, 1]"),
    ({"logprobs": 21}, "logprobs", "logprobs=21: must lie in 0..20"),
    ({"seed": 2**63}, "seed", "seed=9223372036854775808: must lie in [-2**63, 2**63)"),
    ({"extra_body": {"top_k": -2}}, "top_k", "top_k=-2: must be >= 0"),
    ({"extra_body": {"min_p": 1.5}}, "min_p", "min_p=1.5: must lie in [0, 1]"),
    ({"n": 2, "best_of": 3}, "best_of", "best_of=3: candidates are not ranked here"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias", "logit_bias[5]=-100.5: must lie in [-100, 100]"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens=0: must be >= 1, or 0 with echo=true or prompt_logprobs set"),
    ({"max_tokens": -1}, "max_tokens", "max_tokens: Input should be greater than or equal to 0"),
])
def test_unsupported_fields_are_400_naming_the_field(front, kwargs, param, words):
    args = {"model": RANDOM_MODEL_ID, "prompt": PROMPT, "max_tokens": 4} | kwargs
    with pytest.raises(openai.BadRequestError) as err:
        front.client().completions.create(**args)
    assert err.value.status_code == 400 and err.value.param == param
    assert words in err.value.message and err.value.type == "invalid_request_error"


def test_gateway_refusals_map_to_http_statuses(front):
    client = front.client()
    with pytest.raises(openai.BadRequestError) as err:  # the gateway's INVALID_ARGUMENT
        client.completions.create(model=RANDOM_MODEL_ID, prompt=PROMPT, max_tokens=1000)
    assert "exceeds max_seq_len=256" in err.value.message and err.value.code == "invalid_argument"
    assert err.value.param == "prompt"  # the gateway's message starts with the field it refused
    with pytest.raises(openai.BadRequestError) as err:  # a token id outside the vocabulary
        client.completions.create(model=RANDOM_MODEL_ID, prompt=[5, 10**6], max_tokens=2, stream=True)
    assert "prompt token id 1000000 outside" in err.value.message
    assert err.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as err:  # not "stop": the message's first word
        client.completions.create(model=RANDOM_MODEL_ID, prompt=PROMPT, max_tokens=2, extra_body={"stop_token_ids": [10**6]})
    assert "stop token id 1000000 outside" in err.value.message and err.value.param == "stop_token_ids"
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert "model='gpt-4'" in err.value.message and err.value.param == "model"
    status, _, body = _post(front.base_url + "/nowhere", {})
    assert status == 404 and json.loads(body)["error"]["type"] == "not_found_error"
    status, _, body = _post(front.base_url + "/completions", {"prompt": ["a", ""]})
    assert status == 400 and json.loads(body)["error"]["message"] == "prompt[1]: empty (give text or token ids)"
    assert "Traceback" not in body
    raw = urllib.request.Request(front.base_url + "/completions", b"{bad json", {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(raw, timeout=TIMEOUT_S)
    error = json.loads(err.value.read())["error"]
    assert err.value.code == 400 and error["code"] == "invalid_json" and error["param"] is None
    assert error["message"].startswith("request body: not valid JSON")


def test_client_that_disconnects_closes_the_backend_sessions(front, stack):
    finished_before = front.gateway.scheduler.stats.generations
    stream = front.client().completions.create(model=RANDOM_MODEL_ID, prompt=PROMPT, max_tokens=200,
                                               stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    assert set(stack.wait_idle().values()) == {0}
    assert front.gateway.scheduler.stats.generations == finished_before  # cancelled, not run to its end


# ---------------------------------------------------------------------------- other endpoints
def test_models_and_health(front):
    models = front.client().models.list()
    assert [m.id for m in models.data] == [RANDOM_MODEL_ID]
    assert models.data[0].model_extra["max_model_len"] == 256
    with urllib.request.urlopen(f"http://127.0.0.1:{front.http.http.port}/health", timeout=TIMEOUT_S) as resp:
        assert resp.status == 200 and json.loads(resp.read()) == {"status": "ok"}


def test_chat_without_a_template_is_a_clear_400(stack, tmp_path):
    folder = tmp_path / "untemplated-model"
    folder.mkdir()
    f = _start_front(stack, str(folder))
    try:
        with pytest.raises(openai.BadRequestError) as err:
            f.client().chat.completions.create(model="untemplated-model", messages=[{"role": "user", "content": "hi"}])
        assert "no chat template" in err.value.message and err.value.code == "chat_template_missing"
    finally:
        _stop_front(f)


def test_chat_with_a_template_renders_it_and_streams(stack, tmp_path):
    folder = tmp_path / "templated-model"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|eos|>"}))
    f = _start_front(stack, str(folder))
    try:
        client = f.client()
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count: 1 2 3"}]
        rendered = "<system>Be brief.</system>\n<user>Count: 1 2 3</user>\n<assistant>"
        chat = client.chat.completions.create(model="templated-model", messages=messages, max_tokens=8,
                                              extra_body={"ignore_eos": True})
        plain = client.completions.create(model="templated-model", prompt=rendered, max_tokens=8,
                                          extra_body={"ignore_eos": True})
        assert chat.choices[0].message.content == plain.choices[0].text
        assert chat.choices[0].message.role == "assistant" and chat.object == "chat.completion"
        assert chat.usage.prompt_tokens == len(rendered.encode()) == plain.usage.prompt_tokens
        chunks = list(client.chat.completions.create(model="templated-model", messages=messages, max_tokens=8,
                                                     stream=True, extra_body={"ignore_eos": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == plain.choices[0].text
        assert chunks[-1].choices[0].finish_reason == "length"
    finally:
        _stop_front(f)


# ---------------------------------------------------------------------------- auth
def test_bearer_token_is_required_and_forwarded(stack):
    f = _start_front(stack, token=TOKEN)
    try:
        with pytest.raises(openai.AuthenticationError) as err:
            f.client("wrong").completions.create(model=RANDOM_MODEL_ID, prompt=PROMPT, max_tokens=2)
        assert err.value.status_code == 401 and "wrong" not in err.value.message
        status, _, body = _post(f.base_url + "/completions", {"prompt": PROMPT, "max_tokens": 2})
        assert status == 401 and json.loads(body)["error"]["message"] == MISSING_HEADER
        ok = f.client(TOKEN).completions.create(model=RANDOM_MODEL_ID, prompt=PROMPT, max_tokens=2)
        assert ok.usage.completion_tokens >= 1
        assert [m.id for m in f.client(TOKEN).models.list().data] == [RANDOM_MODEL_ID]
    finally:
        _stop_front(f)


def test_same_tokens_usage_and_stats_over_http_stream_and_grpc(front):
    """One prompt and parameter set, three ways: gRPC, HTTP whole, HTTP streamed."""
    g = front.grpc("def f(x):", max_tokens=12, spec="always", stop=["zz"])
    body = {"model": RANDOM_MODEL_ID, "prompt": "def f(x):", "max_tokens": 12, "spec": "always", "stop": "zz",
            "ignore_eos": True, "return_token_ids": True}
    _, _, whole = _post(front.base_url + "/completions", body)
    whole = json.loads(whole)
    _, _, streamed = _post(front.base_url + "/completions",
                           body | {"stream": True, "stream_options": {"include_usage": True}})
    events = [json.loads(e[len("data: "):]) for e in streamed.split("\n\n")[:-2]]
    stats = MessageToDict(g.final.spec_stats, preserving_proto_field_name=True,
                          always_print_fields_with_no_presence=True)
    assert whole["choices"][0]["token_ids"] == g.token_ids
    assert [t for e in events if e["choices"] for t in e["choices"][0]["token_ids"]] == g.token_ids
    assert whole["usage"] == events[-1]["usage"]
    assert (whole["usage"]["prompt_tokens"], whole["usage"]["completion_tokens"]) == \
        (g.final.usage.prompt_tokens, g.final.usage.completion_tokens)
    for got in (whole["dspark"], events[-2]["dspark"]):
        assert {k: v for k, v in got.items() if k != "time_to_first_token_ms"} == stats


# ---------------------------------------------------------------------------- settings and start-up
def test_http_port_setting():
    assert read_settings({"DSPARK_HTTP_PORT": "8000"}, "gateway").http_port == 8000
    assert read_settings({}, "gateway").http_port is None
    assert read_settings({"DSPARK_HTTP_PORT": "8000"}, "gateway", http_port_flag=0).http_port == 0
    assert read_settings({"DSPARK_HTTP_PORT": "8000"}, "verifier").http_port is None
    with pytest.raises(ValueError, match=r"DSPARK_HTTP_PORT='80a': must be an integer in \[0, 65535\]"):
        read_settings({"DSPARK_HTTP_PORT": "80a"}, "gateway")
    with pytest.raises(ValueError, match=r"--http-port=70000: must be in \[0, 65535\]"):
        read_settings({}, "gateway", http_port_flag=70000)
    with pytest.raises(ValueError, match="DSPARK_HTTP_PORT=8000 with DSPARK_GATEWAY_TLS_CERT"):
        http_port(None, {"DSPARK_HTTP_PORT": "8000"}, gateway_tls=True)


def test_cli_refuses_a_bad_http_port_in_one_line():
    for args, words in ((["serve", "gateway", "--http-port", "70000"], "--http-port=70000: must be in [0, 65535]"),
                        (["up", "--http-port", "-1"], "--http-port=-1: must be in [0, 65535]")):
        out = subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=REPO, capture_output=True,
                             text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL,
                             env={k: v for k, v in os.environ.items() if not k.startswith("DSPARK_")})
        assert out.returncode == 2 and "Traceback" not in out.stderr
        assert words in out.stderr.strip().splitlines()[-1]


def test_a_taken_http_port_is_a_named_error(stack):
    gw = stack.loop.run(stack.start_gateway("sequential"))
    taken = socket.socket()
    try:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"HTTP front: could not bind 127.0.0.1:{port}"):
            stack.loop.run(start_http_front(gw.server, gw.scheduler, None, port))
    finally:
        taken.close()
        stack.loop.run(gw.close())


def test_unreachable_gateway_is_503_and_an_expired_deadline_504(stack):
    f = _start_front(stack)
    late = None
    try:
        late = stack.loop.run(start_http_front(f.gateway.server, f.gateway.scheduler, None, 0,
                                               generate_timeout_s=0.001))
        with pytest.raises(openai.APIStatusError) as err:  # the front's deadline on its Generate call expires
            openai.OpenAI(base_url=f"http://127.0.0.1:{late.http.port}/v1", api_key="unused", max_retries=0,
                          timeout=TIMEOUT_S).completions.create(model=RANDOM_MODEL_ID, prompt=PROMPT, max_tokens=50)
        assert err.value.status_code == 504 and err.value.code == "deadline_exceeded"
        stack.loop.run(f.gateway.server.stop(0))
        with pytest.raises(openai.APIStatusError) as err:
            f.client().completions.create(model=RANDOM_MODEL_ID, prompt=PROMPT, max_tokens=2)
        assert err.value.status_code == 503 and err.value.type == "service_unavailable"
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"http://127.0.0.1:{f.http.http.port}/health", timeout=TIMEOUT_S)
        assert health.value.code == 503
    finally:
        if late is not None:
            stack.loop.run(late.http.stop(1.0))
        _stop_front(f)


def test_request_id_and_matched_stop_reach_the_http_response(front):
    client = front.client()
    full = client.completions.create(model=RANDOM_MODEL_ID, prompt=PROMPT, max_tokens=24,
                                     extra_body={"ignore_eos": True}).choices[0].text
    cut = client.completions.create(model=RANDOM_MODEL_ID, prompt=PROMPT, max_tokens=24, stop=full[10:13],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].model_extra["stop_reason"] == full[10:13]
    assert cut.choices[0].finish_reason == "stop"
    _, _, raw = _post(front.base_url + "/completions", {"prompt": PROMPT, "max_tokens": 3, "stream": True,
                                                        "ignore_eos": True})
    finish = json.loads(raw.split("\n\n")[-3][len("data: "):])
    assert finish["choices"][0]["stop_reason"] is None and finish["choices"][0]["finish_reason"] == "length"


def test_the_http_id_is_the_gateway_request_id(front):
    """Gateway.Abort with the id of an HTTP stream, under the bearer token the stream was started
    with (the client's api_key), ends that stream (finish_reason "abort")."""
    from dspark_proto.v1 import gateway_pb2
    stream = front.client().completions.create(model=RANDOM_MODEL_ID, prompt=PROMPT, max_tokens=200,
                                               stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)

    async def abort():
        return await front.gateway.stub.Abort(gateway_pb2.AbortRequest(request_id=first.id), timeout=10,
                                              metadata=(("authorization", "Bearer unused"),))

    reply = front.stack.loop.run(abort())
    rest = list(chunks)
    assert reply.found and rest[-1].choices[0].finish_reason == "abort"
    assert rest[-1].model_extra["dspark"]["rounds"] < 200


def test_request_validation_runs_off_the_event_loop(front, monkeypatch):
    """Tokenizing a prompt (seconds for a 4 MiB one) and compiling a grammar must not hold the
    event loop that streams every other generation: `Scheduler.params` runs on a worker
    thread, for gRPC and HTTP requests alike."""
    import threading
    scheduler = front.gateway.scheduler
    seen: list[str] = []
    real = scheduler.params
    monkeypatch.setattr(scheduler, "params", lambda *a, **kw: (seen.append(threading.current_thread().name),
                                                                 real(*a, **kw))[1])
    front.grpc(max_tokens=2)
    front.client().completions.create(model=RANDOM_MODEL_ID, prompt=PROMPT, max_tokens=2)
    assert len(seen) == 2 and "service-loop" not in seen  # the servers' event loop thread (services_fixtures)
