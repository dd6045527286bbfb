"""Exact verify numerics (`Trunk(verify_numerics="exact")`, docs/architecture.md §4), asserted bitwise on CPU.

Tiny config (docs/model.md §13): W = 8, layer 1 ratio 4 with indexer (index_topk 2), layer 2 ratio 8,
layer 3 ratio 4. Start positions 13, 14, 15, 22, 23 wrap the ring; 15 and 23 are ratio-4
and ratio-8 block boundaries ((p + 1) % r == 0), so blocks from there straddle them.

Asserted with torch.equal (no tolerance), in fp32 and bf16: verify row i equals decode row i
(logits and taps) for i = 0..5; the state a rejected block leaves behind equals a plain
run's; and speculative generation with batched verify equals plain greedy generation token
for token, with always-k and gated draft lengths, on four workload prompts and 20 random
prompts. Drafts come from a corrupted oracle: the plain chain itself, with slot j of a draft
at position p replaced by (token + 1) % V when (p + j) % CORRUPT_EVERY == CORRUPT_EVERY - 1
(the live oracle drafter's schedule), so rounds accept, reject and roll back.
"""

import pytest
import torch
from model_fixtures import state_tensors

from dsv4.attention import sparse_attn, sparse_attn_chunked
from dsv4.config import tiny_config
from dsv4.indexer import index_scores, index_scores_chunked
from dsv4.init import random_weights
from dsv4.trunk import EXACT_ROWS, Trunk
from services.gateway.gate import Gate, GateConfig
from services.gateway.tokenizer import ByteTokenizer
from services.verifier.engine import VerifierEngine
from verifier_fixtures import StepVerifier

DTYPES = [torch.float32, torch.bfloat16]
CORRUPT_EVERY = 4
CONFIDENT, DOUBTFUL = 6.5, -2.0  # the live oracle drafter's confidence logits
GATE_MARGIN = 0.5  # pre-draft margin threshold (logits) of the gated runs: some rounds decode plainly
WORKLOADS = {  # as bench/bench_services.py
    "repeat": "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15",
    "code": "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "prose": "The old lighthouse keeper walked slowly along the shore, watching",
    "math": "Solve for x: 3x + 7 = 22. Subtract 7 from both sides: 3x =",
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.reshape(-1, a.shape[-1]).double(), b.reshape(-1, b.shape[-1]).double()
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max())


@pytest.fixture(scope="module", params=DTYPES, ids=["fp32", "bf16"])
def model(request):
    cfg = tiny_config(max_seq_len=128)
    m = Trunk(cfg, dtype=request.param, verify_numerics="exact")
    m.load_weights(random_weights(cfg, "trunk", seed=3))
    return m


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(11))


# ---------------------------------------------------------------- the fixed-shape pieces
def test_chunked_attention_and_index_scores_match_and_ignore_padding():
    g = torch.Generator().manual_seed(2)
    q, kv, sink = torch.randn(8, 4, 96, generator=g), torch.randn(90, 96, generator=g), torch.randn(4, generator=g)
    idx = torch.randint(-1, 90, (8, 70), generator=g)
    got = sparse_attn_chunked(q, kv, sink, idx, 0.1, 16)
    assert rel(got, sparse_attn(q, kv, sink, idx, 0.1)) < 1e-6
    padded = torch.cat((idx, torch.full((8, 40), -1)), dim=1)  # more (masked) chunks
    assert torch.equal(sparse_attn_chunked(q, kv, sink, padded, 0.1, 16), got)
    qi, w, kc = torch.randn(8, 2, 64, generator=g), torch.randn(8, 2, generator=g), torch.randn(37, 64, generator=g)
    scores = index_scores_chunked(qi, w, kc, 16, 2)  # [8, 48]: 37 entries, zero-padded
    assert scores.shape == (8, 48) and rel(scores[:, :37], index_scores(qi, w, kc)) < 1e-6
    assert torch.equal(index_scores_chunked(qi, w, kc[:20], 16, 2)[:, :20], scores[:, :20])  # fewer entries


# ---------------------------------------------------------------- verify row i == decode row i
@pytest.mark.parametrize("n", [13, 14, 15, 22, 23])
def test_verify_rows_equal_decode_rows_bitwise(model, prompt, n):
    k = 5
    seq_state, blk_state = model.new_state(), model.new_state()
    model.prefill(seq_state, prompt[:n])
    model.prefill(blk_state, prompt[:n])
    block = prompt[n:n + k + 1]
    seq = [model.decode(seq_state, int(t), n + i) for i, t in enumerate(block)]
    out = model.forward_block(blk_state, block, n)
    for i in range(k + 1):
        assert torch.equal(out.logits[i], seq[i].logits), f"logits row {i} at {n + i}"
        assert torch.equal(out.taps[i], seq[i].taps[0]), f"taps row {i} at {n + i}"
    model.rollback(blk_state, out.undo, k + 1)


@pytest.mark.parametrize("keep", [1, 3, 6])
def test_rolled_back_block_leaves_the_plain_state_bitwise(model, prompt, keep):
    """Kept positions were computed inside a 6-token block, yet the state (ring, compressor
    and indexer accumulators, entries) equals that of decoding only them, bit for bit."""
    n = 14
    plain, blk = model.new_state(), model.new_state()
    model.prefill(plain, prompt[:n])
    model.prefill(blk, prompt[:n])
    for i in range(keep):
        model.decode(plain, int(prompt[n + i]), n + i)
    out = model.forward_block(blk, prompt[n:n + 6], n)
    model.rollback(blk, out.undo, keep)
    assert blk.next_position == plain.next_position
    for a, b in zip(state_tensors(blk), state_tensors(plain)):
        assert torch.equal(a, b)


