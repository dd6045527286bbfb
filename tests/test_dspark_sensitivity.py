"""Draft sensitivity: does every input reach the drafted tokens?

One input is perturbed at a time and the changed drafted tokens are counted (k/5 per round):
the anchor (+1), the ring priming (every context key but the seed position's zeroed: an
unprimed ring), the seed position (the same rings, the block roped one position later), and
a zeroed seed row, once with the ring zeroed (the seed position's key is then the only live
context key) and once with a primed ring. Rounds: seed positions 8, 15, 23 (full, wrapped ring) x anchors
7, 100, 300, tiny config, conformance weights, synthetic rows.

Asserted: the anchor and the ring priming change >= 1 token in every round; the seed
position and the zeroed seed (ring zeroed) change >= 1 token over the rounds (a one-position
rope shift moves only the fast frequencies, so a round can legitimately keep all five).
Reported, not asserted: the zeroed seed with a primed ring (the seed row is one key of W
and priming already carries the continuation, so 0/5 changed is a legitimate outcome).
"""

from __future__ import annotations

import functools

import torch

from dsv4.config import tiny_config
from dsv4.dspark import DSparkDraft, DraftState
from reference_dspark import conformance_weights, synthetic_rows

CFG = tiny_config()
W, B = CFG.window_size, CFG.dspark_block_size
ROWS = synthetic_rows(CFG, 24, seed=1)
ROUNDS = [(p, a) for p in (8, 15, 23) for a in (7, 100, 300)]


@functools.lru_cache(maxsize=None)
def model() -> DSparkDraft:
    m = DSparkDraft(CFG)
    m.load_weights(conformance_weights(CFG, 0))
    return m


def primed(p: int, rows: torch.Tensor = ROWS) -> DraftState:
    state = model().new_state()
    model().write_main_kv(state, rows[:p + 1], range(p + 1))
    return state


def only_seed_key(state: DraftState, p: int) -> DraftState:
    """Zero every ring slot except the seed position's."""
    for ring in state.rings:
        keep = ring[p % W].clone()
        ring.zero_()
        ring[p % W] = keep
    return state


def changed(a: list[int], b: list[int]) -> int:
    return sum(x != y for x, y in zip(a, b))


def perturbation_counts(p: int, anchor: int) -> dict[str, int]:
    m = model()
    base = m.draft(primed(p), anchor, p).tokens
    zero_seed = ROWS.clone()
    zero_seed[p] = 0
    ring_zeroed = m.draft(only_seed_key(primed(p), p), anchor, p).tokens
    return {
        "anchor": changed(base, m.draft(primed(p), (anchor + 1) % CFG.vocab_size, p).tokens),
        "ring priming": changed(base, ring_zeroed),
        "seed position": changed(base, m.draft_from_rings(primed(p).rings, anchor, p + 1).tokens),
        "zeroed seed, ring zeroed": changed(ring_zeroed,
                                            m.draft(only_seed_key(primed(p, zero_seed), p), anchor, p).tokens),
        "zeroed seed, ring primed": changed(base, m.draft(primed(p, zero_seed), anchor, p).tokens),
    }


def test_every_input_reaches_the_draft():
    counts = {(p, a): perturbation_counts(p, a) for p, a in ROUNDS}
    names = list(next(iter(counts.values())))
    for name in names:
        per_round = " ".join(f"{c[name]}/{B}" for c in counts.values())
        total = sum(c[name] for c in counts.values())
        print(f"{name:26s} {per_round}   total {total}/{B * len(ROUNDS)}")
    for (p, a), c in counts.items():
        assert c["anchor"] >= 1, f"anchor does not reach the draft (seed {p}, anchor {a})"
        assert c["ring priming"] >= 1, f"ring priming does not reach the draft (seed {p}, anchor {a})"
    assert sum(c["seed position"] for c in counts.values()) >= 1
    assert sum(c["zeroed seed, ring zeroed"] for c in counts.values()) >= 1


def test_zeroed_row_gives_a_zero_key():
    """Why the zeroed-seed probe needs a zeroed ring: a zero row's key is exactly zero (logit 0,
    value 0), one of W keys."""
    state = model().new_state()
    model().write_main_kv(state, torch.zeros(1, CFG.tap_width), [0])
    assert all(torch.count_nonzero(ring) == 0 for ring in state.rings)
