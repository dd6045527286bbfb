"""`DSparkDraft.write_main_kv` and the seed-position contract of `draft` (spec §9.2, §9.6).

Batch writes equal successive single writes bitwise (rows are processed one at a time), a
double write is idempotent, a gap or a first write that leaves the window unknown is an
error, and a draft's seed position must be the last committed position.
"""

from __future__ import annotations

import functools

import pytest
import torch

from dsv4.config import tiny_config
from dsv4.dspark import DraftState, DSparkDraft
from reference_dspark import conformance_weights, synthetic_rows

CFG = tiny_config()
W = CFG.window_size
ROWS = synthetic_rows(CFG, 40, seed=2)


@functools.lru_cache(maxsize=None)
def model(dtype: torch.dtype = torch.float32) -> DSparkDraft:
    m = DSparkDraft(CFG, dtype=dtype)
    m.load_weights(conformance_weights(CFG, 0))
    return m


def written(*writes: tuple[int, int], m: DSparkDraft | None = None) -> DraftState:
    """A state after write_main_kv(ROWS[a:b], range(a, b)) for each (a, b) in order."""
    m = m or model()
    state = m.new_state()
    for a, b in writes:
        m.write_main_kv(state, ROWS[a:b], range(a, b))
    return state


def same(a: DraftState, b: DraftState) -> bool:
    return a.last_position == b.last_position and all(torch.equal(x, y) for x, y in zip(a.rings, b.rings))


# ------------------------------------------------------------------ batch vs single, idempotence
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_write_equals_successive_single_writes_bitwise(dtype):
    m = model(dtype)
    batched = written((0, 6), (6, 14), (14, 17), m=m)  # 6..13 wraps the ring
    single = written(*[(q, q + 1) for q in range(17)], m=m)
    assert batched.last_position == 16
    assert same(batched, single)
    assert all(torch.count_nonzero(r.float().abs().sum(-1)) == W for r in batched.rings)


def test_ring_slot_holds_the_key_of_position_mod_window():
    m = model()
    state = written((0, 13))
    for q in range(13 - W, 13):
        mx = m.main_features(ROWS[q:q + 1])
        for stage, ring in zip(m.mtp, state.rings):
            assert torch.equal(ring[q % W], stage.attn.project_kv(mx, torch.tensor([q]))[0])
    assert not torch.equal(state.rings[0], state.rings[1])  # each stage has its own wkv


def test_write_longer_than_window_keeps_its_last_window():
    assert same(written((0, 20)), written((20 - W, 20)))
    assert same(written((0, 20)), written((0, 12), (12, 20)))


def test_bf16_rows_are_accepted():
    m, state = model(), model().new_state()
    m.write_main_kv(state, ROWS[:5].bfloat16(), range(5))
    ref = written((0, 5))
    assert state.last_position == 4
    assert not same(state, ref)  # the rows were rounded to bf16, so the keys differ slightly
    assert all(torch.allclose(a, b, rtol=0.05, atol=0.05) for a, b in zip(state.rings, ref.rings))


def test_double_write_is_idempotent():
    ref = written((0, 12))
    for again in [(9, 12), (11, 12), (0, 12), (2, 3)]:  # (2, 3) has left the window: skipped
        state = written((0, 12), again)
        assert same(state, ref), f"rewrite of {again}"
    assert same(written((0, 12), (10, 15)), written((0, 15)))  # overlap + continuation


# ------------------------------------------------------------------ position errors
def test_gap_after_last_committed_position_is_an_error():
    state = written((0, 12))
    with pytest.raises(ValueError, match=r"start at 13 but the last committed position is 11"):
        model().write_main_kv(state, ROWS[13:15], range(13, 15))
    assert state.last_position == 11


def test_first_write_must_start_at_zero_or_fill_the_window():
    m = model()
    with pytest.raises(ValueError, match="first write starts at position 5 with 3 rows"):
        m.write_main_kv(m.new_state(), ROWS[5:8], range(5, 8))
    state = m.new_state()
    m.write_main_kv(state, ROWS[5:5 + W], range(5, 5 + W))
    assert state.last_position == 4 + W


@pytest.mark.parametrize("rows, positions, match", [
    (ROWS[:3, :-1], range(3), "row width 767 != tap width 768"),
    (ROWS[:3], range(4), "3 rows but 4 positions"),
    (ROWS[:3], [0, 1, 3], "not consecutive"),
    (ROWS[:3], [2, 1, 0], "not consecutive"),
    (ROWS[0], [0], "2-D float tensor"),
    (ROWS[:3].long(), range(3), "2-D float tensor"),
    (torch.full((2, CFG.tap_width), float("nan")), range(2), "NaN"),
    (ROWS[:2], range(CFG.max_seq_len - 1, CFG.max_seq_len + 1), "max_seq_len=64"),
])
def test_bad_commits_are_rejected(rows, positions, match):
    m = model()
    state = m.new_state()
    with pytest.raises(ValueError, match=match):
        m.write_main_kv(state, rows, positions)
    assert state.last_position == -1


# ------------------------------------------------------------------ draft positions
def test_draft_seed_must_be_the_last_committed_position():
    m, state = model(), written((0, 12))
    for wrong in (10, 12):
        with pytest.raises(ValueError, match=rf"seed_position={wrong} is not the last committed position 11"):
            m.draft(state, 5, wrong)
    assert len(m.draft(state, 5, 11).tokens) == CFG.dspark_block_size


def test_draft_needs_a_commit_first():
    with pytest.raises(ValueError, match="nothing committed"):
        model().draft(model().new_state(), 5, 0)


def test_one_token_prompt_drafts_from_seed_zero():
    m, state = model(), written((0, 1))
    out = m.draft(state, 9, 0)
    assert len(out.tokens) == CFG.dspark_block_size and out.confidence.shape == (CFG.dspark_block_size,)


def test_draft_leaves_the_rings_unchanged():
    m, state = model(), written((0, 12))
    before = [r.clone() for r in state.rings]
    m.draft(state, 5, 11)
    assert all(torch.equal(a, b) for a, b in zip(before, state.rings))


def test_anchor_out_of_range_is_rejected():
    with pytest.raises(ValueError, match="anchor=512"):
        model().draft(written((0, 4)), CFG.vocab_size, 3)
