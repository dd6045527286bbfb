"""The shared backend plumbing: the session table, the declared drafter interface, and the
verifier engine as the one boundary that validates requests and keeps committed rows.

The servicers' session loop (`services.common.session_stream`) runs under every service
test; tests/test_services_errors.py checks that cancelled and failed streams free their
sessions on both backends.
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch

from dsv4.config import tiny_config
from dsv4.dspark import DSparkDraft
from dsv4.init import random_weights
from dsv4.trunk import EXACT_ROWS, Trunk
from reference_dspark import conformance_weights
from services.common.sessions import SessionLimitError, SessionTable, UnknownSessionError
from services.drafter.engine import DrafterEngine
from services.drafter.interface import Drafter, feed_tokens
from services.drafter.live_oracle import LiveOracleDrafter
from services.drafter.oracle import OracleDrafter, OracleScript
from services.verifier.engine import VerifierEngine
from verifier_fixtures import StepVerifier

CFG = tiny_config()
PROMPT = torch.randint(0, CFG.vocab_size, (12,), generator=torch.Generator().manual_seed(5)).tolist()


@functools.lru_cache(maxsize=None)
def trunk(verify_numerics: str = "fast") -> Trunk:
    t = Trunk(CFG, verify_numerics=verify_numerics)
    t.load_weights(random_weights(CFG, "trunk", seed=3))
    return t


@functools.lru_cache(maxsize=None)
def dspark() -> DSparkDraft:
    m = DSparkDraft(CFG, confidence_head=True)
    m.load_weights(conformance_weights(CFG, 0, confidence_head=True))
    return m


# ---------------------------------------------------------------------------- session table
def test_table_opens_gets_and_closes_by_id():
    table: SessionTable[str] = SessionTable(2)
    a, b = table.open("a"), table.open("b")
    assert (a, b, table.get(a), table.get(b), len(table)) == (1, 2, "a", "b", 2)
    with pytest.raises(SessionLimitError, match="session limit reached: 2 sessions open"):
        table.open("c")
    table.close(a)
    table.close(a)  # closing twice is a no-op
    with pytest.raises(UnknownSessionError, match="session 1 is not open"):
        table.get(a)
    with pytest.raises(UnknownSessionError, match="session 1 is not open"):
        with table.locked(a):
            pass
    assert table.open("c") == 3  # ids are never reused
    with table.locked(b) as session:
        assert session == "b"


def test_table_concurrent_opens_get_distinct_ids_up_to_the_limit():
    table: SessionTable[int] = SessionTable(300)
    ids: list[int] = []
    refused = []
    lock = threading.Lock()

    def worker(t: int) -> None:
        for i in range(50):
            try:
                sid = table.open(t * 100 + i)
            except SessionLimitError:
                with lock:
                    refused.append(t)
                continue
            with lock:
                ids.append(sid)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(ids) == 300 and len(set(ids)) == 300 and len(refused) == 100 and len(table) == 300


# ---------------------------------------------------------------------------- drafter interface
def test_every_drafter_declares_the_interface_and_whether_it_observes_tokens():
    script = OracleScript(tuple(PROMPT))
    engines = {"dspark": DrafterEngine(dspark()), "oracle": OracleDrafter(CFG, script),
               "live": LiveOracleDrafter(trunk())}
    assert all(isinstance(e, Drafter) for e in engines.values())
    assert {k: e.observes_tokens for k, e in engines.items()} == {"dspark": False, "oracle": False, "live": True}
    sid = engines["dspark"].open_session()
    with pytest.raises(NotImplementedError, match="DrafterEngine does not observe tokens"):
        engines["dspark"].observe_tokens(sid, 0, PROMPT)


def test_feed_tokens_reaches_only_a_drafter_that_observes_them():
    live, oracle = LiveOracleDrafter(trunk()), OracleDrafter(CFG, OracleScript(tuple(PROMPT)))
    a, b = live.open_session(), oracle.open_session()
    feed_tokens(live, a, 0, PROMPT)
    feed_tokens(live, a, len(PROMPT), [])  # nothing to feed: no call, no error
    feed_tokens(oracle, b, 0, PROMPT)  # the scripted oracle ignores tokens
    assert live.observed_tokens(a) == PROMPT
    with pytest.raises(ValueError, match="token_first_position=3 does not continue the 12"):
        feed_tokens(live, a, 3, [1])


# ---------------------------------------------------------------------------- verifier boundary
def test_verifier_keeps_the_committed_tail_of_every_step():
    engine = StepVerifier(VerifierEngine(trunk()))
    sid = engine.open_session()
    with pytest.raises(ValueError, match="no committed positions yet: prefill first"):
        engine.committed_tail(sid, 0)
    pre = engine.prefill(sid, PROMPT)
    step = engine.decode(sid, pre.next_token, len(PROMPT))
    ver = engine.verify(sid, step.next_token, [1, 2, 3], len(PROMPT) + 1, "batched")
    rows = torch.cat([pre.rows, step.rows, ver.rows]).to(torch.bfloat16)[-CFG.window_size:]
    tail = engine.committed_tail(sid, 0)
    assert tail.rows.dtype == torch.bfloat16 and torch.equal(tail.rows, rows)
    assert (tail.first_position, tail.next_position) == (ver.positions.stop - CFG.window_size, ver.positions.stop)
    assert (tail.next_token, tail.margin) == (ver.bonus_token, ver.margin)
    two = engine.committed_tail(sid, 2)
    assert torch.equal(two.rows, rows[-2:]) and two.first_position == ver.positions.stop - 2
    with pytest.raises(ValueError, match="rows count=-1: must be >= 0"):
        engine.committed_tail(sid, -1)
    engine.close_session(sid)
    with pytest.raises(UnknownSessionError):
        engine.committed_tail(sid, 0)


@pytest.mark.parametrize("call, why", [
    (lambda e, s, n: e.decode(s, CFG.vocab_size, n), f"token id {CFG.vocab_size} at index 0 outside"),
    (lambda e, s, n: e.decode(s, -1, n), "token id -1 at index 0 outside"),
    (lambda e, s, n: e.verify(s, 1, [2, CFG.vocab_size], n, "batched"), f"token id {CFG.vocab_size} at index 2"),
])
def test_verifier_rejects_out_of_range_ids_before_the_trunk_runs(call, why):
    engine = StepVerifier(VerifierEngine(trunk()))
    sid = engine.open_session()
    engine.prefill(sid, PROMPT)
    with pytest.raises(ValueError, match=why):
        call(engine, sid, len(PROMPT))
    assert engine.next_position(sid) == len(PROMPT)
    assert engine.committed_tail(sid, 0).next_position == len(PROMPT)


def test_verifier_rejects_a_prompt_longer_than_max_seq_len():
    engine = StepVerifier(VerifierEngine(trunk()))
    sid = engine.open_session()
    n = CFG.max_seq_len + 1
    with pytest.raises(ValueError, match=f"prompt length {n} exceeds max_seq_len={CFG.max_seq_len}"):
        engine.prefill(sid, [1] * n)
    assert engine.next_position(sid) == 0


def test_exact_numerics_limit_batched_blocks_at_the_engine():
    engine = StepVerifier(VerifierEngine(trunk("exact")))
    sid = engine.open_session()
    engine.prefill(sid, PROMPT)
    drafts = [1] * EXACT_ROWS  # anchor + EXACT_ROWS drafts: one token more than the exact tile
    with pytest.raises(ValueError, match=f"verify block of {EXACT_ROWS + 1} tokens: exact mode verifies at most "
                                         f"{EXACT_ROWS} .* in one batched forward"):
        engine.verify(sid, 1, drafts, len(PROMPT), "batched")
    assert engine.next_position(sid) == len(PROMPT)
    res = engine.verify(sid, 1, drafts, len(PROMPT), "sequential")  # one position at a time: no tile
    assert res.positions.start == len(PROMPT) and 0 <= res.accepted <= EXACT_ROWS
