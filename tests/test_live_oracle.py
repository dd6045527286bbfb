"""The live oracle drafter (`services.drafter.live_oracle`): the trunk's own greedy continuation.

Greedy proposals equal the trunk's plain greedy decode token for token (uncorrupted), the
corruption schedule replaces exactly the scheduled slots, near max_seq_len only positions
before it are proposed, and every bad argument raises a ValueError naming the value and
leaves the session usable (its next draft is still the greedy continuation). Tiny config,
random trunk weights.
"""

from __future__ import annotations

import functools
import math
import re

import numpy as np
import pytest
import torch

from dsv4.config import tiny_config
from dsv4.init import random_weights
from dsv4.trunk import Trunk
from reference_dspark import synthetic_rows
from services.drafter.live_oracle import LiveOracleDrafter

CFG = tiny_config()
W, B, L, V = CFG.window_size, CFG.dspark_block_size, CFG.max_seq_len, CFG.vocab_size
PROMPT = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(7)).tolist()
ROWS = synthetic_rows(CFG, L, seed=9)  # the oracle checks rows but does not use them


@functools.lru_cache(maxsize=None)
def trunk() -> Trunk:
    t = Trunk(CFG)
    t.load_weights(random_weights(CFG, "trunk", seed=2))
    return t


@functools.lru_cache(maxsize=None)
def greedy(prompt: tuple[int, ...] = tuple(PROMPT), total: int = L) -> list[int]:
    """prompt + plain greedy decode up to `total` tokens (positions 0..total-1)."""
    state = trunk().new_state()
    tokens = [*prompt, int(trunk().prefill(state, torch.tensor(prompt), taps=False).logits.argmax())]
    while len(tokens) < total:
        tokens.append(int(trunk().decode(state, tokens[-1], len(tokens) - 1, taps=False).logits.argmax()))
    return tokens


def primed(oracle: LiveOracleDrafter, prompt: list[int] = PROMPT) -> int:
    """A session that saw `prompt` and committed its last min(n, W) rows (the gateway's prefill)."""
    sid = oracle.open_session()
    n = len(prompt)
    oracle.observe_tokens(sid, 0, prompt)
    oracle.commit(sid, ROWS[max(0, n - W):n], range(max(0, n - W), n))
    return sid


def advance(oracle: LiveOracleDrafter, sid: int, tokens: list[int], first: int) -> None:
    """Commit tokens of positions first.. (a verify round's anchor + accepted drafts)."""
    oracle.observe_tokens(sid, first, tokens)
    oracle.commit(sid, ROWS[first:first + len(tokens)], range(first, first + len(tokens)))


# ------------------------------------------------------------------ proposals
def test_greedy_proposals_equal_the_trunks_own_greedy_continuation():
    oracle, g, n = LiveOracleDrafter(trunk()), greedy(), len(PROMPT)
    sid = primed(oracle)
    tokens, conf = oracle.draft(sid, g[n], n - 1)
    assert tokens == g[n + 1:n + 1 + B]
    assert conf.dtype == torch.float32 and conf.tolist() == [6.5] * B
    advance(oracle, sid, g[n:n + 3], n)  # the anchor and two accepted drafts
    assert oracle.draft(sid, g[n + 3], n + 2)[0] == g[n + 4:n + 4 + B]
    assert len(set(g[n:])) > 10  # a continuation worth comparing (not one repeated token)


@pytest.mark.parametrize("every", [1, 2, 3])
def test_corruption_schedule_replaces_exactly_the_scheduled_slots(every):
    oracle, g, n = LiveOracleDrafter(trunk(), corrupt_every=every, confident=3.0, doubtful=-1.5), greedy(), len(PROMPT)
    sid = primed(oracle)
    tokens, conf = oracle.draft(sid, g[n], n - 1)
    seed = n - 1
    bad = [(seed + j) % every == every - 1 for j in range(B)]  # (p + j) % every == every - 1
    assert tokens == [(g[n + 1 + j] + 1) % V if b else g[n + 1 + j] for j, b in enumerate(bad)]
    assert conf.tolist() == [-1.5 if b else 3.0 for b in bad]
    assert any(bad) and (every == 1 or not all(bad))


