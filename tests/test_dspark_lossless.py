"""The speculative loop in process: verifier engine (sequential verify) + drafter engine.

Losslessness: with a fixed block length, speculative decoding reproduces plain greedy
decoding token for token over >= 64 tokens, with the oracle drafter (rounds fully accepted,
partly accepted and rejected; fewer rounds than tokens) and with the real DSpark module
(random weights: it is rarely accepted, losslessness is about output equality). Output
equality cannot catch a drafter bug (sequential verify is lossless whatever it drafts), so
for the DSpark module every round's drafts are also compared with a fresh module's drafts
from rings written with plain decode's rows through the round's seed, and after the loop the
drafter's rings equal rings written from plain decode's rows: only committed rows were
written, at the right positions. Block alignment: verify given [anchor, drafts...] accepts the oracle's drafts;
the misaligned block (the drafts alone, so every comparison shifts one position) reads as
near-zero acceptance.
"""

from __future__ import annotations

import functools

import pytest
import torch

from dsv4.config import tiny_config
from dsv4.dspark import DSparkDraft
from dsv4.init import random_weights
from dsv4.inventory import drafter_params, trunk_params
from dsv4.trunk import Trunk
from services.drafter.engine import DrafterEngine
from services.drafter.oracle import OracleDrafter, OracleScript
from services.verifier.engine import VerifierEngine
from verifier_fixtures import StepVerifier

CFG = tiny_config(max_seq_len=96)
W, B = CFG.window_size, CFG.dspark_block_size
PROMPT = torch.randint(0, CFG.vocab_size, (12,), generator=torch.Generator().manual_seed(5)).tolist()
N_NEW = 66


@functools.lru_cache(maxsize=None)
def weights() -> dict[str, torch.Tensor]:
    return random_weights(CFG, "all", seed=3)


@functools.lru_cache(maxsize=None)
def verifier() -> VerifierEngine:
    trunk = Trunk(CFG)
    trunk.load_weights({p.name: weights()[p.name] for p in trunk_params(CFG)})
    return StepVerifier(VerifierEngine(trunk))


@functools.lru_cache(maxsize=None)
def plain_decode(n_new: int = N_NEW + 2 * B) -> tuple[list[int], dict[int, torch.Tensor]]:
    """Plain greedy: prompt + n_new tokens, and the tap row of every forwarded position."""
    v = verifier()
    sid = v.open_session()
    step = v.prefill(sid, PROMPT)
    tokens, rows = [*PROMPT, step.next_token], dict(zip(step.positions, step.rows))
    for pos in range(len(PROMPT), len(PROMPT) + n_new - 1):
        step = v.decode(sid, tokens[-1], pos)
        tokens.append(step.next_token)
        rows[pos] = step.rows[0]
    v.close_session(sid)
    return tokens, rows


def speculative_decode(drafter, n_new: int, k: int) -> tuple[list[int], list[int], int, list[tuple]]:
    """Greedy speculative decoding with drafts cut to k. Returns (prompt + n_new tokens,
    accepted count per round, the drafter session id, (seed, anchor, drafts) per round)."""
    v = verifier()
    vs, ds = v.open_session(), drafter.open_session()
    step = v.prefill(vs, PROMPT)
    drafter.commit(ds, step.rows, step.positions)  # ring priming: the prompt's last min(n, W) rows
    tokens, accepted, rounds = [*PROMPT, step.next_token], [], []
    n = len(PROMPT)  # position of the anchor tokens[-1]
    while len(tokens) < len(PROMPT) + n_new:
        drafts, _ = drafter.draft(ds, tokens[-1], n - 1)
        rounds.append((n - 1, tokens[-1], drafts))
        res = v.verify(vs, tokens[-1], drafts[:k], n, mode="sequential")
        assert list(res.positions) == list(range(n, n + res.accepted + 1))
        drafter.commit(ds, res.rows, res.positions)  # positions n..n+a only
        tokens += [*drafts[:res.accepted], res.bonus_token]
        accepted.append(res.accepted)
        n += res.accepted + 1
    v.close_session(vs)
    return tokens[:len(PROMPT) + n_new], accepted, ds, rounds


def oracle_script(corrupt: frozenset[int] = frozenset()) -> OracleScript:
    return OracleScript(tokens=tuple(plain_decode()[0]), corrupt=corrupt)


def test_plain_continuation_is_not_trivially_periodic():
    """A repetitive continuation would let a misaligned block match; this one does not repeat."""
    cont = plain_decode()[0][len(PROMPT):]
    assert sum(a == b for a, b in zip(cont, cont[1:])) <= 2
    assert len(set(cont)) > len(cont) // 2


