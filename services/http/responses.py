"""OpenAI response bodies and SSE chunks built from the gateway's `GenerateResponse` messages.

Owns the JSON shapes of /v1/completions and /v1/chat/completions (whole responses and
streamed chunks), `usage` with the prediction-token details and the `dspark` extension
object, and the SSE framing. It holds no connection and decides nothing about a request.

usage.completion_tokens_details: accepted_prediction_tokens = draft tokens the verifier
accepted that appear in the completion (`spec_accepted_tokens`: accepted drafts after a stop
inside their block are not); rejected_prediction_tokens = draft tokens submitted to verify
that do not appear in it (`spec_draft_tokens - spec_accepted_tokens`); drafts the gate dropped
before verify are in neither (they are in `dspark.drafted`). A choice that ended on a stop
carries what matched as `stop_reason` (a token id or a stop string; vLLM's field), else null. The `dspark` object carries the generation's `SpecStats` fields and
`time_to_first_token_ms`, on the whole response and on the chunk that carries finish_reason;
beside it, `seed` is the seed used (the request's, or drawn by the gateway). A response with
several choices (`services.http.batch`) carries `dspark` and `seed` in each choice, the
request's seed beside them, and `usage` summed over the choices (`usage`). `logprobs` is
null unless asked for; then `services.http.logprobs` builds it.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from google.protobuf.json_format import MessageToDict

from dspark_proto.v1 import gateway_pb2

DONE = b"data: [DONE]\n\n"


def sse(payload: dict) -> bytes:
    """One server-sent event carrying `payload` as JSON (`data: ...` and a blank line)."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), allow_nan=False).encode() + b"\n\n"


def usage(finals: list[tuple[int, gateway_pb2.GenerateResponse]]) -> dict:
    """OpenAI `usage` of a request's finished generations, given as (j, final message), j being
    which of its prompt's n choices a generation is: completion tokens and the prediction-token
    details summed over every choice, prompt tokens over the prompts (each counted once, at
    its j = 0, as OpenAI and vLLM count them)."""
    prompt = sum(f.usage.prompt_tokens for j, f in finals if j == 0)
    completion = sum(f.usage.completion_tokens for _, f in finals)
    accepted = sum(f.spec_accepted_tokens for _, f in finals)
    rejected = sum(f.spec_draft_tokens - f.spec_accepted_tokens for _, f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": rejected}}


def stop_reason(final: gateway_pb2.GenerateResponse) -> int | str | None:
    """What ended a generation on a stop: a stop token id or a stop string; None otherwise."""
    which = final.WhichOneof("matched_stop")
    return None if which is None else getattr(final, which)


def dspark_stats(final: gateway_pb2.GenerateResponse) -> dict:
    """The `dspark` extension: every SpecStats field (defaults included) and TTFT (ms)."""
    stats = MessageToDict(final.spec_stats, preserving_proto_field_name=True,
                          always_print_fields_with_no_presence=True)
    stats["time_to_first_token_ms"] = final.time_to_first_token_ms
    return stats


@dataclass
class Shape:
    """The id, creation time (s since the epoch) and kind of one response.

    chat: chat completions (`chat.completion[.chunk]`, message / delta) or text completions
    (`text_completion`, text)."""

    model: str
    chat: bool
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def choice(self, index: int, final: gateway_pb2.GenerateResponse, token_ids: list[int] | None = None,
               logprobs: dict | None = None) -> dict:
        """Choice `index` of a whole response (`final`: its generation's last message);
        token_ids: the completion's ids, added as `token_ids` (None: not added); logprobs:
        the choice's `logprobs` object (None: null)."""
        if self.chat:
            choice = {"index": index, "message": {"role": "assistant", "content": final.text},
                      "logprobs": logprobs, "finish_reason": final.finish_reason}
        else:
            choice = {"index": index, "text": final.text, "logprobs": logprobs, "finish_reason": final.finish_reason}
        choice["stop_reason"] = stop_reason(final)
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return choice

    def whole(self, choices: list[dict], finals: list[tuple[int, gateway_pb2.GenerateResponse]],
              seed: int) -> dict:
        """The non-streaming response: `choices` (from `choice`, in index order), the usage of
        `finals` ((j, final message) per choice) and `seed`, the request's. One choice: the
        `dspark` stats beside it; several: each choice carries its own `dspark` and `seed`."""
        body = {**self._head("chat.completion" if self.chat else "text_completion"), "choices": choices,
                "usage": usage(finals)}
        if len(choices) == 1:
            body["dspark"] = dspark_stats(finals[0][1])
        else:
            for choice, (_, final) in zip(choices, finals):
                choice["dspark"], choice["seed"] = dspark_stats(final), final.seed
        body["seed"] = seed
        return body

    def chunk(self, text: str, finish_reason: str | None = None, *, first: bool = False,
              with_usage_field: bool = False, token_ids: list[int] | None = None,
              logprobs: dict | None = None, index: int = 0) -> dict:
        """One streamed chunk of choice `index` with `text` (chat: the delta; `first` adds the
        assistant role).
        with_usage_field: add `"usage": null`, as OpenAI does when the stream's usage comes last;
        token_ids: the ids new in this chunk, added to the choice (None: not added);
        logprobs: the `logprobs` object of this chunk's tokens (None: null)."""
        if self.chat:
            delta = ({"role": "assistant", "content": text} if first else {"content": text}) \
                if (text or first) else {}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        body = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if with_usage_field:
            body["usage"] = None
        return body

    def final_chunk(self, final: gateway_pb2.GenerateResponse, with_usage_field: bool,
                    with_token_ids: bool = False, index: int = 0) -> dict:
        """The chunk of choice `index` with the finish reason, the last text delta (and ids),
        the `dspark` stats and the seed of that choice's generation."""
        body = self.chunk(final.text_delta, final.finish_reason, with_usage_field=with_usage_field,
                          token_ids=list(final.token_ids) if with_token_ids else None, index=index)
        body["choices"][0]["stop_reason"] = stop_reason(final)
        body["dspark"] = dspark_stats(final)
        body["seed"] = final.seed
        return body

    def usage_chunk(self, finals: list[tuple[int, gateway_pb2.GenerateResponse]]) -> dict:
        """The chunk `stream_options.include_usage` adds after the last one: no choices, the
        usage of every choice's generation (`usage`)."""
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage(finals)}
