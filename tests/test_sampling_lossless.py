"""Statistical losslessness of both acceptance rules on a toy model whose distribution is exact.

The toy: vocab V = 4, a bigram target p(. | prev) and a bigram draft q(. | prev), each row a
cyclic shift of one fixed pair of distributions chosen so the draft often proposes tokens the
target rejects (q piles mass where p has little, and has almost none where p has some), which
is where a broken rule shows. After the prompt token 0 the real speculative loop runs: the
draft proposes k = 2 tokens with `draft_choice` at their absolute positions, the rule
(`accept_coupled` / `accept_rejection`) verifies them against the target's logits rows, and
the loop repeats until 3 tokens are generated. Their exact joint law is
p(t1 | 0) p(t2 | t1) p(t3 | t2) under the request's temperature and filters.

The test (`fit_exact`): N = 3,000 samples (one seed each) against that law, one-sample
chi-square with cells of expected count < 5 pooled; a correct rule must give p > 0.01 and a
TV distance under its 0.999 sampling-error bound (0.08 to 0.10 here). Power: with the 26 (coupled,
T = 0.7) and 63 (rejection, T = 1) pooled degrees of freedom of these cases, the test rejects
at level 0.01 with probability >= 99% every sampler whose law is at TV >= 0.067 (26 df) or
0.078 (63 df) from the exact one on the pooled cells (`detectable_tv`; asserted below). The same function must reject (p < 1e-6) two deliberately
broken variants: accepting a draft with probability p(d) instead of p(d)/q(d), and drawing the
draft with the residual resample's random stream (one stream for both).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import pytest
import torch

from dsv4.sampling import (ACCEPT, DRAFT, RESIDUAL, TOKEN, Acceptance, SamplingParams, accept_coupled,
                           accept_rejection, draft_choice, gumbel, keyed_choice, probabilities, uniforms)
from tests.sampling_stats import detectable_tv, fit_exact

V, K, NEW, N = 4, 2, 3, 3000
_P = torch.tensor([0.207, 0.417, 0.109, 0.268])  # the target's row for prev = 0; row r is this rolled by r
_Q = torch.tensor([0.167, 0.246, 0.576, 0.011])  # the draft's
TARGET = torch.stack([_P.roll(r).log() for r in range(V)])  # [V, V] logits, row = previous token
DRAFTER = torch.stack([_Q.roll(r).log() for r in range(V)])
COUPLED = SamplingParams(temperature=0.7, top_p=0.9, rule="coupled")
REJECTION = SamplingParams(temperature=1.0, top_p=0.9, rule="rejection")


def _draft(prev: int, params: SamplingParams, first: int, stream: int | None = None):
    """K drafts from the bigram draft after `prev` for positions first..first+K-1: (ids, q [K, V]).
    `stream` None: the real `draft_choice`; else a broken drafter drawing from that stream."""
    ids, qs = [], []
    for j in range(K):
        row = DRAFTER[prev:prev + 1]
        if stream is None:
            tok, q = draft_choice(row, params, [first + j])
        else:
            tok, q = keyed_choice(row, params, [first + j], stream), probabilities(row, params)
        ids.append(int(tok[0]))
        qs.append(q[0])
        prev = ids[-1]
    return ids, torch.stack(qs)


def _no_ratio(target_logits, q, drafts, params, first):
    """Broken: accept a draft with probability p(d), not min(1, p(d)/q(d)); else as the real rule."""
    p = probabilities(target_logits, params).double()
    for i, d in enumerate(drafts):
        if float(uniforms(params.seed, [first + i], ACCEPT, 1)[0, 0]) < p[i, d]:
            continue
        residual = (p[i] - q[i].double()).clamp_min(0)
        noise = gumbel(params.seed, [first + i], RESIDUAL, V)[0]
        return Acceptance(i, int((residual.log() + noise).argmax()))
    return Acceptance(len(drafts), int(keyed_choice(target_logits[-1:], params, [first + len(drafts)])[0]))


RULES = {
    "coupled": (lambda t, q, d, p, f: accept_coupled(t, d, p, f), None),
    "rejection": (accept_rejection, None),
    "no-ratio": (_no_ratio, None),
    "shared-stream": (accept_rejection, RESIDUAL),  # the draft's noise is the residual resample's
}


def speculative_sample(params: SamplingParams, rule: str) -> tuple[int, ...]:
    """The first NEW tokens after prompt [0] by the speculative loop under `rule` (see RULES)."""
    accept, stream = RULES[rule]
    tokens = [0]
    while len(tokens) <= NEW:
        n = len(tokens) - 1  # the anchor's position: the drafts take n+1..n+K
        drafts, q = _draft(tokens[-1], params, n + 1, stream)
        result = accept(TARGET[[tokens[-1], *drafts]], q, drafts, params, n + 1)
        tokens += [*drafts[:result.accepted], result.token]
    return tuple(tokens[1:NEW + 1])


@functools.lru_cache(maxsize=None)
def exact_law(params: SamplingParams) -> dict[tuple[int, ...], float]:
    """The exact joint law of the first NEW tokens of plain sampling under `params`."""
    p = probabilities(TARGET, params).double()  # [V, V]
    law = {}
    for seq in itertools.product(range(V), repeat=NEW):
        prob, prev = 1.0, 0
        for t in seq:
            prob, prev = prob * float(p[prev, t]), t
        law[seq] = prob
    return law


def samples(params: SamplingParams, rule: str, seed0: int) -> list[tuple[int, ...]]:
    return [speculative_sample(dataclasses.replace(params, seed=seed0 + i), rule) for i in range(N)]


@pytest.mark.parametrize("rule,params", [("coupled", COUPLED), ("rejection", REJECTION)])
def test_rule_is_lossless(rule, params):
    fit = fit_exact(samples(params, rule, seed0=1000), exact_law(params))
    assert fit.pvalue > 0.01, fit
    assert fit.tv <= fit.tv_bound, fit
    assert 20 <= fit.df <= 63  # the pooling the power statement assumes
    assert detectable_tv(N, fit.df) <= 0.078


@pytest.mark.parametrize("rule", ["no-ratio", "shared-stream"])
def test_broken_variants_are_rejected(rule):
    fit = fit_exact(samples(REJECTION, rule, seed0=1000), exact_law(REJECTION))
    assert fit.pvalue < 1e-6, fit


def test_coupled_sample_is_the_plain_decode_choice():
    """Coupled: whatever the drafts, the speculative tokens are plain decode's keyed choices."""
    for seed in range(50):
        params = dataclasses.replace(COUPLED, seed=seed)
        plain = [0]
        for pos in range(1, NEW + 1):
            plain.append(int(keyed_choice(TARGET[plain[-1]:plain[-1] + 1], params, [pos], TOKEN)[0]))
        assert speculative_sample(params, "coupled") == tuple(plain[1:])


def test_rejection_streams_are_distinct():
    """Drafting, acceptance and resampling never share a draw: their keyed uniforms differ."""
    rows = [uniforms(7, [5], s, 8) for s in (TOKEN, DRAFT, ACCEPT, RESIDUAL)]
    for a, b in itertools.combinations(rows, 2):
        assert not torch.equal(a, b)
    assert torch.equal(uniforms(7, [5], DRAFT, 8), uniforms(7, [5], DRAFT, 8))
