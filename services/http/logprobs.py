"""OpenAI's `logprobs` objects built from the gateway's per-token `TokenLogprob` messages.

Owns the two JSON shapes and nothing else: the values are the gateway's (the target model's
raw log-softmax, before temperature and filters, natural log), and a token's text is the
tokenizer's decoding of that one id.

Completions (`logprobs`: N): {"tokens": [str], "token_logprobs": [float], "top_logprobs":
[{str: float}], "text_offset": [int]}; each top_logprobs entry holds the N most likely tokens
and the chosen one (N + 1 entries when the chosen one is not among them, as vLLM does; fewer
when two ids decode to the same text, the dict's key). With `echo`, the prompt's tokens come
first (`prompt_body`): the first prompt token has `null` in token_logprobs and top_logprobs
(nothing precedes it), as OpenAI's legacy API and vLLM answer, which lm-eval reads.
Chat (`logprobs: true`, `top_logprobs`: N): {"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}]}]}. A streamed response carries, in each
chunk, the logprobs of the tokens new in that chunk; `text_offset` keeps counting across them.
"""

from __future__ import annotations

from typing import Sequence

from dspark_proto.v1 import common_pb2
from services.gateway.tokenizer import Tokenizer


class LogprobFormatter:
    """Formats one response's logprobs (stateful across the chunks of one stream).

    Args:
        tokenizer: decodes a token id to its text.
        chat: the chat shape (else the completions shape).
        top: alternatives kept per token (None: all the record carries); prompt records may
            carry more than the request's `logprobs` when vLLM's `prompt_logprobs` asked more.
    """

    def __init__(self, tokenizer: Tokenizer, chat: bool, top: int | None = None):
        self.tokenizer, self.chat, self.top = tokenizer, chat, top
        self.offset = 0  # completions' text_offset: characters before the next token

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def body(self, records: Sequence[common_pb2.TokenLogprob]) -> dict:
        """The `logprobs` object of `records` (one per token, in order)."""
        if self.chat:
            return {"content": [self._chat_entry(r) for r in records]}
        tokens, offsets = [], []
        for r in records:
            tokens.append(self._text(r.token_id))
            offsets.append(self.offset)
            self.offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [r.logprob for r in records],
                "top_logprobs": [self._top_dict(r) for r in records], "text_offset": offsets}

    def prompt_body(self, first_token_id: int, records: Sequence[common_pb2.TokenLogprob]) -> dict:
        """The completions `logprobs` object of an echoed prompt: its first token (logprob and
        alternatives null) then one entry per record (the prompt's later tokens, in order);
        `text_offset` counts from the start of the prompt."""
        text = self._text(first_token_id)
        head = {"tokens": [text], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [self.offset]}
        self.offset += len(text)
        rest = self.body(records)
        return {key: head[key] + rest[key] for key in head}

    def _top_dict(self, r: common_pb2.TokenLogprob) -> dict[str, float]:
        # Two ids can decode to one string (a lone byte of a multi-byte character): the more
        # likely one keeps the key, as the alternatives arrive most likely first.
        top: dict[str, float] = {}
        for t, lp in list(zip(r.top_ids, r.top_logprobs))[:self.top]:
            top.setdefault(self._text(t), lp)
        top.setdefault(self._text(r.token_id), r.logprob)
        return top

    def _chat_entry(self, r: common_pb2.TokenLogprob) -> dict:
        text = self._text(r.token_id)
        return {"token": text, "logprob": r.logprob, "bytes": list(text.encode()),
                "top_logprobs": [{"token": (t := self._text(i)), "logprob": lp, "bytes": list(t.encode())}
                                 for i, lp in zip(r.top_ids, r.top_logprobs)]}
