"""The HTTP front as the clients people run use it: batches and n, chat by default, the
tokenizer endpoints and folder, refusals of unsupported fields, and the front's own limits.

Real servers on port 0: a verifier that admits only 2 sessions at once (so a batch larger
than that must queue within its request), a live oracle drafter, a gateway (sequential
verify: exact, so repeated runs agree) and its HTTP front with a 16 KiB body limit and a
metrics registry. The request bodies of lm-eval, guidellm, aiperf and langchain are fixtures
copied from what those clients send (their versions named in docs/services.md §9).
"""

from __future__ import annotations

import http.client
import json
import logging
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from prometheus_client import CollectorRegistry, Counter

from services.http.batch import choice_seed
from services.http.chat import PLAIN_TEMPLATE, ChatTemplate
from services.http.schemas import MAX_STOP_CHARS, MAX_STOP_STRINGS
from services.http.server import RANDOM_MODEL_ID, start_http_front
from tests.services_fixtures import start_stack
from tests.test_http_api import Front as ApiFront

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "assets" / "dspark-small"
TIMEOUT_S = 60.0
BODY_LIMIT = 16 * 1024
VERIFIER_SESSIONS = 2


class Front(ApiFront):
    """test_http_api's front, plus raw requests at the server's root (vLLM's endpoints live there)."""

    @property
    def root(self) -> str:
        return self.base_url.removesuffix("/v1")

    def request(self, method: str, path: str, body: dict | bytes | None = None,
                headers: dict | None = None) -> tuple[int, dict, bytes]:
        """(status, headers, body) of one raw HTTP request."""
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        req = urllib.request.Request(self.root + path, data, {"Content-Type": "application/json", **(headers or {})},
                                     method=method)
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as err:
            return err.code, dict(err.headers), err.read()


@pytest.fixture(scope="module")
def front():
    stack = start_stack("oracle", verifier_max_sessions=VERIFIER_SESSIONS)
    registry = CollectorRegistry()
    Counter("dspark_test_marker", "a metric only this registry has", registry=registry).inc()
    gw = stack.loop.run(stack.start_gateway("sequential"))
    http = stack.loop.run(start_http_front(gw.server, gw.scheduler, None, 0, generate_timeout_s=TIMEOUT_S,
                                           metrics_registry=registry, max_body_bytes=BODY_LIMIT))
    yield Front(stack, gw, http)
    stack.loop.run(http.http.stop(1.0))
    stack.loop.run(gw.close())
    stack.close()


def _texts(choices) -> list[str]:
    return [c.text for c in sorted(choices, key=lambda c: c.index)]


# ---------------------------------------------------------------------------- batches and n
def test_two_prompt_batch_gives_one_choice_per_prompt_with_summed_usage(front):
    client = front.client()
    args = dict(model=RANDOM_MODEL_ID, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    batch = client.completions.create(prompt=["The quick brown fox", "1 2 3"], **args)
    alone = [client.completions.create(prompt=p, **args) for p in ("The quick brown fox", "1 2 3")]
    assert [c.index for c in batch.choices] == [0, 1]
    assert _texts(batch.choices) == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone) == 19 + 5
    assert batch.usage.completion_tokens == 12 and batch.usage.total_tokens == 36
    assert set(front.stack.wait_idle().values()) == {0}


def test_n_choices_have_derived_seeds_and_replay_exactly(front):
    client = front.client()
    args = dict(model=RANDOM_MODEL_ID, prompt="Once upon", max_tokens=8, temperature=1.0, seed=7,
                extra_body={"ignore_eos": True})
    three = client.completions.create(n=3, **args)
    again = client.completions.create(n=3, **args)
    assert _texts(three.choices) == _texts(again.choices) and len(set(_texts(three.choices))) == 3
    assert three.model_extra["seed"] == 7 and three.usage.prompt_tokens == 9
    assert three.usage.completion_tokens == 24
    for j in range(3):  # choice j is the plain request with seed choice_seed(7, j)
        plain = client.completions.create(**{**args, "seed": choice_seed(7, j)})
        assert plain.choices[0].text == three.choices[j].text
        assert three.choices[j].model_extra["seed"] == choice_seed(7, j)
    assert choice_seed(7, 0) == 7 and all(0 <= choice_seed(7, j) < 2**53 for j in (1, 2))


