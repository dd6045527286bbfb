"""OpenAI response bodies and SSE chunks built from the gateway's `GenerateResponse` messages.

Owns the JSON shapes of /v1/completions and /v1/chat/completions (whole responses and
streamed chunks), `usage` with the prediction-token details and the `dspark` extension
object, and the SSE framing. It holds no connection and decides nothing about a request.

usage.completion_tokens_details: accepted_prediction_tokens = draft tokens the verifier
accepted (`spec_accepted_tokens`); rejected_prediction_tokens = draft tokens submitted to
verify and rejected (`spec_draft_tokens - spec_accepted_tokens`); drafts the gate dropped
before verify are in neither (they are in `dspark.drafted`). A choice that ended on a stop
carries what matched as `stop_reason` (a token id or a stop string; vLLM's field), else null. The `dspark` object carries the generation's `SpecStats` fields and
`time_to_first_token_ms`, on the whole response and on the chunk that carries finish_reason;
beside it, `seed` is the seed used (the request's, or drawn by the gateway). `logprobs` is
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


def usage(final: gateway_pb2.GenerateResponse) -> dict:
    """OpenAI `usage` of a finished generation (token counts) with the prediction-token details."""
    u = final.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "completion_tokens_details": {
                "accepted_prediction_tokens": final.spec_accepted_tokens,
                "rejected_prediction_tokens": final.spec_draft_tokens - final.spec_accepted_tokens}}


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

    def whole(self, final: gateway_pb2.GenerateResponse, token_ids: list[int] | None = None,
              logprobs: dict | None = None) -> dict:
        """The non-streaming response of a finished generation (`final`: its last message);
        token_ids: the completion's ids, added to the choice as `token_ids` (None: not added);
        logprobs: the choice's `logprobs` object (None: null)."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": final.text},
                      "logprobs": logprobs, "finish_reason": final.finish_reason}
        else:
            choice = {"index": 0, "text": final.text, "logprobs": logprobs, "finish_reason": final.finish_reason}
        choice["stop_reason"] = stop_reason(final)
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": usage(final), "dspark": dspark_stats(final), "seed": final.seed}

    def chunk(self, text: str, finish_reason: str | None = None, *, first: bool = False,
              with_usage_field: bool = False, token_ids: list[int] | None = None,
              logprobs: dict | None = None) -> dict:
        """One streamed chunk with `text` (chat: the delta; `first` adds the assistant role).
        with_usage_field: add `"usage": null`, as OpenAI does when the stream's usage comes last;
        token_ids: the ids new in this chunk, added to the choice (None: not added);
        logprobs: the `logprobs` object of this chunk's tokens (None: null)."""
        if self.chat:
            delta = ({"role": "assistant", "content": text} if first else {"content": text}) \
                if (text or first) else {}
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        body = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if with_usage_field:
            body["usage"] = None
        return body

    def final_chunk(self, final: gateway_pb2.GenerateResponse, with_usage_field: bool,
                    with_token_ids: bool = False) -> dict:
        """The chunk with the finish reason, the last text delta (and ids) and the `dspark` stats."""
        body = self.chunk(final.text_delta, final.finish_reason, with_usage_field=with_usage_field,
                          token_ids=list(final.token_ids) if with_token_ids else None)
        body["choices"][0]["stop_reason"] = stop_reason(final)
        body["dspark"] = dspark_stats(final)
        body["seed"] = final.seed
        return body

    def usage_chunk(self, final: gateway_pb2.GenerateResponse) -> dict:
        """The chunk `stream_options.include_usage` adds after the last one: no choices, the usage."""
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage(final)}
