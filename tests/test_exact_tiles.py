"""Exact numerics' tiles under mixed batches (`dsv4.numerics.ExactNumerics`), asserted bitwise on CPU.

Decode and verify rows run on EXACT_ROWS-row tiles, prompt rows on their own PROMPT_ROWS-row
tiles, and the attention reduction pools the query rows of every call of a kind into those
tiles. Tiny config (docs/model.md §13): W = 8, layer 1 ratio 4 with indexer, layer 2 ratio 8,
layer 3 ratio 4. SPECS mix decodes, verify blocks and prompt chunks (first chunks from 0,
later chunks continuing a prefilled state, one chunk longer than PROMPT_ROWS so it runs as
two pieces) at positions across the ring wrap (7, 13) and from the ratio-4 / ratio-8 block
boundaries (15, 23, 31).

Asserted with torch.equal: every session's logits, taps and (for decodes and prompt chunks)
the state it leaves are the same alone and with 1, 4 and 15 other sessions in different
orders; a prompt's result and state are the same however it is cut into chunks around the
PROMPT_ROWS boundary and whatever shares each chunk's pass. Two deliberately batch-dependent
variants of the new paths (prompt tiles sized by the prompt rows of the pass; the pooled
attention reduction folding over key chunks sized by the number of calls) fail the same
check, which shows it can see the dependence it guards against.
"""

from __future__ import annotations

import pytest
import torch
from model_fixtures import state_tensors

from dsv4.attention import EXACT_KEY_CHUNK
from dsv4.batch import BatchItem
from dsv4.config import tiny_config
from dsv4.init import random_weights
from dsv4.numerics import EXACT_ROWS, PROMPT_ROWS, ExactNumerics, by_kind, tiled
from dsv4.trunk import Trunk

CFG = tiny_config(max_seq_len=128)
KEEP = 4  # tap rows a prompt chunk returns
# (kind, start_pos, tokens) of each session
SPECS = [("decode", 7, 1), ("decode", 15, 1), ("decode", 23, 1), ("verify", 13, 6), ("verify", 15, 8),
         ("verify", 22, 3), ("verify", 31, 5), ("prefill", 0, 5), ("prefill", 0, PROMPT_ROWS + 6),
         ("prefill", 13, 11), ("prefill", 23, PROMPT_ROWS), ("prefill", 40, 3), ("prefill", 7, 1),
         ("prefill", 31, 33), ("decode", 12, 1), ("verify", 9, 4)]
BATCHES = [[8, 0], [3, 11], [9, 4, 1, 13, 7], [10, 15, 5, 12, 2], list(range(16)), list(range(15, -1, -1))]


def make() -> Trunk:
    m = Trunk(CFG, verify_numerics="exact")
    m.load_weights(random_weights(CFG, "trunk", seed=3))
    return m


@pytest.fixture(scope="module")
def model():
    return make()


def session_tokens(i: int) -> torch.Tensor:
    _, start, n = SPECS[i]
    return torch.randint(0, CFG.vocab_size, (start + n,), generator=torch.Generator().manual_seed(200 + i))


def item(model: Trunk, i: int) -> BatchItem:
    """Session i's pending work on a fresh state prefilled (whole, exact) up to its start."""
    kind, start, _ = SPECS[i]
    ids = session_tokens(i)
    st = model.new_state()
    if start:
        model.prefill(st, ids[:start])
    if kind == "decode":
        return BatchItem.decode(st, int(ids[start]), start)
    if kind == "verify":
        return BatchItem.block(st, ids[start:], start)
    return BatchItem.prefill_chunk(st, ids[start:], start, KEEP)


def result(model: Trunk, it: BatchItem, out) -> tuple[torch.Tensor, ...]:
    """Everything a session's work produced: logits, taps, and the state tensors it left
    (a verify block is rolled back to its first two tokens first)."""
    if it.verify:
        model.rollback(it.state, out.undo, min(2, len(it.tokens)))
    return (out.logits, out.taps, *[t.clone() for t in state_tensors(it.state)])


def mismatches(model: Trunk) -> list[tuple[int, int]]:
    """(batch, session) pairs whose results differ bitwise from the session run alone, over BATCHES."""
    alone = {}
    for i in range(len(SPECS)):
        it = item(model, i)
        alone[i] = result(model, it, model.forward_batch([it])[0])
    bad = []
    for b, members in enumerate(BATCHES):
        items = [item(model, i) for i in members]
        for i, it, out in zip(members, items, model.forward_batch(items)):
            if not all(torch.equal(x, y) for x, y in zip(result(model, it, out), alone[i], strict=True)):
                bad.append((b, i))
    return bad


