"""The bundled model (assets/dspark-small, docs/architecture.md §9): its draft, its greedy output,
its recorded rounds.

Skips, saying why, only when the bundled checkpoint is absent. Everything loads through the
services' loaders (`services.app.load_trunk` / `load_drafter`, i.e. `dsv4.checkpoint`), the
same path as the real checkpoint. CPU, one process, a few seconds.

* Draft acceptance (an absolute bar on prompts the trunk is near-certain about,
  docs/architecture.md §12): on cyclic prompts (a counting run and a repeated import line),
  greedy speculative rounds with the whole block verified (always-k) accept >= 80% of the
  drafted tokens. The bar is on the draft following the target: the prompts are ones whose
  target continuation is periodic (the counting run goes on counting; the import line
  continues as "import sys" lines). ("alpha, beta, gamma" x 6 is not such a prompt for this
  trunk: it continues ", gst, gst, gst, cir, gst, cir, cir, ...", and the draft accepts 31/80
  = 39% of it.) Rounds are simulated exactly: the target's greedy continuation is decoded once
  (its tap rows committed as the verifier would), and a round at seed p accepts the drafts
  that equal that continuation, then commits the bonus token.
* A fixed prompt's greedy continuation is pinned (expected ids below; regenerate them only
  when the bundled model is re-exported).
* The committed recorded rounds (tests/data/bundled_rounds.json, written by the gateway's
  recorder in `training.demo --record-rounds`) replay to pinned tok/s.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "assets" / "dspark-small"
ROUNDS = ROOT / "tests" / "data" / "bundled_rounds.json"

pytestmark = pytest.mark.skipif(not (BUNDLED / "config.json").is_file(),
                                reason=f"bundled model absent: {BUNDLED} has no config.json "
                                       "(rebuild: bash training/rebuild.sh)")

CYCLIC_PROMPTS = ["0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
                  "import os\nimport os\nimport os\nimport os\nimport os\n"]
PINNED_PROMPT = "0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"
PINNED_NEW = 16
# Greedy ids of PINNED_PROMPT from the exported model: ' 13, 14, 15, 16, 17, 1' (smallest
# top-1/top-2 logit margin 3.00, far from a tie).
PINNED_IDS: list[int] = [285, 20, 13, 285, 21, 13, 285, 22, 13, 285, 23, 13, 285, 24, 13, 285]
# dspark replay tests/data/bundled_rounds.json under the default gate config (tok/s, 2 decimals).
PINNED_REPLAY: dict[str, dict[str, float]] = {'repeat': {'plain': 3.3, 'always-k': 4.94, 'threshold': 4.54, 'gated': 4.9}, 'code': {'plain': 3.3, 'always-k': 3.97, 'threshold': 4.08, 'gated': 4.37}, 'prose': {'plain': 3.3, 'always-k': 3.57, 'threshold': 3.56, 'gated': 3.34}, 'math': {'plain': 3.3, 'always-k': 4.66, 'threshold': 4.36, 'gated': 3.93}, 'overall': {'plain': 3.3, 'always-k': 4.21, 'threshold': 4.05, 'gated': 4.28}}


@pytest.fixture(scope="module")
def models():
    from services.app import load_drafter, load_trunk
    from services.gateway.tokenizer import load_tokenizer
    trunk = load_trunk(str(BUNDLED))
    draft = load_drafter(str(BUNDLED))
    tok = load_tokenizer(str(BUNDLED), trunk.cfg.vocab_size, trunk.cfg.eos_token_id)
    return trunk, draft, tok


@torch.no_grad()
def greedy(trunk, ids: list[int], new: int) -> tuple[list[int], torch.Tensor]:
    """The trunk's greedy continuation (new ids) and the tap rows [P + new - 1, T*D] of every position."""
    st = trunk.new_state()
    out = trunk.prefill(st, torch.tensor(ids), keep_rows=len(ids))
    taps, gen = [out.taps], []
    for pos in range(len(ids), len(ids) + new):
        gen.append(int(out.logits.argmax()))
        if pos == len(ids) + new - 1:
            break
        out = trunk.decode(st, gen[-1], pos)
        taps.append(out.taps)
    return gen, torch.cat(taps)


@torch.no_grad()
def always_k_rounds(draft, prompt: list[int], gen: list[int], taps: torch.Tensor) -> tuple[int, int, list[int]]:
    """(accepted, submitted, accepted per round) of greedy always-k rounds along `gen`."""
    seq = prompt + gen
    B, st = draft.cfg.dspark_block_size, draft.new_state()
    p, committed, accepted, submitted, per_round = len(prompt) - 1, -1, 0, 0, []
    while p + 1 + B < len(seq):  # every draft of the round has a target token to compare with
        draft.write_main_kv(st, taps[committed + 1:p + 1], range(committed + 1, p + 1))
        committed = p
        out = draft.draft(st, seq[p + 1], p)  # anchor: the committed token at p + 1
        a = 0
        while a < B and out.tokens[a] == seq[p + 2 + a]:
            a += 1
        accepted, submitted = accepted + a, submitted + B
        per_round.append(a)
        p += a + 1  # the accepted drafts and the bonus token are committed
    return accepted, submitted, per_round


@pytest.mark.parametrize("text", CYCLIC_PROMPTS, ids=["counting", "repeated-line"])
def test_bundled_draft_accepts_80_percent_on_a_cyclic_prompt(models, text):
    trunk, draft, tok = models
    prompt = tok.encode(text)
    gen, taps = greedy(trunk, prompt, 48)
    accepted, submitted, per_round = always_k_rounds(draft, prompt, gen, taps)
    assert submitted >= 20
    assert accepted / submitted >= 0.80, (accepted, submitted, per_round, tok.decode(gen))


def test_greedy_continuation_through_the_checkpoint_loader_is_pinned(models):
    trunk, _, tok = models
    gen, _ = greedy(trunk, tok.encode(PINNED_PROMPT), PINNED_NEW)
    assert gen == PINNED_IDS, tok.decode(gen)


def test_replay_of_the_committed_bundled_rounds_is_pinned():
    from services.gateway.gate import GateConfig
    from services.analysis.replay import replay_log
    from services.gateway.rounds import load_rounds
    report = replay_log(load_rounds(ROUNDS), GateConfig())
    got = {w.name: {p: round(r.tok_s, 2) for p, r in w.results.items()} for w in report.workloads + [report.overall]}
    assert got == PINNED_REPLAY
