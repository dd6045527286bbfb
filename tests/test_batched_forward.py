"""Batched forward across sessions (`Trunk.forward_batch`, `dsv4.batch`), on CPU.

Tiny config (docs/model.md §13): W = 8, layer 1 ratio 4 with indexer, layer 2 ratio 8, layer 3
ratio 4. SPECS are 16 sessions' pending work: decodes and verify blocks of 1..8 tokens at
positions before the first ring wrap (5), across it (7, 8, 9, 13, 14) and from or across the
ratio-4 / ratio-8 block boundaries ((p + 1) % r == 0: 15, 23, 31). Every session has its own
prompt.

Fast mode: every item of a 16-item batch matches its per-session forward (`decode` /
`forward_block`) within TOL, and rollback leaves the same state within TOL. Exact mode,
asserted with torch.equal: every row's logits and taps are the same alone and in batches of
2, 5 and 16 mixed items in different orders, and rollback after a batched verify leaves each
state bitwise equal to the per-session path's. Two deliberately batch-dependent variants of
the exact recipe (experts grouped over the batch's rows; dense ops on the whole batch at
once) fail the same check, which shows it detects batch dependence.
"""

from __future__ import annotations

import pytest
import torch
from model_fixtures import state_tensors

from dsv4.batch import BatchItem
from dsv4.config import tiny_config
from dsv4.init import random_weights
from dsv4.numerics import ExactNumerics
from dsv4.trunk import Trunk

TOL = 1e-4  # rel. error between a batched and a per-session forward (fp32), as tests/test_verifier_engine.py
CFG = tiny_config(max_seq_len=128)
# (start_pos, tokens, verify block?) of each session
SPECS = [(7, 1, False), (8, 1, False), (15, 1, False), (23, 1, False), (13, 6, True), (14, 3, True),
         (15, 8, True), (22, 2, True), (23, 5, True), (9, 4, True), (30, 7, True), (31, 1, True),
         (12, 1, False), (19, 8, True), (26, 1, False), (5, 3, True)]
KEEPS = [None, None, None, None, 2, 3, 1, 1, 4, 2, 7, 1, None, 5, None, 3]  # rollback keep per block
BATCHES = [[4, 0], [11, 6], [2, 6, 9, 15, 0], [13, 1, 8, 3, 10], list(range(16)), list(range(15, -1, -1))]


def session_tokens(i: int) -> torch.Tensor:
    """Prompt and work tokens of session i: [start_pos + tokens] ids."""
    start, n, _ = SPECS[i]
    return torch.randint(0, CFG.vocab_size, (start + n,), generator=torch.Generator().manual_seed(100 + i))


def make(verify_numerics: str, dtype: torch.dtype = torch.float32) -> Trunk:
    m = Trunk(CFG, dtype=dtype, verify_numerics=verify_numerics)
    m.load_weights(random_weights(CFG, "trunk", seed=3))
    return m


def item(model: Trunk, i: int) -> BatchItem:
    """Session i's work on a freshly prefilled state."""
    start, n, verify = SPECS[i]
    ids = session_tokens(i)
    st = model.new_state()
    model.prefill(st, ids[:start])
    return BatchItem.block(st, ids[start:], start) if verify else BatchItem.decode(st, int(ids[start]), start)


def solo(model: Trunk, i: int):
    """Session i through the per-session API (`decode` / `forward_block`): (output, state)."""
    it = item(model, i)
    if it.verify:
        return model.forward_block(it.state, it.tokens, it.start_pos), it.state
    return model.decode(it.state, it.tokens, it.start_pos), it.state


