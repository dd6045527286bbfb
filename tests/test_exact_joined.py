"""Exact numerics' joined key building (`dsv4.numerics.ExactNumerics.attend` through
`dsv4.joined_keys`), asserted bitwise on CPU, op by op: the indexer's scores of every row of a
step (`index_scores_tiled`, `Indexer.topk_tiled`), the compressor blocks finalised together
(`Compressor.finalize_pending`) and the Sinkhorn pairs run once over a pass (`sinkhorn_pairs`).

Each op is asserted to give a row (entry) the same bits alone and among other rows, in any
order; the scores are also checked against the plain `index_scores`. A deliberately
batch-dependent variant of the joined scoring (the Di contraction folded in pieces whose size
comes from the number of rows in the step) fails the same check, which shows the check can see
the dependence it guards against. The whole-model checks (decodes and verify blocks alone and
in mixed batches) are tests/test_exact_tiles.py's.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.attention import EXACT_KEY_CHUNK
from dsv4.compressor import FINALIZE_BLOCKS
from dsv4.config import tiny_config
from dsv4.indexer import index_scores, index_scores_tiled, select_topk
from dsv4.layers import pad_rows
from dsv4.init import random_weights
from dsv4.mhc import sinkhorn_pairs
from dsv4.numerics import EXACT_ROWS
from dsv4.trunk import Trunk

HI, DI = 2, 64  # tiny config's index_n_heads, index_head_dim
ENTRIES = [3, 17, 40, 70, 130, 9]  # entries of each session: one chunk, several, a partial last chunk
ROWS = [(s, i) for s in range(len(ENTRIES)) for i in range(3)]  # (session, row seed): 18 query rows
MEMBERS = [list(range(len(ROWS))), list(range(len(ROWS)))[::-1], [4, 13, 1], [16, 2, 9, 11, 5, 0, 7, 3, 8], [17]]


def entries(s: int) -> torch.Tensor:
    return torch.randn(ENTRIES[s], DI, generator=torch.Generator().manual_seed(50 + s))


def query(r: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(90 + r)
    return torch.randn(HI, DI, generator=g), torch.rand(HI, generator=g)


def step_scores(scorer, members: list[int]) -> dict[int, torch.Tensor]:
    """Scores [E_s] fp32 of each member row against its own session's entries, computed by
    `scorer` (index_scores_tiled's signature) for the rows of one step."""
    owner = [ROWS[i][0] for i in members]
    ep = -(-max(ENTRIES[o] for o in owner) // EXACT_KEY_CHUNK) * EXACT_KEY_CHUNK
    mp = -(-len(members) // EXACT_ROWS) * EXACT_ROWS
    kc = torch.stack([torch.nn.functional.pad(entries(o), (0, 0, 0, ep - ENTRIES[o])) for o in owner])
    qi = torch.stack([query(ROWS[i][1] + 3 * ROWS[i][0])[0] for i in members])
    w = torch.stack([query(ROWS[i][1] + 3 * ROWS[i][0])[1] for i in members])
    out = scorer(pad_rows(qi, mp), pad_rows(w, mp), pad_rows(kc, mp), EXACT_ROWS, EXACT_KEY_CHUNK)
    return {i: out[j, :ENTRIES[ROWS[i][0]]] for j, i in enumerate(members)}


def mismatches(scorer) -> int:
    """Rows whose scores differ bitwise from the same row scored alone, over MEMBERS."""
    alone = {i: step_scores(scorer, [i])[i] for i in range(len(ROWS))}
    return sum(not torch.equal(got, alone[i]) for m in MEMBERS for i, got in step_scores(scorer, m).items())


def test_joined_scores_are_the_plain_scores_and_bitwise_equal_alone_and_in_any_step():
    got = step_scores(index_scores_tiled, list(range(len(ROWS))))
    for i, (s, r) in enumerate(ROWS):
        qi, w = query(r + 3 * s)
        torch.testing.assert_close(got[i], index_scores(qi[None], w[None], entries(s))[0], rtol=1e-5, atol=1e-5)
    assert mismatches(index_scores_tiled) == 0


def contraction_by_load(qi, w, kc, tile, chunk):
    """Batch-dependent: the Di contraction folded in pieces sized by how many tiles the step has."""
    piece = max(8, DI // (qi.shape[0] // tile))
    dots = sum(torch.einsum("mhd,med->mhe", qi[..., a:a + piece].float(), kc[..., a:a + piece].float())
               for a in range(0, DI, piece))
    return (torch.relu(dots) * w[:, :, None]).sum(1)


def test_a_batch_dependent_joined_scoring_is_detected():
    assert mismatches(contraction_by_load) > 0, "the check cannot see a step-dependent contraction"


@pytest.fixture(scope="module")
def indexer():
    cfg = tiny_config(max_seq_len=1024)
    model = Trunk(cfg, verify_numerics="exact")
    model.load_weights(random_weights(cfg, "trunk", seed=3))
    return model.layers[1].attn.indexer  # tiny config: layer 1 has ratio 4 and an indexer


def test_tiled_top_k_selects_per_row_as_alone(indexer):
    states = []
    for s, n in enumerate(ENTRIES):
        st = indexer.compressor.new_state(1024)
        st.cache[:n] = entries(s)
        st.n_entries = n
        states.append(st)
    qi = torch.stack([query(r + 3 * s)[0] for s, r in ROWS])
    w = torch.stack([query(r + 3 * s)[1] for s, r in ROWS])
    owner = [s for s, _ in ROWS]
    pos = torch.tensor([4 * ENTRIES[s] - 1 - 5 * r for s, r in ROWS])  # some entries not yet visible
    top = indexer.topk_tiled(qi, w, pos, states, owner, EXACT_ROWS, EXACT_KEY_CHUNK)
    assert top.shape == (len(ROWS), indexer.topk)
    for i, (s, r) in enumerate(ROWS):
        alone = indexer.topk_tiled(qi[i:i + 1], w[i:i + 1], pos[i:i + 1], [states[s]], [0], EXACT_ROWS, EXACT_KEY_CHUNK)
        assert torch.equal(top[i], alone[0])
        plain = select_topk(index_scores(qi[i:i + 1], w[i:i + 1], entries(s)), (pos[i:i + 1] + 1) // 4, indexer.topk)
        visible = int((pos[i] + 1) // 4)
        assert set(top[i][top[i] >= 0].tolist()) == set(plain[0][plain[0] >= 0].tolist())
        assert (top[i] >= 0).sum() == min(indexer.topk, visible)


def test_finalised_entries_do_not_depend_on_the_blocks_finalised_with_them(indexer):
    comp = indexer.compressor
    g = torch.Generator().manual_seed(7)
    blocks = [(comp.new_state(1024), j, torch.randn(8, DI, generator=g), torch.randn(8, DI, generator=g))
              for j in range(2 * FINALIZE_BLOCKS + 3)]
    for order in (range(len(blocks)), reversed(range(len(blocks)))):
        comp.finalize_pending([blocks[i] for i in order])
        together = [st.cache[j].clone() for st, j, _, _ in blocks]
        for st, _, _, _ in blocks:
            st.cache.zero_()
        for b in blocks:
            comp.finalize_pending([b])
        assert all(torch.equal(st.cache[j], t) for (st, j, _, _), t in zip(blocks, together))
        assert all(t.abs().sum() > 0 for t in together)


def test_sinkhorn_pairs_give_a_row_the_same_bits_whatever_the_rows():
    comb = torch.rand(37, 4, 4, generator=torch.Generator().manual_seed(3)) + 0.1
    together = sinkhorn_pairs(comb, 1e-6, 19)
    for lo, hi in ((0, 1), (5, 13), (13, 37), (36, 37)):
        assert torch.equal(sinkhorn_pairs(comb[lo:hi], 1e-6, 19), together[lo:hi])
    torch.testing.assert_close(together.sum(-2), torch.ones(37, 4), rtol=1e-4, atol=1e-4)  # columns normalised
