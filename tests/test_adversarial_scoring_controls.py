"""Regressions from the adversarial pass over prompt scoring and logits controls.

Every choice of a prompt returns the prompt part its first choice (j = 0) scored. Before,
`n` choices each scored their own prefill, and under fast numerics (`dspark up`'s default) a row rounds differently with the rows batched beside it,
so `echo` with `n=3` returned three prompt parts that differed in the last bits (choice 0
prefilled alone, choices 1 and 2 together). Now only choice j = 0 asks for alternatives and
the others are given its records, whole or streamed (`services/http/echo.py`). And a bad word
too long is refused as soon as it is tokenized (`services/gateway/servicer.request_controls`).
"""

from __future__ import annotations

import asyncio

from dspark_proto.v1 import common_pb2, gateway_pb2
from services.http.batch import plan
from services.http.echo import first_records, score_once, with_first_records


def _requests(prompt_logprobs: int, max_tokens: int) -> list[gateway_pb2.GenerateRequest]:
    return [gateway_pb2.GenerateRequest(prompt_token_ids=ids, max_tokens=max_tokens, prompt_logprobs=prompt_logprobs)
            for ids in ([5, 6, 7], [8, 9])]


def test_only_each_prompts_first_choice_asks_for_alternatives():
    choices, _ = plan(_requests(3, 4), 3, 11, "cmpl-x")
    score_once(choices, 4)
    asked = [(c.index, c.request.HasField("prompt_logprobs")) for c in choices]
    assert asked == [(0, True), (1, False), (2, False), (3, True), (4, False), (5, False)]
    assert [c.request.prompt_logprobs for c in choices if c.j == 0] == [3, 3]
    # scoring without generating: the gateway requires the field, so j > 0 asks for 0 alternatives
    choices, _ = plan(_requests(3, 0), 2, 11, "cmpl-x")
    score_once(choices, 0)
    assert [(c.request.HasField("prompt_logprobs"), c.request.prompt_logprobs) for c in choices] == \
        [(True, 3), (True, 0), (True, 3), (True, 0)]


def _record(logprob: float) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=1, logprob=logprob, rank=1)


def test_whole_responses_take_the_first_choices_records():
    choices, _ = plan(_requests(1, 2), 2, 3, "cmpl-y")
    results = [(None, [], [], [_record(-float(c.index))]) for c in choices]  # each choice's own records
    shared = first_records(results, choices)
    assert [r[0].logprob for r in shared] == [0.0, 0.0, -2.0, -2.0]


def test_a_later_choices_messages_wait_for_the_first_choices_records_and_keep_their_order():
    js = {0: 0, 1: 1, 2: 2}
    first = gateway_pb2.GenerateResponse(text_delta="a0", prompt_logprobs=[_record(-1.5)])
    own = gateway_pb2.GenerateResponse(text_delta="b0", prompt_logprobs=[_record(-1.25)])
    items = [(1, own), (2, gateway_pb2.GenerateResponse(text_delta="c0")),
             (1, gateway_pb2.GenerateResponse(text_delta="b1")), (0, first),
             (2, gateway_pb2.GenerateResponse(text_delta="c1")), (0, gateway_pb2.GenerateResponse(text_delta="a1"))]

    async def source():
        for item in items:
            yield item

    async def collect():
        return [(i, m.text_delta, [r.logprob for r in records]) async for i, m, records in with_first_records(source(), js)]

    out = asyncio.run(collect())
    assert out == [(0, "a0", [-1.5]), (1, "b0", [-1.5]), (2, "c0", [-1.5]), (1, "b1", [-1.5]),
                   (2, "c1", [-1.5]), (0, "a1", [-1.5])]


def test_a_bad_word_too_long_is_refused_before_the_rest_are_tokenized():
    """Found by the adversarial pass: 128 bad words of 30,000 characters (a 4 MiB body) were
    all tokenized, two spellings each, on the gateway's event loop (2 s), before any was
    found too long; the first too-long word now ends it."""
    import pytest
    from services.gateway.servicer import request_controls
    from services_fixtures import tiny_tokenizer

    class Counting(type(tiny_tokenizer())):
        calls = 0

        def encode(self, text):
            Counting.calls += 1
            return super().encode(text)

    base = tiny_tokenizer()
    tokenizer = Counting(base.vocab_size, base.eos_token_id)
    req = gateway_pb2.GenerateRequest(prompt="x", max_tokens=4, bad_words=["ok", "w" * 3000] + ["w" * 3000] * 126)
    with pytest.raises(ValueError, match=r"^bad_words: a word of 3000 tokens; each needs 1\.\.32$"):
        request_controls(req, tokenizer)
    assert Counting.calls == 3  # "ok" twice, then the first long word once


def test_a_stop_string_released_under_min_tokens_does_not_stop_a_later_token():
    """Found by the adversarial pass: the first stop check after min_tokens looked one
    character too far back, so a stop string released while min_tokens held the checks off,
    ending right at the released text, stopped the next token (which holds none of it)."""
    from services.gateway.tokenizer import ByteTokenizer, Detokenizer

    detok = Detokenizer(ByteTokenizer(4096), stop=[">"], min_tokens=1)
    assert detok.add(300) == "<300>"          # min_tokens: not checked, released whole
    assert detok.add(ord("x") + 2) == "x" and not detok.stopped
    assert detok.add(301) == "<301" and detok.stopped  # a new ">" stops, cut before it
