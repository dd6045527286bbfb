"""Tensor parallelism of the draft module (docs/architecture.md §10): TP=2 drafts equal TP=1 drafts.

Two processes (torch.multiprocessing.spawn, gloo on CPU, a file store in the test's tmp
folder) each build their shard from the same full weights and draft the same rounds from a
fixed synthetic seed (rows and anchors). Both ranks must draft exactly the TP=1 tokens; the
logits differ only by the bf16 rounding of the two all-reduces per stage. The parametrised
negative case moves the shared expert inside the MoE all-reduce (it is then counted twice)
and shows that the same comparison fails. Each rank also drafts two sessions at different
positions in one `draft_batch` (one pair of all-reduces per stage for both): the TP=1
per-session tokens. The same TP=2 run also builds a module for a
config its world size does not divide (5 experts), which must raise before allocating.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv4.config import tiny_config
from dsv4.dspark import DraftMoE, DSparkDraft
from dsv4.dspark_tp import DraftTP, check_shardable, shard_drafter_weights
from reference_dspark import conformance_weights, rel_err, synthetic_rows

CFG = tiny_config()
ROUNDS = [(7, 15), (100, 17), (300, 23)]  # (anchor, seed position); rows committed up to the seed position


class SharedInsideAllReduce(DraftMoE):
    """The mistake under test: the shared expert added before the all-reduce (counted ws times)."""

    def forward(self, x, ids):
        weights, experts = self.gate(x, ids)
        y = self.routed(x, weights, experts) + self.shared_experts(x).float()
        return self.reduce(y).to(x.dtype)


def indivisible_config_error(tp: DraftTP) -> str:
    """The ValueError message of building a module with 5 routed experts on `tp` ("" if none)."""
    try:
        DSparkDraft(CFG.replace(n_routed_experts=5), tp=tp)
    except ValueError as exc:
        return str(exc)
    return ""


def run_drafts(tp: DraftTP, variant: str) -> dict:
    """Build this rank's module, commit the synthetic rows and draft ROUNDS."""
    module = DSparkDraft(CFG, tp=tp)
    if variant == "shared_inside_all_reduce":
        for stage in module.mtp:
            stage.ffn.__class__ = SharedInsideAllReduce
    module.load_weights(conformance_weights(CFG, 0))
    rows = synthetic_rows(CFG, 24, seed=6)
    state = module.new_state()
    out = {"tokens": [], "logits": [], "confidence": [], "reduces_in_writes": 0, "reduces_per_draft": [],
           "indivisible_config_error": indivisible_config_error(tp)}
    last = -1
    for anchor, p in ROUNDS:
        n = tp.n_all_reduce
        module.write_main_kv(state, rows[last + 1:p + 1], range(last + 1, p + 1))
        out["reduces_in_writes"] += tp.n_all_reduce - n
        n, last = tp.n_all_reduce, p
        d = module.draft(state, anchor, p)
        out["reduces_per_draft"].append(tp.n_all_reduce - n)
        out["tokens"].append(d.tokens)
        out["logits"].append(d.logits)
        out["confidence"].append(d.confidence)
    out.update(batched_drafts(module, tp, state, rows))
    return out


def batched_drafts(module: DSparkDraft, tp: DraftTP, state, rows: torch.Tensor) -> dict:
    """Two sessions at different positions drafted in one `draft_batch` and one at a time."""
    other = module.new_state()
    module.write_main_kv(other, rows[:9], range(9))
    args = ([state, other], [11, 12], [state.last_position, 8])
    n = tp.n_all_reduce
    batch = module.draft_batch(*args)
    reduces = tp.n_all_reduce - n
    solo = [module.draft(s, a, p).tokens for s, a, p in zip(*args)]
    return {"batch_tokens": [o.tokens for o in batch], "batch_logits": torch.cat([o.logits for o in batch]),
            "batch_reduces": reduces, "solo_tokens": solo}


