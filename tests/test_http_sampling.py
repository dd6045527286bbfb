"""Sampling over the OpenAI-compatible HTTP API, with the real `openai` client against the real
server: the same seed gives the gRPC API's tokens, logprobs come in OpenAI's shapes with the
gRPC API's values, a drawn seed is returned, and bad values are 400s naming the field."""

from __future__ import annotations

import json

import openai
import pytest

from dspark_proto.v1 import gateway_pb2
from services.http.server import RANDOM_MODEL_ID
from tests.services_fixtures import SPEC
from tests.test_http_api import TEMPLATE, _start_front, _stop_front, front, stack  # noqa: F401 (fixtures)

PROMPT = "The quick brown fox"


def _grpc(front, prompt=PROMPT, **fields) -> tuple[list[int], list, gateway_pb2.GenerateResponse]:  # noqa: F811
    """(token ids, TokenLogprob messages, final message) of one gRPC generation."""
    req = gateway_pb2.GenerateRequest(prompt=prompt, max_tokens=10, ignore_eos=True, spec=SPEC["always"], **fields)

    async def stream():
        return [m async for m in front.gateway.stub.Generate(req, timeout=60)]
    msgs = front.stack.loop.run(stream())
    return [t for m in msgs for t in m.token_ids], [lp for m in msgs for lp in m.logprobs], msgs[-1]


def test_seeded_completion_equals_grpc_with_logprobs_in_openai_shape(front):  # noqa: F811
    r = front.client().completions.create(
        model=RANDOM_MODEL_ID, prompt=PROMPT, max_tokens=10, temperature=1.0, top_p=0.9, seed=42, logprobs=3,
        extra_body={"ignore_eos": True, "spec": "always", "return_token_ids": True, "top_k": 50})
    ids, records, final = _grpc(front, temperature=1.0, top_p=0.9, seed=42, logprobs=3, top_k=50)
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == ids and len(ids) == 10
    assert r.model_extra["seed"] == 42 == final.seed
    lp = choice.logprobs
    assert lp.token_logprobs == pytest.approx([x.logprob for x in records], abs=0, rel=1e-7)
    tokenizer = front.gateway.scheduler.tokenizer
    assert lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    for top, rec in zip(lp.top_logprobs, records):
        assert 1 <= len(top) <= 4  # the 3 most likely and the chosen one, keyed by (possibly equal) texts
        assert max(top.values()) == pytest.approx(rec.top_logprobs[0], rel=1e-7)


def test_a_completion_without_seed_reports_the_drawn_one_which_reproduces_it(front):  # noqa: F811
    client = front.client()
    first = client.completions.create(model=RANDOM_MODEL_ID, prompt=PROMPT, max_tokens=10, temperature=0.8,
                                      extra_body={"ignore_eos": True, "sampling_rule": "rejection"})
    seed = first.model_extra["seed"]
    again = client.completions.create(model=RANDOM_MODEL_ID, prompt=PROMPT, max_tokens=10, temperature=0.8,
                                      seed=seed, extra_body={"ignore_eos": True, "sampling_rule": "rejection"})
    assert seed > 0 and again.choices[0].text == first.choices[0].text


def test_streamed_completion_carries_each_chunks_logprobs(front):  # noqa: F811
    client = front.client()
    args = dict(model=RANDOM_MODEL_ID, prompt=PROMPT, max_tokens=10, temperature=0.7, seed=7, logprobs=0,
                extra_body={"ignore_eos": True, "spec": "always"})
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(stream=True, **args))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == whole.choices[0].logprobs.token_logprobs and len(streamed) == 10
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def test_chat_logprobs_in_openai_shape(stack, tmp_path):  # noqa: F811
    folder = tmp_path / "templated-model"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|eos|>"}))
    f = _start_front(stack, str(folder))
    try:
        chat = f.client().chat.completions.create(
            model="templated-model", messages=[{"role": "user", "content": "Count: 1 2 3"}], max_tokens=6,
            temperature=1.0, seed=3, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
        content = chat.choices[0].logprobs.content
        assert len(content) == 6 and "".join(c.token for c in content) == chat.choices[0].message.content
        for c in content:
            assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
            assert c.bytes == list(c.token.encode()) and c.logprob <= c.top_logprobs[0].logprob
        with pytest.raises(openai.BadRequestError) as err:
            f.client().chat.completions.create(model="templated-model", messages=[{"role": "user", "content": "x"}],
                                               max_tokens=2, logprobs=True, top_logprobs=21)
        assert err.value.param == "top_logprobs" and "top_logprobs=21" in err.value.message
    finally:
        _stop_front(f)
