"""Request bodies of the OpenAI-compatible endpoints and their translation to `GenerateRequest`.

Owns which OpenAI fields are accepted, their defaults and the checks that belong to the HTTP
layer (field types, sampling values, the prompts and choices of a request, stop strings), and
the refusal of fields that would change the output but are not supported
(`services.http.unsupported`). It never checks what the
gateway checks itself (token ids against the vocabulary, prompt + max_tokens against
max_seq_len, the stop token ids): those come back as INVALID_ARGUMENT, answered 400.

Sampling (docs/services.md §9): `temperature` absent means greedy (the model's default, as
vLLM uses the model's generation default rather than OpenAI's 1); > 0 samples with `top_p`,
`seed` (absent: the gateway draws one, returned as the response's `seed`) and the extensions `top_k`
and `min_p` (vLLM's names) and `sampling_rule` ("coupled" | "rejection"; absent: the
gateway's). `seed` is a signed 64-bit integer, as in OpenAI's and vLLM's APIs; a negative seed s
samples as s + 2**63 (`internal_seed`). `top_k` -1 means off, as 0 does (vLLM's spelling).
Logprobs: completions' integer `logprobs` (0..20 alternatives), chat's
`logprobs` + `top_logprobs`; they are the target model's raw logprobs. A bad value is a 400
naming the field, with `dsv4.sampling.SamplingParams`' own message. Prompt scoring
(completions only, `services.http.echo`): `echo` returns the prompt before the completion,
with its tokens' logprobs when `logprobs` is set; vLLM's `prompt_logprobs` (0..20) returns
vLLM's per-prompt-token list; with either, `max_tokens` may be 0 (score the prompt only).

Logits controls (docs/sampling.md): OpenAI's `logit_bias`, `presence_penalty` and
`frequency_penalty`, vLLM's `repetition_penalty`, `min_tokens` and `bad_words`; each applied
exactly, under speculation too. Logprobs stay the raw ones (vLLM's default).

Extensions beyond OpenAI (vLLM spells the last three the same way): `spec` ("off", "always",
"gated"; default: the gateway's), `ignore_eos`, `stop_token_ids`, and `return_token_ids`
(each choice and chunk then carries the completion's token ids as `token_ids`).
Structured output: `response_format` and the vLLM/SGLang `guided_*` / `structured_outputs`
fields (`services.http.structured`, docs/structured.md).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from dspark_proto.v1 import common_pb2, gateway_pb2
from dsv4.sampling import MAX_LOGPROBS, SamplingParams
from services.common.controls import MAX_BAD_WORDS, LogitsControls
from services.http.errors import invalid
from services.http.unsupported import CHAT_ONLY, SHARED, first_unsupported
from services.http.structured import constraint_message

_CONTROL_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias")
STRUCTURED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "structured_outputs")

SPEC_MODES = {None: gateway_pb2.SPEC_MODE_DEFAULT, "off": gateway_pb2.SPEC_MODE_OFF,
              "always": gateway_pb2.SPEC_MODE_ALWAYS, "gated": gateway_pb2.SPEC_MODE_GATED}
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
SAMPLING_RULES = {None: common_pb2.SAMPLING_RULE_DEFAULT, "coupled": common_pb2.SAMPLING_RULE_COUPLED,
                  "rejection": common_pb2.SAMPLING_RULE_REJECTION}
INT32_MAX = 2**31 - 1  # GenerateRequest carries counts and ids as int32
SEED_SPACE = 2**63  # the seeds SamplingParams takes: [0, 2**63)
# Generations one request may ask for (prompts x n): each is a gateway generation, queued
# within the request at the verifier's session limit.
MAX_CHOICES = 256
# Stop strings: the detokenizer tests each against the text's tail after every token, so both
# the count and the length bound the gateway's work per token.
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 256
# GenerateRequest carries temperature, top_p and min_p as float32: its largest finite value
# and its smallest subnormal, as Python floats (compared in float64)
FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).smallest_subnormal)


def _unicode_text(value: str) -> str:
    """Refuse a string the gRPC request cannot carry: JSON may spell a lone UTF-16 surrogate
    (an escaped half of a pair), which is not a Unicode scalar value and has no UTF-8 form.
    Raises ValueError (a 400 naming the field)."""
    for i, ch in enumerate(value):
        if 0xD800 <= ord(ch) <= 0xDFFF:
            raise ValueError(f"character {i} is a lone surrogate (U+{ord(ch):04X}); send valid Unicode text")
    return value


def _unicode_texts(value):
    """`_unicode_text` on a field whose value is text, a list of texts, or no text at all
    (token ids, None); checked after the union has matched, so the error names the surrogate
    rather than a union member's type. Raises ValueError."""
    for item in value if isinstance(value, list) else [value]:
        if isinstance(item, str):
            _unicode_text(item)
    return value