def test_rows_of_every_kind_are_bitwise_equal_alone_and_in_any_batch(model):
    assert mismatches(model) == []


def chunked(model: Trunk, ids: torch.Tensor, cuts: list[int], company: int) -> tuple[torch.Tensor, ...]:
    """Prefill ids in chunks ending at `cuts`, each chunk's pass shared with `company` other
    sessions' decodes -> (logits, taps, state tensors) after the last chunk."""
    st = model.new_state()
    others = [item(model, i) for i in (0, 1, 2, 14)[:company]]
    lo = 0
    for hi in cuts:
        keep = KEEP if hi == ids.shape[0] else None
        outs = model.forward_batch([BatchItem.prefill_chunk(st, ids[lo:hi], lo, keep), *others])
        others = [BatchItem.decode(o.state, 5, o.state.next_position) for o in others]
        lo = hi
    return (outs[0].logits, outs[0].taps, *state_tensors(st))


@pytest.mark.parametrize("cuts,company", [([100], 0), ([7, 64, 100], 2), ([64, 100], 4), ([30, 70, 99, 100], 1),
                                          ([1, 2, 66, 100], 3)])
def test_a_prompt_does_not_depend_on_its_chunks_nor_on_its_company(model, cuts, company):
    ids = torch.randint(0, CFG.vocab_size, (100,), generator=torch.Generator().manual_seed(7))
    st = model.new_state()
    whole = model.prefill(st, ids, KEEP)
    want = (whole.logits, whole.taps, *state_tensors(st))
    got = chunked(model, ids, cuts, company)
    assert len(got) == len(want)
    assert torch.equal(got[1], want[1][-got[1].shape[0]:]), f"taps differ for cuts {cuts}"  # the last chunk's rows
    for k, (a, b) in enumerate(zip(got, want)):
        assert k == 1 or torch.equal(a, b), f"tensor {k} differs for cuts {cuts}"


def test_the_tile_helpers_keep_row_order_and_pad_with_zeros():
    calls = [(_Prefill(), None, (0, 3)), (_Decode(), None, (3, 4)), (_Prefill(), None, (4, 9))]
    rows = torch.arange(9.0)[:, None]
    seen = []

    def record(tile, part):
        seen.append((tile, part.shape[0]))
        return tiled(lambda t: (t * 2, t.shape[0] * torch.ones_like(t)), tile, part)

    doubled, tile_rows = by_kind(record, (rows,), calls)
    assert torch.equal(doubled, rows * 2)
    assert tile_rows[:, 0].tolist() == [PROMPT_ROWS] * 3 + [EXACT_ROWS] + [PROMPT_ROWS] * 5
    assert seen == [(PROMPT_ROWS, 8), (EXACT_ROWS, 1)]


class _Prefill:
    prefill = True


class _Decode:
    prefill = False


# ---------------------------------------------------------------- the check sees batch dependence
class PromptTilesByLoad(ExactNumerics):
    """Batch-dependent: prompt rows' dense tiles sized by how many prompt rows the pass holds."""

    def dense(self, fn, *rows, calls=None):
        n_prompt = sum(hi - lo for call, _, (lo, hi) in calls or [] if call.prefill)
        if not n_prompt:
            return super().dense(fn, *rows, calls=calls)
        return by_kind(lambda tile, *part: tiled(fn, n_prompt if tile == PROMPT_ROWS else tile, *part), rows, calls)


class KeyChunkByLoad(ExactNumerics):
    """Batch-dependent: the pooled attention reduction folds over key chunks sized by the
    number of calls in the pass, not over fixed EXACT_KEY_CHUNK chunks."""

    def attend(self, attn, x, qr, q, kv, calls):
        self.key_chunk = 16 * len(calls)
        try:
            return super().attend(attn, x, qr, q, kv, calls)
        finally:
            self.key_chunk = EXACT_KEY_CHUNK


@pytest.mark.parametrize("broken", [PromptTilesByLoad, KeyChunkByLoad])
def test_a_batch_dependent_prompt_recipe_is_detected(broken):
    model = make()
    model.numerics = broken(model.exact_threads)
    assert mismatches(model), f"{broken.__name__} gave bitwise-equal rows: the check cannot see batch dependence"
