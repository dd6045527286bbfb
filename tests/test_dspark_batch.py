"""Batched DSpark calls (`DSparkDraft.draft_batch`, `write_main_kv_batch`) against the per-session ones.

Tiny config (W = 8, B = 5, max_seq_len 64), conformance weights. Eight sessions of different
lengths: a one-row prompt (a window of 1), windows still filling (3, 6 rows), positions that
have wrapped the ring once or several times (9, 17, 40), and two near max_seq_len whose
drafts are cut to 3 and 0 tokens. Their batched draft gives the per-session tokens exactly
and logits / hidden states within rounding (fp32 1e-5, bf16 5e-2 relative), confidence
logits within 1e-4 (fp32) / 0.1 (bf16) absolute;
a batch of one is the per-session draft bitwise; rings are only read. A batched write lands
every commit bitwise as separate writes would, reports a bad commit at its index without
touching that session while the others land, and refuses a state twice.
"""

from __future__ import annotations

import functools

import pytest
import torch

from dsv4.config import tiny_config
from dsv4.dspark import DraftState, DSparkDraft
from reference_dspark import conformance_weights, rel_err, synthetic_rows

CFG = tiny_config()
W, B, L = CFG.window_size, CFG.dspark_block_size, CFG.max_seq_len
ROWS = synthetic_rows(CFG, L, seed=11)
LENGTHS = (1, 3, 6, 9, 17, 40, 60, 63)  # committed rows 0..n-1; seed position n-1
TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-2}  # relative, per row (`rel_err`)
CONF_ATOL = {torch.float32: 1e-4, torch.bfloat16: 0.1}  # confidence logits, absolute (they are O(1..10))


@functools.lru_cache(maxsize=None)
def model(dtype: torch.dtype = torch.float32) -> DSparkDraft:
    m = DSparkDraft(CFG, dtype=dtype)
    m.load_weights(conformance_weights(CFG, 0))
    return m


def primed(m: DSparkDraft, n: int) -> DraftState:
    """A state holding rows of positions 0..n-1 (written in chunks of 7 so long ones wrap)."""
    state = m.new_state()
    for a in range(0, n, 7):
        m.write_main_kv(state, ROWS[a:min(n, a + 7)], range(a, min(n, a + 7)))
    return state