def test_a_batch_larger_than_the_session_limit_queues_instead_of_failing(front):
    prompts = [f"prompt number {i}" for i in range(3 * VERIFIER_SESSIONS + 1)]
    r = front.client().completions.create(model=RANDOM_MODEL_ID, prompt=prompts, max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == list(range(len(prompts)))
    assert all(c.finish_reason == "length" for c in r.choices) and r.usage.completion_tokens == 4 * len(prompts)
    assert set(front.stack.wait_idle().values()) == {0}


def test_streamed_batch_with_n_interleaves_choices_and_ends_with_the_summed_usage(front):
    client = front.client()
    args = dict(model=RANDOM_MODEL_ID, prompt=["ab", "cd"], n=2, max_tokens=5, temperature=0.8, seed=11,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**args)
    texts: dict[int, str] = {}
    finished, usage = set(), None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **args):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finished.add(c.index)
        usage = chunk.usage or usage
    assert finished == {0, 1, 2, 3} and [texts[i] for i in range(4)] == _texts(whole.choices)
    assert usage.completion_tokens == 20 == whole.usage.completion_tokens
    assert usage.prompt_tokens == 4 == whole.usage.prompt_tokens  # each prompt once, not n times


def test_a_client_leaving_a_streamed_batch_closes_every_choice(front):
    finished_before = front.gateway.scheduler.stats.generations
    stream = front.client().completions.create(model=RANDOM_MODEL_ID, prompt=["a", "b", "c"], n=2, max_tokens=200,
                                               stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    assert set(front.stack.wait_idle().values()) == {0}
    assert front.gateway.scheduler.stats.generations == finished_before  # cancelled, none run to its end


def test_negative_seed_is_the_seed_plus_2_63_and_top_k_minus_one_is_off(front):
    client = front.client()
    args = dict(model=RANDOM_MODEL_ID, prompt="seeds", max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True})
    negative = client.completions.create(seed=-5, **args)
    assert negative.choices[0].text == client.completions.create(seed=2**63 - 5, **args).choices[0].text
    assert negative.model_extra["seed"] == 2**63 - 5
    off = client.completions.create(seed=3, **{**args, "extra_body": {"ignore_eos": True, "top_k": -1}})
    assert off.choices[0].text == client.completions.create(seed=3, **args).choices[0].text


