"""`bench/determinism.py`: the divergence index, the attribution rule of docs/architecture.md §4,
and a short real run in which sequential verify reproduces plain decode exactly."""

from __future__ import annotations

import asyncio

import pytest

from bench.determinism import CHECKS, Bench, Cell, attribution, first_divergence


@pytest.mark.parametrize("a, b, want", [([1, 2, 3], [1, 2, 3], None), ([1, 2, 3], [1, 9, 3], 1),
                                        ([1, 2], [1, 2, 3], 2), ([], [], None), ([4], [5], 0)])
def test_first_divergence(a, b, want):
    assert first_divergence(a, b) == want


def cells(gated=None, self_=None, vs_plain=None, gated_plain=None) -> dict:
    def c(i):
        return Cell(i, None if i is None else 0.05)
    return {"plain vs plain": c(None), "always-k vs always-k": c(self_), "gated vs always-k": c(gated),
            "always-k vs plain": c(vs_plain), "gated vs plain": c(gated_plain)}


def test_attribution_follows_the_seed_rule():
    assert attribution(cells()) == "-"
    # always-k already differs from itself at or before the gated divergence: not the gate's
    assert attribution(cells(gated=14, self_=14)) == "verify path (always-k differs from itself at 14)"
    assert attribution(cells(gated=14, self_=9)).startswith("verify path")
    # always-k is self-consistent through it: the gate's by the attribution rule
    assert attribution(cells(gated=14, self_=20)) == "gate (always-k agrees with itself through 14)"
    text = attribution(cells(gated=20, vs_plain=20, gated_plain=None))
    assert text.startswith("gate (always-k agrees with itself through 20); gated equals plain there")
    assert Cell(20, 0.0366).text() == "diverges at 20 (margin 0.0366)" and Cell(None, None).text() == "identical"


def test_sequential_verify_rows_are_all_identical_on_the_tiny_model():
    bench = Bench(None, "oracle", corrupt_every=3, max_tokens=12)
    row = asyncio.run(bench.row("code", "def fibonacci(n):", "sequential"))
    assert [row["cells"][c].text() for c in CHECKS] == ["identical"] * 4
    assert row["attribution"] == "-" and len(row["tokens"]["gated"]) == 12