def _worker(rank: int, world_size: int, store: str, out_dir: str, variant: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        torch.save(run_drafts(DraftTP(rank, world_size, dist.group.WORLD), variant), Path(out_dir) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


@functools.lru_cache(maxsize=None)
def run_tp(world_size: int, variant: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        mp.spawn(_worker, args=(world_size, str(tmp / "store"), str(tmp), variant), nprocs=world_size, join=True)
        return [torch.load(tmp / f"{r}.pt") for r in range(world_size)]


@functools.lru_cache(maxsize=None)
def tp1() -> dict:
    return run_drafts(DraftTP(), "documented")


# ------------------------------------------------------------------ TP=2 vs TP=1
@pytest.mark.parametrize("variant, should_match", [("documented", True), ("shared_inside_all_reduce", False)])
def test_tp2_drafts_equal_tp1_drafts(variant, should_match):
    ranks = run_tp(2, variant)
    ref = tp1()
    errs = [rel_err(torch.stack(r["logits"]), torch.stack(ref["logits"])) for r in ranks]
    same = all(r["tokens"] == ref["tokens"] for r in ranks)
    print(f"{variant}: TP=1 {ref['tokens']}, TP=2 {[r['tokens'] for r in ranks]}, logits rel err {errs}")
    assert ranks[0]["tokens"] == ranks[1]["tokens"]  # replicated head: identical ids by construction
    assert torch.equal(torch.stack(ranks[0]["logits"]), torch.stack(ranks[1]["logits"]))
    if should_match:
        assert same
        assert max(errs) < 2e-2  # bf16 rounding of the partial sums only
        for r in ranks:
            assert r["reduces_in_writes"] == 0
            assert r["reduces_per_draft"] == [2 * CFG.n_mtp_layers] * len(ROUNDS)
    else:
        assert not same, "moving the shared expert inside the all-reduce must break TP=1 == TP=2"
        assert max(errs) > 0.1


def test_tp2_batched_draft_equals_tp1_per_session_drafts():
    ranks, ref = run_tp(2, "documented"), tp1()
    assert ref["batch_tokens"] == ref["solo_tokens"]
    for r in ranks:
        assert r["batch_tokens"] == ref["solo_tokens"]
        assert r["batch_reduces"] == 2 * CFG.n_mtp_layers  # one pair per stage for the whole batch
        assert rel_err(r["batch_logits"], ref["batch_logits"]) < 2e-2
    assert torch.equal(ranks[0]["batch_logits"], ranks[1]["batch_logits"])


def test_tp2_module_rejects_a_config_the_world_size_does_not_divide():
    for r in run_tp(2, "documented"):
        assert r["indivisible_config_error"] == "n_routed_experts=5 is not divisible by TP world_size=2"
    assert tp1()["indivisible_config_error"] == ""  # 1 divides everything


def test_tp1_does_two_identity_reductions_per_stage():
    assert tp1()["reduces_per_draft"] == [2 * CFG.n_mtp_layers] * len(ROUNDS)
    assert tp1()["reduces_in_writes"] == 0


# ------------------------------------------------------------------ sharding and setup errors
def test_tp_above_one_without_a_process_group_raises():
    with pytest.raises(ValueError, match="world_size=2 needs a torch.distributed process group"):
        DraftTP(rank=0, world_size=2, group=None)
    with pytest.raises(ValueError, match="rank=2"):
        DraftTP(rank=2, world_size=2)


def test_indivisible_config_is_rejected():
    with pytest.raises(ValueError, match="n_heads=4 is not divisible by TP world_size=3"):
        check_shardable(CFG, 3)
    with pytest.raises(ValueError, match="n_routed_experts=5 is not divisible by TP world_size=2"):
        check_shardable(CFG.replace(n_routed_experts=5), 2)
    for bad in (0, -2, 2.0, True, "2", None):
        with pytest.raises(ValueError, match=f"world_size={bad!r}: must be an integer >= 1"):
            check_shardable(CFG, bad)
    with pytest.raises(ValueError, match="world_size=0"):
        DraftTP(rank=0, world_size=0)
    with pytest.raises(ValueError, match="rank=0.5"):
        DraftTP(rank=0.5, world_size=1)


def test_shards_partition_heads_groups_and_experts():
    full = conformance_weights(CFG, 0)
    shards = [shard_drafter_weights(CFG, full, r, 2) for r in range(2)]
    a = "mtp.1.attn."
    assert torch.equal(torch.cat([s[a + "wq_b.weight"] for s in shards]), full[a + "wq_b.weight"])
    assert torch.equal(torch.cat([s[a + "attn_sink"] for s in shards]), full[a + "attn_sink"])
    assert torch.equal(torch.cat([s[a + "wo_a.weight"] for s in shards]), full[a + "wo_a.weight"])
    assert torch.equal(torch.cat([s[a + "wo_b.weight"] for s in shards], 1), full[a + "wo_b.weight"])
    experts = [{int(n.split(".")[4]) for n in s if ".experts." in n} for s in shards]
    assert experts == [set(range(4)), set(range(4, 8))]
    for name in ("head.weight", "mtp.0.main_proj.weight", "mtp.2.markov_head.markov_w2.weight",
                 "mtp.2.confidence_head.proj.weight", "mtp.0.ffn.shared_experts.w2.weight", "mtp.0.attn.wkv.weight"):
        assert all(s[name] is full[name] for s in shards), f"{name} must be replicated"
