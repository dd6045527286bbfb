"""Prompt logprobs (prompt scoring) through the real services: exact-numerics verifiers on
port 0, a DSpark drafter, gateways, the HTTP front, and the `openai` client.

The property that makes prompt scoring trustworthy: a prompt token's logprob is the one a
plain decode assigns to that token. Generate with logprobs, then score prompt + completion
with `max_tokens: 0`: the completion's tokens get bitwise the logprobs the generation
streamed, whether the generation was speculated (always, gated) or not (off), and whatever
the verifier's prefill chunk. Then the request shapes clients send (lm-eval's exactly, vLLM's
`prompt_logprobs`, a batch with n, streaming) and the 400s naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
import openai
import pytest

from dspark_proto.v1 import gateway_pb2, gateway_pb2_grpc
from services import app
from services.common.server import RunningServer, channel_options
from services.common.settings import BackendSettings, GatewaySettings
from services.gateway.gate import GateConfig
from services.http.server import RANDOM_MODEL_ID, start_http_front
from services_fixtures import SPEC, service_loop, tiny_draft_module, tiny_tokenizer

PROMPT_IDS = [7, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111, 119, 110, 32, 102, 111, 120, 33] * 2 + [9] * 4
GENERATED = 22  # prompt + completion = 66 tokens: the scored sequence crosses a 64-row exact prompt tile
SMALL_CHUNK = 7  # the second verifier's prefill chunk: the prompt in 10 chunks, none on a tile boundary
TIMEOUT_S = 120


@dataclass
class Stack:
    """Two exact-numerics verifiers (prefill chunk 64, and SMALL_CHUNK), one DSpark drafter, a
    gateway over each verifier, and the HTTP front of the first."""

    servers: list[RunningServer] = field(default_factory=list)
    closers: list = field(default_factory=list)
    stubs: dict[str, gateway_pb2_grpc.GatewayStub] = field(default_factory=dict)
    base_url: str = ""
    drafter_engine: object = None

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=TIMEOUT_S)

    async def close(self) -> None:
        for close in reversed(self.closers):
            await close()
        for server in reversed(self.servers):
            await server.stop(0)


async def _start() -> Stack:
    stack = Stack()
    backend = BackendSettings(verify_numerics="exact")
    trunk = app.load_trunk(None, verify_numerics="exact")
    stack.drafter_engine = app.drafter_engine(tiny_draft_module(), settings=backend)
    drafter = await app.start_drafter(stack.drafter_engine)
    stack.servers.append(drafter)
    for name, chunk in (("one_chunk", 64), ("small_chunks", SMALL_CHUNK)):
        verifier = await app.start_verifier(app.verifier_engine(trunk, backend), prefill_chunk=chunk)
        stack.servers.append(verifier)
        settings = GatewaySettings(verifier_target=f"127.0.0.1:{verifier.port}",
                                   drafter_target=f"127.0.0.1:{drafter.port}", verify_mode="batched")
        server, scheduler, backends = await app.start_gateway(settings, GateConfig())
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=channel_options())
        stack.servers.append(server)
        stack.closers += [backends.close, channel.close]
        stack.stubs[name] = gateway_pb2_grpc.GatewayStub(channel)
        if name == "one_chunk":
            front = await start_http_front(server, scheduler, None, 0, generate_timeout_s=TIMEOUT_S)
            stack.closers.append(lambda: front.http.stop(1.0))
            stack.base_url = f"http://127.0.0.1:{front.http.port}/v1"
    return stack


@pytest.fixture(scope="module")
def stack():
    loop = service_loop()
    s = loop.run(_start(), 120)
    yield s
    loop.run(s.close(), 60)


def run(coro):
    return service_loop().run(coro, TIMEOUT_S)


async def _messages(stub, req: gateway_pb2.GenerateRequest) -> list[gateway_pb2.GenerateResponse]:
    return [m async for m in stub.Generate(req, timeout=TIMEOUT_S)]


def _generate(stub, spec: str, logprobs: int = 2, max_tokens: int = GENERATED) -> tuple[list[int], list, int]:
    """(completion ids, their TokenLogprob messages, drafts it verified) of a greedy generation
    after PROMPT_IDS."""
    req = gateway_pb2.GenerateRequest(prompt_token_ids=PROMPT_IDS, max_tokens=max_tokens, spec=SPEC[spec],
                                      ignore_eos=True, logprobs=logprobs)
    msgs = run(_messages(stub, req))
    return [t for m in msgs for t in m.token_ids], [lp for m in msgs for lp in m.logprobs], msgs[-1].spec_draft_tokens


def _score(stub, ids: list[int], top: int = 2) -> gateway_pb2.GenerateResponse:
    """The one message of scoring `ids` without generating (max_tokens 0)."""
    req = gateway_pb2.GenerateRequest(prompt_token_ids=ids, max_tokens=0, prompt_logprobs=top)
    msgs = run(_messages(stub, req))
    assert len(msgs) == 1 and msgs[0].finished and msgs[0].finish_reason == "length"
    assert msgs[0].usage.completion_tokens == 0 and not msgs[0].token_ids
    return msgs[0]


def _fields(records) -> list[tuple]:
    return [(r.token_id, r.logprob, list(r.top_ids), list(r.top_logprobs)) for r in records]


# ---------------------------------------------------------------------------- gRPC: the property
def test_prompt_logprobs_equal_the_decode_logprobs_bitwise_under_every_spec_mode_and_chunking(stack):
    """Each spec mode's generation gives one sequence (greedy, exact numerics); scored back
    through a one-chunk and a 7-token-chunk prefill, its completion tokens get bitwise the
    logprobs each mode streamed (a plain decode's rows under off; verify blocks' under always
    and gated), and the two prefills agree on every record."""
    stub = stack.stubs["one_chunk"]
    runs = {spec: _generate(stub, spec) for spec in ("off", "always", "gated")}
    ids = runs["off"][0]
    assert len(ids) == GENERATED and all(run[0] == ids for run in runs.values())
    assert runs["always"][2] > 0  # its logprobs came from verify blocks
    scored = {name: _score(stack.stubs[name], PROMPT_IDS + ids).prompt_logprobs
              for name in ("one_chunk", "small_chunks")}
    assert _fields(scored["one_chunk"]) == _fields(scored["small_chunks"])
    records = scored["one_chunk"]
    assert [r.token_id for r in records] == PROMPT_IDS[1:] + ids
    completion = records[len(PROMPT_IDS) - 1:]  # its first token was chosen by the prefill's last row
    for spec, (_, streamed, _) in runs.items():
        assert _fields(completion) == _fields(streamed), spec
    assert [r.rank for r in completion] == [1] * GENERATED  # greedy tokens are the most likely
    assert all(r.rank >= 1 for r in records) and any(r.rank > 1 for r in records[:len(PROMPT_IDS) - 1])


def test_a_generation_with_prompt_logprobs_streams_them_first_and_generates_the_same(stack):
    stub = stack.stubs["small_chunks"]
    plain = _generate(stub, "off", max_tokens=8)[0]
    req = gateway_pb2.GenerateRequest(prompt_token_ids=PROMPT_IDS, max_tokens=8, spec=SPEC["always"],
                                      ignore_eos=True, prompt_logprobs=3)
    msgs = run(_messages(stub, req))
    assert [t for m in msgs for t in m.token_ids] == plain
    assert len(msgs[0].prompt_logprobs) == len(PROMPT_IDS) - 1 and not any(m.prompt_logprobs for m in msgs[1:])
    assert all(len(r.top_ids) == 3 and r.rank >= 1 for r in msgs[0].prompt_logprobs)


@pytest.mark.parametrize("fields, words", [
    ({"max_tokens": 0}, ["max_tokens=0", "prompt_logprobs"]),
    ({"max_tokens": 0, "prompt_logprobs": 21}, ["prompt_logprobs=21", "0..20"]),
    ({"max_tokens": 2, "prompt_logprobs": -1}, ["prompt_logprobs=-1", "0..20"]),
    ({"max_tokens": -1, "prompt_logprobs": 0}, ["max_tokens=-1"]),
])
def test_bad_prompt_scoring_requests_are_invalid_argument_naming_the_field(stack, fields, words):
    req = gateway_pb2.GenerateRequest(prompt_token_ids=PROMPT_IDS, **fields)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(_messages(stack.stubs["one_chunk"], req))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert all(w in err.value.details() for w in words), err.value.details()


# ---------------------------------------------------------------------------- HTTP: client shapes
def _lm_eval_loglikelihood(choice, ctxlen: int) -> tuple[float, bool]:
    """What lm-eval's `parse_logprobs` reads of one choice (lm_eval/models/openai_completions.py)."""
    lp = choice.logprobs
    tokens_logprobs, top_logprobs = lp.token_logprobs[ctxlen:-1], lp.top_logprobs[ctxlen:-1]
    return sum(tokens_logprobs), all(t == max(top.values()) for t, top in zip(tokens_logprobs, top_logprobs))


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_lm_eval_request_shape_scores_the_continuation(stack, max_tokens):
    """lm-eval's exact loglikelihood request, batched (two contexts with their continuations),
    read the way lm-eval reads it: the scores equal the gRPC prompt logprobs."""
    context, cont_a, cont_b = PROMPT_IDS[:12], PROMPT_IDS[12:], [120, 121, 122, 32, 33]
    body = dict(model=RANDOM_MODEL_ID, prompt=[context + cont_a, context + cont_b], max_tokens=max_tokens, logprobs=1,
                echo=True, temperature=0, seed=1234)
    r = stack.client().completions.create(**body)
    assert [c.index for c in r.choices] == [0, 1]
    for choice, cont in zip(r.choices, (cont_a, cont_b)):
        ids = context + cont
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + max_tokens and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.tokens[:len(ids)] == [tiny_tokenizer().decode([t]) for t in ids]
        assert choice.text.startswith(tiny_tokenizer().decode(ids))
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        grpc_scored = _score(stack.stubs["one_chunk"], ids, top=1).prompt_logprobs
        assert lp.token_logprobs[1:len(ids)] == [r.logprob for r in grpc_scored]
        if max_tokens == 1:  # lm-eval drops the last entry, the generated token
            total, greedy = _lm_eval_loglikelihood(choice, len(context))
            assert total == sum(r.logprob for r in grpc_scored[len(context) - 1:])
            assert greedy == all(r.rank == 1 for r in grpc_scored[len(context) - 1:])
        for entry, record in zip(lp.top_logprobs[1:], grpc_scored):
            assert len(entry) in (1, 2) and max(entry.values()) == record.top_logprobs[0]
    assert r.usage.completion_tokens == 2 * max_tokens
    assert r.usage.prompt_tokens == 2 * len(context) + len(cont_a) + len(cont_b)