def test_near_max_seq_len_only_positions_before_it_are_proposed():
    oracle, g = LiveOracleDrafter(trunk()), greedy()
    sid = primed(oracle, g[:L - 3])  # positions 0..60
    tokens, conf = oracle.draft(sid, g[L - 3], L - 4)
    assert tokens == g[L - 2:L] and conf.shape == (2,)  # positions 62, 63
    advance(oracle, sid, g[L - 3:L - 1], L - 3)
    tokens, conf = oracle.draft(sid, g[L - 1], L - 2)  # the anchor is the last position
    assert tokens == [] and conf.shape == (0,)
    advance(oracle, sid, g[L - 1:L], L - 1)
    with pytest.raises(ValueError, match="seed_position=63: no room for the anchor at 64"):
        oracle.draft(sid, 0, L - 1)


# ------------------------------------------------------------------ validation
def assert_still_greedy(oracle: LiveOracleDrafter, sid: int) -> None:
    """The session is unchanged: it knows the prompt only and drafts the greedy continuation."""
    n, g = len(PROMPT), greedy()
    assert oracle.observed_tokens(sid) == PROMPT and oracle.last_position(sid) == n - 1
    assert oracle.draft(sid, g[n], n - 1)[0] == g[n + 1:n + 1 + B]


BAD_COMMITS = {
    "row_width": (ROWS[12:13, :-1], [12], "row width 767 != tap width 768"),
    "rows_1d": (ROWS[12], [12], "2-D tensor"),
    "rows_fp64": (ROWS[12:13].double(), [12], "rows dtype torch.float64"),
    "nan": (torch.full((1, CFG.tap_width), float("nan")), [12], "NaN or Inf"),
    "float_position": (ROWS[12:13], [12.7], r"positions\[0\]=12.7 \(float\)"),
    "bool_position": (ROWS[12:13], [True], r"positions\[0\]=True"),
    "string_positions": (ROWS[9:10], "9", "positions='9'"),
    "count": (ROWS[12:14], [12], "2 rows but 1 positions"),
    "not_consecutive": (ROWS[12:14], [12, 14], "not consecutive"),
    "gap": (ROWS[13:14], [13], "start at 13 but the last committed position is 11"),
    "past_max_seq_len": (ROWS[12:14], [L - 1, L], "max_seq_len=64"),
}


@pytest.mark.parametrize("name", BAD_COMMITS)
def test_bad_commits_are_rejected_like_the_dspark_engine(name):
    rows, positions, match = BAD_COMMITS[name]
    oracle = LiveOracleDrafter(trunk())
    sid = primed(oracle)
    with pytest.raises(ValueError, match=match):
        oracle.commit(sid, rows, positions)
    assert_still_greedy(oracle, sid)


def test_first_commit_must_start_at_zero_or_fill_the_window():
    oracle = LiveOracleDrafter(trunk())
    sid = oracle.open_session()
    with pytest.raises(ValueError, match="first write starts at position 5 with 3 rows"):
        oracle.commit(sid, ROWS[5:8], range(5, 8))
    assert oracle.last_position(sid) == -1


@pytest.mark.parametrize("first, ids, match", [
    (12, [5, V, 6], rf"token id {V} at index 1 outside \[0, vocab_size={V}\)"),
    (12, [5, -1], "token id -1 at index 1"),
    (12, [5, 6.7], r"token_ids\[1\]=6.7 \(float\)"),
    (12, [True], r"token_ids\[0\]=True \(bool\)"),
    (12, "56", "token_ids='56'"),
    (12, [], "token_ids is empty"),
    (12, [5] * (L - 11), "tokens of positions 12..64 reach past max_seq_len=64"),
    (13, [5], "token_first_position=13 does not continue the 12 committed tokens seen"),
    (12.0, [5], r"token_first_position=12.0 \(float\)"),
    ("12", [5], "token_first_position='12'"),
], ids=["id_vocab", "id_negative", "id_float", "id_bool", "string", "empty", "past_max_seq_len", "not_continuing",
        "first_float", "first_string"])
