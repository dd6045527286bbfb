"""No hidden host syncs in a step: the guard itself, then one verifier batch step and one
drafter commit + draft step under it (CPU), and the same steps under CUDA's sync debug mode
where CUDA exists."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from dsv4.batch import BatchItem
from dsv4.host_sync import KNOWN_STEP_SYNCS, HostSyncError, host_copy, no_host_sync
from dsv4.sampling import DraftSampler, SamplingParams
from services import app

BUNDLED = Path(__file__).resolve().parents[1] / "assets" / "dspark-small"
ALLOWED = frozenset(KNOWN_STEP_SYNCS)
PROMPT = [5, 17, 99, 3, 8, 9, 10, 11]


def _reads(t: torch.Tensor):
    return [lambda: t.item(), lambda: t.tolist(), lambda: t.cpu(), lambda: bool(t), lambda: int(t),
            lambda: float(t), lambda: [0, 1][t], lambda: t.numpy(), lambda: t.nonzero()]


def test_every_host_read_is_refused_with_its_site():
    t = torch.tensor(1)
    for read in _reads(t):
        with no_host_sync(), pytest.raises(HostSyncError, match=r"tests/test_host_sync.py:<lambda> line \d+"):
            read()


def test_the_one_copy_and_known_sites_pass_and_device_work_does_not_trip():
    t = torch.tensor([1.0, 2.0])
    with no_host_sync():
        u = (t * 2).softmax(-1).argmax()  # device work: no read
        with host_copy():
            assert u.tolist() == 1
    with no_host_sync(allowed=frozenset({"tests/test_host_sync.py:_site"})):
        assert _site(t) == 2.0
    found: list[str] = []
    with no_host_sync(found=found):
        _site(t)
    assert len(found) == 1 and found[0].startswith("tests/test_host_sync.py:_site line ")


def _site(t: torch.Tensor) -> float:
    return float(t.max())


@pytest.fixture(scope="module")
def models():
    trunk, draft = app.load_trunk(BUNDLED), app.load_drafter(BUNDLED)
    return trunk, draft


def _verifier_step(trunk):
    """One `forward_batch` of two decodes, a verify block and a prompt chunk."""
    states = [trunk.new_state() for _ in range(4)]
    for s in states[:3]:
        trunk.prefill(s, torch.tensor(PROMPT))
    items = [BatchItem.decode(states[0], 7, 8), BatchItem.decode(states[1], 12, 8),
             BatchItem.block(states[2], [7, 8, 9], 8), BatchItem.prefill_chunk(states[3], PROMPT[:4], 0, 4)]
    return lambda: trunk.forward_batch(items)


def _drafter_steps(trunk, draft):
    """A commit step of two sessions, then a draft step (one greedy, one sampled draft)."""
    rows = trunk.prefill(trunk.new_state(), torch.tensor(PROMPT), keep_rows=8).taps
    states = [draft.new_state() for _ in range(2)]
    sampler = DraftSampler(SamplingParams(temperature=0.8, top_p=0.9, seed=3), 7)

    def run():
        assert draft.write_main_kv_batch(states, [rows, rows], [range(8), range(8)]) == [None, None]
        return draft.draft_batch(states, [7, 7], [7, 7], [None, sampler])
    return run


def test_a_verifier_step_makes_no_host_sync_but_the_known_ones(models):
    step = _verifier_step(models[0])
    with no_host_sync(allowed=ALLOWED):
        outs = step()
    assert len(outs) == 4


def test_a_drafter_commit_and_draft_step_make_no_host_sync_but_the_known_ones(models):
    steps = _drafter_steps(*models)
    with no_host_sync(allowed=ALLOWED):
        outs = steps()
    assert [len(o.tokens) for o in outs] == [models[1].cfg.dspark_block_size] * 2


def test_the_known_syncs_are_still_there(models):
    """The allow-list stays honest: each entry is a site the steps still reach."""
    found: list[str] = []
    with no_host_sync(found=found):
        _verifier_step(models[0])()
        _drafter_steps(*models)()
    assert {f.split(" ")[0] for f in found} == ALLOWED


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: set_sync_debug_mode runs only where one exists")
def test_cuda_steps_under_sync_debug_mode():
    trunk = app.load_trunk(BUNDLED, device="cuda:0", dtype=torch.bfloat16)
    draft = app.load_drafter(BUNDLED, device="cuda:0", dtype=torch.bfloat16)
    verify, drafts = _verifier_step(trunk), _drafter_steps(trunk, draft)
    torch.cuda.synchronize()
    known = tuple(site.split(":")[0] for site in KNOWN_STEP_SYNCS) + ("dsv4/dspark.py", "dsv4/dspark_rings.py")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            verify()
            drafts()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    unexpected = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)
                  and not Path(w.filename).as_posix().endswith(known)]
    assert unexpected == []