def anchors() -> list[int]:
    return [(37 * i + 5) % CFG.vocab_size for i in range(len(LENGTHS))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_draft_equals_per_session_drafts(dtype):
    m = model(dtype)
    states = [primed(m, n) for n in LENGTHS]
    before = [[r.clone() for r in s.rings] for s in states]
    seeds = [n - 1 for n in LENGTHS]
    solo = [m.draft(s, a, p) for s, a, p in zip(states, anchors(), seeds)]
    batch = m.draft_batch(states, anchors(), seeds)
    assert [len(o.tokens) for o in batch] == [5, 5, 5, 5, 5, 5, 3, 0]  # cut before max_seq_len
    for i, (a, b) in enumerate(zip(solo, batch)):
        assert b.tokens == a.tokens, f"session {i}"
        assert b.logits.shape == a.logits.shape and b.hidden.shape == a.hidden.shape
        if a.tokens:
            assert rel_err(b.logits, a.logits) < TOL[dtype], f"session {i} logits"
            assert rel_err(b.hidden.float(), a.hidden.float()) < TOL[dtype], f"session {i} hidden"
            torch.testing.assert_close(b.confidence, a.confidence, rtol=0, atol=CONF_ATOL[dtype])
    assert sum(len(o.tokens) for o in batch) == 33
    assert all(torch.equal(x, y) for s, old in zip(states, before) for x, y in zip(s.rings, old))


def test_batch_order_does_not_change_a_sessions_tokens():
    m = model()
    states = [primed(m, n) for n in LENGTHS[:6]]
    seeds, ids = [n - 1 for n in LENGTHS[:6]], anchors()[:6]
    forward = m.draft_batch(states, ids, seeds)
    backward = m.draft_batch(states[::-1], ids[::-1], seeds[::-1])[::-1]
    assert [o.tokens for o in forward] == [o.tokens for o in backward]


def test_a_batch_of_one_is_the_per_session_draft_bitwise():
    m = model()
    for n in (1, 9, 40):
        state = primed(m, n)
        [got], ref = m.draft_batch([state], [7], [n - 1]), m.draft(state, 7, n - 1)
        assert got.tokens == ref.tokens
        assert torch.equal(got.logits, ref.logits) and torch.equal(got.confidence, ref.confidence)
        assert torch.equal(got.hidden, ref.hidden)


def test_bad_batched_draft_arguments_name_the_session_and_compute_nothing():
    m = model()
    states = [primed(m, 9), primed(m, 17)]
    with pytest.raises(ValueError, match=r"session 1: seed_position=15 is not the last committed position 16"):
        m.draft_batch(states, [5, 6], [8, 15])
    with pytest.raises(ValueError, match=r"session 0: anchor=512 outside \[0, vocab_size=512\)"):
        m.draft_batch(states, [512, 6], [8, 16])
    with pytest.raises(ValueError, match="2 states, 1 anchors and 2 seed positions"):
        m.draft_batch(states, [5], [8, 16])
    with pytest.raises(ValueError, match="session 1: nothing committed"):
        m.draft_batch([states[0], m.new_state()], [5, 6], [8, 0])
    assert m.draft_batch([], [], []) == []


# ------------------------------------------------------------------ batched writes
def test_batched_write_equals_separate_writes_bitwise():
    m = model()
    commits = [(0, 1), (0, 8), (5, 12), (30, 41), (12, 13)]  # (from, to) rows; 30..40 is a W+ priming write
    batched = [primed(m, a) if a else m.new_state() for a, _ in commits]
    single = [primed(m, a) if a else m.new_state() for a, _ in commits]
    errors = m.write_main_kv_batch(batched, [ROWS[a:b] for a, b in commits], [range(a, b) for a, b in commits])
    assert errors == [None] * len(commits)
    for state, (a, b) in zip(single, commits):
        m.write_main_kv(state, ROWS[a:b], range(a, b))
    for i, (x, y) in enumerate(zip(batched, single)):
        assert x.last_position == y.last_position == commits[i][1] - 1
        assert all(torch.equal(r, s) for r, s in zip(x.rings, y.rings)), f"commit {i}"


def test_a_bad_commit_in_a_batch_is_reported_at_its_index_and_the_others_land():
    m = model()
    states = [primed(m, 9), primed(m, 9), primed(m, 9)]
    keep = [r.clone() for r in states[1].rings]
    changed_row = ROWS[20:21]  # position 8 is committed with ROWS[8]: a different row is refused
    errors = m.write_main_kv_batch(states, [ROWS[9:11], changed_row, ROWS[9:10]], [range(9, 11), [8], [9]])
    assert errors[0] is None and errors[2] is None
    assert isinstance(errors[1], ValueError)
    assert "position 8 is already committed with a different row" in str(errors[1])
    assert states[1].last_position == 8 and all(torch.equal(a, b) for a, b in zip(states[1].rings, keep))
    assert [s.last_position for s in states] == [10, 8, 9]
    gap = m.write_main_kv_batch(states[:1], [ROWS[20:21]], [[20]])
    assert "gap of 9" in str(gap[0]) and states[0].last_position == 10


def test_a_batched_write_refuses_a_state_twice_and_mismatched_lengths():
    m = model()
    state = primed(m, 9)
    with pytest.raises(ValueError, match="a state appears twice"):
        m.write_main_kv_batch([state, state], [ROWS[9:10], ROWS[10:11]], [[9], [10]])
    with pytest.raises(ValueError, match="1 states, 2 row tensors and 1 position lists"):
        m.write_main_kv_batch([state], [ROWS[9:10], ROWS[10:11]], [[9]])
    assert state.last_position == 8
