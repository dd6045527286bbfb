"""Verifier engine: row contract, sequential and batched verify, exact rollback, sessions
(docs/architecture.md §3-§4).

Tiny config (docs/model.md §13): W = 8, layer 1 ratio 4 with indexer (index_topk 2), layer 2 ratio 8,
layer 3 ratio 4. Start positions 13, 14, 15, 22 wrap the ring; 15 and 23 are ratio-4 and
ratio-8 block boundaries ((p + 1) % r == 0).
"""

import numpy as np
import pytest
import torch

from dsv4.config import tiny_config
from dsv4.init import random_weights
from dsv4.trunk import Trunk
from services.verifier.engine import SessionLimitError, UnknownSessionError, VerifierEngine
from verifier_fixtures import StepVerifier

TOL = 1e-4  # rel. error allowed between a batched and a sequential forward (fp32, quant sim off)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max over rows of ||a - b|| / ||b||."""
    a, b = a.reshape(-1, a.shape[-1]).double(), b.reshape(-1, b.shape[-1]).double()
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max())


def build(cfg):
    model = Trunk(cfg)
    model.load_weights(random_weights(cfg, "trunk", seed=3))
    return model


@pytest.fixture(scope="module")
def model():
    return build(tiny_config(max_seq_len=128))  # room for the 60-token perfect-draft run


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(11))


def greedy_chain(engine, prompt_ids, n_tokens):
    """Plain greedy decode: returns (tokens x[n..n+n_tokens-1] with x[n] the first anchor, per-step results)."""
    sid = engine.open_session()
    out = engine.prefill(sid, prompt_ids)
    tokens, steps, pos = [out.next_token], [], len(prompt_ids)
    for _ in range(n_tokens - 1):
        step = engine.decode(sid, tokens[-1], pos)
        steps.append(step)
        tokens.append(step.next_token)
        pos += 1
    engine.close_session(sid)
    return tokens, steps


# ---------------------------------------------------------------- batched vs sequential
@pytest.mark.parametrize("n", [9, 13, 14, 15, 22])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_batched_block_logits_and_rows_match_sequential_decodes(model, prompt, n, k):
    seq_state, blk_state = model.new_state(), model.new_state()
    model.prefill(seq_state, prompt[:n])
    model.prefill(blk_state, prompt[:n])
    block = prompt[n:n + k + 1]
    seq = [model.decode(seq_state, int(t), n + i) for i, t in enumerate(block)]
    out = model.forward_block(blk_state, block, n)
    assert out.logits.shape == (k + 1, model.cfg.vocab_size)
    assert rel(out.logits, torch.stack([s.logits for s in seq])) < TOL
    assert rel(out.taps, torch.cat([s.taps for s in seq])) < TOL