# Text fields of a request body: valid Unicode, so the protobuf string field can encode them.
Text = Annotated[str, AfterValidator(_unicode_text)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class GenerationFields(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share. Unknown fields are kept
    unvalidated and ignored (clients send many that change nothing here, such as `user`),
    except those `UNSUPPORTED` lists, which `check_common` refuses unless neutral."""

    model_config = ConfigDict(strict=True, extra="allow")
    UNSUPPORTED: ClassVar[dict] = SHARED

    model: Text | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    top_k: int | None = Field(default=None, le=INT32_MAX)
    min_p: float | None = None
    sampling_rule: Literal["coupled", "rejection"] | None = None
    stop: Annotated[Union[str, list[str], None], AfterValidator(_unicode_texts)] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    # logits controls (docs/sampling.md); OpenAI's two penalties, logit_bias (token id as a
    # decimal string -> bias), and vLLM's repetition_penalty, min_tokens and bad_words
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    bad_words: list[Text] | None = Field(default=None, max_length=MAX_BAD_WORDS)
    # extensions
    spec: Literal["off", "always", "gated"] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list, max_length=1024)
    return_token_ids: bool = False
    # structured output (services.http.structured checks their shapes; docs/structured.md)
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    # Fields OpenAI's API documents as "or null" whose type here is not Optional: null means
    # the default (clients built from that spec send `"logprobs": null` and the like).
    NULLABLE: ClassVar[frozenset[str]] = frozenset(
        {"stream", "n", "presence_penalty", "frequency_penalty", "logprobs", "echo", "min_tokens"})

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        """The body with every NULLABLE field that is null left out, so its default applies."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in cls.NULLABLE)}
        return data

    def check_common(self, logprobs: int = 0) -> None:
        """Refuse bad sampling values and what the service cannot do.

        logprobs: top alternatives asked per token (the endpoint's own field, 0 when none).
        Raises:
            ApiError: 400 naming the field: a sampling value `SamplingParams` refuses (NaN or
                negative temperature, top_p outside (0, 1], top_k < -1, min_p outside [0, 1],
                logprobs outside 0..20), a seed outside [-2**63, 2**63), a logits control
                `LogitsControls` refuses (a bias or penalty out of range, NaN, a logit_bias key
                that is no token id), more than MAX_STOP_STRINGS stop strings or one longer
                than MAX_STOP_CHARS, a negative or too large stop token id, an `UNSUPPORTED`
                field set.
        """
        if self.seed is not None and not -SEED_SPACE <= self.seed < SEED_SPACE:
            raise invalid("seed", f"seed={self.seed}: must lie in [-2**63, 2**63) (a signed 64-bit integer)")
        self.sampling(logprobs)
        refused = first_unsupported(self.model_extra or {}, self.UNSUPPORTED)
        if refused is not None:
            raise invalid(*refused)
        stops = self.stops
        if len(stops) > MAX_STOP_STRINGS:
            raise invalid("stop", f"stop: {len(stops)} strings; at most {MAX_STOP_STRINGS}")
        long = next((s for s in stops if len(s) > MAX_STOP_CHARS), None)
        if long is not None:
            raise invalid("stop", f"stop: a string of {len(long)} characters ({long[:20]!r}...); "
                                  f"at most {MAX_STOP_CHARS}")
        self.controls()
        bad = [t for t in self.stop_token_ids if not 0 <= t <= INT32_MAX]
        if bad:
            raise invalid("stop_token_ids", f"stop_token_ids: {bad[0]} is not a token id")
        self.constraint()

    def controls(self) -> LogitsControls:
        """The body's logits controls, checked by `LogitsControls` (bad_words stay text: the
        gateway tokenizes them). Raises ApiError 400 naming the field (and the logit_bias key)."""
        bias = []
        for key, value in (self.logit_bias or {}).items():
            # ASCII digits only: str.isdigit() also holds for "²" and "①", which int() refuses (a 500)
            if not (key.strip().isascii() and key.strip().isdigit()) or int(key) > INT32_MAX:
                raise invalid("logit_bias", f"logit_bias key {key!r}: must be a token id (a decimal integer)")
            bias.append((int(key), value))
        for name, value in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty),
                            ("repetition_penalty", self.repetition_penalty), *(("logit_bias", v) for _, v in bias)]:
            _check_float32(name, value)
        if any(not w.strip() for w in self.bad_words or ()):
            raise invalid("bad_words", "bad_words: an empty word; each must hold text")
        try:
            return LogitsControls(tuple(sorted(bias)), self.presence_penalty, self.frequency_penalty,
                                  1.0 if self.repetition_penalty is None else self.repetition_penalty, self.min_tokens)
        except ValueError as exc:  # LogitsControls' messages start with the field's name
            message = str(exc)
            raise invalid(next((f for f in _CONTROL_FIELDS if message.startswith(f)), "logit_bias"), message) from None

    def constraint(self) -> common_pb2.Constraint | None:
        """The body's output constraint on the wire (None: unconstrained). Raises ApiError 400
        naming the field (`services.http.structured`)."""
        return constraint_message({name: getattr(self, name) for name in STRUCTURED_FIELDS})

    def sampling(self, logprobs: int) -> SamplingParams:
        """The request's sampling values checked by `SamplingParams` (seed 0 stands in for an
        absent one, which the gateway draws). Raises ApiError 400 naming the field."""
        for name in ("temperature", "top_p", "min_p"):
            _check_float32(name, getattr(self, name))
        try:
            return SamplingParams(temperature=self.temperature or 0.0, top_p=1.0 if self.top_p is None else self.top_p,
                                  top_k=self.top_k_or_off, min_p=self.min_p or 0.0, seed=self.internal_seed or 0,
                                  logprobs=logprobs)
        except ValueError as exc:  # SamplingParams' messages start with "<field>=<value>"
            field, message = str(exc).split("=", 1)[0], str(exc)
            if field == "logprobs":
                field, message = self.LOGPROBS_FIELD, self.LOGPROBS_FIELD + message[len("logprobs"):]
            if field == "top_k":
                message += " (or -1: off)"
            raise invalid(field, message) from None

    LOGPROBS_FIELD: ClassVar[str] = "logprobs"  # the endpoint's name of the alternatives count

    @property
    def top_k_or_off(self) -> int:
        """top_k as the gateway takes it: 0 (off) for absent, 0 or -1 (vLLM's "off")."""
        return 0 if self.top_k in (None, -1) else self.top_k

    @property
    def internal_seed(self) -> int | None:
        """The seed in SamplingParams' space [0, 2**63): a negative seed s maps to s + 2**63,
        so every signed 64-bit seed names one stream (s and s + 2**63 name the same one);
        None when the request has none."""
        return None if self.seed is None else self.seed % SEED_SPACE

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def generate_request(self, request_id: str, max_tokens: int, prompt: str = "",
                         prompt_ids: list[int] | None = None, logprobs: int = 0,
                         prompt_logprobs: int | None = None) -> gateway_pb2.GenerateRequest:
        """The gRPC request of this body (checked by `check_common` first): `prompt` text or
        `prompt_ids` (int32 token ids); request_id: the response's id, which the gateway
        carries on its spans and log lines; logprobs: top alternatives per token;
        prompt_logprobs: top alternatives per prompt token (None: no prompt logprobs). The
        seed is `internal_seed` (unset when the body has none: the gateway draws one)."""
        req = gateway_pb2.GenerateRequest(
            prompt=prompt, prompt_token_ids=prompt_ids or [], max_tokens=max_tokens,
            temperature=self.temperature or 0.0, top_p=self.top_p or 0.0, top_k=self.top_k_or_off,
            min_p=self.min_p or 0.0, logprobs=logprobs, sampling_rule=SAMPLING_RULES[self.sampling_rule],
            spec=SPEC_MODES[self.spec], stop=self.stops, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, request_id=request_id, prompt_logprobs=prompt_logprobs)
        if self.seed is not None:
            req.seed = self.internal_seed
        c = self.controls()
        req.presence_penalty, req.frequency_penalty = c.presence_penalty, c.frequency_penalty
        req.repetition_penalty, req.min_tokens = c.repetition_penalty, c.min_tokens
        req.logit_bias.update(dict(c.logit_bias))
        req.bad_words.extend(self.bad_words or ())
        constraint = self.constraint()
        if constraint is not None:
            req.constraint.CopyFrom(constraint)
        return req


