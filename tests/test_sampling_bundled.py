"""Losslessness of both acceptance rules on the bundled model (assets/dspark-small): the first
3 sampled tokens after a prose prompt, speculation on vs off, two-sample chi-square.

Speculation off: the prefill's token, then plain keyed choices. Speculation on: the prefill's
token, then rounds of K = 2 drafts from the bundled DSpark module, sampled slot by slot after
the Markov head with `draft_choice` (the Markov bias of slot j follows the token sampled at
slot j - 1), verified by `accept_coupled` or `accept_rejection` against the trunk's logits.
The trunk's logits and the draft module's hidden states are functions of the token prefix, so
each distinct prefix is forwarded once (at most 1 + 3 + 9 + 27 with top_k 3) and every sample
reuses them; the per-sample work is the rule itself. 2,000 samples per arm, one seed each;
a correct rule gives p > 0.01. Skips when the bundled checkpoint is absent.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch

from dsv4.sampling import SamplingParams, accept_coupled, accept_rejection, draft_choice, keyed_choice
from tests.sampling_stats import fit_two_sample

BUNDLED = Path(__file__).resolve().parents[1] / "assets" / "dspark-small"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (BUNDLED / "config.json").is_file(),
                                 reason=f"bundled model absent: {BUNDLED} has no config.json")]
PROMPT = "The old lighthouse keeper walked slowly along the"
N, NEW, K = 2000, 3, 2
PARAMS = SamplingParams(temperature=1.0, top_p=0.9, top_k=3)


class Model:
    """The bundled trunk and draft module with per-prefix caches (CPU, one thread)."""

    def __init__(self):
        from services.app import load_drafter, load_trunk
        from services.gateway.tokenizer import load_tokenizer
        self.trunk, self.draft = load_trunk(str(BUNDLED)), load_drafter(str(BUNDLED))
        cfg = self.trunk.cfg
        self.prompt = load_tokenizer(str(BUNDLED), cfg.vocab_size, cfg.eos_token_id).encode(PROMPT)
        self.forward = functools.lru_cache(maxsize=None)(self._forward)
        self.hidden = functools.lru_cache(maxsize=None)(self._hidden)

    @torch.no_grad()
    def _forward(self, ids: tuple[int, ...]):
        """ids -> (logits [V] fp32 choosing position len(ids), tap rows of every position)."""
        out = self.trunk.prefill(self.trunk.new_state(), torch.tensor(ids), keep_rows=len(ids), taps=True)
        return out.logits.float(), out.taps

    @torch.no_grad()
    def _hidden(self, ids: tuple[int, ...]) -> torch.Tensor:
        """The draft's pre-head logits [B, V] after anchor ids[-1] (rings: rows of ids[:-1])."""
        n = len(ids) - 1
        _, taps = self.forward(ids[:-1])
        state = self.draft.new_state()
        self.draft.write_main_kv(state, taps[-self.draft.cfg.window_size:],
                                 range(max(0, n - self.draft.cfg.window_size), n))
        out = self.draft.draft(state, ids[-1], n - 1)
        return self.draft.head(self.draft.mtp[-1].norm(out.hidden).float()), out

    def drafts(self, ids: tuple[int, ...], k: int, params: SamplingParams):
        """k drafts after anchor ids[-1] sampled slot by slot after the Markov head: (ids, q [k, V])."""
        base, _ = self.hidden(ids)
        markov, prev, toks, qs = self.draft.mtp[-1].markov_head, torch.tensor([ids[-1]]), [], []
        for j in range(k):
            logits = base[j] + markov.markov_w2(markov.markov_w1(prev))[0]
            tok, q = draft_choice(logits[None], params, [len(ids) + j])
            toks.append(int(tok[0]))
            qs.append(q[0])
            prev = tok
        return toks, torch.stack(qs)


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many small forwards: threads only contend
    yield Model()
    torch.set_num_threads(threads)


def plain_sample(m: Model, params: SamplingParams) -> tuple[int, ...]:
    ids = tuple(m.prompt)
    for _ in range(NEW):
        ids += (int(keyed_choice(m.forward(ids)[0][None], params, [len(ids)])[0]),)
    return ids[-NEW:]


def spec_sample(m: Model, params: SamplingParams) -> tuple[int, ...]:
    ids = tuple(m.prompt)
    ids += (int(keyed_choice(m.forward(ids)[0][None], params, [len(ids)])[0]),)  # the prefill's token
    while len(ids) < len(m.prompt) + NEW:
        k = min(K, len(m.prompt) + NEW - len(ids))  # no row past the last token measured
        drafts, q = m.drafts(ids, k, params)
        rows = torch.stack([m.forward(ids + tuple(drafts[:i]))[0] for i in range(k + 1)])
        if params.rule == "coupled":
            res = accept_coupled(rows, drafts, params, len(ids))
        else:
            res = accept_rejection(rows, q, drafts, params, len(ids))
        ids += (*drafts[:res.accepted], res.token)
    return ids[len(m.prompt):len(m.prompt) + NEW]


def test_markov_reconstruction_matches_the_module(model):
    """The slot-by-slot Markov loop above is the module's own when each slot takes the argmax."""
    ids = tuple(model.prompt)
    base, out = model.hidden(ids)
    greedy = dataclasses.replace(PARAMS, temperature=0.0)
    toks, _ = model.drafts(ids, len(out.tokens), greedy)
    assert toks == out.tokens


@pytest.mark.parametrize("rule", ["coupled", "rejection"])
def test_first_tokens_spec_on_match_spec_off(model, rule):
    params = dataclasses.replace(PARAMS, rule=rule)
    off = [plain_sample(model, dataclasses.replace(params, seed=10_000 + i)) for i in range(N)]
    on = [spec_sample(model, dataclasses.replace(params, seed=20_000 + i)) for i in range(N)]
    fit = fit_two_sample(on, off)
    assert fit.df >= 5, fit  # a real distribution over several outcomes
    assert fit.pvalue > 0.01, fit
