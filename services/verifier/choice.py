"""How a verifier session chooses its tokens from the target's logits (docs/sampling.md).

Owns the per-position decisions of the verifier's accept rule on top of `dsv4.sampling`:
the next token of a prefill or decode, the verdict on one draft of a verify block, the
logprob record of every chosen token, and the check of a verify's draft distributions.
It never forwards a model and holds no session; `services.verifier.engine` calls it from
`absorb`, the one place both the per-session calls and the step loop take results through.

Positions. The logits of position t choose the token at t + 1: a prefill of n tokens
chooses position n, a decode at t chooses t + 1, row i of a verify block at n chooses
n + i + 1. Every random draw is keyed by that absolute position and the session's seed, so
a token does not depend on how it was reached (plain decode, sequential or batched verify,
any draft length, any batch).

Dimension legend: V = vocab, k = drafts in a block.
"""

from __future__ import annotations

import torch

from dsv4.sampling import SamplingParams, judge_draft, keyed_choice


def choose(row: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The token at `position` chosen from the logits row [V] (any float dtype) of position - 1.

    Greedy: the argmax (lowest id among ties), exactly the verifier's choice before sampling
    existed. Sampled: the Gumbel-max draw keyed by (seed, position) on the TOKEN stream, a
    sample from the filtered, temperature-scaled distribution.
    """
    if params.greedy:
        return int(row.argmax())
    return int(keyed_choice(row.reshape(1, -1), params, [position])[0])


def judge(row: torch.Tensor, ids: list[int], i: int, params: SamplingParams, position: int,
          draft_probs: torch.Tensor | None) -> int | None:
    """Row i of a verify block [anchor, d1..dk] at `position`: None when draft ids[i + 1] is
    accepted, else the token taken at position + i + 1 (the correction, or past the last
    draft the bonus token).

    row [V]: the target's logits of position + i; draft_probs [k, V] fp32 or None (the
    rejection rule's q, checked by `check_draft_probs`).
    Raises:
        ValueError: the rejection rule at T > 0 without draft_probs.
    """
    at = position + i + 1
    if i + 1 >= len(ids):
        return choose(row, params, at)
    q = None if draft_probs is None else draft_probs[i]
    return judge_draft(row.reshape(1, -1), ids[i + 1], params, at, q)


def needs_draft_probs(params: SamplingParams) -> bool:
    """Whether a verify under `params` needs the drafts' distributions: the rejection rule at T > 0."""
    return not params.greedy and params.rule == "rejection"


def check_draft_probs(params: SamplingParams, draft_probs: object, k: int, vocab: int) -> torch.Tensor | None:
    """Validate a verify's draft distributions: -> fp32 [k, V] on CPU, or None where the rule
    does not use them (greedy, coupled, or no drafts; then whatever was sent is ignored).

    Raises:
        ValueError: under the rejection rule with k > 0, draft_probs missing, not a tensor,
            not [k, V], not floating point, or holding a NaN, an infinity or a negative value
            (each named with what was received).
    """
    if not needs_draft_probs(params) or k == 0:
        return None
    if draft_probs is None:
        raise ValueError(f"draft_probs missing: the session samples with the rejection rule, so a verify "
                         f"of {k} drafts needs draft_probs float32 [{k}, {vocab}] (the q each draft was drawn from)")
    if not torch.is_tensor(draft_probs):
        raise ValueError(f"draft_probs must be a tensor, got {type(draft_probs).__name__}")
    if tuple(draft_probs.shape) != (k, vocab):
        raise ValueError(f"draft_probs shape {tuple(draft_probs.shape)}: a verify of {k} drafts needs "
                         f"[{k}, {vocab}] (drafts, vocab_size)")
    if not draft_probs.is_floating_point():
        raise ValueError(f"draft_probs dtype {draft_probs.dtype}: must be floating point (float32 on the wire)")
    q = draft_probs.detach().to("cpu", torch.float32)
    if not bool(torch.isfinite(q).all()) or bool((q < 0).any()):
        raise ValueError("draft_probs holds a NaN, an infinity or a negative value: each row must be a distribution")
    return q