def test_failed_observe_tokens_leaves_the_session_unchanged(first, ids, match):
    oracle = LiveOracleDrafter(trunk())
    sid = primed(oracle)
    with pytest.raises(ValueError, match=match):
        oracle.observe_tokens(sid, first, ids)
    assert_still_greedy(oracle, sid)
    g, n = greedy(), len(PROMPT)
    advance(oracle, sid, g[n:n + 2], n)  # a correct call afterwards still works
    assert oracle.draft(sid, g[n + 2], n + 1)[0] == g[n + 3:n + 3 + B]


def test_empty_first_observe_names_the_empty_list():
    oracle = LiveOracleDrafter(trunk())
    sid = oracle.open_session()
    with pytest.raises(ValueError, match="token_ids is empty"):
        oracle.observe_tokens(sid, 0, [])
    assert oracle.observed_tokens(sid) == []


@pytest.mark.parametrize("anchor, seed, match", [
    (5, 11.0, r"seed_position=11.0 \(float\)"),
    (5, "11", r"seed_position='11' \(str\)"),
    (5, True, r"seed_position=True \(bool\)"),
    (5.5, 11, r"anchor=5.5 \(float\)"),
    (True, 11, r"anchor=True \(bool\)"),
    (V, 11, rf"anchor={V} outside"),
    (5, 12, "seed_position=12 is not the last committed position 11"),
], ids=["seed_float", "seed_string", "seed_bool", "anchor_float", "anchor_bool", "anchor_vocab", "seed_wrong"])
def test_bad_draft_arguments_are_rejected(anchor, seed, match):
    oracle = LiveOracleDrafter(trunk())
    sid = primed(oracle)
    with pytest.raises(ValueError, match=match):
        oracle.draft(sid, anchor, seed)
    assert_still_greedy(oracle, sid)


def test_integer_arguments_of_every_kind_are_accepted():
    oracle, g, n = LiveOracleDrafter(trunk()), greedy(), len(PROMPT)
    sid = oracle.open_session()
    oracle.observe_tokens(sid, np.int64(0), torch.tensor(PROMPT))
    oracle.commit(sid, ROWS[n - W:n], torch.arange(n - W, n))
    assert oracle.draft(sid, np.int64(g[n]), torch.tensor(n - 1))[0] == g[n + 1:n + 1 + B]


@pytest.mark.parametrize("bad", [0.5, 2.0, float("nan"), float("inf"), -1, True, "2", None])
def test_corrupt_every_must_be_an_integer_of_at_least_zero(bad):
    with pytest.raises(ValueError, match=re.escape(f"corrupt_every={bad!r}: must be an integer >= 0")):
        LiveOracleDrafter(trunk(), corrupt_every=bad)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_sessions=float("nan")), "max_sessions=nan"),
    (dict(max_sessions=math.inf), "max_sessions=inf"),
    (dict(max_sessions=2.5), "max_sessions=2.5"),
    (dict(max_sessions="3"), "max_sessions='3'"),
    (dict(max_sessions=None), "max_sessions=None"),
    (dict(max_sessions=0), "max_sessions=0"),
    (dict(confident=float("nan")), "confident=nan: must be a finite real"),
    (dict(doubtful="low"), "doubtful='low'"),
])
def test_bad_constructor_arguments_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LiveOracleDrafter(trunk(), **kwargs)


def test_sessions_are_limited_and_closed():
    from services.drafter.engine import SessionLimitError, UnknownSessionError

    oracle = LiveOracleDrafter(trunk(), max_sessions=np.int64(1))
    sid = oracle.open_session()
    with pytest.raises(SessionLimitError, match="1 sessions"):
        oracle.open_session()
    oracle.close_session(sid)
    assert oracle.num_sessions == 0
    with pytest.raises(UnknownSessionError):
        oracle.observe_tokens(sid, 0, [1])
    assert oracle.identity()["kind"] == "oracle" and oracle.max_sessions == 1
