"""Probabilistic drafting (the DSpark drafter's chooser inside the Markov loop), the drafter
wire of sampling, the gateway's checks of a draft's q, and the sampling-rule setting."""

from __future__ import annotations

import grpc
import pytest
import torch

from dspark_proto.v1 import drafter_pb2, drafter_pb2_grpc
from dsv4.sampling import DRAFT, GREEDY, RULES, TOKEN, DraftSampler, SamplingParams, keyed_choice, probabilities
from services import app
from verifier_fixtures import StepVerifier
from services.common.sampling_wire import params_to_proto
from services.common.settings import SAMPLING_RULES, BackendSettings, GatewaySettings
from services.common.tensors import from_proto, to_proto
from services.drafter.steps import DraftStepLoop
from services.gateway.backends import DraftReply, InvalidDraftReply
from services.gateway.drafters import DraftCheck
from services.settings import gateway_settings
from services_fixtures import service_loop, tiny_draft_module, tiny_trunk

PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def primed():
    """(drafter engine, session id, anchor, seed position, prompt rows) after the verifier's
    prefill of PROMPT (rows [n, row_width] of positions 0..n-1)."""
    verifier = StepVerifier(app.verifier_engine(tiny_trunk(), BackendSettings()))
    sid = verifier.open_session()
    first = verifier.prefill(sid, PROMPT)
    drafter = app.drafter_engine(tiny_draft_module(), settings=BackendSettings())
    ds = drafter.open_session()
    drafter.commit(ds, first.rows, range(first.positions.start, first.positions.stop))
    yield drafter, ds, first.next_token, len(PROMPT) - 1, first.rows
    verifier.close_session(sid)
    drafter.close_session(ds)


def test_greedy_params_draft_exactly_the_argmax_drafts(primed):
    drafter, ds, anchor, p, _ = primed
    tokens, conf = drafter.draft(ds, anchor, p)
    out = drafter.draft_sampled(ds, anchor, p, GREEDY)
    assert out.tokens == tokens and torch.equal(out.confidence, conf)
    assert torch.equal(out.probs.argmax(-1), torch.tensor(tokens)) and bool((out.probs.sum(-1) == 1).all())


@pytest.mark.parametrize("rule", RULES)
def test_each_slot_is_the_keyed_choice_of_the_draft_distribution_at_its_position(primed, rule):
    drafter, ds, anchor, p, _ = primed
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, rule=rule)
    out = drafter.draft_sampled(ds, anchor, p, params)
    # replay the Markov loop with the drafted tokens: each slot's logits give back its token
    full = drafter.module.draft_from_rings(drafter.session_state(ds).rings, anchor, p, DraftSampler(params, p))
    assert full.tokens[:len(out.tokens)] == out.tokens
    stream = TOKEN if rule == "coupled" else DRAFT
    for j, t in enumerate(out.tokens):
        row = full.logits[j:j + 1]
        assert int(keyed_choice(row, params, [p + 2 + j], stream)[0]) == t
        assert torch.allclose(out.probs[j], probs_row := probabilities(row, params)[0]) and probs_row[t] > 0
    again = drafter.draft_sampled(ds, anchor, p, params)
    assert again.tokens == out.tokens  # keyed by (seed, position): reproducible
    other = drafter.draft_sampled(ds, anchor, p, SamplingParams(temperature=0.8, top_p=0.9, seed=99, rule=rule))
    assert other.tokens != out.tokens


def test_draft_sampler_refuses_slots_out_of_order():
    sampler = DraftSampler(SamplingParams(temperature=1.0), 3)
    sampler(0, torch.zeros(8))
    with pytest.raises(ValueError, match="slot 2 chosen out of order"):
        sampler(2, torch.zeros(8))
    with pytest.raises(ValueError, match="seed_position=-2"):
        DraftSampler(GREEDY, -2)


