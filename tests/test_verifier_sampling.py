"""The verifier's sampling (docs/sampling.md) against `VerifierEngine` on the random tiny trunk.

* Coupled rule, exact numerics (torch.equal, no tolerance): speculative decoding with
  sequential and batched verify, drafts random or the plain chain itself with every third
  slot corrupted, reproduces plain sampled decoding token for token and logprob record for
  logprob record, for 3 seeds at T in {0.7, 1.0} with top_p 0.9 and top-5 logprobs.
* Rejection rule, exact numerics: the same seed gives the same tokens twice, sequential and
  batched verify agree, and a verify without (or with mis-shaped) draft_probs is a
  ValueError naming draft_probs that leaves the session unchanged.
* Fast numerics: batched verify's logprobs equal plain decode's within 1e-5.
* Greedy sessions: the argmax, as before sampling existed, with logprobs when asked.
* The wire: bad sampling values are INVALID_ARGUMENT naming the field, over a real in-process
  gRPC verifier; a sampled prefill and verify return their logprob records.
"""

from __future__ import annotations

import dataclasses
import functools

import grpc
import pytest
import torch

from dspark_proto.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from dsv4.config import tiny_config
from dsv4.init import random_weights
from dsv4.sampling import GREEDY, SamplingParams, probabilities
from dsv4.trunk import Trunk
from services.app import start_verifier
from services.common.sampling_wire import params_from_proto, params_to_proto
from services.common.server import channel_options
from services.common.tensors import to_proto
from services.verifier.engine import VerifierEngine
from verifier_fixtures import StepVerifier
from tests.services_fixtures import service_loop

CFG = tiny_config(max_seq_len=96)
PROMPTS = [torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(s)).tolist()
           for n, s in ((9, 1), (17, 2))]
NEW, K = 14, 3
PARAMS = [SamplingParams(temperature=t, top_p=0.9, seed=seed, logprobs=5) for t in (0.7, 1.0) for seed in (1, 2, 3)]


@functools.lru_cache(maxsize=None)
def engine(numerics: str) -> VerifierEngine:
    trunk = Trunk(CFG, verify_numerics=numerics)
    trunk.load_weights(random_weights(CFG, "trunk", seed=3))
    return StepVerifier(VerifierEngine(trunk, max_sessions=8))


def plain(v: VerifierEngine, prompt: list[int], params: SamplingParams, new: int = NEW):
    """Plain sampled decoding: (new tokens, their logprob records)."""
    sid = v.open_session()
    step = v.prefill(sid, prompt, params)
    tokens, lps = [step.next_token], list(step.logprobs)
    while len(tokens) < new:
        step = v.decode(sid, tokens[-1], len(prompt) + len(tokens) - 1)
        tokens.append(step.next_token)
        lps += step.logprobs
    v.close_session(sid)
    return tokens, lps


def speculative(v: VerifierEngine, prompt: list[int], params: SamplingParams, drafts_of, mode: str,
                new: int = NEW):
    """Speculative decoding: drafts_of(position of the anchor, tokens so far) -> K drafts;
    returns (tokens, logprob records, accepted drafts in all)."""
    sid = v.open_session()
    step = v.prefill(sid, prompt, params)
    tokens, lps, accepted = [step.next_token], list(step.logprobs), 0
    while len(tokens) < new:
        n = len(prompt) + len(tokens) - 1
        drafts = drafts_of(n, tokens)
        res = v.verify(sid, tokens[-1], drafts, n, mode)
        assert len(res.logprobs) == res.accepted + 1
        tokens += [*drafts[:res.accepted], res.bonus_token]
        lps += res.logprobs
        accepted += res.accepted
    v.close_session(sid)
    return tokens[:new], lps[:new], accepted


def random_drafts(n: int, tokens: list[int]) -> list[int]:
    return torch.randint(0, CFG.vocab_size, (K,), generator=torch.Generator().manual_seed(n)).tolist()


