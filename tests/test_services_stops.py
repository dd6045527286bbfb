"""Stop conditions and limits through the gateway, with the live oracle drafter.

The oracle drafter proposes the target's own greedy continuation, so with spec `always` and
sequential verify every round accepts its whole block: the first message carries the prefill's
anchor (completion index 0), round r carries completion indices 1 + (r-1)(B+1) .. r(B+1)
(B drafts, then the bonus token). Choosing a stop token id from the plain `off` run's
tokens therefore puts the stop at a known block position; the output must end exactly there
although the verifier accepted the whole block.
"""

from __future__ import annotations

import math

import pytest

from services_fixtures import block_size, gen_request, oracle_stack, tiny_tokenizer  # noqa: F401

PROMPT = "stop here"
REF_TOKENS = 26


@pytest.fixture(scope="module")
def reference(oracle_stack):  # noqa: F811
    """The plain (`off`) greedy continuation of PROMPT."""
    gen = oracle_stack.generate(gen_request(PROMPT, max_tokens=REF_TOKENS, spec="off"))
    assert len(gen.token_ids) == REF_TOKENS
    return gen.token_ids


def completion_index(round_: int, block_position: int) -> int:
    """Completion index of the token at `block_position` (0..B-1 drafts, B the bonus) in `round_` >= 1."""
    return 1 + (round_ - 1) * (block_size() + 1) + block_position


def assert_consistent(gen) -> None:
    """usage equals the streamed token count and the deltas concatenate to the final text."""
    assert gen.final.usage.completion_tokens == len(gen.token_ids)
    assert gen.final.usage.prompt_tokens == len(PROMPT)
    assert gen.streamed_text == gen.final.text


def first_occurrence_round(ref: list[int], block_position: int) -> int:
    """The first round >= 2 whose token at block_position does not occur earlier in ref."""
    for r in range(2, 5):
        i = completion_index(r, block_position)
        if i < len(ref) and ref[i] not in ref[:i]:
            return r
    raise AssertionError(f"no round puts a fresh token at block position {block_position}: {ref}")


@pytest.mark.parametrize("block_position", range(5))
def test_stop_token_at_block_position_ends_output_there(oracle_stack, reference, block_position):  # noqa: F811
    B = block_size()
    assert B == 5
    r = first_occurrence_round(reference, block_position)
    i = completion_index(r, block_position)
    gen = oracle_stack.generate(gen_request(PROMPT, max_tokens=REF_TOKENS, spec="always",
                                            stop_token_ids=[reference[i]]))
    assert gen.token_ids == reference[: i + 1]
    assert gen.finish_reason == "stop"
    assert gen.final.text == tiny_tokenizer().decode(reference[:i])  # the stop token's text is not shown
    assert_consistent(gen)
    # the stop landed inside a block the verifier accepted whole; nothing after it was streamed
    assert gen.stats.rounds == r
    assert gen.stats.submitted == gen.stats.accepted == r * B
    assert [t for c in gen.chunks for t in c][-1] == reference[i]
    assert len([c for c in gen.chunks if c][-1]) == block_position + 1


@pytest.mark.parametrize("where", ["prefill_anchor", "bonus"])
def test_stop_token_outside_the_drafts(oracle_stack, reference, where):  # noqa: F811
    i = 0 if where == "prefill_anchor" else completion_index(2, block_size())
    assert reference[i] not in reference[:i]
    gen = oracle_stack.generate(gen_request(PROMPT, max_tokens=REF_TOKENS, spec="always",
                                            stop_token_ids=[reference[i]]))
    assert gen.token_ids == reference[: i + 1]
    assert gen.finish_reason == "stop"
    assert gen.final.text == tiny_tokenizer().decode(reference[:i])
    assert_consistent(gen)
    assert gen.stats.rounds == (0 if i == 0 else 2)


def test_stop_string_across_two_blocks(oracle_stack, reference):  # noqa: F811
    tok = tiny_tokenizer()
    B = block_size()
    # the stop string spans the last draft and the bonus of round 1 and the first two drafts of round 2
    start, end = completion_index(1, B - 1), completion_index(2, 1)  # indices 5 and 8
    head, full = tok.decode(reference[:start]), tok.decode(reference[: end + 1])
    assert full.startswith(head)
    stop = full[len(head):]
    assert tok.decode(reference[: start + 1]) != head            # starts inside round 1's text
    assert stop not in tok.decode(reference[:end])                # completes only with round 2's token
    assert len(tok.decode(reference[: completion_index(2, 0)])) < len(full)
    gen = oracle_stack.generate(gen_request(PROMPT, max_tokens=REF_TOKENS, spec="always", stop=[stop]))
    assert gen.token_ids == reference[: end + 1]
    assert gen.finish_reason == "stop"
    assert gen.final.text == head                                 # the stop string is not returned
    assert_consistent(gen)
    assert gen.stats.rounds == 2


def test_stop_string_prefix_that_never_completes_is_released(oracle_stack, reference):  # noqa: F811
    tok = tiny_tokenizer()
    # the text of indices 5..6 followed by a character that never comes: held back, then released
    head = tok.decode(reference[:5])
    stop = tok.decode(reference[:7])[len(head):] + "\x00never"
    gen = oracle_stack.generate(gen_request(PROMPT, max_tokens=13, spec="always", stop=[stop]))
    assert gen.token_ids == reference[:13]
    assert gen.finish_reason == "length"
    assert gen.final.text == tok.decode(reference[:13])
    assert_consistent(gen)


@pytest.mark.parametrize("max_tokens", range(1, 2 * (5 + 1) + 2))
def test_max_tokens_is_exact(oracle_stack, reference, max_tokens):  # noqa: F811
    B = block_size()
    gen = oracle_stack.generate(gen_request(PROMPT, max_tokens=max_tokens, spec="always"))
    assert gen.token_ids == reference[:max_tokens]
    assert gen.finish_reason == "length"
    assert gen.final.text == tiny_tokenizer().decode(reference[:max_tokens])
    assert_consistent(gen)
    # k is capped by the remaining budget: no round submits a draft past max_tokens
    rounds = math.ceil((max_tokens - 1) / (B + 1))
    assert gen.stats.rounds == rounds
    assert gen.stats.submitted == gen.stats.accepted == max_tokens - 1 - rounds
