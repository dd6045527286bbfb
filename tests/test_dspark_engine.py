"""Drafter engine and oracle drafter: sessions, commit/draft contract, identity."""

from __future__ import annotations

import functools

import pytest
import torch

from dsv4.config import tiny_config
from dsv4.dspark import DSparkDraft
from reference_dspark import conformance_weights, synthetic_rows
from services.drafter.engine import DrafterEngine, SessionLimitError, UnknownSessionError
from services.drafter.oracle import OracleDrafter, OracleScript

CFG = tiny_config()
B = CFG.dspark_block_size
ROWS = synthetic_rows(CFG, 30, seed=4)


@functools.lru_cache(maxsize=None)
def module(confidence_head: bool = True) -> DSparkDraft:
    m = DSparkDraft(CFG, confidence_head=confidence_head)
    m.load_weights(conformance_weights(CFG, 0, confidence_head=confidence_head))
    return m


def primed_engine(n: int = 12, **kw) -> tuple[DrafterEngine, int]:
    engine = DrafterEngine(module(**kw))
    sid = engine.open_session()
    engine.commit(sid, ROWS[:n], range(n))
    return engine, sid


# ------------------------------------------------------------------ DSpark engine
def test_session_limit_and_close():
    engine = DrafterEngine(module(), max_sessions=2)
    a, b = engine.open_session(), engine.open_session()
    with pytest.raises(SessionLimitError, match="2 sessions"):
        engine.open_session()
    assert issubclass(SessionLimitError, RuntimeError)
    engine.close_session(a)
    engine.close_session(a)  # no-op
    c = engine.open_session()
    assert engine.num_sessions == 2 and c not in (a, b)
    with pytest.raises(UnknownSessionError):
        engine.commit(a, ROWS[:1], [0])
    with pytest.raises(ValueError, match="max_sessions=0"):
        DrafterEngine(module(), max_sessions=0)


def test_draft_returns_block_tokens_and_confidence_logits():
    engine, sid = primed_engine()
    tokens, conf = engine.draft(sid, 3, 11)
    assert len(tokens) == B and all(isinstance(t, int) and 0 <= t < CFG.vocab_size for t in tokens)
    assert conf.shape == (B,) and conf.dtype == torch.float32
    direct = module().draft(engine.session_state(sid), 3, 11)
    assert tokens == direct.tokens and torch.equal(conf, direct.confidence)
    assert engine.session_bytes(sid) == CFG.n_mtp_layers * CFG.window_size * CFG.head_dim * 4


def test_draft_without_confidence_head_returns_none():
    engine, sid = primed_engine(confidence_head=False)
    tokens, conf = engine.draft(sid, 3, 11)
    assert conf is None and len(tokens) == B
    assert engine.identity()["confidence_head"] is False


def test_draft_rejects_a_seed_other_than_the_last_committed_position():
    engine, sid = primed_engine(12)
    with pytest.raises(ValueError, match="seed_position=12 is not the last committed position 11"):
        engine.draft(sid, 3, 12)  # the seed's off-by-one: the anchor's own position
    engine.commit(sid, ROWS[12:14], range(12, 14))
    assert engine.last_position(sid) == 13
    assert len(engine.draft(sid, 3, 13)[0]) == B


def test_one_token_prompt_drafts_from_seed_zero():
    engine, sid = primed_engine(1)
    tokens, conf = engine.draft(sid, 3, 0)
    assert len(tokens) == B and torch.isfinite(conf).all()


def test_sessions_are_independent():
    engine, a = primed_engine(12)
    b = engine.open_session()
    engine.commit(b, ROWS[12:24], range(12))  # other rows at the same positions
    before = engine.draft(a, 3, 11)
    assert engine.draft(b, 3, 11)[0] != before[0]
    engine.close_session(b)
    assert engine.draft(a, 3, 11)[0] == before[0]


