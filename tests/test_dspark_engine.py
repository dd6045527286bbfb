"""Drafter engine and oracle drafter: sessions, commit/draft contract, identity, and atomic
weight loading (a rejected `load_weights` leaves the module as it was)."""

from __future__ import annotations

import functools
import gc
import re
import weakref

import numpy as np
import pytest
import torch

from dsv4.config import tiny_config
from dsv4.dspark import DSparkDraft
from reference_dspark import conformance_weights, synthetic_rows
from services.drafter.engine import DrafterEngine, SessionLimitError, SessionTable, UnknownSessionError
from services.drafter.oracle import OracleDrafter, OracleScript

CFG = tiny_config()
B, W, L = CFG.dspark_block_size, CFG.window_size, CFG.max_seq_len
ROWS = synthetic_rows(CFG, L, seed=4)
BAD_COUNTS = [0, -1, float("nan"), float("inf"), 2.5, 3.0, "3", None, True]


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


@pytest.mark.parametrize("bad", BAD_COUNTS)
def test_max_sessions_must_be_an_integer_of_at_least_one(bad):
    with pytest.raises(ValueError, match=re.escape(f"max_sessions={bad!r}: must be an integer >= 1")):
        DrafterEngine(module(), max_sessions=bad)
    with pytest.raises(ValueError, match="max_sessions="):
        SessionTable(bad)
    with pytest.raises(ValueError, match="max_sessions="):
        OracleDrafter(CFG, SCRIPT, max_sessions=bad)


def test_max_sessions_accepts_a_numpy_integer():
    engine = DrafterEngine(module(), max_sessions=np.int64(2))
    assert engine.max_sessions == 2 and type(engine.max_sessions) is int


def test_closing_a_session_frees_its_state():
    engine, sid = primed_engine()
    state = weakref.ref(engine.session_state(sid))
    other = engine.open_session()
    engine.close_session(sid)
    gc.collect()
    assert state() is None
    assert engine.num_sessions == 1
    with pytest.raises(UnknownSessionError, match=f"session {sid} is not open"):
        engine.draft(sid, 3, 11)
    engine.commit(other, ROWS[:1], [0])  # the other session still works
    assert engine.last_position(other) == 0


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
        engine.draft(sid, 3, 12)  # off by one (docs/model.md §9.2): the anchor's own position
    engine.commit(sid, ROWS[12:14], range(12, 14))
    assert engine.last_position(sid) == 13
    assert len(engine.draft(sid, 3, 13)[0]) == B


def test_one_token_prompt_drafts_from_seed_zero():
    engine, sid = primed_engine(1)
    tokens, conf = engine.draft(sid, 3, 0)
    assert len(tokens) == B and torch.isfinite(conf).all()


@pytest.mark.parametrize("anchor, seed, match", [
    (3.9, 11, r"anchor=3.9 \(float\)"),
    (True, 11, r"anchor=True \(bool\)"),
    ("3", 11, r"anchor='3' \(str\)"),
    (-1, 11, r"anchor=-1 outside \[0, vocab_size=512\)"),
    (3, 11.5, r"seed_position=11.5 \(float\)"),
    (3, 11.0, r"seed_position=11.0 \(float\)"),
    (3, "11", r"seed_position='11' \(str\)"),
    (3, True, r"seed_position=True \(bool\)"),
])
def test_draft_arguments_must_be_integers(anchor, seed, match):
    engine, sid = primed_engine()
    before = engine.draft(sid, 3, 11)
    with pytest.raises(ValueError, match=match):
        engine.draft(sid, anchor, seed)
    after = engine.draft(sid, np.int64(3), torch.tensor(11))
    assert after[0] == before[0] and torch.equal(after[1], before[1])


def test_draft_near_max_seq_len_returns_only_positions_before_it():
    engine = DrafterEngine(module())
    sid = engine.open_session()
    engine.commit(sid, ROWS[L - 2 - W:L - 2], range(L - 2 - W, L - 2))  # through 61
    tokens, conf = engine.draft(sid, 3, L - 3)
    full = module().draft_from_rings(engine.session_state(sid).rings, 3, L - 3)
    assert tokens == full.tokens[:1] and torch.equal(conf, full.confidence[:1])  # position 63 only
    engine.commit(sid, ROWS[L - 2:L], [L - 2, L - 1])
    with pytest.raises(ValueError, match="seed_position=63: no room for the anchor at 64"):
        engine.draft(sid, 3, L - 1)


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
    with pytest.raises(RuntimeError, match="not loaded"):
        engine.draft(sid, 3, 0)
    assert engine.last_position(sid) == -1


