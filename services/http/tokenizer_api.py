"""vLLM's tokenizer endpoints on the HTTP front: `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`.

Owns their request and response shapes (vLLM's: `{"prompt"}` or `{"messages"}` ->
`{"count", "max_model_len", "tokens", "token_strs"}`; `{"tokens"}` -> `{"prompt"}`;
tokenizer_info: the checkpoint's tokenizer_config.json with `tokenizer_class`). The ids are the
gateway tokenizer's, exactly what a generation endpoint feeds the model for the same text
(chat: the same rendered template). That tokenizer adds no special tokens to a prompt, so
`add_special_tokens` changes nothing and is accepted for vLLM's clients. It never generates.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Union

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from services.gateway.tokenizer import HFTokenizer
from services.http.errors import invalid
from services.http.schemas import ChatMessage, Text
from services.http.unsupported import CHAT_ONLY, first_unsupported

MAX_DETOKENIZE_IDS = 1 << 20


class TokenizeCompletion(BaseModel):
    """`/tokenize` of a text prompt (vLLM's TokenizeCompletionRequest)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(BaseModel):
    """`/tokenize` of a conversation rendered by the chat template (vLLM's TokenizeChatRequest).
    Fields that would render another prompt than /v1/chat/completions does are refused."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False


class Detokenize(BaseModel):
    """`/detokenize` (vLLM's DetokenizeRequest)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: Text | None = None
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE_IDS)


def _tokenize_form(body) -> str:
    """Which form a /tokenize body is: a body with `messages` is a chat, anything else a text
    prompt, so a bad `prompt` is refused naming `prompt` (not a missing `messages`)."""
    return "TokenizeChat" if isinstance(body, dict) and "messages" in body else "TokenizeCompletion"


TokenizeBody = Annotated[Union[Annotated[TokenizeChat, Tag("TokenizeChat")],
                               Annotated[TokenizeCompletion, Tag("TokenizeCompletion")]],
                         Discriminator(_tokenize_form)]


def tokenizer_info(checkpoint: str | None, tokenizer) -> dict:
    """GET /tokenizer_info: the checkpoint's tokenizer_config.json (chat template included),
    with `tokenizer_class` set: the file's, else "PreTrainedTokenizerFast" for a tokenizer.json,
    "ByteTokenizer" for the random model's byte tokenizer.
    Raises ValueError naming the file when it is not a JSON object."""
    config: dict = {}
    path = Path(checkpoint) / "tokenizer_config.json" if checkpoint is not None else None
    if path is not None and path.is_file():
        config = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ValueError(f"{path}: not a JSON object")
    fallback = "PreTrainedTokenizerFast" if isinstance(tokenizer, HFTokenizer) else type(tokenizer).__name__
    return {**config, "tokenizer_class": config.get("tokenizer_class", fallback)}


def add_tokenizer_routes(app: FastAPI, front, info: dict) -> None:
    """The three endpoints over `front` (routes.Front: authorize, check_model, tokenizer,
    chat_template, model); info: the /tokenizer_info body."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody, request: Request):
        front.authorize(request)
        front.check_model(body.model)
        if isinstance(body, TokenizeChat):
            refused = first_unsupported(body.model_extra or {}, CHAT_ONLY)
            if refused is not None:
                raise invalid(*refused)
            text = front.template().render([m.as_template_input() for m in body.messages],
                                           add_generation_prompt=body.add_generation_prompt)
        else:
            text = body.prompt
        ids = await asyncio.to_thread(front.tokenizer.encode, text)  # off the loop that streams for everyone
        out = {"count": len(ids), "max_model_len": front.model.max_seq_len, "tokens": ids, "token_strs": None}
        if body.return_token_strs:
            out["token_strs"] = [front.tokenizer.token_str(i) for i in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(body: Detokenize, request: Request):
        front.authorize(request)
        front.check_model(body.model)
        bad = next((t for t in body.tokens if not 0 <= t < front.model.vocab_size), None)
        if bad is not None:
            raise invalid("tokens", f"tokens: {bad} is not a token id of this model (0..{front.model.vocab_size - 1})")
        return {"prompt": front.tokenizer.decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def get_tokenizer_info(request: Request):
        front.authorize(request)
        return info
