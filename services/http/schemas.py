"""Request bodies of the OpenAI-compatible endpoints and their translation to `GenerateRequest`.

Owns which OpenAI fields are accepted, their defaults and the checks that belong to the HTTP
layer (field types, greedy-only sampling fields, one prompt per request). It never checks
what the gateway checks itself (token ids against the vocabulary, prompt + max_tokens against
max_seq_len, the stop token ids): those come back as INVALID_ARGUMENT, answered 400.

Sampling: only greedy decoding runs today. `temperature` absent means greedy (the model's
default, as vLLM uses the model's generation default rather than OpenAI's 1); an explicit
value must be 0, `top_p` 1, `logprobs` null, or the request is refused with a 400 that names
the field and says only greedy decoding is supported. `seed` is accepted and changes nothing
(greedy output does not depend on it).

Extensions beyond OpenAI (vLLM spells the last three the same way): `spec` ("off", "always",
"gated"; default: the gateway's), `ignore_eos`, `stop_token_ids`, and `return_token_ids`
(each choice and chunk then carries the completion's token ids as `token_ids`).
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from dspark_proto.v1 import gateway_pb2
from services.http.errors import invalid

SPEC_MODES = {None: gateway_pb2.SPEC_MODE_DEFAULT, "off": gateway_pb2.SPEC_MODE_OFF,
              "always": gateway_pb2.SPEC_MODE_ALWAYS, "gated": gateway_pb2.SPEC_MODE_GATED}
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
GREEDY_ONLY = "only greedy decoding is supported"
INT32_MAX = 2**31 - 1  # GenerateRequest carries counts and ids as int32


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class GenerationFields(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share. Unknown fields are ignored
    (clients send many that change nothing here, such as `user`)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # extensions
    spec: Literal["off", "always", "gated"] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list, max_length=1024)
    return_token_ids: bool = False

    def check_common(self) -> None:
        """Refuse what the service cannot do yet.

        Raises:
            ApiError: 400 naming the field: temperature != 0, top_p != 1, n != 1, a non-zero
                penalty, a negative or too large stop token id.
        """
        if self.temperature is not None and self.temperature != 0:
            raise invalid("temperature", f"temperature={self.temperature:g}: {GREEDY_ONLY} (temperature 0)")
        if self.top_p is not None and self.top_p != 1:
            raise invalid("top_p", f"top_p={self.top_p:g}: {GREEDY_ONLY} (top_p 1)")
        if self.n != 1:
            raise invalid("n", f"n={self.n}: one choice per request is supported (n 1)")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise invalid(name, f"{name}={getattr(self, name):g}: {GREEDY_ONLY} without penalties (0)")
        bad = [t for t in self.stop_token_ids if not 0 <= t <= INT32_MAX]
        if bad:
            raise invalid("stop_token_ids", f"stop_token_ids: {bad[0]} is not a token id")

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def generate_request(self, request_id: str, max_tokens: int, prompt: str = "",
                         prompt_ids: list[int] | None = None) -> gateway_pb2.GenerateRequest:
        """The gRPC request of this body: `prompt` text or `prompt_ids` (int32 token ids), greedy;
        request_id: the response's id, which the gateway carries on its spans and log lines."""
        return gateway_pb2.GenerateRequest(
            prompt=prompt, prompt_token_ids=prompt_ids or [], max_tokens=max_tokens, temperature=0.0,
            spec=SPEC_MODES[self.spec], stop=self.stops, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, request_id=request_id)


class CompletionRequest(GenerationFields):
    """POST /v1/completions. `prompt`: a string, a list of token ids, or a one-element list of
    either; `logprobs` must be null; `echo` false; `best_of` null or 1; `suffix` null."""

    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def checked(self) -> tuple[str, list[int]]:
        """(prompt text, prompt token ids): exactly one of them non-empty.

        Raises:
            ApiError: 400 naming the field: an unsupported sampling field (`check_common`),
                logprobs not null, echo, best_of > 1, a suffix, an empty prompt, several
                prompts, a token id outside int32.
        """
        self.check_common()
        if self.logprobs is not None:
            raise invalid("logprobs", f"logprobs={self.logprobs}: {GREEDY_ONLY}, without logprobs (null)")
        if self.echo:
            raise invalid("echo", "echo=true: not supported (false)")
        if self.best_of not in (None, 1):
            raise invalid("best_of", f"best_of={self.best_of}: {GREEDY_ONLY} (best_of 1)")
        if self.suffix:
            raise invalid("suffix", "suffix: not supported (null)")
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise invalid("prompt", f"prompt: a batch of {len(prompt)} prompts; send one prompt per request")
            prompt = prompt[0]
        if not prompt:
            raise invalid("prompt", "prompt: empty (give text or token ids)")
        if isinstance(prompt, str):
            return prompt, []
        bad = [t for t in prompt if not 0 <= t <= INT32_MAX]
        if bad:
            raise invalid("prompt", f"prompt: {bad[0]} is not a token id")
        return "", list(prompt)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; `content` is a string or a list of text parts (joined without separator)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None

    def as_template_input(self) -> dict:
        """{"role", "content"} with the content as one string, as chat templates expect."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(GenerationFields):
    """POST /v1/chat/completions. `max_completion_tokens` is the newer name of `max_tokens`
    (it wins when both are given); `logprobs` must be false, `top_logprobs` null."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = None

    def checked(self) -> list[dict]:
        """The messages as chat-template input.

        Raises:
            ApiError: 400 naming the field: an unsupported sampling field, logprobs.
        """
        self.check_common()
        if self.logprobs or self.top_logprobs is not None:
            raise invalid("logprobs", f"logprobs={self.logprobs}, top_logprobs={self.top_logprobs}: "
                                      f"{GREEDY_ONLY}, without logprobs")
        return [m.as_template_input() for m in self.messages]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