def first_divergence(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def test_sequential_speculation_equals_plain_greedy_and_batched_divergence_is_reported(model, prompt, capsys):
    """Asserted: a perfect-draft speculative chain verified sequentially is token-for-token the
    plain greedy chain (sequential verify is exact). Reported, not asserted: where the
    batched chain first differs (reduction order changes with the block shape)."""
    engine = StepVerifier(VerifierEngine(model))
    chain, steps = greedy_chain(engine, prompt[:13], 40)
    assert speculate_with_drafts(engine, prompt[:13], chain, "sequential", 40) == chain
    out = speculate_with_drafts(engine, prompt[:13], chain, "batched", 40)
    i = first_divergence(out, chain)
    margin = steps[i - 1].margin if i else float("nan")
    with capsys.disabled():
        print("\n[report] batched verify vs plain greedy over 40 tokens: "
              + ("identical" if i is None else f"diverges at {i} (margin {margin:.3g})"))


def speculate_with_drafts(engine, prompt_ids, chain, mode, n_tokens, block=5):
    """Speculative loop whose drafts are the plain chain (a perfect drafter)."""
    sid = engine.open_session()
    out = [engine.prefill(sid, prompt_ids).next_token]
    pos = len(prompt_ids)
    while len(out) < n_tokens:
        drafts = chain[len(out):len(out) + block]
        res = engine.verify(sid, out[-1], drafts, pos, mode)
        out += drafts[:res.accepted] + [res.bonus_token]
        pos += res.accepted + 1
    engine.close_session(sid)
    return out[:n_tokens]


# ---------------------------------------------------------------- row contract
@pytest.mark.parametrize("mode", ["sequential", "batched"])
@pytest.mark.parametrize("n_match", [0, 2, 5])
def test_verify_returns_rows_of_positions_n_to_n_plus_a(model, prompt, mode, n_match):
    engine = StepVerifier(VerifierEngine(model))
    n = 14
    chain, steps = greedy_chain(engine, prompt[:n], 12)  # chain[0] is the anchor at n
    drafts = chain[1:1 + n_match] + ([(chain[1 + n_match] + 1) % 500] if n_match < 5 else [])
    sid = engine.open_session()
    engine.prefill(sid, prompt[:n])
    res = engine.verify(sid, chain[0], drafts, n, mode)
    assert res.accepted == n_match
    assert res.bonus_token == chain[n_match + 1]
    assert list(res.positions) == list(range(n, n + n_match + 1))
    decode_rows = torch.cat([s.rows for s in steps])  # rows of positions n.. (steps[i] consumed n+i)
    assert rel(res.rows, decode_rows[: n_match + 1]) < TOL
    assert rel(res.rows, decode_rows[1: n_match + 2]) > 0.05  # shifted by one: clearly different
    assert engine.next_position(sid) == n + n_match + 1


def plain_greedy(model, prompt_ids, n_tokens):
    """Plain greedy decode on the model: tokens x[n..] (x[n] the first anchor) and logits
    [n_tokens, V], where logits[j] is the distribution x[n+j] was taken from."""
    st = model.new_state()
    out = model.prefill(st, prompt_ids)
    toks, logits = [int(out.logits.argmax())], [out.logits]
    for j in range(n_tokens - 1):
        out = model.decode(st, toks[-1], len(prompt_ids) + j)
        toks.append(int(out.logits.argmax()))
        logits.append(out.logits)
    return toks, torch.stack(logits)


def test_perfect_draft_sequential_accepts_every_position(model, prompt, capsys):
    """Perfect drafts: the plain greedy chain fed back as drafts, block 5.

    Sequential: every draft accepted and every bonus is the chain's next token. Batched: its
    logits match the plain ones within rel. TOL per row (asserted above), so a draft can be
    rejected, or a bonus differ from the chain, only where the plain top1 - top2 margin is at
    most 2 * TOL * ||logits||; the number of such positions is reported.
    """
    chain, logits = plain_greedy(model, prompt[:9], 61)
    top2 = logits.topk(2, dim=-1).values
    margins, norms = top2[:, 0] - top2[:, 1], logits.norm(dim=-1)
    engine = StepVerifier(VerifierEngine(model))
    for mode in ("sequential", "batched"):
        sid = engine.open_session()
        engine.prefill(sid, prompt[:9])
        pos, i, rejected = 9, 0, 0
        while i + 6 < len(chain):  # chain[i + 6] exists: the bonus of a fully accepted block
            res = engine.verify(sid, chain[i], chain[i + 1:i + 6], pos, mode)
            j = i + res.accepted + 1  # logits[j] chose chain[j], the bonus's slot
            assert 0 <= res.accepted <= 5 and res.rows.shape == (res.accepted + 1, model.cfg.tap_width)
            if mode == "sequential":
                assert res.bonus_token == chain[j]
            elif res.bonus_token != chain[j]:
                assert margins[j] <= 2 * TOL * norms[j], (j, float(margins[j]), float(norms[j]))
            rejected += 5 - res.accepted
            pos, i = pos + res.accepted + 1, j
        engine.close_session(sid)
        if mode == "sequential":
            assert rejected == 0 and i >= 50
        else:
            with capsys.disabled():
                print(f"\n[report] batched verify of the perfect draft: {rejected} rejected draft "
                      f"positions over {i} tokens")


# ---------------------------------------------------------------- overwrite safety
def continuation(model, state, token, pos, steps=8):
    """Greedy decode `steps` tokens from `state`: (tokens, logits [steps, V])."""
    toks, logits = [], []
    for i in range(steps):
        out = model.decode(state, token, pos + i)
        token = int(out.logits.argmax())
        toks.append(token)
        logits.append(out.logits)
    return toks, torch.stack(logits)


def overshoot_run(model, prompt, n, keep, overshoot, **rollback_flags):
    """Verify keep committed + `overshoot` rejected tokens at n, roll back, continue 8 tokens."""
    state = model.new_state()
    model.prefill(state, prompt[:n])
    garbage = torch.arange(overshoot) * 37 % 500 + 3
    block = torch.cat((prompt[n:n + keep], garbage))
    out = model.forward_block(state, block, n)
    model.rollback(state, out.undo, keep, **rollback_flags)
    return state, continuation(model, state, 5, n + keep)


def clean_run(model, prompt, n, keep):
    state = model.new_state()
    model.prefill(state, prompt[:n])
    for i in range(keep):
        model.decode(state, int(prompt[n + i]), n + i)
    return state, continuation(model, state, 5, n + keep)


OVERSHOOTS = [1, 2, 3, 4, 5, 8]
# (n, keep): the first rejected position n + keep is a ratio boundary (15: ratio 4; 23: ratio 4
# and 8), and every block wraps the W = 8 ring; 13 + 1 = 14 is mid-ratio.
POSITIONS = [(14, 1), (13, 2), (22, 1), (13, 1)]


@pytest.mark.parametrize("overshoot", OVERSHOOTS)
@pytest.mark.parametrize("n,keep", POSITIONS)
def test_full_rollback_continuation_equals_clean_run(model, prompt, n, keep, overshoot):
    _, (toks, logits) = overshoot_run(model, prompt, n, keep, overshoot)
    _, (clean_toks, clean_logits) = clean_run(model, prompt, n, keep)
    assert toks == clean_toks
    assert rel(logits, clean_logits) < TOL


@pytest.mark.parametrize("overshoot", OVERSHOOTS)
@pytest.mark.parametrize("n,keep", [(14, 1), (22, 1)])
def test_without_compressor_rollback_the_continuation_diverges(model, prompt, n, keep, overshoot, capsys):
    """Rejected tokens that cross a ratio boundary shift the overlapped accumulator and emit
    entries: without restoring them the state and the logits differ (all six diverge on the
    reference setup, docs/architecture.md §12)."""
    state, (toks, logits) = overshoot_run(model, prompt, n, keep, overshoot, compressor=False)
    clean_state, (clean_toks, clean_logits) = clean_run(model, prompt, n, keep)
    assert rel(logits, clean_logits) > 100 * TOL
    first = first_divergence(toks, clean_toks)
    with capsys.disabled():
        print(f"\n[report] no compressor rollback, n={n} overshoot={overshoot}: tokens "
              + ("identical" if first is None else f"diverge at {first}"))


@pytest.mark.parametrize("overshoot", OVERSHOOTS)
def test_ring_rollback_on_a_config_without_compressed_layers(prompt, overshoot):
    """Control without compressors: only the ring can go wrong. A rejected write at q evicts
    q - W, still inside the next query's window, so ring handling is needed from overshoot 2
    on; a single rejected position is rewritten by the next real token before it is read."""
    model = build(tiny_config(compress_ratios=[0] * 7, max_seq_len=128))
    n, keep = 13, 1
    _, (_, on_logits) = overshoot_run(model, prompt, n, keep, overshoot)
    _, (_, off_logits) = overshoot_run(model, prompt, n, keep, overshoot, ring=False)
    _, (_, clean_logits) = clean_run(model, prompt, n, keep)
    assert rel(on_logits, clean_logits) < TOL
    if overshoot >= 2:
        assert rel(off_logits, clean_logits) > 100 * TOL
    else:
        assert rel(off_logits, clean_logits) < TOL


# ---------------------------------------------------------------- transaction (a verify block and its undo)
def refined_block(engine, prompt_ids, chain):
    """Block [anchor, d1..d5] refined until batched verify accepts every row."""
    n = len(prompt_ids)
    block = chain[:6]
    for _ in range(10):
        sid = engine.open_session()
        engine.prefill(sid, prompt_ids)
        res = engine.verify(sid, block[0], block[1:], n, "batched")
        engine.close_session(sid)
        if res.accepted == 5:
            return block
        # replace the first rejected draft by what the batched pass chose there, then retry
        block = block[:res.accepted + 1] + [res.bonus_token] + block[res.accepted + 2:]
    raise AssertionError("block refinement did not converge")


@pytest.mark.parametrize("accepted", [0, 1, 2, 3, 4])
def test_rejected_suffix_does_not_change_the_continuation(model, prompt, accepted, capsys):
    engine = StepVerifier(VerifierEngine(model))
    n = 15
    chain, _ = greedy_chain(engine, prompt[:n], 8)
    block = refined_block(engine, prompt[:n], chain)
    results = []
    for variant in (1, 2):
        drafts = block[1:accepted + 1] + [(block[accepted + 1] + variant * 7) % 500 + j for j in range(5 - accepted)]
        sid = engine.open_session()
        engine.prefill(sid, prompt[:n])
        res = engine.verify(sid, block[0], drafts, n, "batched")
        assert res.accepted == accepted
        pos, token, toks = n + accepted + 1, res.bonus_token, []
        for _ in range(8):
            step = engine.decode(sid, token, pos)
            token, pos = step.next_token, pos + 1
            toks.append(token)
        engine.close_session(sid)
        results.append((res, toks))
    (res_a, toks_a), (res_b, toks_b) = results
    assert res_a.bonus_token == res_b.bonus_token
    assert toks_a == toks_b
    diff = float((res_a.rows - res_b.rows).abs().max())
    with capsys.disabled():
        print(f"\n[report] accepted={accepted}: committed rows differ by max_abs {diff:.3g} between suffixes")


# ---------------------------------------------------------------- sessions
def test_interleaved_sessions_equal_their_solo_runs(model, prompt):
    engine = StepVerifier(VerifierEngine(model))

    def script(sid, ids, mode):
        first = engine.prefill(sid, ids)
        yield first.next_token
        pos, anchor = len(ids), first.next_token
        for r in range(6):
            if r % 2:
                res = engine.decode(sid, anchor, pos)
                anchor, pos = res.next_token, pos + 1
            else:
                res = engine.verify(sid, anchor, [(anchor + j) % 500 for j in range(1, 4)], pos, mode)
                anchor, pos = res.bonus_token, pos + res.accepted + 1
            yield anchor, res.margin

    def solo(ids, mode):
        sid = engine.open_session()
        out = list(script(sid, ids, mode))
        engine.close_session(sid)
        return out

    solo_a, solo_b = solo(prompt[:10], "batched"), solo(prompt[5:21], "sequential")
    a, b = engine.open_session(), engine.open_session()
    ga, gb = script(a, prompt[:10], "batched"), script(b, prompt[5:21], "sequential")
    mixed_a, mixed_b = [], []
    for x, y in zip(ga, gb):
        mixed_a.append(x)
        mixed_b.append(y)
    assert mixed_a == solo_a and mixed_b == solo_b


def test_session_limit_and_close(model):
    engine = StepVerifier(VerifierEngine(model, max_sessions=2))
    a, b = engine.open_session(), engine.open_session()
    with pytest.raises(SessionLimitError, match="2 sessions"):
        engine.open_session()
    engine.close_session(a)
    c = engine.open_session()
    assert engine.num_sessions == 2 and c not in (a, b)
    with pytest.raises(UnknownSessionError, match=str(a)):
        engine.decode(a, 1, 0)


def test_session_bytes_count_every_state_buffer(model):
    engine = StepVerifier(VerifierEngine(model))
    sid = engine.open_session()
    cfg = model.cfg
    expected = 0
    for r in cfg.compress_ratios[: cfg.n_layers]:
        expected += cfg.window_size * cfg.head_dim * 4  # ring fp32
        if r:
            k = 2 if r == 4 else 1
            expected += 2 * (k * r) * (k * cfg.head_dim) * 4 + (cfg.max_seq_len // r) * cfg.head_dim * 4
        if r == 4:
            expected += 2 * 8 * (2 * cfg.index_head_dim) * 4 + (cfg.max_seq_len // 4) * cfg.index_head_dim * 4
    assert engine.session_bytes(sid) == expected


def test_positions_and_inputs_are_checked(model, prompt):
    engine = StepVerifier(VerifierEngine(model))
    sid = engine.open_session()
    with pytest.raises(ValueError, match="prefill first"):
        engine.decode(sid, 1, 0)
    engine.prefill(sid, prompt[:6])
    with pytest.raises(ValueError, match="position=7 is not session .* next position 6"):
        engine.decode(sid, 1, 7)
    with pytest.raises(ValueError, match="position=5 is not"):
        engine.verify(sid, 1, [2, 3], 5, "batched")
    with pytest.raises(ValueError, match="token id 512"):
        engine.verify(sid, 1, [512], 6, "batched")
    with pytest.raises(ValueError, match="mode='fast'"):
        engine.verify(sid, 1, [2], 6, "fast")
    with pytest.raises(ValueError, match="already prefilled"):
        engine.prefill(sid, prompt[:3])
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.verify(sid, 1, [2] * 122, 6, "batched")
    # nothing above changed the session
    assert engine.next_position(sid) == 6
    res = engine.verify(sid, 1, [], 6, "batched")
    assert res.accepted == 0 and list(res.positions) == [6]


# ---------------------------------------------------------------- input validation
def same_next_verify(engine, sid, prompt_ids):
    """The session answers a verify exactly as a fresh session with the same prompt does."""
    fresh = engine.open_session()
    engine.prefill(fresh, prompt_ids)
    n = len(prompt_ids)
    a = engine.verify(sid, 1, [2, 3], n, "batched")
    b = engine.verify(fresh, 1, [2, 3], n, "batched")
    engine.close_session(fresh)
    return (a.accepted, a.bonus_token, a.margin) == (b.accepted, b.bonus_token, b.margin) and torch.equal(a.rows, b.rows)


@pytest.mark.parametrize("call, why", [
    (lambda e, s: e.verify(s, 3.7, [1], 6), "anchor=3.7"),
    (lambda e, s: e.verify(s, "3", [1], 6), "anchor='3'"),
    (lambda e, s: e.verify(s, True, [1], 6), "anchor=True"),
    (lambda e, s: e.verify(s, 5.9, [1], 6, "batched"), "anchor=5.9"),
    (lambda e, s: e.verify(s, 1, {1, 2}, 6), "drafts must be a list, tuple or 1-D integer tensor"),
    (lambda e, s: e.verify(s, 1, "12", 6), "drafts must be a list"),
    (lambda e, s: e.verify(s, 1, [1, 2.5], 6), r"drafts\[1\]=2.5"),
    (lambda e, s: e.verify(s, 1, [1, "2"], 6), r"drafts\[1\]='2'"),
    (lambda e, s: e.verify(s, 1, torch.tensor([[1, 2]]), 6), "drafts must be a 1-D integer tensor"),
    (lambda e, s: e.verify(s, 1, torch.tensor([1.0]), 6), "drafts must be a 1-D integer tensor"),
    (lambda e, s: e.verify(s, 1, [2], 6.0), "position=6.0"),
    (lambda e, s: e.decode(s, 3.7, 6), "token_id=3.7"),
    (lambda e, s: e.decode(s, 1, "6"), "position='6'"),
    (lambda e, s: e.decode(s, 512, 6), "token id 512"),
    (lambda e, s: e.decode(s, -1, 6), "token id -1"),
])
def test_engine_rejects_bad_ids_and_positions_leaving_the_session_unchanged(model, prompt, call, why):
    engine = StepVerifier(VerifierEngine(model))
    sid = engine.open_session()
    engine.prefill(sid, prompt[:6])
    with pytest.raises(ValueError, match=why):
        call(engine, sid)
    assert engine.next_position(sid) == 6
    assert same_next_verify(engine, sid, prompt[:6])


def test_engine_accepts_numpy_and_torch_integers(model, prompt):
    engine = StepVerifier(VerifierEngine(model))
    a, b = engine.open_session(), engine.open_session()
    engine.prefill(a, prompt[:6].numpy())
    engine.prefill(b, prompt[:6].tolist())
    x = engine.verify(a, np.int64(1), torch.tensor([2, 3]), torch.tensor(6), "batched")
    y = engine.verify(b, 1, [2, 3], 6, "batched")
    assert (x.accepted, x.bonus_token) == (y.accepted, y.bonus_token) and torch.equal(x.rows, y.rows)
    assert type(engine.next_position(a)) is int


@pytest.mark.parametrize("prompt_ids, why", [
    ([], "empty prompt"), (torch.tensor([], dtype=torch.int64), "empty prompt"), ((), "empty prompt"),
    ([1, 512], "token id 512 at index 1"), ([1, -2], "token id -2"), ([1, 2.5], r"prompt\[1\]=2.5"),
    (list(range(129)), "129 exceeds max_seq_len=128"), (torch.ones(2, 3, dtype=torch.int64), "1-D integer"),
    ("abc", "prompt must be a list"),
])
def test_engine_prefill_errors_leave_the_session_unchanged(model, prompt, prompt_ids, why):
    engine = StepVerifier(VerifierEngine(model))
    sid, fresh = engine.open_session(), engine.open_session()
    with pytest.raises(ValueError, match=why):
        engine.prefill(sid, prompt_ids)
    assert engine.next_position(sid) == 0
    a, b = engine.prefill(sid, prompt[:6]), engine.prefill(fresh, prompt[:6])  # not "already prefilled"
    assert (a.next_token, a.margin, a.positions) == (b.next_token, b.margin, b.positions)
    assert torch.equal(a.rows, b.rows)


def test_engine_decode_beyond_max_seq_len_leaves_the_state_unchanged(prompt):
    model = build(tiny_config(max_seq_len=24))
    engine = StepVerifier(VerifierEngine(model))
    ids = torch.cat((prompt, prompt))[:24]
    sid, fresh = engine.open_session(), engine.open_session()
    engine.prefill(sid, ids)
    engine.prefill(fresh, ids)
    with pytest.raises(ValueError, match="position=24: must be < max_seq_len=24"):
        engine.decode(sid, 1, 24)
    with pytest.raises(ValueError, match="runs past max_seq_len=24"):
        engine.verify(sid, 1, [], 24)
    assert engine.next_position(sid) == 24
    # no call can succeed at max_seq_len, so compare the state itself with the untouched twin
    got, want = engine._get(sid).state, engine._get(fresh).state
    for a, b in zip(got.layers, want.layers):
        assert torch.equal(a.ring, b.ring)
        for x, y in ((a.compressor, b.compressor), (a.indexer, b.indexer)):
            if x is not None:
                assert torch.equal(x.kv, y.kv) and torch.equal(x.cache, y.cache) and x.n_entries == y.n_entries


@pytest.mark.parametrize("kwargs, why", [
    ({"prefill_keep_rows": -1}, "prefill_keep_rows=-1: must be >= 0"),
    ({"prefill_keep_rows": 2.5}, "prefill_keep_rows=2.5"),
    ({"max_sessions": "4"}, "max_sessions='4'"),
    ({"max_sessions": 2.5}, "max_sessions=2.5"),
    ({"max_sessions": 0}, "max_sessions=0: must be >= 1"),
    ({"max_sessions": True}, "max_sessions=True"),
])
def test_engine_constructor_validates_its_limits(model, kwargs, why):
    with pytest.raises(ValueError, match=why):
        VerifierEngine(model, **kwargs)
    assert VerifierEngine(model, max_sessions=np.int64(3), prefill_keep_rows=0).max_sessions == 3