def chain_drafts(chain: list[int], start: int):
    """Drafts from the plain chain itself (start: the prompt length), every third slot corrupted."""
    def drafts_of(n: int, tokens: list[int]) -> list[int]:
        out = chain[n - start + 1:n - start + 1 + K] + [0] * K
        return [(t + 1) % CFG.vocab_size if (n + j) % 3 == 2 else t for j, t in enumerate(out[:K])]
    return drafts_of


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p.temperature}-s{p.seed}")
@pytest.mark.parametrize("mode", ["sequential", "batched"])
def test_coupled_speculation_is_bitwise_plain_decode(params, mode):
    v = engine("exact")
    for prompt in PROMPTS:
        tokens, lps = plain(v, prompt, params)
        assert len(set(tokens)) > 3  # really sampled: not one repeated token
        for drafts_of in (random_drafts, chain_drafts(tokens, len(prompt))):
            got, got_lps, _ = speculative(v, prompt, params, drafts_of, mode)
            assert got == tokens
            assert got_lps == lps  # dataclass equality: every float bitwise
        assert all(len(r.top_ids) == 5 and r.top_logprobs[0] >= r.logprob for r in lps)


def test_coupled_oracle_drafts_are_accepted():
    """Drafts equal to the target's own choices are all accepted (the coupling)."""
    v, params = engine("exact"), PARAMS[0]
    tokens, _ = plain(v, PROMPTS[0], params, NEW + K)
    oracle = lambda n, _t: tokens[n - len(PROMPTS[0]) + 1:n - len(PROMPTS[0]) + 1 + K]  # noqa: E731
    got, _, accepted = speculative(v, PROMPTS[0], params, oracle, "batched")
    assert got == tokens[:NEW]
    assert accepted >= NEW - 1 - (NEW - 1) // (K + 1)  # every round but the bonus tokens


def rejection_run(v, prompt, params, mode):
    """Rejection-rule speculation with drafts drawn from a fixed wrong distribution q."""
    q = probabilities(torch.randn(1, CFG.vocab_size, generator=torch.Generator().manual_seed(9)), params)[0]
    sid = v.open_session()
    step = v.prefill(sid, prompt, params)
    tokens, lps = [step.next_token], list(step.logprobs)
    while len(tokens) < NEW:
        n = len(prompt) + len(tokens) - 1
        drafts = torch.multinomial(q, K, replacement=True, generator=torch.Generator().manual_seed(n)).tolist()
        res = v.verify(sid, tokens[-1], drafts, n, mode, draft_probs=q.expand(K, -1))
        tokens += [*drafts[:res.accepted], res.bonus_token]
        lps += res.logprobs
    v.close_session(sid)
    return tokens[:NEW], lps[:NEW]


def test_rejection_rule_is_reproducible_and_mode_independent():
    v = engine("exact")
    params = dataclasses.replace(PARAMS[1], rule="rejection")
    first = rejection_run(v, PROMPTS[0], params, "sequential")
    assert rejection_run(v, PROMPTS[0], params, "sequential") == first
    assert rejection_run(v, PROMPTS[0], params, "batched") == first
    other = rejection_run(v, PROMPTS[0], dataclasses.replace(params, seed=99), "batched")
    assert other[0] != first[0]


@pytest.mark.parametrize("probs, why", [
    (None, "draft_probs missing"), (torch.full((2, CFG.vocab_size), 1.0 / CFG.vocab_size), r"shape \(2, "),
    (torch.full((K, CFG.vocab_size), float("nan")), "NaN"), (torch.ones(K, CFG.vocab_size, dtype=torch.int64),
                                                            "dtype"),
])
def test_rejection_verify_needs_well_formed_draft_probs(probs, why):
    v = engine("exact")
    sid = v.open_session()
    step = v.prefill(sid, PROMPTS[0], dataclasses.replace(PARAMS[0], rule="rejection"))
    n = len(PROMPTS[0])
    with pytest.raises(ValueError, match=why):
        v.verify(sid, step.next_token, [1, 2, 3], n, "batched", draft_probs=probs)
    assert v.next_position(sid) == n
    v.close_session(sid)


def test_fast_numerics_logprobs_match_plain_within_1e5():
    v = engine("fast")
    for params in PARAMS[:3]:
        tokens, lps = plain(v, PROMPTS[1], params)
        got, got_lps, _ = speculative(v, PROMPTS[1], params, chain_drafts(tokens, len(PROMPTS[1])), "batched")
        same = next((i for i, (a, b) in enumerate(zip(got, tokens)) if a != b), len(tokens))
        assert same >= NEW // 2, (got, tokens)
        for a, b in zip(got_lps[:same], lps[:same]):
            assert a.token_id == b.token_id and a.top_ids == b.top_ids
            assert abs(a.logprob - b.logprob) <= 1e-5
            assert max(abs(x - y) for x, y in zip(a.top_logprobs, b.top_logprobs)) <= 1e-5


