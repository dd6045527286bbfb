"""Prompt scoring on /v1/completions: `echo` (with `logprobs`) and vLLM's `prompt_logprobs`.

Owns what a completion returns about its prompt: the prompt text before the completion's
(`echo`), the prompt tokens' entries before the completion's in the legacy `logprobs`
object (`LogprobFormatter.prompt_body`: the first prompt token has null logprob and
alternatives), and vLLM's / SGLang's `prompt_logprobs` list (first entry null, then per
prompt token a dict token id -> {"logprob", "rank", "decoded_token"} holding the top M
alternatives and the prompt token itself). The values are the gateway's prompt logprobs:
the target's raw log-softmax at each prompt position, before temperature and filters
(docs/sampling.md §5), computed by the verifier from the rows of the prefill.

It decides which prompt logprobs the gateway is asked for (`PromptScoring.alternatives`,
`score_once`) and never validates a field (`schemas.CompletionRequest.checked` does) or
calls the gateway.

A prompt is scored once per request, by its first choice (j = 0), and every choice of the
prompt returns that choice's records (`score_once`, `with_first_records`): under fast
numerics a prefill's rows round differently with the rows batched beside them, so n
choices each scoring their own prefill would return prompt parts that differ in the last
bits; and the other choices then skip the alternatives' vocabulary sort per prompt row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Sequence

from dspark_proto.v1 import common_pb2, gateway_pb2
from services.http.batch import Choice
from services.gateway.tokenizer import Tokenizer
from services.http.logprobs import LogprobFormatter


@dataclass(frozen=True)
class PromptPart:
    """What one choice returns about its prompt: `text` before its completion ("" without
    echo), `logprobs` the prompt's part of the legacy logprobs object (None: not asked), and
    `prompt_logprobs` vLLM's list (None: not asked)."""

    text: str
    logprobs: dict | None
    prompt_logprobs: list | None

    def apply(self, choice: dict, completion_logprobs: dict | None) -> dict:
        """`choice` (a completions choice or chunk choice with its completion `text`) with this
        prompt part before the completion: text, logprobs lists concatenated, and
        `prompt_logprobs` added when asked."""
        choice["text"] = self.text + choice["text"]
        if self.logprobs is not None:
            rest = completion_logprobs or {key: [] for key in self.logprobs}
            choice["logprobs"] = {key: self.logprobs[key] + rest[key] for key in self.logprobs}
        if self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs
        return choice


@dataclass(frozen=True)
class PromptScoring:
    """A completions request's prompt scoring: `echo`, its `logprobs` (None: null) and vLLM's
    `prompt_logprobs` (None: not asked); `prompts` each prompt's (text, token ids), in order;
    `n` choices per prompt."""

    echo: bool
    logprobs: int | None
    prompt_logprobs: int | None
    prompts: Sequence[tuple[str, list[int]]]
    n: int

    @property
    def asked(self) -> bool:
        """Whether any choice returns something about its prompt."""
        return self.echo or self.prompt_logprobs is not None

    def alternatives(self, max_tokens: int) -> int | None:
        """The `prompt_logprobs` to ask the gateway for: the most alternatives any output needs
        (echo with logprobs N: N; vLLM's prompt_logprobs M: M), 0 for a prompt scored without
        generating (max_tokens 0; the gateway requires prompt logprobs then), else None (the
        head then runs on the last prompt row only)."""
        wanted = [v for v in (self.logprobs if self.echo else None, self.prompt_logprobs) if v is not None]
        if max_tokens == 0:
            wanted.append(0)
        return max(wanted) if wanted else None

    def part(self, index: int, records: Sequence[common_pb2.TokenLogprob], tokenizer: Tokenizer,
             fmt: LogprobFormatter | None) -> PromptPart:
        """The prompt part of choice `index` (prompt index // n) from the gateway's prompt
        records (one per prompt token after the first). `fmt`: the choice's logprob formatter
        (None: logprobs null); it is advanced past the prompt, so the completion's text_offset
        continues after it.

        Raises:
            ValueError: the records do not match the prompt (a gateway that sent none, or
                others): their count is not the prompt's length - 1.
        """
        text, ids = self.prompts[index // self.n]
        scored = (self.echo and fmt is not None) or self.prompt_logprobs is not None
        if scored and len(records) != len(ids) - 1:
            raise ValueError(f"the gateway scored {len(records)} prompt tokens of {len(ids)}: expected {len(ids) - 1}")
        echoed = (text or tokenizer.decode(ids)) if self.echo else ""
        logprobs = fmt.prompt_body(ids[0], records) if (self.echo and fmt is not None) else None
        listed = None
        if self.prompt_logprobs is not None:
            listed = [None, *(vllm_entry(r, self.prompt_logprobs, tokenizer) for r in records)]
        return PromptPart(echoed, logprobs, listed)


def vllm_entry(record: common_pb2.TokenLogprob, top: int, tokenizer: Tokenizer) -> dict:
    """One prompt position in vLLM's `prompt_logprobs` shape: {str(token id): {"logprob",
    "rank", "decoded_token"}} for the `top` most likely ids (ranks 1..top, in order) and the
    prompt token itself (its own rank; it may be one of them)."""
    out = {}
    for rank, (t, lp) in enumerate(list(zip(record.top_ids, record.top_logprobs))[:top], start=1):
        out[str(t)] = {"logprob": lp, "rank": rank, "decoded_token": tokenizer.decode([t])}
    out.setdefault(str(record.token_id), {"logprob": record.logprob, "rank": record.rank,
                                          "decoded_token": tokenizer.decode([record.token_id])})
    return out


def score_once(choices: Sequence[Choice], max_tokens: int) -> None:
    """Ask only each prompt's first choice (j = 0) for prompt logprobs, in place: the others'
    requests drop the field, or, scoring without generating (max_tokens 0, where the gateway
    requires it), ask for 0 alternatives, the least the verifier computes."""
    for choice in choices:
        if choice.j > 0:
            if max_tokens == 0:
                choice.request.prompt_logprobs = 0
            else:
                choice.request.ClearField("prompt_logprobs")


def first_records(results: Sequence[tuple], choices: Sequence[Choice]) -> list[list[common_pb2.TokenLogprob]]:
    """Per choice (in `choices`' order, which is index order), the prompt records of its
    prompt's first choice: results[i][3] (an `Admission.collect` result) of choice index - j."""
    return [results[c.index - c.j][3] for c in choices]


async def with_first_records(items: AsyncIterator[tuple[int, gateway_pb2.GenerateResponse]], js: dict[int, int]
                             ) -> AsyncIterator[tuple[int, gateway_pb2.GenerateResponse, list]]:
    """(choice index, message, its prompt's records) for the interleaved streams `items`
    (js: choice index -> j): the records are those of the first message of the prompt's first
    choice (index - j), so a choice j > 0's messages are held, in order, until that message
    has passed. A stream that ends with messages still held (its first choice never sent
    one, which `Admission.stream_all` raises for) yields nothing more."""
    records: dict[int, list] = {}
    held: dict[int, list] = {}
    async for index, message in items:
        first = index - js[index]
        if first in records:
            yield index, message, records[first]
        elif index != first:
            held.setdefault(first, []).append((index, message))
        else:
            records[first] = list(message.prompt_logprobs)
            yield index, message, records[first]
            for other, kept in held.pop(first, []):
                yield other, kept, records[first]