def test_vllm_prompt_logprobs_and_echo_with_a_batch_n_and_a_stream(stack):
    client = stack.client()
    prompts = ["The quick brown fox", "jumps over"]
    r = client.completions.create(model=RANDOM_MODEL_ID, prompt=prompts, max_tokens=3, n=2, temperature=0.9,
                                  seed=5, echo=True, extra_body={"prompt_logprobs": 2, "ignore_eos": True})
    assert len(r.choices) == 4
    for choice in r.choices:
        text = prompts[choice.index // 2]
        assert choice.text.startswith(text) and len(choice.text) > len(text) and choice.logprobs is None
        listed = choice.model_extra["prompt_logprobs"]
        ids = tiny_tokenizer().encode(text)
        assert listed[0] is None and len(listed) == len(ids)
        for entry, token in zip(listed[1:], ids[1:]):
            assert str(token) in entry and 2 <= len(entry) <= 3
            ranks = sorted(v["rank"] for v in entry.values())
            assert ranks[:2] == [1, 2] and entry[str(token)]["decoded_token"] == tiny_tokenizer().decode([token])
    assert r.choices[0].model_extra["prompt_logprobs"] == r.choices[1].model_extra["prompt_logprobs"]
    # streamed: the prompt part comes first in each choice's stream, then its completion
    whole = client.completions.create(model=RANDOM_MODEL_ID, prompt=prompts[0], max_tokens=4, logprobs=1, echo=True,
                                      extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=RANDOM_MODEL_ID, prompt=prompts[0], max_tokens=4, logprobs=1,
                                            echo=True, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].text == prompts[0]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == whole.choices[0].logprobs.token_logprobs
    offsets = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.text_offset]
    assert offsets == whole.choices[0].logprobs.text_offset


