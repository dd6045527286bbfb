"""Adversarial checks of sampling values at the edges of float32, over real servers.

A temperature between 0 and `MIN_TEMPERATURE` used to be accepted: dividing the fp32 logits
by it overflowed them to inf, so the "sampled" tokens were garbage (not the argmax a tiny
temperature means) and under the rejection rule the drafter sent non-finite q, which the
gateway counted as drafter failures. The HTTP front passed finite doubles that float32
cannot carry: 1e39 reached the gateway as inf (a 400 naming a value the client never sent)
and a top_p of 1e-50 reached it as 0, i.e. unset, so a near-greedy nucleus sampled from the
whole vocabulary. A `null` for a field OpenAI documents as nullable (`"logprobs": null` on
chat, `"n": null`, ...) was a 400 where OpenAI's API takes the default. Every request here runs through in-process servers on port 0 and real
clients (gRPC stubs, the `openai` package).
"""

from __future__ import annotations

import json

import grpc
import openai
import pytest
import torch

from dspark_proto.v1 import common_pb2
from dsv4.sampling import MIN_TEMPERATURE, SamplingParams, draft_choice, keyed_choice
from services.http.server import RANDOM_MODEL_ID
from tests.services_fixtures import collect, gen_request
from tests.test_http_api import TEMPLATE, _post, _start_front, _stop_front, front, stack  # noqa: F401 (fixtures)

PROMPT = "The quick brown fox"


def test_a_temperature_below_the_floor_is_refused_naming_it():
    for t in (1e-40, 1e-45, MIN_TEMPERATURE / 2):
        with pytest.raises(ValueError, match=rf"temperature={t:g}: must be 0 \(greedy\) or >= 1e-30"):
            SamplingParams(temperature=t)
    assert SamplingParams(temperature=MIN_TEMPERATURE).temperature == MIN_TEMPERATURE


def test_the_floor_temperature_samples_the_argmax_with_finite_draft_probabilities():
    logits = torch.randn(6, 512, generator=torch.Generator().manual_seed(0)) * 20  # [6, V]
    for rule in ("coupled", "rejection"):
        params = SamplingParams(temperature=MIN_TEMPERATURE, seed=11, rule=rule)
        assert keyed_choice(logits, params, range(6)).tolist() == logits.argmax(-1).tolist()
        tokens, q = draft_choice(logits, params, range(6))
        assert torch.isfinite(q).all() and tokens.tolist() == logits.argmax(-1).tolist()
        assert q.max(-1).values.tolist() == [1.0] * 6


def _grpc(front, **fields):  # noqa: F811
    """(token ids, final message) of one gRPC generation through the front's gateway."""
    req = gen_request(PROMPT, max_tokens=12, spec="always")
    for name, value in fields.items():
        setattr(req, name, value)
    gen = front.stack.loop.run(collect(front.gateway.stub, req))
    return gen.token_ids, gen.final


def test_grpc_tiny_temperature_is_invalid_argument_and_the_floor_decodes_greedily(front):  # noqa: F811
    tiny = 2.0 ** -100  # 7.9e-31, exact in float32, so the message shows the value sent
    for rule in (common_pb2.SAMPLING_RULE_COUPLED, common_pb2.SAMPLING_RULE_REJECTION):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            _grpc(front, temperature=tiny, sampling_rule=rule)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(f"temperature={tiny:g}: must be 0 (greedy) or >= 1e-30")
        greedy, _ = _grpc(front, sampling_rule=rule)
        floor, final = _grpc(front, temperature=MIN_TEMPERATURE, seed=5, sampling_rule=rule)
        assert floor == greedy and len(floor) == 12
        assert not final.spec_stats.drafter_failed
    assert front.stack.wait_idle() == {"verifier_info": 0, "verifier_engine": 0,
                                       "drafter_info": 0, "drafter_engine": 0}


@pytest.mark.parametrize("fields, param, shown", [
    ({"temperature": 1e39}, "temperature", "temperature=1e+39"),
    ({"temperature": 1e-40}, "temperature", "temperature=1e-40"),
    ({"temperature": 1.0, "top_p": 1e-50}, "top_p", "top_p=1e-50"),
    ({"temperature": 1.0, "extra_body": {"min_p": 1e-47}}, "min_p", "min_p=1e-47"),
])
def test_http_float_beyond_float32_is_a_400_naming_the_value_sent(front, fields, param, shown):  # noqa: F811
    with pytest.raises(openai.BadRequestError) as err:
        front.client().completions.create(model=RANDOM_MODEL_ID, prompt=PROMPT, max_tokens=4, **fields)
    body = err.value.body
    assert body["param"] == param and body["message"].startswith(shown), body


def test_http_smallest_float32_top_p_keeps_only_the_top_token(front):  # noqa: F811
    greedy = front.client().completions.create(model=RANDOM_MODEL_ID, prompt=PROMPT, max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True, "return_token_ids": True})
    tiny = front.client().completions.create(model=RANDOM_MODEL_ID, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                             top_p=1.5e-45, seed=9,
                                             extra_body={"ignore_eos": True, "return_token_ids": True})
    assert tiny.choices[0].model_extra["token_ids"] == greedy.choices[0].model_extra["token_ids"]


def test_http_null_for_openai_nullable_fields_means_the_default(stack, tmp_path):  # noqa: F811
    folder = tmp_path / "templated-model"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|eos|>"}))
    f = _start_front(stack, str(folder))
    nulls = {"logprobs": None, "n": None, "stream": None, "presence_penalty": None, "frequency_penalty": None}
    try:
        base = {"model": "templated-model", "messages": [{"role": "user", "content": "Count: 1 2 3"}],
                "max_tokens": 5, "ignore_eos": True}
        status, _, text = _post(f.base_url + "/chat/completions", {**base, **nulls})
        plain = f.client().chat.completions.create(model=base["model"], messages=base["messages"], max_tokens=5,
                                                   extra_body={"ignore_eos": True})
        assert status == 200, text
        reply = json.loads(text)["choices"][0]
        assert reply["logprobs"] is None and reply["message"]["content"] == plain.choices[0].message.content
        status, _, text = _post(f.base_url + "/completions", {"model": "templated-model", "prompt": PROMPT,
                                                               "max_tokens": 3, **nulls, "echo": None})
        assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 3, text
    finally:
        _stop_front(f)
