"""Structured output, fast parts (docs/structured.md): constraint parsing and compilation,
refusals naming the field, the matcher's mask / accept / rollback / completion, the HTTP
field mapping, and the gateway refusing a bad constraint before any session opens."""

from __future__ import annotations

import json

import pytest
import torch

from services.common.constraint import (ConstraintError, byte_vocab, checkpoint_vocab, make_constraint,
                                        productive)
from services.common.constraint_wire import constraint_from_proto, constraint_to_proto
from services.http.errors import ApiError
from services.http.structured import constraint_message
from services.common.grammar import GrammarError, GrammarState
from services.gateway.tokenizer import ByteTokenizer

VOCAB = byte_vocab(512, 1)
TOK = ByteTokenizer(512, 1)


@pytest.mark.parametrize("kind,spec,field,match", [
    ("json_schema", {"type": "foo"}, "response_format", r"response_format: the json schema does not compile: "
                                                         r'Unsupported type "foo"'),
    ("json_schema", "{not json", "guided_json", "guided_json: the JSON schema is not JSON"),
    ("regex", "a(b", "guided_regex", "guided_regex: the regex does not compile: .*parenthesis"),
    ("grammar", 'root ::= "a" root', "constraint.grammar", "constraint.grammar: the grammar has no accepting path"),
    ("grammar", "root ::= x", "constraint.grammar", 'Rule "x" is not defined'),
])
def test_a_constraint_the_compiler_refuses_is_one_error_naming_the_field(kind, spec, field, match):
    with pytest.raises(ConstraintError, match=match):
        VOCAB.compile(make_constraint(kind, spec, field))


@pytest.mark.parametrize("kind,spec,match", [
    ("choice", [], "non-empty list"), ("choice", ["a", "a"], "duplicate"), ("choice", ["a", ""], "non-empty string"),
    ("regex", "", "non-empty string"), ("xml", "", "not one of"), ("json_schema", [1], "must be an object"),
])
def test_malformed_constraint_values_are_refused(kind, spec, match):
    with pytest.raises(ConstraintError, match=f"f: .*{match}"):
        make_constraint(kind, spec, "f")


def test_productivity_finds_dead_ends_only():
    assert productive('root ::= (("a") | ("b" x))\nx ::= (("a" x))')
    assert not productive('root ::= (("b" x))\nx ::= (("a" x))')
    assert productive('root ::= ((x* "c"))\nx ::= (("a" x))')  # x may be absent
    assert productive("something unreadable")  # only a proven dead end is refused


def test_compile_cache_returns_the_same_compiled_grammar_per_spec():
    a = VOCAB.compile(make_constraint("regex", "[0-9]+", "x"))
    assert VOCAB.compile(make_constraint("regex", "[0-9]+", "y")) is a  # the field is not identity
    assert VOCAB.compile(make_constraint("regex", "[0-9]*", "x")) is not a


