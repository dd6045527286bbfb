"""The `openai` package against the HTTP API (run in the clients' venv by bench/clients.py).

Usage: python openai_check.py BASE_URL MODEL_ID. Prints one JSON line {"ok", "reason"}; the
reason names the first check that failed, else what was checked.

Checks, each with the package's own calls and types:
  * completions, not streamed: a batch of 2 prompts with n=3, a seed and logprobs=2 gives 6
    choices with index 0..5, per-choice logprobs (one entry per completion token, 2
    alternatives each, and the sampled token, as OpenAI's legacy shape has it) and usage summed over the choices; the same request replays the same
    texts;
  * the same request streamed (with the usage chunk) gives the same text per index;
  * chat completions streamed: chat.completion.chunk chunks, a finish_reason, the usage chunk;
  * chat completions with response_format json_schema: the content parses as JSON of the
    schema (a finish_reason "stop").
"""

from __future__ import annotations

import json
import sys

import openai

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


class CheckFailed(Exception):
    """One check's failure; its message is the row's reason."""


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise CheckFailed(what)


def completions(client: openai.OpenAI, model: str) -> str:
    args = dict(model=model, prompt=["import os\n", "def main():"], n=3, seed=1234, logprobs=2,
                max_tokens=8, temperature=0.8)
    first = client.completions.create(**args)
    expect(sorted(c.index for c in first.choices) == list(range(6)),
           f"batch of 2 x n=3: indices {[c.index for c in first.choices]}")
    for c in first.choices:
        lp = c.logprobs
        expect(lp is not None and len(lp.tokens) == len(lp.token_logprobs) >= 1,
               f"choice {c.index}: logprobs {lp}")
        # OpenAI's legacy shape: the 2 most likely, plus the sampled token when it is not among them
        expect(all(tok in alts and len(alts) in (2, 3) for tok, alts in zip(lp.tokens, lp.top_logprobs)),
               f"choice {c.index}: top_logprobs {lp.top_logprobs} for tokens {lp.tokens}")
    tokens = sum(len(c.logprobs.tokens) for c in first.choices)
    expect(first.usage.completion_tokens == tokens,
           f"usage.completion_tokens {first.usage.completion_tokens} != {tokens} tokens over the choices")
    texts = {c.index: c.text for c in first.choices}
    again = client.completions.create(**args)
    expect({c.index: c.text for c in again.choices} == texts, "the same (request, seed) gave other texts")
    streamed: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(**args, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
        usage = chunk.usage or usage
    expect(streamed == texts, f"streamed texts {streamed} != {texts}")
    expect(usage is not None and usage.completion_tokens == tokens, f"streamed usage {usage}")
    return f"batch 2 x n=3 seeded with logprobs, replayed and streamed ({tokens} tokens)"


def chat(client: openai.OpenAI, model: str) -> str:
    kinds, finish, text, usage = set(), None, "", None
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                            max_completion_tokens=12, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        kinds.add(chunk.object)
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
        usage = chunk.usage or usage
    expect(kinds == {"chat.completion.chunk"}, f"chunk objects {kinds}")
    expect(finish in ("stop", "length") and usage is not None and usage.completion_tokens >= 1,
           f"streamed chat: finish_reason {finish}, usage {usage}")
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Is the sky blue? Answer in JSON."}], max_tokens=32,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}})
    content = out.choices[0].message.content
    expect(out.choices[0].finish_reason == "stop", f"json_schema: finish_reason {out.choices[0].finish_reason}")
    try:
        value = json.loads(content)
    except json.JSONDecodeError as exc:
        raise CheckFailed(f"json_schema: content {content!r} is not JSON: {exc}") from None
    expect(isinstance(value, dict) and set(value) == {"ok"} and isinstance(value["ok"], bool),
           f"json_schema: {value!r} does not match the schema")
    return f"chat streamed ({usage.completion_tokens} tokens), json_schema gave {content!r}"


def main() -> None:
    base_url, model = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=120, max_retries=0)
    try:
        done = [completions(client, model), chat(client, model)]
        result = {"ok": True, "reason": "; ".join(done)}
    except CheckFailed as exc:
        result = {"ok": False, "reason": str(exc)}
    except openai.APIError as exc:
        result = {"ok": False, "reason": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