def test_identity_names_what_the_gateway_must_match():
    ident = primed_engine()[0].identity()
    assert ident == {
        "kind": "dspark", "config_hash": CFG.config_hash(), "vocab_size": 512, "block_size": 5,
        "window_size": 8, "target_layer_ids": [1, 2, 3], "row_width": 768, "dim": 256, "max_seq_len": 64,
        "noise_token_id": 511, "confidence_head": True, "tp": 1,
    }
    other = tiny_config(window_size=16)
    assert DrafterEngine(DSparkDraft(other, device="meta")).identity()["config_hash"] != ident["config_hash"]


def test_draft_before_weights_load_is_an_error():
    engine = DrafterEngine(DSparkDraft(CFG))
    sid = engine.open_session()
    with pytest.raises(RuntimeError, match="not loaded"):
        engine.commit(sid, ROWS[:1], [0])


# ------------------------------------------------------------------ oracle
SCRIPT = OracleScript(tokens=tuple(range(100, 130)), corrupt=frozenset({15, 17}),
                      confidence={14: -2.0, 15: -3.5}, default_confidence=2.5)


def test_oracle_proposes_the_script_corrupted_where_scripted():
    oracle = OracleDrafter(CFG, SCRIPT)
    sid = oracle.open_session()
    oracle.commit(sid, ROWS[:12], range(12))
    tokens, conf = oracle.draft(sid, SCRIPT.tokens[12], 11)  # positions 13..17
    assert tokens == [113, 114, 116, 116, 118]
    assert conf.tolist() == [2.5, -2.0, -3.5, 2.5, 2.5]
    assert oracle.identity()["kind"] == "oracle" and oracle.identity()["confidence_head"] is True


def test_oracle_checks_positions_and_anchor_like_the_engine():
    oracle = OracleDrafter(CFG, SCRIPT, max_sessions=1)
    sid = oracle.open_session()
    with pytest.raises(SessionLimitError):
        oracle.open_session()
    with pytest.raises(ValueError, match="nothing committed"):
        oracle.draft(sid, 112, 11)
    oracle.commit(sid, ROWS[:12], range(12))
    with pytest.raises(ValueError, match="seed_position=12 is not the last committed position 11"):
        oracle.draft(sid, 112, 12)
    with pytest.raises(ValueError, match="anchor=5 at position 12 is not the script's token 112"):
        oracle.draft(sid, 5, 11)
    with pytest.raises(ValueError, match="gap"):
        oracle.commit(sid, ROWS[:1], [13])


def test_oracle_past_the_script_proposes_filler():
    oracle = OracleDrafter(CFG, OracleScript(tokens=(1, 2, 3, 4), filler_token=9))
    sid = oracle.open_session()
    oracle.commit(sid, ROWS[:2], range(2))
    assert oracle.draft(sid, 3, 1)[0] == [4, 9, 9, 9, 9]
    with pytest.raises(ValueError, match="script token 512"):
        OracleDrafter(CFG, OracleScript(tokens=(1, 512)))


# ------------------------------------------------------------------ loading from a checkpoint
@pytest.mark.parametrize("conf", [True, False])
def test_engine_from_checkpoint_reports_the_confidence_head(tmp_path, conf):
    from dsv4.checkpoint import load_drafter_weights, save_checkpoint
    from dsv4.dspark import load_draft_module
    from dsv4.init import random_weights

    save_checkpoint(tmp_path, CFG, random_weights(CFG, "all", seed=1, confidence_head=conf))
    m = load_draft_module(tmp_path)
    _, logical, has_conf = load_drafter_weights(tmp_path)
    assert has_conf is conf and m.has_confidence_head is conf
    assert all(torch.equal(t, logical[n]) for n, t in m.state_dict().items())
    engine = DrafterEngine(m)
    assert engine.identity()["confidence_head"] is conf
    sid = engine.open_session()
    engine.commit(sid, ROWS[:3], range(3))
    tokens, confidence = engine.draft(sid, 3, 2)
    assert len(tokens) == B and (confidence is None) is (not conf)