def test_drafter_service_sends_q_under_the_rejection_rule_only(primed):
    drafter, _, anchor, p, rows = primed

    async def ask(params):
        server = await app.start_drafter(drafter)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                call = drafter_pb2_grpc.DrafterStub(ch).Session(timeout=30)
                await call.write(drafter_pb2.DrafterRequest(commit=drafter_pb2.CommitRequest(
                    rows=to_proto(rows), first_position=0)))
                await call.read()
                req = drafter_pb2.DraftRequest(anchor=anchor, seed_position=p)
                if params is not None:
                    req.sampling.CopyFrom(params_to_proto(params))
                await call.write(drafter_pb2.DrafterRequest(draft=req))
                reply = await call.read()
                await call.done_writing()
                return reply
        finally:
            await server.stop(0)

    loop = service_loop()
    greedy = loop.run(ask(None))
    coupled = loop.run(ask(SamplingParams(temperature=1.0, seed=5)))
    rejection = loop.run(ask(SamplingParams(temperature=1.0, seed=5, rule="rejection")))
    assert not greedy.HasField("draft_probs") and not coupled.HasField("draft_probs")
    q = from_proto(rejection.draft_probs)
    assert tuple(q.shape) == (len(rejection.tokens), drafter.identity()["vocab_size"])
    assert bool((q[torch.arange(len(rejection.tokens)), torch.tensor(list(rejection.tokens))] > 0).all())


def test_gateway_checks_a_drafts_q():
    check = DraftCheck(vocab_size=4, block_size=3)
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    check(DraftReply([0, 2], None, 1.0, q), need_probs=True)
    for reply, words in ((DraftReply([0, 2], None, 1.0), "no draft probabilities"),
                         (DraftReply([0, 2], None, 1.0, q[:1]), "shape [1, 4], expected [2, 4]"),
                         (DraftReply([0, 3], None, 1.0, q), "token 3 at index 1 has probability 0"),
                         (DraftReply([0, 2], None, 1.0, -q), "finite and >= 0")):
        with pytest.raises(InvalidDraftReply, match="draft_probs") as err:
            check(reply, need_probs=True)
        assert words in str(err.value)
    check(DraftReply([0, 2], None, 1.0), need_probs=False)  # the coupled rule needs no q


def test_sampling_rule_setting():
    assert SAMPLING_RULES == RULES
    assert gateway_settings({}).sampling_rule == "coupled"
    assert gateway_settings({"DSPARK_SAMPLING_RULE": "rejection"}).sampling_rule == "rejection"
    with pytest.raises(ValueError, match="DSPARK_SAMPLING_RULE='greedy'"):
        gateway_settings({"DSPARK_SAMPLING_RULE": "greedy"})
    with pytest.raises(ValueError, match="sampling_rule"):
        GatewaySettings(sampling_rule="both")


def test_step_loop_draws_each_sessions_draft_with_its_own_params(primed):
    drafter, ds, anchor, p, rows = primed
    other = drafter.open_session()
    drafter.commit(other, rows, range(0, rows.shape[0]))
    params = [SamplingParams(temperature=1.0, seed=8, rule="rejection"), SamplingParams(temperature=0.7, seed=9)]
    loop = DraftStepLoop(drafter)
    try:
        futures = [loop.submit_draft(sid, anchor, p, prm) for sid, prm in zip((ds, other), params)]
        replies = [f.result(60).value for f in futures]
        plain = loop.submit_draft(other, anchor, p).result(60).value
    finally:
        loop.close()
        drafter.close_session(other)
    for reply, sid, prm in zip(replies, (ds, other), params):
        alone = drafter.draft_sampled(ds, anchor, p, prm)  # both sessions hold the same rings
        assert reply.tokens == alone.tokens and torch.allclose(reply.probs, alone.probs, atol=1e-6)
    assert plain[0] == drafter.draft(ds, anchor, p)[0]  # no params: the argmax drafts
