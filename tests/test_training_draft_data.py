"""Batched draft-data generation (`training.draft_data`): many sequences per
`Trunk.forward_batch` pass give exactly what one-at-a-time greedy generation gives, under
exact verify numerics, on the tiny model (`tests/model_fixtures.py`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model_fixtures import tiny_trunk_with
from training.draft_data import continue_greedy, continue_greedy_batch, parse_args, write_shard

FIELDS = ("ids", "taps", "top_ix", "top_lp")


@pytest.fixture(scope="module")
def exact():
    return tiny_trunk_with("exact")


def prompts(n: int, seed: int = 0) -> list[torch.Tensor]:
    """n prompts of different lengths (1..29 tokens: across the 8-row exact tiles and the
    ratio-4 / ratio-8 compressor boundaries) of random ids >= 2."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 511, (1 + (7 * i + 3) % 29,), generator=g) for i in range(n)]


def same(a: dict, b: dict) -> bool:
    return a["prompt_len"] == b["prompt_len"] and all(torch.equal(a[f], b[f]) for f in FIELDS)


def test_batched_generation_equals_sequential_bitwise(exact):
    ps = prompts(6)
    batched = continue_greedy_batch(exact, ps, new=7, topk=5)
    for p, got in zip(ps, batched):
        ref = continue_greedy(exact, p, new=7, topk=5)
        assert same(got, ref)
        P = p.shape[0]
        assert got["prompt_len"] == P and got["ids"].shape == (P + 7,)
        assert torch.equal(got["ids"][:P], p)
        assert got["taps"].shape == (P + 7, 3 * exact.cfg.dim) and got["taps"].dtype == torch.float32
        assert got["top_ix"].shape == (7, 5) and got["top_ix"].dtype == torch.int16
        # greedy: each continuation token is the argmax, the first of the top-K
        assert torch.equal(got["ids"][P:], got["top_ix"][:, 0].long())
        assert bool((got["top_lp"][:, :-1] >= got["top_lp"][:, 1:]).all())
    # a sequence's result does not depend on the batch it ran in
    assert same(continue_greedy_batch(exact, ps[2:4], new=7, topk=5)[1], batched[3])


def test_batched_generation_rejects_bad_arguments(exact):
    with pytest.raises(ValueError, match="at least one prompt"):
        continue_greedy_batch(exact, [], new=4, topk=3)
    with pytest.raises(ValueError, match="new=0"):
        continue_greedy_batch(exact, prompts(1), new=0, topk=3)
    with pytest.raises(ValueError, match="prompt 1: length \\(125,\\) \\+ new=4"):
        continue_greedy_batch(exact, [torch.tensor([5, 6]), torch.arange(2, 127)], new=4, topk=3)


def test_shard_files_do_not_depend_on_the_batch_and_resume_completes(exact, tmp_path):
    rng = np.random.default_rng(0)
    doc = lambda n: [0, *rng.integers(2, 511, n).tolist(), 1]  # noqa: E731
    streams = {d: np.array(doc(40) + doc(60) + doc(50), dtype=np.uint16) for d in ("code", "prose", "math", "repeat")}
    common = ["--sequences", "5", "--new", "4", "--topk", "3", "--prompt-min", "3", "--prompt-max", "12",
              "--doc-start", "0.5", "--split", "train"]
    one = write_shard(exact, streams, parse_args(common + ["--batch", "1", "--out", str(tmp_path / "one")]))
    # a shard interrupted after its first group of 2, then resumed in groups of 3
    part = parse_args(common + ["--batch", "2", "--out", str(tmp_path / "many")])
    part.sequences = 2
    write_shard(exact, streams, part)
    rest = parse_args(common + ["--batch", "3", "--resume", "--out", str(tmp_path / "many")])
    many = write_shard(exact, streams, rest)
    a, b = (torch.load(f, weights_only=False) for f in (one, many))
    assert len(a["seqs"]) == len(b["seqs"]) == 5
    assert a["meta"] == b["meta"] and a["meta"]["numerics"] == "exact"
    for x, y in zip(a["seqs"], b["seqs"]):
        assert same(x, y) and x["domain"] == y["domain"]
    with pytest.raises(SystemExit):
        parse_args(["--batch", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--save-every-s", "-1"])


def test_a_shard_is_written_at_its_end_whatever_the_save_interval(exact, tmp_path):
    """Saves are throttled by --save-every-s (an hour here), but the last group is always written."""
    streams = {d: np.array([0, *range(2, 80), 1], dtype=np.uint16) for d in ("code", "prose", "math", "repeat")}
    args = parse_args(["--sequences", "3", "--new", "2", "--topk", "2", "--prompt-min", "3", "--prompt-max", "6",
                       "--batch", "1", "--save-every-s", "3600", "--out", str(tmp_path)])
    path = write_shard(exact, streams, args)
    assert path.stat().st_mtime_ns > 0 and len(torch.load(path, weights_only=False)["seqs"]) == 3
