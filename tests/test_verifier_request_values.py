"""Request values at the verifier's boundary: the engine rejects every malformed or
out-of-range token id with a ValueError naming it, leaving the session unchanged. The trunk
below only asserts these (it checks its state protocol and capacity itself,
tests/test_dsv4_trunk.py), so these cases live here, against `VerifierEngine`."""

import numpy as np
import pytest
import torch

from dsv4.config import tiny_config
from dsv4.init import random_weights
from dsv4.trunk import Trunk
from services.verifier.engine import VerifierEngine
from verifier_fixtures import StepVerifier


@pytest.fixture(scope="module")
def engine():
    cfg = tiny_config()
    model = Trunk(cfg)
    model.load_weights(random_weights(cfg, "trunk", seed=3))
    return StepVerifier(VerifierEngine(model, max_sessions=64))


@pytest.mark.parametrize("prompt_ids, why", [
    (None, "prompt must be a list"), ([1, "2"], r"prompt\[1\]='2'"),
    (torch.tensor([True, False]), "1-D integer tensor"), (torch.ones(3), "1-D integer tensor"),
    (torch.tensor([3, 600], dtype=torch.int16), "token id 600 at index 1"),
    (torch.tensor([3, -3], dtype=torch.int16), "token id -3 at index 1"),
    (torch.tensor([3, 2**63 + 5], dtype=torch.uint64), f"token id {2**63 + 5} at index 1"),
    (np.array([3, 512], dtype=np.uint16), "token id 512 at index 1"),
    ([3, 100000], "token id 100000 at index 1"),
])
def test_prefill_rejects_malformed_or_out_of_range_ids_by_true_value(engine, prompt_ids, why):
    sid = engine.open_session()
    with pytest.raises(ValueError, match=why):
        engine.prefill(sid, prompt_ids)
    assert engine.next_position(sid) == 0
    engine.close_session(sid)


@pytest.mark.parametrize("bad", [512, -1, 100000])
def test_decode_and_verify_reject_out_of_range_ids(engine, bad):
    sid = engine.open_session()
    engine.prefill(sid, [3, 4, 5])
    with pytest.raises(ValueError, match=f"token id {bad}"):
        engine.decode(sid, bad, 3)
    with pytest.raises(ValueError, match=f"token id {bad}"):
        engine.verify(sid, bad, [1], 3, "batched")
    with pytest.raises(ValueError, match=f"token id {bad}"):
        engine.verify(sid, 1, [2, bad], 3, "batched")
    assert engine.next_position(sid) == 3
    engine.close_session(sid)


def test_small_integer_dtypes_are_accepted_by_value(engine):
    a, b = engine.open_session(), engine.open_session()
    x = engine.prefill(a, torch.tensor([3, 100, 7, 120], dtype=torch.uint8))
    y = engine.prefill(b, [3, 100, 7, 120])
    assert (x.next_token, x.margin) == (y.next_token, y.margin) and torch.equal(x.rows, y.rows)
