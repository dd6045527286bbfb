"""Token selection from logits: greedy, seeded sampling, and the two lossless acceptance rules.

Owns the sampling parameters of a request, the filters (temperature, top-k, top-p, min-p),
the keyed random streams and the two acceptance rules of speculative sampling
(docs/sampling.md). It is pure tensor math on CPU or device tensors: it never holds a
session, never forwards a model and knows nothing of gRPC.

Dimension legend: S = rows (positions) in one call, V = vocab, k = drafts in a block.

Positions. Every random draw is keyed by (seed, position, stream): `position` is the absolute
index, in the whole sequence (prompt included), of the token being chosen. The logits that
choose the token at position t are the target's (or the draft's) logits of position t - 1.
Keying by position rather than by a running counter is what makes a token a function of
(logits, seed, position) alone: it does not matter how many rounds, drafts, retries or other
requests came before it.

Streams. Each use of randomness has its own stream, so no two uses ever share a draw:
  TOKEN    the Gumbel noise of the coupled choice (plain decode, coupled verify, bonus token);
  DRAFT    the drafter's own samples under the rejection rule;
  ACCEPT   the uniform that accepts or rejects a draft under the rejection rule;
  RESIDUAL the Gumbel noise that resamples from the residual after a rejection.
Under the coupled rule the drafter proposes with the TOKEN stream itself: that shared draw is
the coupling, and it is why an accepted draft is exactly the token plain decode would pick.

Random numbers come from Philox-4x32-10 keyed by (seed, position, stream)
(`dsv4.keyed_noise`): a counter-based generator computed with integer tensor ops on the
device that holds the logits, bit for bit the same on a CPU and a GPU, so the drafter and the
verifier (separate processes, possibly separate machines and devices) draw the same noise for
the same key, and sampling never leaves the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from dsv4 import keyed_noise

TOKEN, DRAFT, ACCEPT, RESIDUAL = 0, 1, 2, 3  # random streams (see the module docstring)
STREAMS = (TOKEN, DRAFT, ACCEPT, RESIDUAL)
RULES = ("coupled", "rejection")
MAX_LOGPROBS = 20  # top alternatives a request may ask for per token
SEED_LIMIT = 2 ** 63  # seeds are non-negative int64 (they travel as uint64 / int64 on the wire)
# The smallest temperature > 0. `filtered_logits` divides fp32 logits by it: below about
# |logit| / 3.4e38 a logit overflows to inf and the softmax of its row is NaN, so the token
# would be garbage (and a drafter's q non-finite). At 1e-30 logits up to 3.4e8 stay finite,
# far beyond any model's, and the distribution is already the argmax's for every real gap.
MIN_TEMPERATURE = 1e-30


@dataclass(frozen=True)
class SamplingParams:
    """How one request chooses its tokens.

    temperature: 0 is greedy (argmax, no randomness, every other field but logprobs ignored);
        >= MIN_TEMPERATURE divides the logits before the filters. Finite.
    top_p: keep the smallest set of most likely tokens whose probability reaches top_p, in (0, 1].
    top_k: keep the k most likely tokens; 0 keeps all.
    min_p: drop tokens whose probability is below min_p x the top token's, in [0, 1].
    seed: the key of every random draw, in [0, 2**63).
    rule: "coupled" (a token is a function of logits, seed and position) or "rejection"
        (standard speculative rejection sampling); see docs/sampling.md.
    logprobs: top alternatives returned per token, 0..MAX_LOGPROBS (the chosen token's own
        logprob is always returned).
    Raises:
        ValueError: naming the field and value: NaN or infinite floats, a negative
            temperature or one in (0, MIN_TEMPERATURE), top_p outside (0, 1], top_k < 0,
            min_p outside [0, 1], a seed outside [0, 2**63), an unknown rule, logprobs
            outside 0..MAX_LOGPROBS, non-integer ints.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    rule: str = "coupled"
    logprobs: int = 0

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name}={v!r}: must be a finite number")
        for name in ("top_k", "seed", "logprobs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"{name}={v!r}: must be an integer")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature:g}: must be >= 0 (0 is greedy)")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature={self.temperature:g}: must be 0 (greedy) or >= {MIN_TEMPERATURE:g} "
                             "(a smaller one overflows the scaled logits)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p:g}: must lie in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}: must be >= 0 (0 keeps every token)")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p:g}: must lie in [0, 1]")
        if not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed={self.seed}: must lie in [0, 2**63)")
        if self.rule not in RULES:
            raise ValueError(f"rule={self.rule!r}: must be one of {', '.join(RULES)}")
        if not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs={self.logprobs}: must lie in 0..{MAX_LOGPROBS}")

    @property
    def greedy(self) -> bool:
        """Temperature 0: the argmax, with no randomness."""
        return self.temperature == 0


