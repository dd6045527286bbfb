"""Request fields that would change the output and that this server cannot honour yet.

Owns the one table of such fields and their neutral values (the value that changes nothing,
which passes). A request that sets any of them to anything else is refused with a 400 naming
the field, never served as if the field were absent: a client that bans a token with
`logit_bias` must not get that token back silently. Fields the server honours, and fields
that change nothing about the tokens (`user`, `metadata`, `store`, `service_tier`,
`parallel_tool_calls` without tools, ...), are not listed; they are declared on the request
models or ignored as unknown.

The table is read when a request model is built (`GenerationFields.unsupported`); it never
reads the environment.
"""

from __future__ import annotations

from typing import Any, Callable

NOT_YET = "not supported by this server yet"


def _none(value: Any) -> bool:
    return value is None


def _falsy(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {}


def _zero_bias(value: Any) -> bool:
    """An absent or empty logit_bias, or one whose every bias is 0."""
    return value is None or (isinstance(value, dict) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0 for v in value.values()))


def _is(neutral: bool) -> Callable[[Any], bool]:
    """Absent, or exactly the boolean `neutral`."""
    return lambda value: value is None or value is neutral


def _number(neutral: float) -> Callable[[Any], bool]:
    """Absent, or a number (not a boolean) equal to `neutral`."""
    return lambda value: value is None or (
        isinstance(value, (int, float)) and not isinstance(value, bool) and value == neutral)


def _text_format(value: Any) -> bool:
    return value is None or value == {"type": "text"}


def _no_tool_choice(value: Any) -> bool:
    return value is None or value in ("none", "auto")


def _text_modalities(value: Any) -> bool:
    return value is None or value == ["text"]


# field -> (is the value neutral?, what the neutral value is, for the message). The penalties
# and logit_bias are sampling controls the verifier does not apply yet; the guided and tool
# fields constrain the output; the chat-template fields would render another prompt.
SHARED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "logit_bias": (_zero_bias, "{} or only zero biases"),
    "repetition_penalty": (_number(1), "1"),
    "min_tokens": (_number(0), "0"),
    "response_format": (_text_format, '{"type": "text"}'),
    "bad_words": (_falsy, "[]"),
    "allowed_token_ids": (_none, "null"),
    "prompt_logprobs": (_none, "null"),
    "guided_json": (_none, "null"),
    "guided_regex": (_none, "null"),
    "guided_choice": (_none, "null"),
    "guided_grammar": (_none, "null"),
    "structured_outputs": (_none, "null"),
    "logits_processors": (_none, "null"),
    "truncate_prompt_tokens": (_none, "null"),
    "use_beam_search": (_is(False), "false"),
    "include_stop_str_in_output": (_is(False), "false"),
    "skip_special_tokens": (_is(True), "true"),
    "spaces_between_special_tokens": (_is(True), "true"),
    "return_tokens_as_token_ids": (_is(False), "false"),
    "reasoning_effort": (_none, "null"),
    "verbosity": (_none, "null"),
    "web_search_options": (_none, "null"),
}
CHAT_ONLY: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tools": (_falsy, "null or []"),
    "functions": (_falsy, "null or []"),
    "tool_choice": (_no_tool_choice, '"none" or "auto" (no tools)'),
    "function_call": (_no_tool_choice, '"none" or "auto" (no functions)'),
    "add_generation_prompt": (_is(True), "true"),
    "continue_final_message": (_is(False), "false"),
    "add_special_tokens": (_is(False), "false"),
    "chat_template": (_none, "null (the model's template)"),
    "chat_template_kwargs": (_falsy, "null or {}"),
    "documents": (_none, "null"),
    "audio": (_none, "null"),
    "modalities": (_text_modalities, '["text"]'),
}


def first_unsupported(extra: dict[str, Any], table: dict[str, tuple[Callable[[Any], bool], str]]
                      ) -> tuple[str, str] | None:
    """(field, message) of the first field of `extra` (the body's fields no model declares)
    that `table` lists with a value other than its neutral one; None when there is none."""
    for name, value in extra.items():
        rule = table.get(name)
        if rule is not None and not rule[0](value):
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
            return name, f"{name}={shown}: {NOT_YET}; leave it out or send {rule[1]}"
    return None