# ---------------------------------------------------------------------------- chat
def test_chat_works_by_default_with_text_parts_and_streams_chunks(front):
    client = front.client()
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Count: "}, {"type": "text", "text": "1 2"}]}]
    rendered = "system: Be brief.\nuser: Count: 1 2\nassistant:"
    assert ChatTemplate(PLAIN_TEMPLATE).render([{"role": m["role"], "content": m["content"] if isinstance(
        m["content"], str) else "Count: 1 2"} for m in messages]) == rendered
    chat = client.chat.completions.create(model=RANDOM_MODEL_ID, messages=messages, max_completion_tokens=6,
                                          extra_body={"ignore_eos": True})
    plain = client.completions.create(model=RANDOM_MODEL_ID, prompt=rendered, max_tokens=6,
                                      extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == plain.choices[0].text and chat.object == "chat.completion"
    assert chat.usage.prompt_tokens == len(rendered.encode())
    chunks = list(client.chat.completions.create(model=RANDOM_MODEL_ID, messages=messages, max_completion_tokens=6,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    many = client.chat.completions.create(model=RANDOM_MODEL_ID, messages=messages, max_completion_tokens=4, n=2,
                                          temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    assert [c.index for c in many.choices] == [0, 1] and many.usage.completion_tokens == 8


# ---------------------------------------------------------------------------- tokenizer
def test_bundled_folder_loads_with_transformers_as_the_gateway_tokenizes():
    transformers = pytest.importorskip("transformers")
    from services.gateway.tokenizer import HFTokenizer
    ours = HFTokenizer(BUNDLED / "tokenizer.json")
    text = "Hello world, 1 2 3: chat!"
    for cls in (transformers.AutoTokenizer, transformers.PreTrainedTokenizerFast):
        tok = cls.from_pretrained(str(BUNDLED))
        assert tok.encode(text) == ours.encode(text) and tok.decode(ours.encode(text)) == ours.decode(ours.encode(text))
        assert (tok.bos_token, tok.eos_token, tok.eos_token_id) == ("<|bos|>", "<|eos|>", 1)
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        ChatTemplate(PLAIN_TEMPLATE).render(messages)
    config = transformers.AutoConfig.from_pretrained(str(BUNDLED))
    assert config.compress_rates["heavily_compressed_attention"] == 16
    from training.export import tokenizer_config  # what an export writes is what the folder holds
    assert tokenizer_config(1024) == json.loads((BUNDLED / "tokenizer_config.json").read_text())


def test_tokenize_detokenize_and_tokenizer_info_in_vllm_shapes(front):
    status, _, body = front.request("POST", "/tokenize", {"prompt": "hi", "add_special_tokens": False,
                                                          "return_token_strs": True})
    assert status == 200 and json.loads(body) == {"count": 2, "max_model_len": 256, "tokens": [106, 107],
                                                  "token_strs": ["h", "i"]}
    status, _, body = front.request("POST", "/tokenize", {"messages": [{"role": "user", "content": "x"}]})
    assert json.loads(body)["tokens"] == [b + 2 for b in b"user: x\nassistant:"]
    status, _, body = front.request("POST", "/detokenize", {"tokens": [106, 107]})
    assert status == 200 and json.loads(body) == {"prompt": "hi"}
    status, _, body = front.request("POST", "/detokenize", {"tokens": [5, 10**6]})
    assert status == 400 and json.loads(body)["error"]["param"] == "tokens"
    status, _, body = front.request("GET", "/tokenizer_info")
    assert status == 200 and json.loads(body)["tokenizer_class"] == "ByteTokenizer"
    from services.gateway.tokenizer import HFTokenizer
    from services.http.tokenizer_api import tokenizer_info
    info = tokenizer_info(str(BUNDLED), HFTokenizer(BUNDLED / "tokenizer.json"))
    assert info["eos_token"] == "<|eos|>" and info["chat_template"] == PLAIN_TEMPLATE  # what lm-eval reads


# ---------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("field, value", [
    ("include_stop_str_in_output", True), ("allowed_token_ids", [5])])
def test_fields_that_would_change_the_output_are_refused_naming_them(front, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        front.client().completions.create(model=RANDOM_MODEL_ID, prompt="abc", max_tokens=2,
                                          extra_body={field: value})
    assert err.value.param == field and err.value.body["message"].startswith(f"{field}=")
    assert "not supported" in err.value.message


def test_neutral_values_of_unsupported_fields_pass_and_chat_only_fields_are_refused(front):
    client = front.client()
    neutral = {"logit_bias": {}, "repetition_penalty": 1.0, "min_tokens": 0, "response_format": {"type": "text"}}
    r = client.completions.create(model=RANDOM_MODEL_ID, prompt="abc", max_tokens=2, extra_body=neutral)
    assert r.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=RANDOM_MODEL_ID, messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert err.value.param == "tools"


# ---------------------------------------------------------------------------- hardening
def test_body_limit_answers_413_without_reading_and_leaks_nothing(front):
    big = {"model": RANDOM_MODEL_ID, "prompt": "x" * (BODY_LIMIT + 10), "max_tokens": 2}
    status, _, body = front.request("POST", "/v1/completions", big)
    error = json.loads(body)["error"]
    assert status == 413 and error["code"] == "body_too_large" and str(BODY_LIMIT) in error["message"]
    conn = http.client.HTTPConnection("127.0.0.1", front.http.http.port, timeout=TIMEOUT_S)
    conn.putrequest("POST", "/v1/completions")  # chunked: no Content-Length to refuse up front
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    chunk = json.dumps(big).encode()
    conn.send(b"%x\r\n%s\r\n0\r\n\r\n" % (len(chunk), chunk))
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["message"].startswith("POST /v1/completions")
    conn.close()
    assert set(front.stack.wait_idle().values()) == {0}
    assert front.client().completions.create(model=RANDOM_MODEL_ID, prompt="ok", max_tokens=1).choices


def test_stop_strings_are_capped_in_number_and_length(front):
    client = front.client()
    for stop, words in ([[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)], f"at most {MAX_STOP_STRINGS}"],
                        [["y" * (MAX_STOP_CHARS + 1)], f"at most {MAX_STOP_CHARS}"]):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=RANDOM_MODEL_ID, prompt="abc", max_tokens=2, stop=stop)
        assert err.value.param == "stop" and words in err.value.message
    ok = client.completions.create(model=RANDOM_MODEL_ID, prompt="abc", max_tokens=2,
                                   stop=["z" * MAX_STOP_CHARS] * MAX_STOP_STRINGS)
    assert ok.choices[0].finish_reason == "length"


def test_every_request_gets_an_access_log_line_refused_ones_too(front, caplog):
    with caplog.at_level(logging.INFO, logger="dspark.http.access"):
        ok = front.client().completions.create(model=RANDOM_MODEL_ID, prompt="abc", max_tokens=1)
        status, headers, _ = front.request("POST", "/v1/completions", {"prompt": "abc", "max_tokens": 0})
        big, _, _ = front.request("POST", "/v1/completions", b"{" + b" " * BODY_LIMIT + b"}")
        missing, _, _ = front.request("GET", "/nowhere")
    records = [r for r in caplog.records if r.name == "dspark.http.access"]
    seen = [(r.method, r.path, r.status) for r in records]
    assert seen == [("POST", "/v1/completions", 200), ("POST", "/v1/completions", 400),
                    ("POST", "/v1/completions", 413), ("GET", "/nowhere", 404)]
    assert (status, big, missing) == (400, 413, 404)
    assert records[0].request_id == ok.id and records[1].request_id == headers["x-request-id"]
    assert all(r.ms >= 0 and len(r.request_id) >= 32 for r in records)
    assert records[0].getMessage().startswith("POST /v1/completions 200 ") and ok.id in records[0].getMessage()


def test_model_by_id_head_health_and_metrics_without_a_redirect(front):
    client = front.client()
    assert client.models.retrieve(RANDOM_MODEL_ID).id == RANDOM_MODEL_ID
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    status, _, body = front.request("HEAD", "/health")
    assert status == 200 and body == b""
    conn = http.client.HTTPConnection("127.0.0.1", front.http.http.port, timeout=TIMEOUT_S)
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    assert resp.status == 200 and b"dspark_test_marker_total 1.0" in resp.read()
    conn.close()


# ---------------------------------------------------------------------------- client shapes
# Captured from the clients themselves (bench/clients.py's pins: lm-eval 0.4.13, guidellm 0.8.1,
# aiperf 0.13.0, langchain-openai 1.8.1), only the model id and the texts changed.
# lm-eval `local-completions` generate_until, tokenized requests, --batch_size 2: `until` plus
# the tokenizer's eos text as stop strings, its default seed
LM_EVAL_GENERATE_UNTIL = {"prompt": [[86, 105, 104, 35, 84], [53, 34, 52, 34, 54]], "model": RANDOM_MODEL_ID,
                          "max_tokens": 8, "temperature": 0.0, "stop": ["\n", "<|eos|>"], "seed": 1234}
# lm-eval `local-chat-completions --apply_chat_template` generate_until
LM_EVAL_CHAT = {"messages": [{"role": "user", "content": "def square(x):\n    return"}], "model": RANDOM_MODEL_ID,
                "max_tokens": 8, "temperature": 0.0, "stop": ["\n"], "seed": 1234}
# guidellm `run` with synthetic data: chat (its default request type), streamed
GUIDELLM_CHAT = {"model": RANDOM_MODEL_ID, "stream": True,
                 "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                 "max_completion_tokens": 6, "ignore_eos": True,
                 "messages": [{"role": "user", "content": [{"type": "text", "text": "alpha beta gamma"}]}]}
# aiperf `profile --streaming`: chat (its default endpoint type)
AIPERF_CHAT = {"messages": [{"role": "user", "content": "delta epsilon"}], "model": RANDOM_MODEL_ID, "stream": True,
               "max_completion_tokens": 6, "stream_options": {"include_usage": True}}
# langchain-openai `OpenAI(...).batch([...])`: one completions call per 20 prompts
LANGCHAIN_BATCH = {"model": RANDOM_MODEL_ID, "prompt": ["first", "second", "third"], "frequency_penalty": 0,
                   "logprobs": None, "max_tokens": 5, "n": 1, "presence_penalty": 0, "seed": None,
                   "temperature": 0.0, "top_p": 1}
# langchain-openai `ChatOpenAI(...).invoke("...")`
LANGCHAIN_CHAT = {"model": RANDOM_MODEL_ID, "stream": False, "messages": [{"content": "Say hello.", "role": "user"}],
                  "max_completion_tokens": 5, "temperature": 0.0}


def _sse(body: bytes) -> list[dict]:
    events = [line[len(b"data: "):] for line in body.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("name, path, body, choices", [
    ("lm-eval", "/v1/completions", LM_EVAL_GENERATE_UNTIL, 2),
    ("lm-eval chat", "/v1/chat/completions", LM_EVAL_CHAT, 1),
    ("guidellm", "/v1/chat/completions", GUIDELLM_CHAT, 1),
    ("aiperf", "/v1/chat/completions", AIPERF_CHAT, 1),
    ("langchain", "/v1/completions", LANGCHAIN_BATCH, 3),
    ("langchain chat", "/v1/chat/completions", LANGCHAIN_CHAT, 1)])
def test_the_request_shapes_real_clients_send_are_served(front, name, path, body, choices):
    status, _, raw = front.request("POST", path, body)
    assert status == 200, raw
    if body.get("stream"):
        events = _sse(raw)
        assert {e["object"] for e in events} == {"chat.completion.chunk"}
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6
        assert sum(1 for e in events for c in e["choices"] if c["finish_reason"] == "length") == choices
    else:
        out = json.loads(raw)
        assert sorted(c["index"] for c in out["choices"]) == list(range(choices))
        assert all(c["finish_reason"] in ("stop", "length") for c in out["choices"])
        assert out["object"] == ("chat.completion" if "messages" in body else "text_completion")
        limit = body.get("max_tokens") or body["max_completion_tokens"]
        assert 1 <= out["usage"]["completion_tokens"] <= limit * choices


# ---------------------------------------------------------------------------- tenants
def test_abort_reaches_only_the_callers_own_request_ids(front):
    from dspark_proto.v1 import gateway_pb2

    def abort(rid: str, token: str | None) -> bool:
        metadata = (("authorization", f"Bearer {token}"),) if token else None
        async def call():
            return await front.gateway.stub.Abort(gateway_pb2.AbortRequest(request_id=rid), timeout=10,
                                                  metadata=metadata)
        return front.stack.loop.run(call()).found

    alice = openai.OpenAI(base_url=front.root + "/v1", api_key="alice", max_retries=0, timeout=TIMEOUT_S)
    stream = alice.completions.create(model=RANDOM_MODEL_ID, prompt="long", max_tokens=200, stream=True,
                                      extra_body={"ignore_eos": True})
    chunks = iter(stream)
    rid = next(chunks).id
    assert not abort(rid, "bob") and not abort(rid, None)  # another tenant's id reads as unknown
    assert abort(rid, "alice")
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["abort"]
    assert set(front.stack.wait_idle().values()) == {0}
