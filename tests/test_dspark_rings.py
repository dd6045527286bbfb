"""`DSparkDraft.write_main_kv` and the seed-position contract of `draft` (docs/model.md §9.2, §9.6).

Batch writes equal successive single writes bitwise (rows are processed one at a time), a
double write with identical rows is idempotent while a different row at a committed position
is rejected, a gap or a first write that leaves the window unknown is an error, every
rejected commit leaves the state (and the next draft) unchanged, a draft's seed position must
be the last committed position, and near max_seq_len a draft returns only the positions
before it.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from dsv4.config import tiny_config
from dsv4.dspark import DraftState, DSparkDraft
from reference_dspark import conformance_weights, synthetic_rows

CFG = tiny_config()
W, B, L = CFG.window_size, CFG.dspark_block_size, CFG.max_seq_len
ROWS = synthetic_rows(CFG, L, seed=2)


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


def snapshot(state: DraftState) -> DraftState:
    return DraftState([r.clone() for r in state.rings], state.last_position)


def with_row(q: int, value: float, col: int | None = None) -> torch.Tensor:
    """ROWS[q:q+1] with every element (col None) or one element set to `value`."""
    row = ROWS[q:q + 1].clone()
    row[0, slice(None) if col is None else col] = value
    return row


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


def test_rewrite_with_a_different_row_is_rejected_and_changes_nothing():
    m, state = model(), written((0, 12))
    before, draft = snapshot(state), m.draft(state, 5, 11)
    for rows, positions, where in [
        (ROWS[20:22], [9, 10], "position 9"),                                 # both differ
        (torch.cat((ROWS[10:11], ROWS[30:31])), [10, 11], "position 11"),    # the second differs
        (torch.cat((ROWS[30:31], ROWS[12:14])), [11, 12, 13], "position 11"),  # new positions not written
    ]:
        with pytest.raises(ValueError, match=rf"{where} is already committed with a different row"):
            m.write_main_kv(state, rows, positions)
        assert same(state, before), f"{positions} changed the state"
    again = m.draft(state, 5, 11)
    assert again.tokens == draft.tokens and torch.equal(again.logits, draft.logits)
    m.write_main_kv(state, ROWS[2:3] + 1.0, [2])  # left the window: skipped unchecked, a no-op
    assert same(state, before)


def test_rows_too_large_for_main_norm_are_rejected_before_any_write():
    m, state = model(), written((0, 12))
    before = snapshot(state)
    # Finite, but main_proj's output overflows main_norm's mean square: rsqrt(inf) = 0, so the
    # keys are all zero, or NaN where a projected value is itself inf (inf * 0; whether any is
    # depends on the CPU's GEMM kernel): never a usable key.
    for row in (with_row(13, 1e20, col=5), with_row(13, 1e38)):
        features = m.main_features(row)
        assert not torch.any(torch.isfinite(features) & (features != 0)), features
    for bad in (with_row(13, 1e20, col=5), with_row(13, 1e38), with_row(13, -3e38)):
        with pytest.raises(ValueError, match=r"rows\[1\] \(position 13\) is out of range"):
            m.write_main_kv(state, torch.cat((ROWS[12:13], bad)), [12, 13])  # row 12 is fine
        assert same(state, before)
    m.write_main_kv(state, ROWS[12:13] * 1e6, [12])  # large but representable: accepted
    assert state.last_position == 12


def test_rows_with_non_finite_keys_are_rejected_naming_the_stage():
    weights = conformance_weights(CFG, 0)
    weights["mtp.1.attn.kv_norm.weight"] = torch.full((CFG.head_dim,), 3e38)  # finite, but the keys overflow
    m = DSparkDraft(CFG)
    m.load_weights(weights)
    state = m.new_state()
    with pytest.raises(ValueError, match=r"rows\[0\] \(position 0\) gives a non-finite key in stage 1"):
        m.write_main_kv(state, ROWS[:2], range(2))
    assert state.last_position == -1 and all(torch.count_nonzero(r) == 0 for r in state.rings)


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


NAN_ROW, INF_ROW = with_row(12, float("nan"), col=7), with_row(12, float("-inf"), col=0)
BAD_COMMITS = {  # on a session primed with positions 0..11; each would be accepted but for its defect
    "row_width": (ROWS[12:15, :-1], range(12, 15), "row width 767 != tap width 768"),
    "count": (ROWS[12:15], range(12, 16), "3 rows but 4 positions"),
    "gap_inside": (ROWS[12:15], [12, 13, 15], "not consecutive"),
    "descending": (ROWS[10:13], [12, 11, 10], "not consecutive"),
    "duplicate": (ROWS[12:14], [12, 12], "not consecutive"),
    "negative": (ROWS[:2], [-1, 0], r"positions -1..0 outside \[0, max_seq_len=64\)"),
    "past_max_seq_len": (ROWS[12:14], [63, 64], "max_seq_len=64"),
    "rows_1d": (ROWS[12], [12], r"2-D tensor \[R, 768\], got shape \(768,\)"),
    "rows_3d": (ROWS[12:14][None], [12, 13], r"2-D tensor \[R, 768\], got shape \(1, 2, 768\)"),
    "rows_int": (ROWS[12:14].long(), [12, 13], "rows dtype torch.int64"),
    "rows_fp16": (ROWS[12:14].half(), [12, 13], "rows dtype torch.float16: must be torch.float32 or torch.bfloat16"),
    "rows_fp64": (ROWS[12:14].double(), [12, 13], "rows dtype torch.float64"),
    "rows_list": (ROWS[12:14].tolist(), [12, 13], "rows must be a torch tensor"),
    "nan": (NAN_ROW, [12], r"rows\[0\] \(position 12\) contains NaN or Inf"),
    "inf": (torch.cat((ROWS[11:12], INF_ROW)), [11, 12], r"rows\[1\] \(position 12\) contains NaN or Inf"),
    "float_position": (ROWS[12:13], [12.7], r"positions\[0\]=12.7 \(float\): must be an integer"),
    "float_position_scalar": (ROWS[12:13], 12.7, "positions=12.7"),
    "half_position": (ROWS[11:12], [11.5], r"positions\[0\]=11.5"),
    "integral_float": (ROWS[12:13], [12.0], r"positions\[0\]=12.0"),
    "float_tensor": (ROWS[12:13], torch.tensor([12.5]), r"positions=tensor\(\[12.5000\]\) \(torch.float32"),
    "numpy_float": (ROWS[12:13], np.array([12.0]), r"positions\[0\]=.*12.0.* \(float64\)"),
    "string": (ROWS[9:10], "9", "positions='9'"),
    "bool": (ROWS[1:2], [True], r"positions\[0\]=True \(bool\)"),
    "none": (ROWS[12:13], None, "positions=None"),
    "int_scalar": (ROWS[12:13], 12, "positions=12 \\(int\\)"),
    "empty": (ROWS[12:12], [], "positions is empty"),
}


@pytest.mark.parametrize("name", BAD_COMMITS)
def test_bad_commits_are_rejected_and_leave_the_session_unchanged(name):
    rows, positions, match = BAD_COMMITS[name]
    m, state = model(), written((0, 12))
    before, draft = snapshot(state), m.draft(state, 5, 11)
    with pytest.raises(ValueError, match=match):
        m.write_main_kv(state, rows, positions)
    assert same(state, before)
    again = m.draft(state, 5, 11)
    assert again.tokens == draft.tokens and torch.equal(again.logits, draft.logits)


def test_integer_positions_of_every_kind_are_accepted():
    ref = written((0, 12), (12, 14))
    for positions in ([12, 13], (12, 13), np.array([12, 13]), torch.tensor([12, 13]),
                      [np.int64(12), torch.tensor(13)]):
        state = written((0, 12))
        model().write_main_kv(state, ROWS[12:14], positions)
        assert same(state, ref), f"{positions!r}"


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


@pytest.mark.parametrize("anchor, seed, match", [
    (CFG.vocab_size, 3, r"anchor=512 outside \[0, vocab_size=512\)"),
    (-1, 3, r"anchor=-1 outside"),
    (3.9, 3, r"anchor=3.9 \(float\): must be an integer"),
    (True, 3, r"anchor=True \(bool\)"),
    ("3", 3, r"anchor='3' \(str\)"),
    (torch.tensor(3.0), 3, r"anchor=tensor\(3.\)"),
    (5, 3.0, r"seed_position=3.0 \(float\)"),
    (5, -1, r"seed_position=-1: must be >= 0"),
])
def test_bad_draft_arguments_are_rejected(anchor, seed, match):
    with pytest.raises(ValueError, match=match):
        model().draft(written((0, 4)), anchor, seed)


def test_integer_anchor_of_every_kind_drafts_the_same():
    m, state = model(), written((0, 4))
    ref = m.draft(state, 5, 3).tokens
    for anchor, seed in ((np.int64(5), 3), (torch.tensor(5), torch.tensor(3)), (5, np.int32(3))):
        assert m.draft(state, anchor, seed).tokens == ref


def test_a_state_that_does_not_belong_to_the_module_is_rejected():
    m, state = model(), written((0, 12))
    wrong = {
        "one ring": (DraftState(state.rings[:1], 11), "state has 1 rings, the module 3 stages"),
        "window 16": (DraftState([torch.zeros(16, CFG.head_dim) for _ in range(3)], 11),
                      r"rings\[0\] is \(16, 96\) torch.float32 on cpu, the module needs \(8, 96\)"),
        "bf16 rings": (DraftState([r.bfloat16() for r in state.rings], 11), r"rings\[0\] is \(8, 96\) torch.bfloat16"),
        "not a state": ([r.clone() for r in state.rings], "state must be a DraftState, got list"),
    }
    for name, (bad, match) in wrong.items():
        with pytest.raises(ValueError, match=match):
            m.draft(bad, 5, 11)
        with pytest.raises(ValueError, match=match):
            m.write_main_kv(bad, ROWS[12:13], [12])
        if isinstance(bad, DraftState):
            assert bad.last_position == 11, name
    with pytest.raises(ValueError, match="state has 2 rings"):
        m.draft_from_rings(state.rings[:2], 5, 11)


# ------------------------------------------------------------------ end of the sequence
def primed_to(last: int) -> DraftState:
    """Rows of positions last-W+1..last (a first write of W rows)."""
    state = model().new_state()
    model().write_main_kv(state, ROWS[last - W + 1:last + 1], range(last - W + 1, last + 1))
    return state


@pytest.mark.parametrize("seed, n", [(57, 5), (58, 4), (60, 2), (61, 1), (62, 0)])
def test_draft_near_max_seq_len_returns_only_positions_before_it(seed, n):
    m, state = model(), primed_to(seed)
    out, full = m.draft(state, 5, seed), m.draft_from_rings(state.rings, 5, seed)
    assert n == min(B, L - seed - 2) and len(out.tokens) == n  # drafts of positions seed+2..L-1
    assert out.tokens == full.tokens[:n]
    assert torch.equal(out.logits, full.logits[:n]) and torch.equal(out.confidence, full.confidence[:n])
    assert out.hidden.shape == (n, CFG.dim)


def test_draft_with_the_anchor_at_max_seq_len_has_no_room():
    state = primed_to(L - 1)
    with pytest.raises(ValueError, match=r"seed_position=63: no room for the anchor at 64"):
        model().draft(state, 5, L - 1)
    assert state.last_position == L - 1