def _walk(state: GrammarState, seed: int, steps: int = 200) -> list[int]:
    """Greedy over random logits inside the grammar until eos."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        t = int(state.mask(torch.randn(state.vocab_size, generator=g)).argmax())
        state.accept(t)
        out.append(t)
        if t == 1:
            break
    return out


@pytest.mark.parametrize("kind,spec,check", [
    ("json_schema", {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                                      "e": {"enum": ["x", "y"]}}, "required": ["n", "e"]},
     lambda t: set(json.loads(t)) == {"n", "e"} and 0 <= json.loads(t)["n"] <= 99),
    ("choice", ["yes", 'no "quoted"'], lambda t: t in ("yes", 'no "quoted"')),
    ("regex", "[a-c]{2}-[0-9]{3}", lambda t: len(t) == 6 and t[2] == "-" and t[3:].isdigit()),
    ("grammar", 'root ::= "(" [0-9] ")"', lambda t: len(t) == 3 and t[1].isdigit()),
])
def test_every_walk_inside_the_mask_ends_with_eos_in_the_language(kind, spec, check):
    for seed in range(3):
        state = GrammarState(VOCAB.compile(make_constraint(kind, spec)), 512, 1)
        out = _walk(state, seed)
        assert out[-1] == 1 and state.finished, (kind, out)
        text = TOK.decode(out[:-1])
        assert check(text), text


def test_mask_accept_and_rollback():
    state = GrammarState(VOCAB.compile(make_constraint("choice", ["ab", "ac"])), 512, 1)
    allowed = state.allowed()
    assert allowed.nonzero().flatten().tolist() == [ord("a") + 2]
    row = torch.zeros(512)
    masked = state.mask(row)
    assert masked[ord("a") + 2] == 0 and torch.isinf(masked).sum() == 511 and row.eq(0).all()  # a copy
    with pytest.raises(GrammarError, match="not allowed"):
        state.accept(ord("b") + 2)
    state.accept(ord("a") + 2)
    assert set(state.allowed().nonzero().flatten().tolist()) == {ord("b") + 2, ord("c") + 2}
    state.accept(ord("b") + 2)
    assert state.finished and state.allowed().nonzero().flatten().tolist() == [1]  # eos only
    state.rollback_to(1)
    assert not state.finished and state.allows(ord("c") + 2)
    assert not state.allows(600) and not state.allows(-1)


def test_wire_round_trip_and_a_false_json_object_is_refused():
    from dspark_proto.v1 import common_pb2
    for c in (make_constraint("choice", ["a", "b"]), make_constraint("json_object"),
              make_constraint("json_schema", {"type": "object"}), make_constraint("regex", "x+")):
        back = constraint_from_proto(constraint_to_proto(c))
        assert back.key == c.key
    assert constraint_from_proto(common_pb2.Constraint()) is None
    with pytest.raises(ConstraintError, match="constraint.json_object: false"):
        constraint_from_proto(common_pb2.Constraint(json_object=False))  # explicitly set to false


def test_http_fields_map_to_one_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    m = constraint_message({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                                      "strict": True}}})
    assert json.loads(m.json_schema) == schema
    assert constraint_message({"response_format": {"type": "text"}}) is None
    assert constraint_message({"response_format": {"type": "json_object"}}).json_object
    assert list(constraint_message({"guided_choice": ["x", "y"]}).choice.choices) == ["x", "y"]
    assert constraint_message({"guided_regex": "a+"}).regex == "a+"
    assert constraint_message({"structured_outputs": {"grammar": 'root ::= "a"'}}).grammar == 'root ::= "a"'
    assert json.loads(constraint_message({"guided_json": json.dumps(schema)}).json_schema) == schema
    for fields, param in [({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
                          ({"response_format": {"type": "yaml"}}, "response_format.type"),
                          ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format.json_schema"),
                          ({"guided_choice": "abc"}, "guided_choice"),
                          ({"structured_outputs": {"xml": "a"}}, "structured_outputs.xml")]:
        with pytest.raises(ApiError) as err:
            constraint_message(fields)
        assert err.value.param == param, (fields, err.value)


def test_bundled_tokenizer_vocab_keeps_special_tokens_out():
    vocab = checkpoint_vocab("assets/dspark-small", 4096, 1)
    state = GrammarState(vocab.compile(make_constraint("json_object")), 4096, 1)
    allowed = state.allowed()
    assert not allowed[0] and not allowed[4095] and allowed.sum() > 0  # bos, the noise token
    assert vocab.info.vocab_size == 4096


def test_forced_run_is_the_single_allowed_tokens_and_leaves_the_matcher():
    state = GrammarState(VOCAB.compile(make_constraint("json_schema", {
        "type": "object", "properties": {"color": {"enum": ["red", "green"]}}, "required": ["color"]})), 512, 1)
    forced = state.forced_run(64)
    assert TOK.decode(forced) == '{"color": "'  # then red / green: a choice
    assert state.accepted == 0 and state.allows(ord("{") + 2)
    assert state.forced_run(3) == forced[:3]


def test_a_constraint_no_token_can_start_is_refused():
    from services.common.constraint import GrammarVocab
    vocab = GrammarVocab(["", "", "a", "b"], 4, 1)  # spells only a and b
    with pytest.raises(ConstraintError, match="guided_regex: no token of the model's vocabulary can start"):
        vocab.compile(make_constraint("regex", "c+", "guided_regex"))
    state = GrammarState(vocab.compile(make_constraint("regex", "a+")), 4, 1)
    state.accept(2)
    assert state.allowed().tolist() == [False, True, True, False]  # eos may end it, or more a


def test_prefetched_masks_along_a_draft_path_equal_fresh_fills():
    """`prefetch(path)` fills the masks of the states along a verify's drafts beside the
    forward: each state reached by accepting a prefix of the path gets exactly the mask a
    fresh fill gives; a state off the path (a rejected draft, a correction) is filled anew;
    the matcher is left where it was."""
    compiled = VOCAB.compile(make_constraint("json_schema", {
        "type": "object", "properties": {"color": {"enum": ["red", "green"]}, "n": {"type": "integer"}},
        "required": ["color", "n"]}))
    text = list(b'{"color": "green", "n": 12}')
    ids = [b + 2 for b in text]
    state, fresh = GrammarState(compiled, 512, 1), GrammarState(compiled, 512, 1)
    for t in ids[:10]:
        state.accept(t)
        fresh.accept(t)
    state.prefetch(ids[10:14])  # g r e e
    row = torch.randn(512, generator=torch.Generator().manual_seed(0))
    for t in ids[10:13]:
        assert torch.equal(state.allowed(), fresh.allowed())
        assert torch.equal(state.mask(row), fresh.mask(row))  # the prefetched CPU path, bitwise
        state.accept(t)
        fresh.accept(t)
    assert state.prefetched_hits == 3 and state.accepted == 13
    state.prefetch([ord("x") + 2, ord("e") + 2])  # forbidden first: only the current state's mask
    assert torch.equal(state.allowed(), fresh.allowed()) and state.prefetched_hits == 4
    state.accept(ord("e") + 2)
    fresh.accept(ord("e") + 2)
    assert torch.equal(state.allowed(), fresh.allowed()) and state.prefetched_hits == 4  # off the path: a fill
    state.prefetch(ids[14:20])
    state.rollback_to(12)  # waits for the job; the matcher was where it was left
    fresh.rollback_to(12)
    assert torch.equal(state.allowed(), fresh.allowed()) and state.prefetched_hits == 4
    assert state.forced_run(8) == fresh.forced_run(8)


def test_forced_run_reads_the_top_bit_of_a_word():
    """Token 31 (the sign bit of bitmask word 0) as the one allowed token."""
    from services.common.constraint import GrammarVocab
    vocab = GrammarVocab([""] * 31 + ["q"] + [""] * 32, 64, 1)
    state = GrammarState(vocab.compile(make_constraint("regex", "qq")), 64, 1)
    assert state.forced_run(5) == [31, 31]