def _check_float32(name: str, value: float | None) -> None:
    """Refuse a finite value the float32 wire field cannot carry: past float32's largest (it
    would arrive as inf) or non-zero below half its smallest subnormal (it would arrive as 0,
    which for top_p means unset, i.e. 1). Raises ApiError 400 naming the field and value."""
    if value is None or not np.isfinite(value) or value == 0:
        return  # NaN, inf and 0 are for SamplingParams to judge
    if abs(value) > FLOAT32_MAX or abs(value) < FLOAT32_TINY / 2:
        raise invalid(name, f"{name}={value!r}: outside the float32 range the API carries it in "
                            f"(magnitude {FLOAT32_TINY:g} to {FLOAT32_MAX:g}, or 0)")


class CompletionRequest(GenerationFields):
    """POST /v1/completions. `prompt`: a string, a list of token ids, or a list of either (a
    batch: one choice per prompt, times `n`); `logprobs`: null or 0..20 alternatives per
    token; `echo`: return the prompt (and its logprobs) before the completion;
    `prompt_logprobs` (vLLM's extension): null or 0..20 alternatives per prompt token;
    `max_tokens` 0 only with echo or prompt_logprobs (the prompt is scored, nothing is
    generated); `best_of` null or equal to `n`; `suffix` null."""

    prompt: Annotated[Union[str, list[int], list[str], list[list[int]]], AfterValidator(_unicode_texts)]
    max_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None
    best_of: int | None = None
    suffix: Text | None = None

    def checked(self) -> list[tuple[str, list[int]]]:
        """The prompts, in order: (text, token ids) each, exactly one of the two non-empty.

        Raises:
            ApiError: 400 naming the field: a bad sampling value (`check_common`), logprobs
                or prompt_logprobs outside 0..20, max_tokens 0 without echo or
                prompt_logprobs, best_of other than n (no ranking of candidates), a suffix,
                no prompt or an empty one, more than MAX_CHOICES prompts x n, a token id
                outside int32.
        """
        self.check_common(self.top_alternatives)
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise invalid("prompt_logprobs", f"prompt_logprobs={self.prompt_logprobs}: must lie in 0..{MAX_LOGPROBS} "
                                             "(or null)")
        if self.max_tokens == 0 and not (self.echo or self.prompt_logprobs is not None):
            raise invalid("max_tokens", "max_tokens=0: must be >= 1, or 0 with echo=true or prompt_logprobs set "
                                        "(score the prompt without generating)")
        if self.best_of not in (None, self.n):
            raise invalid("best_of", f"best_of={self.best_of}: candidates are not ranked here; "
                                     f"best_of must be null or equal n={self.n}")
        if self.suffix:
            raise invalid("suffix", "suffix: not supported (null)")
        prompt = self.prompt
        batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        if len(batch) * self.n > MAX_CHOICES:
            raise invalid("prompt", f"prompt: {len(batch)} prompts x n={self.n} choices; "
                                    f"at most {MAX_CHOICES} per request")
        return [_one_prompt(p, i if len(batch) > 1 else None) for i, p in enumerate(batch)]

    @property
    def top_alternatives(self) -> int:
        """Alternatives per token asked for (0 also when logprobs are not asked for at all)."""
        return self.logprobs or 0