@pytest.mark.parametrize("body, param, words", [
    ({"max_tokens": 0}, "max_tokens", "max_tokens=0: must be >= 1, or 0 with echo=true or prompt_logprobs"),
    ({"max_tokens": 0, "echo": True, "logprobs": 21}, "logprobs", "logprobs=21: must lie in 0..20"),
    ({"max_tokens": 1, "extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs", "prompt_logprobs=21"),
    ({"max_tokens": 1, "extra_body": {"prompt_logprobs": -1}}, "prompt_logprobs", "must lie in 0..20"),
])
def test_bad_prompt_scoring_is_a_400_naming_the_field(stack, body, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        stack.client().completions.create(model=RANDOM_MODEL_ID, prompt="abc", **body)
    assert err.value.param == param and words in err.value.message


def _drafter_sessions_opened(stack, work) -> int:
    """Drafter sessions opened while `work()` ran (session ids are handed out in order)."""
    engine = stack.drafter_engine
    before = engine.open_session()
    engine.close_session(before)
    work()
    after = engine.open_session()
    engine.close_session(after)
    return after - before - 1


def test_echo_without_logprobs_returns_the_prompt_and_max_tokens_0_opens_no_drafter_session(stack):
    client = stack.client()

    def score():
        r = client.completions.create(model=RANDOM_MODEL_ID, prompt="hello there", max_tokens=0, echo=True,
                                      extra_body={"spec": "always"})
        assert r.choices[0].text == "hello there" and r.choices[0].logprobs is None
        assert r.usage.completion_tokens == 0 and r.choices[0].finish_reason == "length"
        chunks = list(client.completions.create(model=RANDOM_MODEL_ID, prompt="hello there", max_tokens=0,
                                                echo=True, logprobs=0, stream=True))
        assert [c.choices[0].text for c in chunks] == ["hello there", ""]
        assert chunks[0].choices[0].logprobs.token_logprobs[0] is None
        assert chunks[1].choices[0].finish_reason == "length"

    def generate():
        client.completions.create(model=RANDOM_MODEL_ID, prompt="hello there", max_tokens=4, echo=True,
                                  extra_body={"spec": "always"})
    assert _drafter_sessions_opened(stack, score) == 0
    assert _drafter_sessions_opened(stack, generate) == 1  # the control: a generation that drafts opens one


@pytest.mark.parametrize("field, value", [("prompt_logprobs", 1), ("echo", True)])
def test_chat_refuses_prompt_scoring_rather_than_ignoring_it(stack, field, value):
    """The random model has a chat template; chat has no prompt scoring, so the fields are refused."""
    with pytest.raises(openai.BadRequestError) as err:
        stack.client().chat.completions.create(model=RANDOM_MODEL_ID, messages=[{"role": "user", "content": "x"}],
                                               max_tokens=1, extra_body={field: value})
    assert err.value.param == field and "not supported" in err.value.message


def test_streamed_choices_of_a_prompt_carry_its_first_choices_prompt_part(stack):
    """n = 3 choices of two prompts, streamed: each choice's first chunk is its prompt part,
    the same for every choice of a prompt (the first choice's records, `with_first_records`),
    and each choice's chunks join to the whole response's choice."""
    client = stack.client()
    prompts = ["The quick brown fox", "jumps over"]
    body = dict(model=RANDOM_MODEL_ID, prompt=prompts, max_tokens=3, n=3, temperature=0.9, seed=8, echo=True,
                logprobs=1, extra_body={"prompt_logprobs": 2, "ignore_eos": True})
    whole = client.completions.create(**body)
    chunks = [c for c in client.completions.create(stream=True, **body) if c.choices]
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices[0].index == choice.index]
        sibling = whole.choices[choice.index - choice.index % 3]
        assert mine[0].text == prompts[choice.index // 3]
        assert mine[0].model_extra["prompt_logprobs"] == sibling.model_extra["prompt_logprobs"]
        assert choice.logprobs.token_logprobs[:len(mine[0].logprobs.tokens)] == mine[0].logprobs.token_logprobs
        assert "".join(c.text for c in mine) == choice.text
        assert [v for c in mine if c.logprobs for v in c.logprobs.token_logprobs] == choice.logprobs.token_logprobs