GREEDY = SamplingParams()


# ---------------------------------------------------------------------- filters
def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature and filters: logits [S, V] (any float dtype) -> [S, V] fp32, the
    temperature-scaled logits with -inf outside each row's kept set.

    The filters apply in a fixed order (top-k, then top-p, then min-p), each to the
    distribution left by the previous one, and always keep each row's most likely token,
    so a row never ends empty. Greedy params return the logits unchanged (as fp32).
    Raises:
        ValueError: logits not 2-D.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [S, V], got shape {tuple(logits.shape)}")
    x = logits.float()
    if params.greedy:
        return x
    x = x / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, dim=-1).values[:, -1:]  # [S, 1]
        x = x.masked_fill(x < kth, -math.inf)
    if params.top_p < 1:
        x = _top_p(x, params.top_p)
    if params.min_p > 0:
        p = x.softmax(-1)
        x = x.masked_fill(p < params.min_p * p.max(-1, keepdim=True).values, -math.inf)
    return x


def _top_p(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest prefix of tokens sorted by probability whose mass reaches top_p:
    x [S, V] fp32 -> [S, V] with -inf elsewhere. Ties at the cut are broken by token id (the
    stable sort), so the kept set is a function of the logits alone."""
    p_sorted, order = x.softmax(-1).sort(dim=-1, descending=True, stable=True)  # [S, V]
    before = p_sorted.cumsum(-1) - p_sorted  # mass strictly before each token
    drop_sorted = before >= top_p  # the first token (before = 0) is always kept
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return x.masked_fill(drop, -math.inf)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution tokens are drawn from: logits [S, V] -> probs [S, V] fp32 (rows sum
    to 1). Greedy: one-hot on the argmax (lowest id among ties)."""
    x = filtered_logits(logits, params)
    if params.greedy:
        return torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).float()
    return x.softmax(-1)


def logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of the target's raw distribution (log-softmax of the model's logits, before
    temperature and filters; docs/sampling.md says why): logits [S, V], tokens [S] int64 ->
    (chosen [S] fp32, top_values [S, top] fp32, top_ids [S, top] int64), the top
    alternatives in descending order (lowest id first among ties)."""
    lp = logits.float().log_softmax(-1)  # [S, V]
    chosen = lp.gather(-1, tokens.reshape(-1, 1).long().to(lp.device))[:, 0]
    if top == 0:  # the common case: no full-vocab sort
        empty = torch.zeros(lp.shape[0], 0, dtype=torch.int64, device=lp.device)
        return chosen, lp.gather(-1, empty), empty
    order = lp.argsort(dim=-1, descending=True, stable=True)[:, :top]  # [S, top]
    return chosen, lp.gather(-1, order), order


@dataclass(frozen=True)
class TokenLogprob:
    """One chosen token's logprob under the target's raw distribution (natural log), and its
    `top` alternatives: top_ids / top_logprobs in descending logprob, lowest id first among
    ties (empty when none were asked for). rank: the token's rank in the distribution, the
    count of ids at least as likely (1 for the most likely; vLLM's `rank`), computed for
    prompt logprobs only (0: not computed)."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    rank: int = 0


def token_logprobs(logits: torch.Tensor, tokens, top: int, ranks: bool = False) -> list[TokenLogprob]:
    """`logprobs` as records: logits [S, V], tokens S ids, top 0..MAX_LOGPROBS -> S records;
    `ranks`: also each token's rank (one more pass over the row's V logprobs).

    Each row is computed on its own, so a token's logprob does not depend on how many rows
    the caller's forward held (a block verify and a decode agree whenever their logits do).
    Raises:
        ValueError: top outside 0..MAX_LOGPROBS, or a token count that does not match the rows.
    """
    if not 0 <= top <= MAX_LOGPROBS:
        raise ValueError(f"logprobs top={top}: must lie in 0..{MAX_LOGPROBS}")
    tokens = [int(t) for t in tokens]
    if len(tokens) != logits.shape[0]:
        raise ValueError(f"{len(tokens)} tokens for {logits.shape[0]} logits rows")
    out = []
    for i, t in enumerate(tokens):
        chosen, values, ids = logprobs(logits[i:i + 1], torch.tensor([t]), top)
        rank = int((logits[i].float().log_softmax(-1) >= chosen[0]).sum()) if ranks else 0
        out.append(TokenLogprob(t, float(chosen[0]), tuple(ids[0].tolist()), tuple(values[0].tolist()), rank))
    return out


# ---------------------------------------------------------------------- keyed noise
def uniforms(seed: int, positions, stream: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """n uniforms in (0, 1) per position keyed by (seed, position, stream): [S, n] fp64 on
    `device` (`dsv4.keyed_noise`: the same bits on every device).

    positions: S absolute token positions (ints). The same key always gives the same numbers,
    in any process, on any device. Raises ValueError for a stream not in STREAMS or a
    negative position.
    """
    if stream not in STREAMS:
        raise ValueError(f"stream={stream!r}: must be one of {STREAMS}")
    positions = [int(p) for p in positions]
    for p in positions:
        if p < 0:
            raise ValueError(f"position={p}: must be >= 0")
    return keyed_noise.to_uniform(keyed_noise.words(seed, positions, stream, n, device))


def gumbel(seed: int, positions, stream: int, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard Gumbel noise keyed by (seed, position, stream): [S, vocab] fp64 on `device`."""
    return -torch.log(-torch.log(uniforms(seed, positions, stream, vocab, device)))


def keyed_choice(logits: torch.Tensor, params: SamplingParams, positions, stream: int = TOKEN) -> torch.Tensor:
    """The Gumbel-max draw: argmax(filtered logits + Gumbel noise keyed by (seed, position,
    stream)) per row, a sample from `probabilities(logits, params)` that is a deterministic
    function of (logits, params, position). logits [S, V], positions S ints -> tokens [S]
    int64 on the logits' device. Greedy params: the argmax, with no noise."""
    x = filtered_logits(logits, params)
    if params.greedy:
        return x.argmax(-1)
    noise = gumbel(params.seed, positions, stream, x.shape[-1], x.device)
    return (x.double() + noise).argmax(-1)  # -inf + noise stays -inf: filtered tokens never win


# ---------------------------------------------------------------------- acceptance rules
@dataclass(frozen=True)
class Acceptance:
    """The outcome of verifying k drafts: `accepted` drafts a (0..k) and `token`, the token at
    the first position not covered by an accepted draft (the correction or the bonus token)."""

    accepted: int
    token: int


def accept_coupled(target_logits: torch.Tensor, drafts, params: SamplingParams, first_position: int) -> Acceptance:
    """The coupled rule: each position's token is `keyed_choice` of the target's logits; a
    draft is accepted when it equals that token.

    target_logits [k+1, V]: row i chooses the token at first_position + i; drafts: k ids.
    The result equals plain decode's tokens for the same seed whatever the drafts were.
    """
    for i, d in enumerate(int(t) for t in drafts):
        token = judge_draft(target_logits[i:i + 1], d, params, first_position + i)
        if token is not None:
            return Acceptance(i, token)
    k = len(drafts)
    return Acceptance(k, int(keyed_choice(target_logits[k:k + 1], params, [first_position + k])[0]))


def judge_draft(target_row: torch.Tensor, draft: int, params: SamplingParams, position: int,
                q_row: torch.Tensor | None = None) -> int | None:
    """One position of either rule: None when `draft` is accepted as the token at `position`,
    else the token taken there instead (the coupled choice, or the residual resample).

    target_row [1, V]: the target's logits that choose the token at `position`; q_row [V]
    fp32: the distribution `draft` was drawn from (rejection rule only; ignored otherwise).
    Each position is decided from its own row alone, so the verdict does not depend on how
    many rows the caller forwarded together: the per-position verify and the block verify
    agree bitwise whenever their logits do.
    Raises:
        ValueError: the rejection rule at T > 0 without q_row.
    """
    if params.greedy or params.rule == "coupled":
        chosen = int(keyed_choice(target_row, params, [position])[0])
        return None if chosen == draft else chosen
    if q_row is None:
        raise ValueError("the rejection rule needs the draft's distribution q (draft_probs)")
    return _rejection_step(probabilities(target_row, params)[0].double(), q_row.double().to(target_row.device),
                           draft, params.seed, position)


def _rejection_step(p: torch.Tensor, q: torch.Tensor, draft: int, seed: int, position: int) -> int | None:
    """Accept `draft` with probability min(1, p/q) (ACCEPT stream), else resample from the
    normalised max(0, p - q) (RESIDUAL stream): p, q [V] fp64 -> None (accepted) or a token."""
    u = uniforms(seed, [position], ACCEPT, 1, p.device)[0, 0]
    if bool((q[draft] > 0) & (u * q[draft] < p[draft])):  # u < p/q without dividing by a tiny q
        return None
    residual = (p - q).clamp_min(0)
    # p == q: a rejection cannot happen; guard against rounding (a select, not a branch)
    residual = torch.where(residual.sum() > 0, residual, p)
    noise = gumbel(seed, [position], RESIDUAL, p.shape[-1], p.device)[0]
    return int((residual.log() + noise).argmax())


def accept_rejection(target_logits: torch.Tensor, draft_probs: torch.Tensor, drafts, params: SamplingParams,
                     first_position: int) -> Acceptance:
    """Speculative rejection sampling, lossless in distribution.

    target_logits [k+1, V] (row i: the token at first_position + i), draft_probs [k, V] fp32:
    the distribution q each draft was drawn from (`probabilities` of the draft's logits with
    the same params), drafts: k ids. Draft i is accepted with probability min(1, p(d)/q(d))
    (ACCEPT stream); at the first rejection the token is drawn from the normalised residual
    max(0, p - q) (RESIDUAL stream); after k acceptances the bonus token is drawn from p
    (TOKEN stream). Greedy params reduce to the coupled rule.
    Raises:
        ValueError: shapes that do not match k drafts.
    """
    k = len(drafts)
    if target_logits.shape[0] != k + 1 or tuple(draft_probs.shape) != (k, target_logits.shape[-1]):
        raise ValueError(f"rejection verify of {k} drafts needs target logits [{k + 1}, V] and draft "
                         f"probs [{k}, V], got {tuple(target_logits.shape)} and {tuple(draft_probs.shape)}")
    if params.greedy:
        return accept_coupled(target_logits, drafts, params, first_position)
    for i, d in enumerate(int(t) for t in drafts):
        token = judge_draft(target_logits[i:i + 1], d, params, first_position + i, draft_probs[i])
        if token is not None:
            return Acceptance(i, token)
    return Acceptance(k, int(keyed_choice(target_logits[k:k + 1], params, [first_position + k])[0]))


def draft_choice(draft_logits: torch.Tensor, params: SamplingParams, positions) -> tuple[torch.Tensor, torch.Tensor]:
    """How the drafter proposes under `params`: draft_logits [S, V] (after the Markov bias),
    positions S ints -> (tokens [S] int64, q [S, V] fp32 the distribution they were drawn from).

    Coupled: the TOKEN stream's Gumbel-max over the draft's own filtered distribution, the
    same noise the target will use at that position. Rejection: the DRAFT stream, a sample
    independent of every draw the verifier makes. Greedy: the argmax (q one-hot).
    """
    q = probabilities(draft_logits, params)
    stream = TOKEN if params.rule == "coupled" else DRAFT
    return keyed_choice(draft_logits, params, positions, stream), q


class DraftSampler:
    """A drafter's slot chooser under `params` (the `choose` hook of `DSparkDraft.head_forward`):
    slot j of a block drafted from seed position p picks the token at absolute position
    p + 2 + j with `draft_choice`, and keeps the distribution q it drew from.

    Called as sampler(j, logits [V] fp32 after the Markov bias) -> token [1] int64 on the
    logits' device. `probs()` -> q [n, V] fp32 on CPU, one row per slot chosen so far (the
    one device-to-host copy of q per draft; slots keep theirs on the device until then).
    Raises:
        ValueError: seed_position < -1 (named), or a slot asked out of order.
    """

    def __init__(self, params: SamplingParams, seed_position: int):
        if int(seed_position) < -1:
            raise ValueError(f"seed_position={seed_position}: must be >= -1")
        self.params, self.first_position = params, int(seed_position) + 2
        self._q: list[torch.Tensor] = []

    def __call__(self, j: int, logits: torch.Tensor) -> torch.Tensor:
        if j != len(self._q):  # keyed by position: a skipped or repeated slot would misalign the noise
            raise ValueError(f"draft slot {j} chosen out of order (expected slot {len(self._q)})")
        token, q = draft_choice(logits.reshape(1, -1), self.params, [self.first_position + j])
        self._q.append(q[0])  # stays on the device: `probs()` is the reply's one copy
        return token.reshape(1)

    def probs(self) -> torch.Tensor:
        """q [n, V] fp32 on CPU: the distribution each chosen slot's token was drawn from."""
        return torch.stack(self._q).cpu() if self._q else torch.zeros(0, 0)