def _one_prompt(prompt: str | list[int], index: int | None) -> tuple[str, list[int]]:
    """(text, token ids) of one prompt; index: its place in a batch (None: not a batch).
    Raises ApiError 400 naming `prompt`: empty, or a token id outside int32."""
    where = "prompt" if index is None else f"prompt[{index}]"
    if not prompt:
        raise invalid("prompt", f"{where}: empty (give text or token ids)")
    if isinstance(prompt, str):
        return prompt, []
    bad = [t for t in prompt if not 0 <= t <= INT32_MAX]
    if bad:
        raise invalid("prompt", f"{where}: {bad[0]} is not a token id")
    return "", list(prompt)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    """One message; `content` is a string or a list of text parts (joined without separator)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[Union[str, list[TextPart], None], AfterValidator(_unicode_texts)] = None

    def as_template_input(self) -> dict:
        """{"role", "content"} with the content as one string, as chat templates expect."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(GenerationFields):
    """POST /v1/chat/completions. `max_completion_tokens` is the newer name of `max_tokens`
    (it wins when both are given); `logprobs` true returns each token's logprob, with
    `top_logprobs` (0..20) alternatives; `n` choices of the one conversation."""

    UNSUPPORTED: ClassVar[dict] = {**SHARED, **CHAT_ONLY}
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = None

    def checked(self) -> list[dict]:
        """The messages as chat-template input.

        Raises:
            ApiError: 400 naming the field: a bad sampling value, top_logprobs outside 0..20
                or given without logprobs.
        """
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs", f"top_logprobs={self.top_logprobs}: needs logprobs=true")
        self.check_common(self.top_alternatives)
        return [m.as_template_input() for m in self.messages]

    LOGPROBS_FIELD: ClassVar[str] = "top_logprobs"

    @property
    def top_alternatives(self) -> int:
        """Alternatives per token asked for (0 also when logprobs are not asked for at all)."""
        return self.top_logprobs or 0

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
