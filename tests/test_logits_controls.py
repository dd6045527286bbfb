"""Logits controls (services/common/controls.py, docs/sampling.md): the per-row rule, exactly.

Unit checks of `ControlState` (each control's value on a known row, the order of application,
rollback) and the rule inside the real verifier: row j of one batched verify forward is
transformed with the counts after rows < j, so a block verify chooses exactly the tokens
plain decode chooses, and a draft the penalty alone rules out is rejected at its row.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from dsv4.sampling import SamplingParams
from services.app import load_trunk, verifier_engine
from services.common.controls import ControlState, LogitsControls, control_state
from services.common.controls_wire import controls_from_proto, controls_to_proto
from services.common.settings import BackendSettings
from services.verifier.batcher import StepLoop

V = 16


def test_each_control_transforms_the_row_exactly():
    row = torch.linspace(-4.0, 3.5, V)  # negative and positive logits
    c = LogitsControls(logit_bias=((2, 1.5), (9, -100.0)), presence_penalty=0.5, frequency_penalty=0.25,
                       repetition_penalty=2.0, min_tokens=4, stop_ids=(1, 4), bad_words=((7,), (5, 6)))
    s = ControlState(c, V, prompt_ids=[12], grammar=None)
    for t in (3, 3, 5):
        s.accept(t)
    x = s.apply(row)
    want = row.clone()
    want[2] += 1.5
    want[9] -= 100.0
    want[[1, 4]] = -math.inf  # 3 generated < min_tokens 4
    want[7] = -math.inf  # a one-token bad word: always
    want[6] = -math.inf  # (5, 6): the output ends with 5
    for t in (3, 5, 12):  # seen: generated 3 and 5, prompt 12
        want[t] = want[t] / 2.0 if want[t] > 0 else want[t] * 2.0
    want[3] -= 0.25 * 2 + 0.5  # generated twice
    want[5] -= 0.25 * 1 + 0.5
    assert torch.equal(x, want), (x, want)
    assert torch.equal(row, torch.linspace(-4.0, 3.5, V)), "apply must not write the caller's row"


def test_min_tokens_masks_the_stop_ids_until_enough_tokens():
    s = ControlState(LogitsControls(min_tokens=2, stop_ids=(1,)), V)
    row = torch.zeros(V)
    assert s.apply(row)[1] == -math.inf
    s.accept(4)
    assert s.apply(row)[1] == -math.inf
    s.accept(4)
    assert s.apply(row)[1] == 0  # two tokens generated: eos may follow


def test_rollback_restores_the_counts_and_the_bad_word_context():
    c = LogitsControls(frequency_penalty=1.0, bad_words=((5, 6),))
    s = ControlState(c, V)
    row = torch.zeros(V)
    s.accept(3)
    before = s.apply(row).clone()
    mark = s.accepted
    for t in (5, 3, 3):  # a draft's tentative slots
        s.accept(t)
    assert s.apply(row)[3] == -3.0
    s.rollback_to(mark)
    assert torch.equal(s.apply(row), before) and s.generated == [3]
    s.accept(5)
    assert s.apply(row)[6] == -math.inf  # the bad word's context counts the new token


def test_neutral_controls_make_no_state_and_wire_round_trip():
    assert control_state(LogitsControls(), V) is None
    assert control_state(LogitsControls(min_tokens=4), V) is None  # no stop ids to mask: nothing to do
    c = LogitsControls(logit_bias=((3, -100.0), (7, 2.5)), presence_penalty=0.5, frequency_penalty=-1.0,
                       repetition_penalty=1.25, min_tokens=2, stop_ids=(1,), bad_words=((4, 5),))
    assert controls_from_proto(controls_to_proto(c)) == c


@pytest.mark.parametrize("kwargs, words", [
    ({"logit_bias": ((3, 101.0),)}, "logit_bias[3]=101: must lie in [-100, 100]"),
    ({"logit_bias": ((3, float("nan")),)}, "logit_bias[3]=nan: must be a finite number"),
    ({"logit_bias": ((-1, 1.0),)}, "logit_bias key -1=-1: must be a token id"),
    ({"presence_penalty": 2.5}, "presence_penalty=2.5: must lie in [-2, 2]"),
    ({"frequency_penalty": float("inf")}, "frequency_penalty=inf: must be a finite number"),
    ({"repetition_penalty": 0.0}, "repetition_penalty=0: must be > 0"),
    ({"min_tokens": -1}, "min_tokens=-1: must be an integer >= 0"),
    ({"bad_words": ((),)}, "bad_words: a word of 0 tokens"),
])
def test_bad_values_are_refused_naming_them(kwargs, words):
    with pytest.raises(ValueError) as err:
        LogitsControls(**kwargs)
    assert words in str(err.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the CPU path is tested above")
def test_the_transform_runs_on_the_rows_device_bitwise_as_on_the_cpu():
    c = LogitsControls(logit_bias=((2, 1.5),), presence_penalty=0.5, frequency_penalty=0.25,
                       repetition_penalty=1.7, min_tokens=5, stop_ids=(1,), bad_words=((5, 6),))
    row = torch.randn(V, generator=torch.Generator().manual_seed(0))
    outs = []
    for device in ("cpu", "cuda"):
        s = ControlState(c, V, prompt_ids=[12])
        for t in (3, 3, 5, 9):
            s.accept(t)
        s.rollback_to(3)
        x = s.apply(row.to(device))
        assert x.device.type == device
        outs.append(x.cpu())
    assert torch.equal(outs[0], outs[1])


def test_a_token_outside_the_vocabulary_is_named():
    with pytest.raises(ValueError, match=r"logit_bias key 16 outside \[0, vocab_size=16\)"):
        LogitsControls(logit_bias=((16, 1.0),)).check_vocab(V)


# ---------------------------------------------------------------------------- in the verifier
@functools.lru_cache(maxsize=None)
def _exact_engine():
    return verifier_engine(load_trunk(None, verify_numerics="exact"), BackendSettings(verify_numerics="exact"))


def _plain(loop: StepLoop, prompt, controls, sampling, n):
    """n tokens by plain decode (one position per step) under `controls`."""
    sid = loop.engine.open_session()
    try:
        first = loop.prefill(sid, prompt, sampling, 60, controls)
        tokens, pos = [first.next_token], len(prompt)
        for _ in range(n - 1):
            tokens.append(loop.decode(sid, tokens[-1], pos, 60).next_token)
            pos += 1
        return tokens
    finally:
        loop.engine.close_session(sid)


def _block(loop: StepLoop, prompt, controls, sampling, drafts):
    """(accepted, bonus token) of one batched verify of `drafts` after the prefill's anchor."""
    sid = loop.engine.open_session()
    try:
        anchor = loop.prefill(sid, prompt, sampling, 60, controls).next_token
        r = loop.verify(sid, anchor, drafts, len(prompt), "batched", timeout_s=60)
        return anchor, r.accepted, r.bonus_token
    finally:
        loop.engine.close_session(sid)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_row_j_of_a_verify_block_uses_the_counts_after_rows_before_it(temperature):
    """A negative frequency penalty makes the plain output repeat; one batched verify of the
    plain continuation accepts every draft and picks plain's next token as the bonus, which
    only holds if each row counted the drafts accepted before it. The unpenalized continuation
    as drafts is rejected at the first row where the penalty changed the choice."""
    prompt, k = [40, 41, 42, 43], 6
    sampling = SamplingParams(temperature=temperature, seed=11)
    controls = LogitsControls(frequency_penalty=-2.0, presence_penalty=-0.5)
    with StepLoop(_exact_engine()) as loop:
        plain = _plain(loop, prompt, controls, sampling, k + 2)
        free = _plain(loop, prompt, None, sampling, k + 2)
        assert plain != free  # the penalty changes the tokens: the check below is not vacuous
        anchor, accepted, bonus = _block(loop, prompt, controls, sampling, plain[1:k + 1])
        assert (anchor, accepted, bonus) == (plain[0], k, plain[k + 1])
        j = next(i for i in range(1, k + 1) if plain[i] != free[i])  # the first token the penalty changed
        _, accepted, bonus = _block(loop, prompt, controls, sampling, free[1:k + 1])
        assert (accepted, bonus) == (j - 1, plain[j])
