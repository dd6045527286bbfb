"""Fast numerics' joined attention (`FastNumerics.attend`, `dsv4.joined_keys.joined_keys`), on CPU.

Tiny config (docs/model.md §13): W = 8; layer 0 has no compressor, layer 1 ratio 4 with the
indexer, layer 2 a plain ratio-8 compressor. One pass mixes a prompt's first piece, a later
prompt piece, decodes before the first ring wrap (5), across it (8, 9), at ratio-4 / ratio-8
boundaries ((p + 1) % r == 0: 15, 23, 31) and past them, and verify blocks of 1..7 tokens
crossing those boundaries, on sessions of different lengths. The joined path (one reduction
over every decode and verify row) must match the per-call path (`Attention.core` per call)
within TOL on every row, and leave every state as the per-call path does: the ring and every
journal's saved ring rows bitwise, the compressor and indexer states (whose projections the
joined path computes over all rows at once) within TOL, with the same entry counts.

Two more passes go through the joined path's other shapes: decodes only (the plain-decode
step: no row gather), among them sessions with no compressed entry yet (positions 1, 2),
several completing a block in the same step (their entries finalised in one batch) and
others holding 1..9 entries (the indexer's padded scoring); and decodes with verify blocks
but no prompt piece. Every case also runs with quantisation simulation on (the batched
entry finalisation's fp8 / fp4 round trips).
"""

from __future__ import annotations

import copy

import pytest
import torch

from dsv4.attention import Attention, AttentionState
from dsv4.config import tiny_config
from dsv4.init import random_weights
from dsv4.numerics import Call, FastNumerics
from dsv4.trunk import Trunk

TOL = 1e-5  # rel. error, fp32: only the reduction's shape differs between the two paths
CFG = tiny_config(max_seq_len=128)
# (start_pos, tokens, kind) of each call of the pass; "prompt" calls are pieces of a prompt
CALLS = [(5, 1, "decode"), (0, 12, "prompt"), (8, 1, "decode"), (13, 6, "verify"), (9, 1, "decode"),
         (15, 1, "decode"), (22, 2, "verify"), (23, 1, "decode"), (16, 5, "prompt"), (30, 7, "verify"),
         (31, 1, "decode"), (40, 1, "decode"), (19, 1, "verify")]
# decodes only: no entry yet (1, 2), ratio-4 blocks completing together (3, 7, 11, 19, 39),
# ratio-8 ones (7, 15, 23, 39), 1..9 entries, before and after the ring wraps
DECODES = [(p, 1, "decode") for p in (1, 2, 3, 7, 11, 15, 19, 23, 24, 30, 39, 6, 9)]
# decodes and verify blocks, no prompt piece: the joined rows are gathered from the pass
STEP = [(3, 1, "decode"), (4, 5, "verify"), (2, 1, "decode"), (11, 1, "decode"), (14, 3, "verify"),
        (27, 1, "decode"), (1, 2, "verify"), (35, 1, "decode")]
PASSES = {"mixed": CALLS, "decodes": DECODES, "decodes+verify": STEP}


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "quant_sim"])
def layers(request) -> list[Attention]:
    m = Trunk(CFG, dtype=torch.float32, verify_numerics="fast", quant_sim=request.param)
    m.load_weights(random_weights(CFG, "trunk", seed=3))
    return [m.layers[i].attn for i in range(3)]


def prepared(attn: Attention, gen: torch.Generator,
             calls: list = CALLS) -> tuple[list[AttentionState], torch.Tensor]:
    """Each call's state, filled by a prefill of start_pos random tokens (empty for a first
    piece), and the pass's input rows x [N, D]."""
    states = []
    for start, _, _ in calls:
        st = attn.new_state()
        if start:
            attn(torch.randn(start, CFG.dim, generator=gen), 0, st)
        states.append(st)
    return states, torch.randn(sum(n for _, n, _ in calls), CFG.dim, generator=gen)


def pass_calls(states: list[AttentionState], calls: list = CALLS) -> list:
    """The pass's (call, state, rows) list, a fresh journal for each verify block."""
    out, lo = [], 0
    for (start, n, kind), st in zip(calls, states):
        out.append((Call(start, n, [] if kind == "verify" else None, kind == "prompt"), st, (lo, lo + n)))
        lo += n
    return out


def state_tensors(st: AttentionState) -> list[torch.Tensor]:
    parts = []
    for cst in (st.compressor, st.indexer):
        if cst is not None:
            parts += [v for v in vars(cst).values() if isinstance(v, torch.Tensor)]
    return parts


def projected(attn: Attention, x: torch.Tensor, calls: list = CALLS) -> tuple[torch.Tensor, ...]:
    pos = torch.cat([torch.arange(s, s + n) for s, n, _ in calls])
    q, qr = attn.project_q(x, pos)
    return x, qr, q, attn.project_kv(x, pos)