def test_greedy_session_is_the_argmax_with_logprobs():
    v = engine("exact")
    tokens, _ = plain(v, PROMPTS[0], GREEDY)
    lp_tokens, lps = plain(v, PROMPTS[0], dataclasses.replace(GREEDY, logprobs=3))
    assert lp_tokens == tokens
    assert all(r.top_ids[0] == t and r.top_logprobs[0] == r.logprob < 0 for r, t in zip(lps, tokens))
    sid = v.open_session()
    out = v.model.prefill(v._get(sid).state, torch.tensor(PROMPTS[0]))
    assert tokens[0] == int(out.logits.argmax())
    v.close_session(sid)


# ---------------------------------------------------------------------------- the wire
@pytest.mark.parametrize("field, value, why", [
    ("temperature", float("nan"), "sampling.temperature=nan"), ("temperature", -0.5, "sampling.temperature=-0.5"),
    ("top_p", 1.5, "sampling.top_p=1.5"), ("top_k", -1, "sampling.top_k=-1"), ("min_p", 2.0, "sampling.min_p=2"),
    ("logprobs", 21, "sampling.logprobs=21"), ("seed", 2**63, f"sampling.seed={2**63}"), ("rule", 7, "sampling.rule=7"),
])
def test_wire_params_name_the_bad_field(field, value, why):
    msg = common_pb2.SamplingParams(temperature=0.7)
    setattr(msg, field, value)
    with pytest.raises(ValueError, match=why):
        params_from_proto(msg)


def test_wire_params_defaults_and_round_trip():
    p = params_from_proto(common_pb2.SamplingParams(temperature=0.7, seed=5), default_rule="rejection")
    assert (p.top_p, p.rule, p.seed) == (1.0, "rejection", 5)
    assert p.temperature == float(torch.tensor(0.7, dtype=torch.float32))  # the float32 the wire holds
    assert params_from_proto(params_to_proto(p)) == p


def test_grpc_sampled_session_and_bad_values():
    v = engine("exact")
    params = PARAMS[0]
    tokens, lps = plain(v, PROMPTS[0], params_from_proto(params_to_proto(params)), 4)

    async def run():
        server = await start_verifier(v, port=0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=channel_options()) as ch:
                stub = verifier_pb2_grpc.VerifierStub(ch)
                return await _sampled_calls(stub, params)
        finally:
            await server.stop(0)

    first, verify, bad_prefill, bad_verify = service_loop().run(run())
    assert first.next_token == tokens[0] and first.logprobs[0].token_id == tokens[0]
    assert list(first.logprobs[0].top_ids) == list(lps[0].top_ids)
    assert len(verify.logprobs) == verify.accepted + 1
    assert bad_prefill.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prefill.sampling.top_p=1.5" in bad_prefill.details()
    assert bad_verify.code() == grpc.StatusCode.INVALID_ARGUMENT and "draft_probs" in bad_verify.details()


async def _sampled_calls(stub, params):
    """A coupled session (prefill, verify), a prefill with top_p 1.5, and a rejection-rule
    verify without draft_probs; returns (prefill reply, verify reply, error, error)."""
    n = len(PROMPTS[0])
    call = stub.Session(timeout=60)
    await call.write(verifier_pb2.VerifierRequest(
        prefill=verifier_pb2.PrefillRequest(token_ids=PROMPTS[0], sampling=params_to_proto(params))))
    first = await call.read()
    await call.write(verifier_pb2.VerifierRequest(verify=verifier_pb2.VerifyRequest(
        anchor=first.next_token, drafts=[1, 2], position=n, draft_probs=to_proto(torch.zeros(2, 3), "float32"))))
    verify = await call.read()
    await call.done_writing()
    errors = []
    for sampling, probs in ((common_pb2.SamplingParams(temperature=0.7, top_p=1.5), False),
                            (params_to_proto(dataclasses.replace(params, rule="rejection")), True)):
        call = stub.Session(timeout=60)
        await call.write(verifier_pb2.VerifierRequest(
            prefill=verifier_pb2.PrefillRequest(token_ids=PROMPTS[0], sampling=sampling)))
        try:
            reply = await call.read()
            await call.write(verifier_pb2.VerifierRequest(verify=verifier_pb2.VerifyRequest(
                anchor=reply.next_token, drafts=[1, 2], position=n)))
            await call.read()
        except grpc.aio.AioRpcError as exc:
            errors.append(exc)
            continue
        errors.append(None)
    return first, verify, errors[0], errors[1]
