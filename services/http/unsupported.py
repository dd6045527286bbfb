"""Request fields that would change the output and that this server cannot honour yet.

Owns the one table of such fields and their neutral values (the value that changes nothing,
which passes). A request that sets any of them to anything else is refused with a 400 naming
the field, never served as if the field were absent: a client that bans a token with
`logit_bias` must not get that token back silently (logit_bias and the penalties are honoured
now; docs/sampling.md). Fields the server honours, and fields
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


def _is(neutral: bool) -> Callable[[Any], bool]:
    """Absent, or exactly the boolean `neutral`."""
    return lambda value: value is None or value is neutral


def _no_tool_choice(value: Any) -> bool:
    return value is None or value in ("none", "auto")


def _text_modalities(value: Any) -> bool:
    return value is None or value == ["text"]


# field -> (is the value neutral?, what the neutral value is, for the message, whether only chat
# takes it). The tool fields constrain the output (structured output is services.http.structured's);
# the chat-template fields would render another prompt.
_FIELDS: dict[str, tuple[Callable[[Any], bool], str, bool]] = {
    **dict.fromkeys(("allowed_token_ids", "logits_processors", "truncate_prompt_tokens",
                     "reasoning_effort", "verbosity", "web_search_options"), (_none, "null", False)),
    **dict.fromkeys(("use_beam_search", "include_stop_str_in_output", "return_tokens_as_token_ids"),
                    (_is(False), "false", False)),
    **dict.fromkeys(("skip_special_tokens", "spaces_between_special_tokens"), (_is(True), "true", False)),
    # chat only
    **dict.fromkeys(("tools", "functions", "chat_template_kwargs"), (_falsy, "null, [] or {}", True)),
    **dict.fromkeys(("tool_choice", "function_call"), (_no_tool_choice, '"none" or "auto" (no tools)', True)),
    **dict.fromkeys(("chat_template", "documents", "audio"), (_none, "null (the model's own)", True)),
    **dict.fromkeys(("continue_final_message", "add_special_tokens", "echo"), (_is(False), "false", True)),
    # prompt scoring is /v1/completions' (services.http.echo); chat would score the rendered template
    "prompt_logprobs": (_none, "null (score prompts on /v1/completions)", True),
    "add_generation_prompt": (_is(True), "true", True),
    "modalities": (_text_modalities, '["text"]', True),
}
# The tables the endpoints check: (is neutral?, neutral value) by field.
SHARED = {name: rule[:2] for name, rule in _FIELDS.items() if not rule[2]}
CHAT_ONLY = {name: rule[:2] for name, rule in _FIELDS.items() if rule[2]}


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