def test_block_alignment_with_the_oracle():
    v, oracle = verifier(), OracleDrafter(CFG, oracle_script())
    aligned = misaligned = 0
    seeds = (12, 20, 31, 40, 47)
    for m in seeds:  # prompt = the script's first m tokens
        prompt, anchor = list(oracle.script.tokens[:m]), oracle.script.tokens[m]
        ds = oracle.open_session()
        sessions = [v.open_session(), v.open_session()]
        for vs in sessions:
            step = v.prefill(vs, prompt)
            assert step.next_token == anchor
        oracle.commit(ds, step.rows, step.positions)
        drafts, _ = oracle.draft(ds, anchor, m - 1)
        aligned += v.verify(sessions[0], anchor, drafts, m).accepted
        misaligned += v.verify(sessions[1], drafts[0], drafts[1:], m).accepted  # the drafts alone
        for vs in sessions:
            v.close_session(vs)
    print(f"aligned {aligned}/{B * len(seeds)}, misaligned {misaligned}/{(B - 1) * len(seeds)}")
    assert aligned == B * len(seeds)
    assert misaligned <= 0.1 * (B - 1) * len(seeds)


def test_speculative_loop_with_the_oracle_is_lossless():
    g = torch.Generator().manual_seed(8)
    corrupt = frozenset(q for q in range(len(PROMPT), len(PROMPT) + N_NEW + 2 * B)
                        if float(torch.rand((), generator=g)) < 0.12)
    tokens, accepted, _, _ = speculative_decode(OracleDrafter(CFG, oracle_script(corrupt)), N_NEW, B)
    print(f"oracle: {len(accepted)} rounds for {N_NEW} tokens, accepted per round {accepted}")
    assert tokens == plain_decode()[0][:len(PROMPT) + N_NEW]
    assert B in accepted and 0 in accepted and any(0 < a < B for a in accepted)
    assert len(accepted) < N_NEW // 2


def test_speculative_loop_with_the_dspark_module_is_lossless():
    module = DSparkDraft(CFG)
    module.load_weights({p.name: weights()[p.name] for p in drafter_params(CFG)})
    drafter = DrafterEngine(module)
    tokens, accepted, ds, rounds = speculative_decode(drafter, N_NEW, B)
    print(f"dspark: {len(accepted)} rounds for {N_NEW} tokens, {sum(accepted)} drafts accepted")
    assert tokens == plain_decode()[0][:len(PROMPT) + N_NEW]
    plain, rows = plain_decode()
    # Every round drafted what a fresh module drafts from plain decode's rows through its seed:
    # a write of a rejected position, a skipped or shifted row, or a wrong seed changes a draft.
    ref, last_written = module.new_state(), len(PROMPT) - W - 1
    for seed, anchor, drafts in rounds:
        assert anchor == plain[seed + 1]
        module.write_main_kv(ref, torch.stack([rows[q] for q in range(last_written + 1, seed + 1)]),
                             range(last_written + 1, seed + 1))
        last_written = seed
        assert drafts == module.draft(ref, anchor, seed).tokens, f"round at seed {seed}"
    assert len({tuple(d) for _, _, d in rounds}) > len(rounds) // 2  # the drafts depend on the round
    # Only committed rows reached the rings: they equal rings written from plain decode's rows.
    state = drafter.session_state(ds)
    last = state.last_position
    fresh = module.new_state()
    module.write_main_kv(fresh, torch.stack([rows[q] for q in range(last - W + 1, last + 1)]),
                         range(last - W + 1, last + 1))
    assert all(torch.equal(a, b) for a, b in zip(state.rings, fresh.rings))


def test_in_process_setup_shares_embed_and_head_with_the_trunk():
    trunk = verifier().model
    module = DSparkDraft(CFG)
    module.load_weights({p.name: weights()[p.name] for p in drafter_params(CFG)})
    state = module.new_state()
    rows = plain_decode()[1]
    module.write_main_kv(state, torch.stack([rows[q] for q in range(4, 12)]), range(4, 12))
    before = module.draft(state, 5, 11)
    module.share_embed_head(trunk.embed, trunk.head)
    assert module.embed is trunk.embed and module.head is trunk.head
    after = module.draft(state, 5, 11)
    assert after.tokens == before.tokens and torch.equal(after.logits, before.logits)
    other = DSparkDraft(CFG)
    other.load_weights(random_weights(CFG, "drafter", seed=4))
    with pytest.raises(ValueError, match="embed: the trunk's"):
        other.share_embed_head(trunk.embed, trunk.head)
