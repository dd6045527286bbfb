"""Verifier work: the admitted-request record, the per-request results, and `absorb`.

Owns what happens after a forward has run: `absorb` takes one forward's output (a decode, a
position of a stepwise verify, a prefill chunk, or a batched verify block) into its session
record, judges each logits row by the session's sampling rule (`services.verifier.choice`),
rolls a batched block back to what it accepted, commits the rows, and returns the
`StepResult` / `VerifyResult` once the request is complete. The per-session calls of
`services.verifier.engine` and the step loop (`services.verifier.batcher`) both finish their
requests here, so the two paths return the same results.

It must not validate client values (`VerifierEngine.admit_*` does, before a `Work` exists),
run forwards, take session locks (callers hold them), or know about gRPC.

Dimension legend: V = vocab, T = len(dspark_target_layer_ids), D = dim, k = drafts in a
block, a = accepted drafts (0 <= a <= k).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.verifier.choice import choose, judge
from services.verifier.committed import CommittedRows

from dsv4.sampling import GREEDY, SamplingParams, TokenLogprob, token_logprobs
from dsv4.trunk_state import TrunkState


@dataclass(frozen=True)
class StepResult:
    """Result of prefill or decode.

    next_token: the token the session chooses from the last consumed position's logits (the
        new anchor; the argmax for a greedy session).
    margin: top1 - top2 raw logit there (logit units).
    rows: [R, T*D] fp32 tap rows of `positions` (prefill: the last min(n, keep_rows)).
    positions: absolute positions of `rows`.
    forward_ms: wall time of the model forward (ms).
    logprobs: one record, next_token's (raw target logprob and the session's top-N).
    step_rows: rows (tokens) of the step-loop batch step that completed it; 0 outside one.
    """

    next_token: int
    margin: float
    rows: torch.Tensor
    positions: range
    forward_ms: float
    logprobs: tuple[TokenLogprob, ...] = ()
    step_rows: int = 0


@dataclass(frozen=True)
class VerifyResult:
    """Result of verifying a draft block [anchor, d1..dk] at positions n..n+k.

    accepted: a, the drafts accepted by the session's rule (0..k; greedy: the longest prefix
        matching the target's argmax).
    bonus_token: the token chosen from the logits at n+a (the next anchor; not yet
        forwarded): the correction after a rejected draft, else the bonus token.
    margin: top1 - top2 raw logit at n+a.
    rows: [a+1, T*D] fp32 tap rows of positions n..n+a.
    positions: range(n, n+a+1).
    forwarded: positions forwarded (sequential: a+1, it stops at the first mismatch;
        batched: k+1).
    rollback_bytes: bytes copied to restore the state after rejected positions (batched).
    forward_ms: wall time of the model forwards (ms).
    step_rows: rows (tokens) of the step-loop batch step that completed it; 0 outside one.
    """

    accepted: int
    bonus_token: int
    margin: float
    rows: torch.Tensor
    positions: range
    forwarded: int
    rollback_bytes: int
    forward_ms: float
    logprobs: tuple[TokenLogprob, ...] = ()  # a + 1 records: the accepted drafts, then bonus_token
    step_rows: int = 0


@dataclass
class SessionRecord:
    """One verifier session: its target state, committed tail, and sampling parameters."""

    state: TrunkState
    committed: CommittedRows
    prefilled: bool = False
    sampling: SamplingParams = GREEDY  # set by the prefill, fixed for the session's life


@dataclass
class Work:
    """One admitted request (`VerifierEngine.admit_*`): its values are valid for the session.

    op: "prefill" | "decode" | "verify". ids: the prompt [n], the decoded token [1] or the
    block [anchor, d1..dk]. position: where ids[0] goes (0 for a prefill). mode: the verify
    path. A stepwise verify (sequential, or no drafts) forwards one position per forward:
    `done` counts the positions forwarded so far, `rows` their [1, T*D] fp32 tap rows,
    `logprobs` the records of the tokens chosen so far. A prefill fed in chunks (the step
    loop) counts its prompt positions forwarded in `done` and keeps the tap rows
    [<= keep, T*D] fp32 of the last `keep` of them in `rows`.
    forward_ms: wall time of the forwards it took part in so far (ms).
    sampling: a prefill's sampling parameters (the session keeps them). draft_probs: a
    verify's [k, V] fp32 draft distributions (rejection rule only; else None).
    """

    sid: int
    op: str
    ids: list[int]
    position: int
    mode: str = "batched"
    done: int = 0
    rows: list[torch.Tensor] = field(default_factory=list)
    forward_ms: float = 0.0
    sampling: SamplingParams = GREEDY
    draft_probs: torch.Tensor | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    keep: int = 0

    @property
    def stepwise(self) -> bool:
        """A verify forwarded one position at a time (sequential mode, or a block of no drafts)."""
        return self.op == "verify" and (self.mode == "sequential" or len(self.ids) == 1)


def top2_margin(logits: torch.Tensor) -> tuple[int, float]:
    """logits [V] -> (argmax id, top1 - top2 in logit units). Ties pick the lowest id (torch.argmax)."""
    top = torch.topk(logits.float(), 2).values
    return int(logits.argmax()), float(top[0] - top[1])

def absorb(s: SessionRecord, work: Work, out, ms: float, model=None) -> StepResult | VerifyResult | None:
    """Take one forward's output for an admitted decode or verify into its session record `s`.

    `out`: the trunk's ForwardOutput (a decode, one position of a stepwise verify, or one
    chunk of a prefill) or BlockOutput (a batched verify block, still open); `ms`: that
    forward's wall time (ms), added to `work.forward_ms`; `model`: the trunk, which rolls a
    block back (verify only). Tokens are chosen and drafts judged by the session's sampling
    rule (a prefill: the request's), one logits row at a time (`services.verifier.choice`).
    Returns the request's result once it is complete, its rows committed; None when a
    stepwise verify needs its next position forwarded (position work.position + work.done)
    or a prefill its next chunk (from position work.done).
    Raises:
        ValueError: a rejection-rule verify without draft_probs (admission prevents it).
    """
    work.forward_ms += ms
    if work.op == "prefill":
        return _absorb_chunk(s, work, out)
    params = s.sampling
    if work.op == "decode":
        token = choose(out.logits, params, work.position + 1)
        lp = token_logprobs(out.logits.reshape(1, -1), [token], params.logprobs)
        result = StepResult(token, top2_margin(out.logits)[1], out.taps, range(work.position, work.position + 1),
                            work.forward_ms, tuple(lp))
        s.committed.add(result.rows, result.positions, token, result.margin)
        return result
    n, ids = work.position, work.ids
    if work.stepwise:
        i = work.done
        work.rows.append(out.taps)
        work.done += 1
        token = _judge_row(work, out.logits, i, params)
        if token is None:
            return None
        result = VerifyResult(i, token, top2_margin(out.logits)[1], torch.cat(work.rows), range(n, n + i + 1),
                              i + 1, 0, work.forward_ms, tuple(work.logprobs))
    else:
        a = 0
        while (token := _judge_row(work, out.logits[a], a, params)) is None:
            a += 1
        copied = model.rollback(s.state, out.undo, keep=a + 1)
        result = VerifyResult(a, token, top2_margin(out.logits[a])[1], out.taps[: a + 1], range(n, n + a + 1),
                              len(ids), copied, work.forward_ms, tuple(work.logprobs))
    s.committed.add(result.rows, result.positions, result.bonus_token, result.margin)
    return result


def _judge_row(work: Work, row: torch.Tensor, i: int, params: SamplingParams) -> int | None:
    """Judge row i ([V] logits of position work.position + i) of a verify block and record the
    logprob of the token taken at the next position: None when draft i + 1 is accepted, else
    the token chosen there (the correction, or past the last draft the bonus token)."""
    token = judge(row, work.ids, i, params, work.position, work.draft_probs)
    taken = work.ids[i + 1] if token is None else token
    work.logprobs += token_logprobs(row.reshape(1, -1), [taken], params.logprobs)
    return token


def _absorb_chunk(s: SessionRecord, work: Work, out) -> StepResult | None:
    """Take one prefill chunk's ForwardOutput (logits [V] fp32 of its last position, taps
    [<= keep, T*D] fp32 of its last positions) into `work`; once the chunk that ends the
    prompt is in, commit the prefill as `VerifierEngine.prefill` does and return its result:
    the next token and margin of position n-1 and the tap rows of the last min(n, keep)."""
    work.done = s.state.next_position  # a prompt starts at 0: positions forwarded so far
    tail = torch.cat([*work.rows, out.taps])[-work.keep:] if work.keep else out.taps[:0]
    work.rows = [tail]  # only the rows the result can still return are held
    if work.done < len(work.ids):
        return None
    n = work.done
    token = choose(out.logits, work.sampling, n)
    result = StepResult(token, top2_margin(out.logits)[1], tail, range(n - tail.shape[0], n), work.forward_ms,
                        tuple(token_logprobs(out.logits.reshape(1, -1), [token], work.sampling.logprobs)))
    s.committed.add(result.rows, result.positions, token, result.margin)
    s.sampling, s.prefilled = work.sampling, True  # only once the whole prompt is in
    return result


def abandon(s: SessionRecord, work: Work) -> None:
    """A request failed part way (its session record `s` held by the caller): a prefill that
    forwarded some chunks leaves its session empty again, so the prompt can be sent again."""
    if work.op == "prefill" and s.state.next_position > 0 and not s.prefilled:
        s.state.reset()