# ------------------------------------------------------------------ weights
def weights_with(**changes) -> dict:
    w = conformance_weights(CFG, 0)
    w.update(changes)
    return w


def loaded_module(seed: int = 1) -> DSparkDraft:
    m = DSparkDraft(CFG)
    m.load_weights(conformance_weights(CFG, seed))
    return m


NAME = "mtp.1.attn.wkv.weight"
SHAPE = tuple(conformance_weights(CFG, 0)[NAME].shape)
BAD_WEIGHTS = {
    "nan": ({NAME: torch.full(SHAPE, float("nan"))}, f"{NAME}: contains NaN or Inf"),
    "inf": ({"head.weight": conformance_weights(CFG, 0)["head.weight"].clone().index_fill_(0, torch.tensor([3]),
                                                                                          float("inf"))},
            "head.weight: contains NaN or Inf"),
    "numpy": ({NAME: np.zeros(SHAPE, dtype=np.float32)}, f"{NAME}: ndarray is not a torch tensor"),
    "list": ({NAME: torch.zeros(SHAPE).tolist()}, f"{NAME}: list is not a torch tensor"),
    "int64": ({NAME: torch.zeros(SHAPE, dtype=torch.int64)}, f"{NAME}: dtype torch.int64 is not floating point"),
}


@pytest.mark.parametrize("name", BAD_WEIGHTS)
def test_failed_load_weights_leaves_a_loaded_module_unchanged(name):
    changes, match = BAD_WEIGHTS[name]
    m = loaded_module(1)
    before = {n: t.clone() for n, t in m.state_dict().items()}
    state = m.new_state()
    m.write_main_kv(state, ROWS[:12], range(12))
    draft = m.draft(state, 3, 11)
    with pytest.raises(ValueError, match=match):
        m.load_weights(weights_with(**changes))
    assert all(torch.equal(t, before[n]) for n, t in m.state_dict().items())
    again = m.draft(state, 3, 11)
    assert again.tokens == draft.tokens and torch.equal(again.logits, draft.logits)


def test_failed_load_weights_leaves_a_new_module_unloaded():
    m = DSparkDraft(CFG)
    with pytest.raises(ValueError, match=f"{NAME}: ndarray is not a torch tensor"):
        m.load_weights(weights_with(**{NAME: np.zeros(SHAPE, dtype=np.float32)}))
    with pytest.raises(RuntimeError, match="not loaded"):
        m.write_main_kv(m.new_state(), ROWS[:1], [0])
    with pytest.raises(ValueError, match="mtp.0.main_norm.weight: contains NaN"):
        m.load_weights(weights_with(**{"mtp.0.main_norm.weight": torch.full((CFG.dim,), float("nan"))}))
    with pytest.raises(RuntimeError, match="not loaded"):
        m.draft(m.new_state(), 3, 0)
    m.load_weights(conformance_weights(CFG, 0))  # a good load still works afterwards
    assert all(torch.equal(t, module().state_dict()[n]) for n, t in m.state_dict().items())


def test_load_weights_names_every_bad_tensor():
    with pytest.raises(ValueError) as err:
        DSparkDraft(CFG).load_weights(weights_with(**{NAME: torch.full(SHAPE, float("nan")),
                                                      "head.weight": torch.zeros(CFG.vocab_size, CFG.dim).long(),
                                                      "embed.weight": np.zeros((CFG.vocab_size, CFG.dim))}))
    message = str(err.value)
    for problem in (f"{NAME}: contains NaN or Inf", "head.weight: dtype torch.int64 is not floating point",
                    "embed.weight: ndarray is not a torch tensor"):
        assert problem in message


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


