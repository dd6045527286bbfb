"""`DSPARK_TOPK_DIAG` dumps and `dspark parity` (docs/analysis.md §6-§7): the verdict rule on synthetic logits,
sequential vs batched verify of the tiny model from real dumps, and one dump per TP rank."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.analysis.parity import Row, compare, load_dump, verdict
from dsv4.init import random_weights
from services.app import TINY_SEED, drafter_engine, random_tiny_config, verifier_engine
from services.cli import main
from services.common.settings import BackendSettings
from services.gateway.backends import LocalDrafterSession, LocalVerifierSession
from services.gateway.gate import GateConfig
from services.gateway.scheduler import FinalEvent, ModelLimits, Scheduler
from services.verifier.engine import VerifierEngine
from verifier_fixtures import StepVerifier, loop_of
from services.settings import topk_diag_settings
from services.verifier.topk_diag import TopKDiagTrunk, maybe_wrap
from services.verifier.tp import start_tp_trunk
from services_fixtures import tiny_tokenizer, tiny_trunk


def row(ids, logits, position=5, token=1, op="decode") -> Row:
    return Row(position, token, tuple(ids), tuple(float(x) for x in logits), op)


# ---------------------------------------------------------------------------- the rule
def test_same_argmax_is_argmax_agree_whatever_the_logits():
    v, info = verdict(row([7, 3, 9], [10.0, 4.0, 1.0]), row([7, 9, 3], [30.0, 29.0, 2.0]), delta=0.0)
    assert v == "argmax_agree" and info["margin_a"] == 6.0 and info["margin_b"] == 1.0


def test_flip_within_twice_the_measured_disagreement_is_a_near_tie():
    # A: 2524 over 36101 by 0.002; B: 36101 over 2524 by 0.05. δ = 0.03 -> bound 0.06 >= 0.052
    a = row([2524, 36101, 5], [33.090, 33.088, 20.0])
    b = row([36101, 2524, 5], [33.10, 33.05, 20.01])
    v, info = verdict(a, b, delta=0.03)
    assert v == "near_tie"
    assert info["gap_a"] == pytest.approx(0.002) and info["gap_b"] == pytest.approx(0.05)
    assert verdict(a, b, delta=0.02)[0] == "mismatch"  # 0.052 > 0.04: the drift cannot explain it


def test_flip_far_beyond_the_disagreement_is_a_mismatch():
    v, info = verdict(row([11, 12, 13], [9.0, 3.0, 1.0]), row([12, 11, 13], [8.5, 2.0, 1.0]), delta=0.1)
    assert v == "mismatch" and info["gap_a"] + info["gap_b"] == pytest.approx(12.5)


def test_pick_outside_the_other_sides_top_k_is_a_mismatch():
    v, info = verdict(row([1, 2], [5.0, 4.999]), row([3, 1], [5.0, 4.999]), delta=100.0)
    assert v == "mismatch" and info["gap_a"] is None


def _dump(path, sessions):
    """A dump file: sessions = [(prompt_sha, [(op, position, token, ids, logits), ...]), ...]."""
    lines = [{"format": "dspark-topk", "version": 1, "k": 3, "rank": 0, "pid": 1, "config_hash": "x"}]
    for s, (sha, rows) in enumerate(sessions):
        for op, q, tok, ids, logits in rows:
            rec = {"session": s, "op": op, "positions": [q], "tokens": [tok], "ids": [ids], "logits": [logits]}
            if op == "prefill":
                rec.update(prompt_len=q + 1, prompt_sha256=sha)
            lines.append(rec)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def test_compare_measures_the_disagreement_on_agreeing_rows_only(tmp_path):
    a = _dump(tmp_path / "a.jsonl", [("p", [("prefill", 3, 9, [4, 5, 6], [9.0, 7.0, 1.0]),
                                            ("decode", 4, 4, [8, 2, 1], [5.0, 4.99, 1.0]),
                                            ("decode", 5, 2, [1, 2, 3], [6.0, 1.0, 0.0])])])
    b = _dump(tmp_path / "b.jsonl", [("p", [("prefill", 3, 9, [4, 5, 6], [9.02, 7.0, 1.0]),    # agree, δ 0.02
                                            ("decode", 4, 4, [2, 8, 1], [5.0, 4.98, 1.0]),     # gaps .01 + .02
                                            ("decode", 5, 8, [1, 2, 3], [6.0, 1.0, 0.0])])])   # other input
    result = compare(load_dump(a), load_dump(b))
    assert result["delta"] == pytest.approx(0.02) and result["delta_rows"] == 1
    s = result["sessions"][0]
    assert s["verdicts"] == {"argmax_agree": 1, "near_tie": 1, "mismatch": 0}
    assert s["prefill"]["verdict"] == "argmax_agree" and s["first_difference"]["position"] == 4
    assert s["inputs_diverge_at"] == 5  # token 2 vs 8 at position 5: the sides condition on different text
    strict = compare(load_dump(a), load_dump(b), tolerance=0.0)
    assert strict["verdicts"]["near_tie"] == 1
    c = _dump(tmp_path / "c.jsonl", [("q", [("prefill", 3, 9, [4, 5, 6], [9.0, 7.0, 1.0])])])
    other = compare(load_dump(a), load_dump(c))
    assert other["sessions"][0]["rows"] == 0 and "different prompts" in other["notes"][0]


def test_parity_cli_exit_codes(tmp_path, capsys):
    a = _dump(tmp_path / "a.jsonl", [("p", [("prefill", 3, 9, [4, 5, 6], [9.0, 7.0, 1.0])])])
    b = _dump(tmp_path / "b.jsonl", [("p", [("prefill", 3, 9, [5, 4, 6], [9.0, 2.0, 1.0])])])
    assert main(["parity", a, a]) == 0
    assert "1 argmax_agree, 0 near_tie, 0 mismatch" in capsys.readouterr().out
    assert main(["parity", a, b, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["verdicts"]["mismatch"] == 1 and out["sessions"][0]["prefill"]["verdict"] == "mismatch"
    assert main(["parity", a, b, "--tolerance", "5"]) == 0  # gaps 2 + 7 <= 2·5: a stated drift of 5 explains it
    assert "near_tie" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"format": "dspark-topk"}\n{"session": 0}\n')
    assert main(["parity", a, str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"dspark parity: error: {bad}:2: missing field 'op'"


# ---------------------------------------------------------------------------- real dumps
@pytest.mark.parametrize("value, message", [("abc", "DSPARK_TOPK_DIAG='abc'"), ("5000", "DSPARK_TOPK_DIAG='5000'"),
                                            ("-3", "DSPARK_TOPK_DIAG='-3'")])
def test_bad_topk_setting_names_the_variable(value, message):
    with pytest.raises(ValueError, match=message):
        topk_diag_settings({"DSPARK_TOPK_DIAG": value})


def test_topk_setting_off_and_missing_directory(tmp_path):
    assert topk_diag_settings({}) is None and topk_diag_settings({"DSPARK_TOPK_DIAG": "0"}) is None
    assert maybe_wrap("model", None) == "model"
    with pytest.raises(ValueError, match="DSPARK_TOPK_DIAG_DIR="):
        topk_diag_settings({"DSPARK_TOPK_DIAG": "4", "DSPARK_TOPK_DIAG_DIR": str(tmp_path / "nope")})


async def _generate(engine, spec: str, verify_mode: str, prompt: str, max_tokens: int) -> list[int]:
    cfg = engine.cfg
    oracle = drafter_engine(tiny_trunk(), oracle=True, settings=BackendSettings(), corrupt_every=3)
    limits = ModelLimits(cfg.vocab_size, cfg.max_seq_len, cfg.eos_token_id, cfg.dspark_block_size, True)
    sched = Scheduler(limits, tiny_tokenizer(), GateConfig(), verify_mode, "configured")
    p = sched.params(prompt, [], max_tokens, spec, ignore_eos=True)
    verifier, drafter = LocalVerifierSession(loop_of(engine)), LocalDrafterSession(oracle)
    tokens = []
    try:
        async for ev in sched.generate(p, verifier, drafter if spec != "off" else None):
            if not isinstance(ev, FinalEvent):
                tokens += ev.token_ids
    finally:
        await verifier.close()
        await drafter.close()
    return tokens


def test_sequential_and_batched_verify_dumps_agree_under_parity(tmp_path):
    topk = topk_diag_settings({"DSPARK_TOPK_DIAG": "8", "DSPARK_TOPK_DIAG_DIR": str(tmp_path)})
    engines = {mode: verifier_engine(maybe_wrap(tiny_trunk(), topk), BackendSettings())
               for mode in ("sequential", "batched")}
    assert all(isinstance(e.model, TopKDiagTrunk) for e in engines.values())
    tokens = {mode: asyncio.run(_generate(e, "always", mode, "def fibonacci(n):", 24)) for mode, e in engines.items()}
    a, b = (str(engines[m].model.path) for m in ("sequential", "batched"))
    assert a != b and "topk-rank0-pid" in a
    dump_b = load_dump(b)
    ops = {r.op for r in dump_b.sessions[0].rows.values()}
    assert ops == {"prefill", "block"} and dump_b.header["k"] == 8
    assert {r.op for r in load_dump(a).sessions[0].rows.values()} == {"prefill", "decode"}
    result = compare(load_dump(a), dump_b)
    s = result["sessions"][0]
    assert s["prefill"]["verdict"] == "argmax_agree"
    assert result["verdicts"]["mismatch"] == 0
    if tokens["sequential"] == tokens["batched"]:
        assert s["inputs_diverge_at"] is None and s["rows"] >= 24
    # every committed position of the generation was forwarded on both sides: prompt's last + 23 steps
    assert s["rows"] >= min(len(tokens["sequential"]), len(tokens["batched"]))


def _steps(model) -> None:
    """Prefill, five decodes and a batched verify block on a fresh engine session."""
    engine = StepVerifier(VerifierEngine(model))
    sid = engine.open_session()
    r = engine.prefill(sid, list(range(2, 20)))
    token, pos = r.next_token, 18
    for _ in range(5):
        r = engine.decode(sid, token, pos)
        token, pos = r.next_token, pos + 1
    engine.verify(sid, token, [5, 6, 7], pos, "batched")
    engine.close_session(sid)


def test_every_tp_rank_writes_its_dump_and_tp2_agrees_with_tp1(tmp_path):
    topk = topk_diag_settings({"DSPARK_TOPK_DIAG": "4", "DSPARK_TOPK_DIAG_DIR": str(tmp_path)})  # every rank gets it
    cfg = random_tiny_config()
    weights = random_weights(cfg, "trunk", TINY_SEED)
    tp1 = maybe_wrap(start_tp_trunk(cfg, weights, 1), topk)
    _steps(tp1)
    tp2 = start_tp_trunk(cfg, weights, 2, topk=topk)
    try:
        _steps(tp2)
        rank0 = tp2.model.path
    finally:
        tp2.close()
    rank1 = [p for p in tmp_path.iterdir() if p.name.startswith("topk-rank1-")]
    assert len(rank1) == 1 and "topk-rank0-" in rank0.name
    assert load_dump(rank1[0]).header["rank"] == 1
    ranks = compare(load_dump(rank0), load_dump(rank1[0]))
    assert ranks["verdicts"] == {"argmax_agree": 10, "near_tie": 0, "mismatch": 0}  # 1 prefill + 5 + 4 block rows
    tp = compare(load_dump(tp1.path), load_dump(rank0))
    assert tp["verdicts"]["mismatch"] == 0 and tp["sessions"][0]["rows"] == 10