def rows(out) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [S, V], taps [S, T*D]) of a decode or block output."""
    return out.logits.reshape(-1, out.logits.shape[-1]), out.taps


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def fast():
    return make("fast")


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def exact(request):
    return make("exact", request.param)


# ---------------------------------------------------------------- fast mode
def test_fast_batch_matches_per_session_forwards_and_rollback(fast):
    items = [item(fast, i) for i in range(16)]
    outs = fast.forward_batch(items)
    for i, (out, it) in enumerate(zip(outs, items)):
        ref, ref_state = solo(fast, i)
        assert out.logits.shape == ref.logits.shape and out.taps.shape == ref.taps.shape
        assert rel(out.logits, ref.logits) < TOL, i
        assert rel(out.taps, ref.taps) < TOL, i
        if KEEPS[i] is not None:
            fast.rollback(it.state, out.undo, KEEPS[i])
            fast.rollback(ref_state, ref.undo, KEEPS[i])
        assert it.state.next_position == ref_state.next_position and it.state.open_block is None
        for a, b in zip(state_tensors(it.state), state_tensors(ref_state)):
            assert torch.allclose(a, b, rtol=TOL, atol=TOL), i


# ---------------------------------------------------------------- exact mode: batch invariance
class GroupedExperts(ExactNumerics):
    """Batch-dependent: each expert runs once on every row the batch routes to it."""

    def route(self, moe, x, weights, experts, small_m):
        return moe.combine(x, weights, experts, small_m=small_m)


class WholeBatchTiles(ExactNumerics):
    """Batch-dependent: the dense ops run on one tile of all the batch's rows."""

    def dense(self, fn, *rows, calls=None):
        return fn(*rows)


def mismatches(model: Trunk) -> list[tuple[int, int]]:
    """(batch, session) pairs whose logits or taps differ bitwise from the session run alone
    through forward_batch, over BATCHES."""
    alone = {i: rows(model.forward_batch([item(model, i)])[0]) for i in range(16)}
    bad = []
    for b, members in enumerate(BATCHES):
        outs = model.forward_batch([item(model, i) for i in members])
        for i, out in zip(members, outs):
            got, want = rows(out), alone[i]
            if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
                bad.append((b, i))
    return bad


def test_exact_rows_are_bitwise_equal_alone_and_in_any_batch(exact):
    assert mismatches(exact) == []
    for i in (0, 4, 6):  # and alone through the batch == the per-session API
        a, b = rows(exact.forward_batch([item(exact, i)])[0]), rows(solo(exact, i)[0])
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("broken", [GroupedExperts, WholeBatchTiles])
def test_a_batch_dependent_recipe_is_detected(broken):
    model = make("exact")
    model.numerics = broken(model.exact_threads)
    assert mismatches(model), f"{broken.__name__} gave bitwise-equal rows: the check cannot see batch dependence"


def test_exact_rollback_after_a_batched_verify_equals_the_per_session_path(exact):
    items = [item(exact, i) for i in range(16)]
    outs = exact.forward_batch(items)
    for i, (out, it) in enumerate(zip(outs, items)):
        ref, ref_state = solo(exact, i)
        if KEEPS[i] is not None:
            exact.rollback(it.state, out.undo, KEEPS[i])
            exact.rollback(ref_state, ref.undo, KEEPS[i])
        assert it.state.next_position == ref_state.next_position
        for a, b in zip(state_tensors(it.state), state_tensors(ref_state)):
            assert torch.equal(a, b), i
    # the rolled-back states keep decoding in a batch exactly as they do alone
    nxt = [BatchItem.decode(it.state, 3, it.state.next_position) for it in items]
    for i, out in enumerate(exact.forward_batch(nxt)):
        ref, ref_state = solo(exact, i)
        if KEEPS[i] is not None:
            exact.rollback(ref_state, ref.undo, KEEPS[i])
        alone = exact.decode(ref_state, 3, ref_state.next_position)
        assert torch.equal(out.logits, alone.logits) and torch.equal(out.taps, alone.taps), i


# ---------------------------------------------------------------- arguments
def test_batch_arguments_are_checked_before_any_change(fast):
    good = [item(fast, 0), item(fast, 4)]
    with pytest.raises(ValueError, match="at least one"):
        fast.forward_batch([])
    with pytest.raises(ValueError, match="item 1: .* not a BatchItem"):
        fast.forward_batch([good[0], "decode"])
    with pytest.raises(ValueError, match="item 1: its state is already in the batch"):
        fast.forward_batch([good[0], BatchItem.decode(good[0].state, 1, 7)])
    with pytest.raises(ValueError, match="item 2: decode position=9 does not match state.next_position=8"):
        fast.forward_batch([*good, BatchItem.decode(item(fast, 1).state, 1, 9)])
    assert [g.state.next_position for g in good] == [7, 13] and good[1].state.open_block is None
    outs = fast.forward_batch(good)  # the rejected calls changed nothing
    assert good[1].state.open_block is outs[1].undo and good[1].state.next_position == 19