def test_oracle_anchor_past_the_script_end_is_an_error():
    oracle = OracleDrafter(CFG, OracleScript(tokens=(1, 2, 3, 4)))
    sid = oracle.open_session()
    oracle.commit(sid, ROWS[:4], range(4))
    with pytest.raises(ValueError, match=r"anchor position 4 is past the script's end \(4 tokens\)"):
        oracle.draft(sid, 7, 3)
    for anchor, match in ((2.0, r"anchor=2.0 \(float\)"), (True, "anchor=True"), (512, "anchor=512 outside")):
        with pytest.raises(ValueError, match=match):
            oracle.draft(sid, anchor, 1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(tokens=(1, 2.5)), r"tokens\[1\]=2.5 \(float\)"),
    (dict(tokens=(1, True)), r"tokens\[1\]=True \(bool\)"),
    (dict(tokens=(1, -2)), "tokens value -2: must be >= 0"),
    (dict(tokens=()), "tokens is empty"),
    (dict(tokens="12"), "tokens='12'"),
    (dict(tokens=(1, 2), default_confidence=float("nan")), "default_confidence=nan: must be a finite real"),
    (dict(tokens=(1, 2), default_confidence=True), "default_confidence=True"),
    (dict(tokens=(1, 2), confidence={3: float("inf")}), "confidence=inf"),
    (dict(tokens=(1, 2), confidence={3.5: 1.0}), r"confidence position=3.5"),
    (dict(tokens=(1, 2), corrupt=frozenset({1.5})), r"corrupt\[0\]=1.5"),
    (dict(tokens=(1, 2), filler_token=-1), "filler_token value -1"),
])
def test_oracle_script_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OracleScript(**kwargs)


def test_oracle_script_stores_plain_ints():
    script = OracleScript(tokens=[np.int64(3), torch.tensor(4)], corrupt={5}, confidence={np.int32(6): 1})
    assert script.tokens == (3, 4) and type(script.tokens[1]) is int
    assert script.corrupt == frozenset({5}) and script.confidence == {6: 1.0}


def test_oracle_near_max_seq_len_proposes_only_positions_before_it():
    oracle = OracleDrafter(CFG, OracleScript(tokens=tuple(range(100, 100 + L)), default_confidence=1.5))
    sid = oracle.open_session()
    oracle.commit(sid, ROWS[L - 3 - W:L - 3], range(L - 3 - W, L - 3))  # through 60
    tokens, conf = oracle.draft(sid, 100 + L - 3, L - 4)
    assert tokens == [100 + L - 2, 100 + L - 1] and conf.tolist() == [1.5, 1.5]  # positions 62, 63
    oracle.commit(sid, ROWS[L - 3:L - 1], [L - 3, L - 2])
    tokens, conf = oracle.draft(sid, 100 + L - 1, L - 2)  # the anchor is the last position
    assert tokens == [] and conf.shape == (0,)
    oracle.commit(sid, ROWS[L - 1:L], [L - 1])
    with pytest.raises(ValueError, match="seed_position=63: no room"):
        oracle.draft(sid, 0, L - 1)


def test_oracle_commit_checks_rows_and_positions_like_the_engine():
    oracle = OracleDrafter(CFG, SCRIPT)
    sid = oracle.open_session()
    oracle.commit(sid, ROWS[:12], range(12))
    for rows, positions, match in ((ROWS[12:13], [12.5], r"positions\[0\]=12.5"),
                                   (ROWS[12:13].double(), [12], "rows dtype torch.float64"),
                                   (torch.full((1, CFG.tap_width), float("inf")), [12], "NaN or Inf"),
                                   (ROWS[12:13], None, "positions=None")):
        with pytest.raises(ValueError, match=match):
            oracle.commit(sid, rows, positions)
    assert oracle.last_position(sid) == 11


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


def test_checkpoint_with_a_nan_drafter_tensor_is_rejected_naming_it(tmp_path):
    from dsv4.checkpoint import save_checkpoint
    from dsv4.dspark import load_draft_module
    from dsv4.init import random_weights

    weights = random_weights(CFG, "all", seed=1)
    weights["mtp.2.markov_head.markov_w2.weight"][4, 1] = float("nan")
    save_checkpoint(tmp_path, CFG, weights)
    # The checkpoint reader (a CheckpointError, a ValueError) or load_weights rejects it, by name.
    with pytest.raises(ValueError, match=r"(?i)mtp\.2\.markov_head\.markov_w2\.weight.*nan"):
        load_draft_module(tmp_path)


def test_load_draft_module_checks_the_dtype_before_reading(tmp_path):
    from dsv4.dspark import load_draft_module

    with pytest.raises(ValueError, match="dtype=torch.float16: must be torch.float32 or torch.bfloat16"):
        load_draft_module(tmp_path / "does-not-exist", dtype=torch.float16)  # no file is opened
