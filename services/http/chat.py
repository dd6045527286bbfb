"""The checkpoint's chat template: loading it and rendering chat messages into a prompt.

Owns where a template is found and how it is rendered; it never tokenizes (the caller
encodes the rendered text with the gateway's tokenizer) and never reads the environment.

A Hugging Face checkpoint carries its template as `chat_template` in `tokenizer_config.json`
(a string, or a list of {"name", "template"} of which "default" is used) or as a
`chat_template.jinja` file beside it. Templates are Jinja2, rendered in Jinja's immutable
sandbox (a template is data from the checkpoint, not trusted code) with the variables
Hugging Face templates use: `messages`, `add_generation_prompt`, `bos_token`, `eos_token`
and the function `raise_exception(message)`.

The models this project makes (the bundled `assets/dspark-small`, trained on plain text, and
the random tiny model) use `PLAIN_TEMPLATE`: one `role: content` line per message, then
`assistant:` for the turn to generate. The bundled folder carries it in its
`tokenizer_config.json`, as a real checkpoint does; the random model has no folder and gets it
here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.http.errors import ApiError


PLAIN_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
                  "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


class ChatTemplateError(ValueError):
    """A template a message list cannot be rendered with (what the template itself refused)."""


def _token_text(value) -> str:
    """A special token of tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template. source: the Jinja text; bos_token / eos_token: the special
    tokens' text the template may insert."""

    source: str
    bos_token: str = ""
    eos_token: str = ""

    def __post_init__(self) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        object.__setattr__(self, "_template", env.from_string(self.source))

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of `messages` ([{"role", "content"}]), ending with the assistant's
        turn when `add_generation_prompt`.

        Raises:
            ApiError: 400 naming `messages` when the template refuses them or fails on them.
        """
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except (ChatTemplateError, TemplateError, TypeError, ValueError) as exc:
            raise ApiError(400, f"messages: the chat template refused them: {exc}", param="messages",
                           code="invalid_value") from None


def _raise(message: str):
    raise ChatTemplateError(message)


def load_chat_template(checkpoint: str | Path | None) -> ChatTemplate | None:
    """The checkpoint folder's chat template, or None when it has none; `PLAIN_TEMPLATE` for
    the random tiny model (no folder).

    Raises:
        ValueError: naming the file: tokenizer_config.json is not JSON, its chat_template is
            neither a string nor a list with a "default" entry, or the template does not compile.
    """
    if checkpoint is None:
        return ChatTemplate(PLAIN_TEMPLATE)
    folder = Path(checkpoint)
    config_path = folder / "tokenizer_config.json"
    config = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{config_path}: not readable as JSON: {exc}") from None
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
        if source is None:
            raise ValueError(f"{config_path}: chat_template lists no 'default' template")
    if source is None and (folder / "chat_template.jinja").is_file():
        source = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if source is None:
        return None
    if not isinstance(source, str):
        raise ValueError(f"{config_path}: chat_template must be a string, not {type(source).__name__}")
    try:
        return ChatTemplate(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))
    except TemplateError as exc:
        raise ValueError(f"{config_path}: chat_template does not compile: {exc}") from None