@pytest.mark.parametrize("name", list(PASSES))
@pytest.mark.parametrize("layer", [0, 1, 2], ids=["ratio0", "ratio4-indexer", "ratio8"])
def test_joined_attention_matches_the_per_call_path(layers, layer, name):
    attn, calls = layers[layer], PASSES[name]
    states, x = prepared(attn, torch.Generator().manual_seed(10 + layer), calls)
    rows = projected(attn, x, calls)
    per_call_states = copy.deepcopy(states)
    joined_calls, per_calls = pass_calls(states, calls), pass_calls(per_call_states, calls)

    joined = FastNumerics().attend(attn, *rows, joined_calls)
    x_, qr, q, kv = rows
    ref = torch.cat([attn.core(x_[lo:hi], qr[lo:hi], q[lo:hi], kv[lo:hi], c.start_pos, st, c.undo)
                     for c, st, (lo, hi) in per_calls])

    assert joined.shape == ref.shape == (x.shape[0], CFG.n_heads, CFG.head_dim)
    assert joined.dtype == ref.dtype == torch.float32
    for c, _, (lo, hi) in joined_calls:
        err = float((joined[lo:hi] - ref[lo:hi]).abs().max() / ref[lo:hi].abs().max())
        assert err < TOL, f"call at {c.start_pos} ({hi - lo} rows): rel. error {err:.2e}"
    for a, b in zip(states, per_call_states):
        assert torch.equal(a.ring, b.ring)
        for s, t in zip(state_tensors(a), state_tensors(b)):
            torch.testing.assert_close(s, t, rtol=TOL, atol=TOL)
        for s, t in ((a.compressor, b.compressor), (a.indexer, b.indexer)):
            assert s is None and t is None or s.n_entries == t.n_entries
    for (c, _, _), (r, _, _) in zip(joined_calls, per_calls):
        if c.undo is not None:
            assert len(c.undo) == len(r.undo) == 1
            assert torch.equal(c.undo[0].ring_rows, r.undo[0].ring_rows)
            assert torch.equal(c.undo[0].block_kv, r.undo[0].block_kv)


def test_a_single_decode_runs_as_before(layers):
    """One decode (or one verify block) alone takes the per-call path: bitwise `core`."""
    attn = layers[1]
    gen = torch.Generator().manual_seed(7)
    st = attn.new_state()
    attn(torch.randn(23, CFG.dim, generator=gen), 0, st)
    other = copy.deepcopy(st)
    x = torch.randn(1, CFG.dim, generator=gen)
    pos = torch.tensor([23])
    q, qr = attn.project_q(x, pos)
    kv = attn.project_kv(x, pos)
    out = FastNumerics().attend(attn, x, qr, q, kv, [(Call(23, 1), st, (0, 1))])
    assert torch.equal(out, attn.core(x, qr, q, kv, 23, other, None))


def test_precomputed_rows_are_refused_for_a_prefill(layers):
    attn = layers[1]
    x = torch.randn(4, CFG.dim, generator=torch.Generator().manual_seed(8))
    pos = torch.arange(4)
    q, qr = attn.project_q(x, pos)
    with pytest.raises(ValueError, match="start_pos 0"):
        attn.keys(x, qr, attn.project_kv(x, pos), 0, attn.new_state(), None, attn.exact_rows(x, qr, pos))


@pytest.mark.parametrize("layer", [1, 2], ids=["ratio4-indexer", "ratio8"])
def test_joined_journals_roll_back_like_the_per_call_ones(layers, layer):
    """A verify block's journal written by the joined step (its compressors' blocks stored by
    the batched finalisation) rolls back, keeping 1..S tokens, to the state the per-call
    path's journal rolls back to: ring bitwise, compressor and indexer states within TOL."""
    attn = layers[layer]
    states, x = prepared(attn, torch.Generator().manual_seed(20 + layer), STEP)
    rows = projected(attn, x, STEP)
    per_call_states = copy.deepcopy(states)
    joined_calls, per_calls = pass_calls(states, STEP), pass_calls(per_call_states, STEP)
    FastNumerics().attend(attn, *rows, joined_calls)
    x_, qr, q, kv = rows
    for c, st, (lo, hi) in per_calls:
        attn.core(x_[lo:hi], qr[lo:hi], q[lo:hi], kv[lo:hi], c.start_pos, st, c.undo)
    blocks = 0
    for (c, a, _), (r, b, _) in zip(joined_calls, per_calls):
        if c.undo is None:
            continue
        blocks += 1
        keep = 1 + blocks % c.n_tokens  # a different cut per block, the whole block kept for some
        attn.rollback(a, c.undo[0], keep)
        attn.rollback(b, r.undo[0], keep)
        assert torch.equal(a.ring, b.ring)
        for s, t in zip(state_tensors(a), state_tensors(b)):
            torch.testing.assert_close(s, t, rtol=TOL, atol=TOL)
        assert a.compressor.n_entries == b.compressor.n_entries
        assert a.compressor.journal is None and b.compressor.journal is None
    assert blocks == 3
