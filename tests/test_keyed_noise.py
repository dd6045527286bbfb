"""The keyed generator's bits: Random123's known answers, a recorded fixture checked on every
machine, CUDA equal to the CPU where CUDA exists, and the uniforms' range and keying."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsv4.keyed_noise import philox4x32, to_uniform, words
from dsv4.sampling import ACCEPT, DRAFT, RESIDUAL, TOKEN, SamplingParams, gumbel, keyed_choice, uniforms

FIXTURE = Path(__file__).parent / "data" / "keyed_noise_words.json"
HAS_CUDA = torch.cuda.is_available()
NO_CUDA = "no CUDA device on this machine: the CUDA == CPU bit test runs only where one exists"

# Philox-4x32-10 known-answer vectors of the Random123 distribution (kat_vectors):
# (counter, key) -> output.
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_philox_matches_random123_known_answers(counter, key, expected):
    out = philox4x32(*(torch.tensor([c], dtype=torch.int64) for c in counter), *key)
    assert tuple(int(w[0]) for w in out) == expected


def _fixture_words(device: str) -> list[tuple[list[int], list[int]]]:
    """(recorded, generated on `device`) word lists, one pair per fixture record."""
    records = json.loads(FIXTURE.read_text())["records"]
    return [(r["words"], words(r["seed"], [r["position"]], r["stream"], len(r["words"]), device)[0].cpu().tolist())
            for r in records]


def test_words_equal_the_recorded_fixture_on_cpu():
    pairs = _fixture_words("cpu")
    assert len(pairs) == 8
    for recorded, got in pairs:
        assert got == recorded


@pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)
def test_words_equal_the_recorded_fixture_on_cuda():
    for recorded, got in _fixture_words("cuda"):
        assert got == recorded


@pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)
def test_cuda_noise_and_choice_equal_the_cpu_bitwise():
    positions = list(range(1000, 1016))
    cpu = words(2**62 + 3, positions, TOKEN, 129_280, "cpu")
    assert torch.equal(words(2**62 + 3, positions, TOKEN, 129_280, "cuda").cpu(), cpu)
    assert torch.equal(uniforms(5, positions, ACCEPT, 7, "cuda").cpu(), uniforms(5, positions, ACCEPT, 7))
    logits = torch.randn(16, 4096, generator=torch.Generator().manual_seed(0)) * 4
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11)
    assert torch.equal(keyed_choice(logits.cuda(), params, positions).cpu(), keyed_choice(logits, params, positions))


def test_rows_are_keyed_by_position_not_by_batch():
    block = words(9, [40, 41, 42], DRAFT, 33)
    for i, p in enumerate((40, 41, 42)):
        assert torch.equal(words(9, [p], DRAFT, 33)[0], block[i])
    scattered = words(9, [42, 40], DRAFT, 33)  # a non-consecutive row list takes the copy path
    assert torch.equal(scattered, block[[2, 0]])
    assert torch.equal(words(9, torch.tensor([41]), DRAFT, 33), block[1:2])


def test_a_longer_row_extends_a_shorter_one():
    assert torch.equal(words(3, [8], RESIDUAL, 10)[0], words(3, [8], RESIDUAL, 1000)[0, :10])


def test_keys_differ_in_every_component():
    base = words(1, [2], TOKEN, 64)
    for other in (words(2, [2], TOKEN, 64), words(1, [3], TOKEN, 64), words(1, [2], ACCEPT, 64),
                  words(1 + 2**32, [2], TOKEN, 64), words(1, [2 + 2**32], TOKEN, 64)):
        assert (other != base).float().mean() > 0.95


def test_uniforms_lie_strictly_inside_the_unit_interval_and_gumbel_is_finite():
    assert to_uniform(torch.tensor([0, 2**32 - 1])).tolist() == [2.0 ** -33, 1 - 2.0 ** -33]
    u = uniforms(4, range(8), TOKEN, 4096)
    assert u.dtype == torch.float64 and u.shape == (8, 4096)
    assert 0 < float(u.min()) and float(u.max()) < 1
    # 32768 uniforms: the mean's standard error is 0.0016, so 0.01 is over 6 sigma
    assert abs(float(u.mean()) - 0.5) < 0.01
    assert bool(torch.isfinite(gumbel(4, range(8), TOKEN, 4096)).all())


def test_bad_stream_and_position_are_named():
    with pytest.raises(ValueError, match="stream=9"):
        uniforms(0, [0], 9, 4)
    with pytest.raises(ValueError, match="position=-1"):
        uniforms(0, [-1], TOKEN, 4)