def test_exact_mode_arguments(model, prompt):
    cfg = model.cfg
    with pytest.raises(ValueError, match="verify_numerics='bitwise'"):
        Trunk(cfg, verify_numerics="bitwise")
    st = model.new_state()
    model.prefill(st, prompt[:10])
    with pytest.raises(ValueError, match=f"at most {EXACT_ROWS}"):
        model.forward_block(st, prompt[10:10 + EXACT_ROWS + 1], 10)
    assert st.next_position == 10 and st.open_block is None  # rejected before any change


def test_exact_forward_pins_the_thread_count(model, prompt):
    st = model.new_state()
    model.prefill(st, prompt[:10])
    before = torch.get_num_threads()
    torch.set_num_threads(model.exact_threads + 1)
    try:
        seen = []
        hook = model.layers[0].register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
        model.decode(st, int(prompt[10]), 10)
        hook.remove()
        assert seen == [model.exact_threads]
        assert torch.get_num_threads() == model.exact_threads + 1  # restored
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------- speculative == plain
def plain_chain(engine, prompt_ids, n_tokens):
    sid = engine.open_session()
    tokens, pos = [engine.prefill(sid, prompt_ids).next_token], len(prompt_ids)
    while len(tokens) < n_tokens:
        tokens.append(engine.decode(sid, tokens[-1], pos).next_token)
        pos += 1
    engine.close_session(sid)
    return tokens


def oracle_draft(chain, done, pos, vocab, block):
    """Drafts for the anchor chain[done-1] at position pos - 1 + 1 ...: the chain's next tokens,
    corrupted on the live oracle's schedule; with their confidence logits."""
    drafts, conf = [], []
    for j, tok in enumerate(chain[done:done + block]):
        bad = (pos + j) % CORRUPT_EVERY == CORRUPT_EVERY - 1
        drafts.append((tok + 1) % vocab if bad else tok)
        conf.append(DOUBTFUL if bad else CONFIDENT)
    return drafts, conf


def speculate(engine, prompt_ids, chain, n_tokens, gated):
    """Greedy speculative generation with batched verify; returns (tokens, verify rounds,
    accepted drafts, plain decodes). Gated: the gate (services.gateway.gate, docs/architecture.md §5) picks
    each length, and a pre-draft margin threshold sends uncertain anchors to plain decode."""
    cfg, gate = engine.cfg, Gate(GateConfig(enabled=True, margin_threshold=GATE_MARGIN))
    sid = engine.open_session()
    first = engine.prefill(sid, prompt_ids)
    out, pos, margin = [first.next_token], len(prompt_ids), first.margin
    rounds = accepted = plain = 0
    while len(out) < n_tokens:
        k = 0
        if not gated or gate.pre_draft(margin) is None:
            drafts, conf = oracle_draft(chain, len(out), pos + 1, cfg.vocab_size, cfg.dspark_block_size)
            k = gate.choose(conf, len(drafts)).k if gated else len(drafts)
        if k == 0:
            step = engine.decode(sid, out[-1], pos)
            out, pos, margin, plain = out + [step.next_token], pos + 1, step.margin, plain + 1
            continue
        res = engine.verify(sid, out[-1], drafts[:k], pos, mode="batched")
        if gated:
            gate.observe(conf, k, res.accepted)
        out += drafts[:res.accepted] + [res.bonus_token]
        pos, margin = pos + res.accepted + 1, res.margin
        rounds, accepted = rounds + 1, accepted + res.accepted
    engine.close_session(sid)
    return out[:n_tokens], rounds, accepted, plain


def prompts():
    tok = ByteTokenizer(512)
    named = [(name, tok.encode(text)) for name, text in WORKLOADS.items()]
    g = torch.Generator().manual_seed(5)
    for i in range(20):
        n = int(torch.randint(3, 40, (1,), generator=g))
        named.append((f"random{i}", torch.randint(0, 512, (n,), generator=g).tolist()))
    return named


def test_speculative_output_equals_plain_output(model, capsys):
    engine = StepVerifier(VerifierEngine(model))
    n_tokens = 20
    stats = {"always": [0, 0, 0], "gated": [0, 0, 0]}
    for name, ids in prompts():
        chain = plain_chain(engine, ids, n_tokens)
        for mode in ("always", "gated"):
            out, *counts = speculate(engine, ids, chain, n_tokens, gated=mode == "gated")
            assert out == chain, f"{name} ({len(ids)} prompt tokens), {mode}: first difference at " \
                                 f"{next(i for i, (a, b) in enumerate(zip(out, chain)) if a != b)}"
            stats[mode] = [a + b for a, b in zip(stats[mode], counts)]
    rounds, accepted, _ = stats["always"]
    assert 0 < accepted < 5 * rounds  # drafts were accepted and rejected
    assert stats["gated"][2] > 0 and stats["gated"][1] > 0  # gated runs decoded plainly and accepted drafts
    with capsys.disabled():
        print(f"\n[report] exact {model.dtype}: 24 prompts x {n_tokens} tokens, speculative == plain; "
              "(verify rounds, accepted drafts, plain decodes): "
              f"always-k {tuple(stats['always'])}, gated {tuple(stats['gated'])}")
