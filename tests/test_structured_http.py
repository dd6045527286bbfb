"""Structured output through the OpenAI-compatible HTTP front, driven by the official `openai`
client (docs/structured.md): `response_format` json_schema / json_object, the vLLM extras
through `extra_body`, the streaming case of vLLM #55313 (no text after the grammar
completes), refusals naming the field, and `dspark generate --choice / --json-schema`.
Real servers on port 0: verifier, live oracle drafter (every third slot corrupted), gateway
(sequential verify) and its HTTP front."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import openai
import pytest

from services.http.server import start_http_front
from services_fixtures import gen_request, start_stack
from structured_schemas import SCHEMAS

SCHEMA = SCHEMAS[2]  # a short output: {"color": ...}
NESTED = SCHEMAS[14]
TIMEOUT_S = 120.0


TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
MODEL = "structured-model"


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / MODEL  # the random model with a chat template
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|eos|>"}))
    stack = start_stack("oracle", corrupt_every=3)
    gw = stack.loop.run(stack.start_gateway("sequential"))
    http = stack.loop.run(start_http_front(gw.server, gw.scheduler, str(folder), 0, generate_timeout_s=TIMEOUT_S))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http.http.port}/v1", api_key="unused", max_retries=0,
                           timeout=TIMEOUT_S)
    yield stack, gw, client
    stack.loop.run(http.http.stop(1.0))
    stack.loop.run(gw.close())
    stack.close()


def _grpc_text(stack, gw, prompt: str, **constraint) -> str:
    from services_fixtures import collect
    req = gen_request(prompt, max_tokens=200, spec="always", ignore_eos=False)
    for kind, value in constraint.items():
        if kind == "choice":
            req.constraint.choice.choices.extend(value)
        else:
            setattr(req.constraint, kind, value)
    return stack.loop.run(collect(gw.stub, req)).final.text


def test_response_format_json_schema_through_the_openai_client(front):
    stack, gw, client = front
    out = client.completions.create(
        model=MODEL, prompt="user:", max_tokens=200, temperature=0,
        extra_body={"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "user", "schema": SCHEMA, "strict": True}}})
    text = out.choices[0].text
    jsonschema.validate(json.loads(text), SCHEMA)
    assert out.choices[0].finish_reason == "stop"
    assert text == _grpc_text(stack, gw, "user:", json_schema=json.dumps(SCHEMA))  # the same constraint


def test_chat_response_format_and_guided_json_via_extra_body(front):
    _, _, client = front
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a user please"}], max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
    guided = client.completions.create(model=MODEL, prompt="x", max_tokens=200, temperature=0.7, seed=3,
                                       extra_body={"guided_json": SCHEMAS[2]})
    jsonschema.validate(json.loads(guided.choices[0].text), SCHEMAS[2])
    obj = client.completions.create(model=MODEL, prompt="x", max_tokens=12,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert obj.choices[0].text.startswith("{")  # a JSON object, cut by max_tokens unless it closed


@pytest.mark.parametrize("extra,check", [
    ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, lambda t: len(t) == 6 and t[:3].isdigit() and t[3] == "-"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
    ({"guided_grammar": 'root ::= "<" [a-c]+ ">"'}, lambda t: t[0] == "<" and t[-1] == ">"),
])
def test_vllm_guided_extras(front, extra, check):
    _, _, client = front
    out = client.completions.create(model=MODEL, prompt="pick:", max_tokens=100, extra_body=extra)
    assert check(out.choices[0].text) and out.choices[0].finish_reason == "stop", out.choices[0].text


def test_streaming_json_schema_emits_nothing_after_the_grammar_completes(front):
    """vLLM #55313: a streaming json_schema request kept streaming whitespace after the JSON
    closed. Here the stream's text is exactly the compact JSON, and it ends there with stop."""
    _, _, client = front
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "go"}], max_tokens=200, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "u", "schema": NESTED, "strict": True}})
    deltas, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.content:
                deltas.append(c.delta.content)
            finish = c.finish_reason or finish
    text = "".join(deltas)
    value = json.loads(text)
    jsonschema.validate(value, NESTED)
    assert finish == "stop" and text == json.dumps(value, ensure_ascii=False)  # nothing after the closing brace


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     None),  # the gateway's compiler refuses it: the message names the constraint field
    ({"guided_regex": "a(b"}, None),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
])
def test_bad_constraints_are_a_400_naming_the_field(front, extra, param):
    _, _, client = front
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=10, extra_body=extra)
    body = err.value.body if isinstance(err.value.body, dict) else {}
    message = body.get("message", str(err.value))
    if param is None:
        assert "constraint." in message and "does not compile" in message, message
    else:
        assert body.get("param") == param, body


def test_a_constraint_with_ignore_eos_is_refused(front):
    _, _, client = front
    with pytest.raises(openai.BadRequestError, match="ignore_eos"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=10,
                                  extra_body={"guided_choice": ["a", "b"], "ignore_eos": True})


def test_generate_cli_json_schema(front, tmp_path):
    _, gw, _ = front
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    res = subprocess.run([sys.executable, "-m", "services.cli", "generate", "p", "--target", gw.target,
                          "--json-schema", str(schema), "--timeout", "120"], capture_output=True, text=True,
                         timeout=240)
    assert res.returncode == 0, res.stderr
    jsonschema.validate(json.loads(res.stdout), SCHEMA)


def test_generate_cli_constraint_flags(tmp_path):
    import argparse
    from services.client_cli import cli_constraint
    ns = lambda **kw: argparse.Namespace(**{"json_schema": None, "json_object": False, "regex": None,  # noqa: E731
                                            "grammar": None, "choice": None, **kw})
    assert list(cli_constraint(ns(choice="alpha,beta")).choice.choices) == ["alpha", "beta"]
    assert cli_constraint(ns(regex="a+")).regex == "a+" and cli_constraint(ns()) is None
    assert cli_constraint(ns(json_object=True)).json_object
    (tmp_path / "g.ebnf").write_text('root ::= "a"')
    assert cli_constraint(ns(grammar=str(tmp_path / "g.ebnf"))).grammar == 'root ::= "a"'
    (tmp_path / "bad.json").write_text("{")
    for kw, match in [({"json_schema": str(tmp_path / "missing.json")}, "--json-schema=.*cannot read"),
                      ({"json_schema": str(tmp_path / "bad.json")}, "--json-schema=.*not JSON"),
                      ({"choice": "a,,b"}, "--choice=.*non-empty")]:
        with pytest.raises(ValueError, match=match):
            cli_constraint(ns(**kw))
