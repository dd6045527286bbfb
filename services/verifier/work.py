"""Verifier work: the one per-session record, the per-request results, and `absorb`.

`SessionRecord` is the verifier's one record of a session, from admission to the reply: its
target state, committed tail and sampling parameters, and the request in flight (op, ids,
position, draft probabilities, the positions forwarded so far). `VerifierEngine.admit_*`
validates a request and writes it into the record (`begin`); the step loop
(`services.verifier.batcher`) schedules records, builds each one's forward input (`item`),
runs one `forward_batch` and hands each output back to `absorb`, which judges each logits row
by the session's sampling rule (`services.verifier.choice`), rolls a batched block back to
what it accepted, commits the rows, and returns the `StepResult` / `VerifyResult` once the
request is complete; `end` then clears the request. A prefill is finished only here
(`_absorb_chunk`), whatever its chunks.

It must not validate client values (`VerifierEngine.admit_*` does, before `begin`), run
forwards, take session locks (callers hold them), or know about gRPC.

Dimension legend: V = vocab, T = len(dspark_target_layer_ids), D = dim, k = drafts in a
block, a = accepted drafts (0 <= a <= k).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from services.verifier.choice import choose, judge
from services.verifier.committed import CommittedRows
from services.common.controls import ControlState

from dsv4.batch import BatchItem
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
    prompt_logprobs: a prefill that asked for them: n - 1 records, those of prompt tokens
        x[1..n-1], each from the raw logits of the position before it (empty otherwise).
    """

    next_token: int
    margin: float
    rows: torch.Tensor
    positions: range
    forward_ms: float
    logprobs: tuple[TokenLogprob, ...] = ()
    step_rows: int = 0
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


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
    admitted: the drafts the verifier judged, k or fewer when the step's budget cut the block
        (`services.common.budget`); accepted <= admitted.
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
    admitted: int = 0


@dataclass(eq=False)  # compared by identity: one record per session
class SessionRecord:
    """One verifier session: its target state, committed tail and sampling parameters, and
    the request in flight (none while `op` is None).

    Session: sid; state (the target's rings and caches); committed (its last window_size tap
    rows); prefilled (the whole prompt is in); sampling (set by the prefill's admission, fixed
    for the session's life once prefilled).
    Request (`begin` sets it, `end` clears it): op "prefill" | "decode" | "verify"; ids the
    prompt [n], the decoded token [1] or the block [anchor, d1..dk]; position where ids[0]
    goes (0 for a prefill); mode the verify path; draft_probs a verify's [k, V] fp32 draft
    distributions (rejection rule only; else None); keep the tap rows a prefill returns;
    future what its caller awaits. Progress: a stepwise verify (sequential, or no drafts)
    forwards one position per step, `done` counting the positions forwarded, `rows` their
    [1, T*D] fp32 tap rows and `logprobs` the records of the tokens chosen so far; a prefill
    fed in chunks counts its prompt positions forwarded in `done` and keeps the tap rows
    [<= keep, T*D] fp32 of the last `keep` of them in `rows`. forward_ms: wall time of the
    forwards it took part in so far (ms).
    controls: the session's logits controls and output constraint over its committed tokens
    (`services.common.controls.ControlState`; None: neither): every row a token is chosen
    from, and every draft judged by, is the row they transform (docs/sampling.md,
    docs/structured.md).
    prompt_logprobs: a prefill's top alternatives per prompt token (0..MAX_LOGPROBS), None
    when it asked for no prompt logprobs; prompt_records the records of the prompt tokens
    scored so far (one per prompt token after the first, in order).
    survival: a batched verify's per-draft P(drafts 1..j all accepted), the gateway's estimate
    the step's budget admits drafts by (`services.common.budget`; None: the block is verified
    whole).
    """

    sid: int
    state: TrunkState
    committed: CommittedRows
    prefilled: bool = False
    sampling: SamplingParams = GREEDY
    op: str | None = None
    ids: list[int] = field(default_factory=list)
    position: int = 0
    mode: str = "batched"
    draft_probs: torch.Tensor | None = None
    keep: int = 0
    future: Future | None = None
    done: int = 0
    rows: list[torch.Tensor] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    forward_ms: float = 0.0
    controls: ControlState | None = None
    prompt_logprobs: int | None = None
    prompt_records: list[TokenLogprob] = field(default_factory=list)
    survival: tuple[float, ...] | None = None

    def begin(self, op: str, ids: list[int], position: int, mode: str = "batched",
              draft_probs: torch.Tensor | None = None, keep: int = 0,
              prompt_logprobs: int | None = None, survival: tuple[float, ...] | None = None) -> "SessionRecord":
        """Make the admitted request the one in flight; returns self.

        Raises:
            ValueError: the session already has a request in flight (one at a time).
        """
        if self.op is not None:
            raise ValueError(f"session {self.sid} already has a request in flight: send one at a time")
        self.op, self.ids, self.position, self.mode = op, ids, position, mode
        self.draft_probs, self.keep, self.future = draft_probs, keep, Future()
        self.done, self.rows, self.logprobs, self.forward_ms = 0, [], [], 0.0
        self.prompt_logprobs, self.prompt_records = prompt_logprobs, []
        self.survival = survival if op == "verify" and mode == "batched" and len(ids) > 1 else None
        grammar = None if self.controls is None else self.controls.grammar
        if grammar is not None and op != "prefill":
            grammar.prefetch(ids[1:])  # the rows' masks fill while the forward runs (docs/structured.md §7)
        return self

    def end(self) -> None:
        """The request left the step loop (answered or failed): the session may send again."""
        self.op, self.ids, self.draft_probs, self.future, self.rows, self.logprobs = None, [], None, None, [], []
        self.prompt_logprobs, self.prompt_records, self.survival = None, [], None

    def step_rows(self) -> int:
        """Rows a verify or decode forwards in its next step (a batched block all of them;
        a prompt's chunk is the schedule's and not counted here)."""
        return len(self.ids) if self.op == "verify" and not self.stepwise else 1

    def trim(self, drafts: int) -> None:
        """Cut the verify block in flight to its first `drafts` drafts (the step's budget
        admitted no more; 0 <= drafts <= k): what is committed stays the same tokens, only
        fewer of them this step."""
        self.ids = self.ids[:drafts + 1]
        if self.draft_probs is not None:
            self.draft_probs = self.draft_probs[:drafts]
        self.survival = self.survival[:drafts] if drafts else None

    @property
    def stepwise(self) -> bool:
        """A verify forwarded one position at a time (sequential mode, or a block of no drafts)."""
        return self.op == "verify" and (self.mode == "sequential" or len(self.ids) == 1)

    @property
    def left(self) -> int:
        """Prompt tokens still to forward (a prefill; what the schedule's chunk filling reads)."""
        return len(self.ids) - self.done

    def item(self, chunk: int) -> BatchItem:
        """The forward input of this step: the decode, the next position of a stepwise verify,
        the whole verify block, or the next `chunk` prompt tokens (from position `done`, with
        the tap rows the prefill can still return, and the logits of every row when it asked
        for prompt logprobs)."""
        if self.op == "prefill":
            return BatchItem.prefill_chunk(self.state, self.ids[self.done:self.done + chunk], self.done, self.keep,
                                           all_logits=self.prompt_logprobs is not None)
        if self.op == "decode":
            return BatchItem.decode(self.state, self.ids[0], self.position)
        if self.stepwise:
            return BatchItem.decode(self.state, self.ids[self.done], self.position + self.done)
        return BatchItem.block(self.state, torch.tensor(self.ids), self.position)


def top2_margin(logits: torch.Tensor) -> tuple[int, float]:
    """logits [V] -> (argmax id, top1 - top2 in logit units). Ties pick the lowest id (torch.argmax)."""
    top = torch.topk(logits.float(), 2).values
    return int(logits.argmax()), float(top[0] - top[1])

def absorb(s: SessionRecord, out, ms: float, model=None) -> StepResult | VerifyResult | None:
    """Take one forward's output for the request in flight of session record `s`.

    `out`: the trunk's ForwardOutput (a decode, one position of a stepwise verify, or one
    chunk of a prefill) or BlockOutput (a batched verify block, still open); `ms`: that
    forward's wall time (ms), added to `s.forward_ms`; `model`: the trunk, which rolls a
    block back (verify only). Tokens are chosen and drafts judged by the session's sampling
    rule, one logits row at a time (`services.verifier.choice`).
    Returns the request's result once it is complete, its rows committed; None when a
    stepwise verify needs its next position forwarded (position s.position + s.done) or a
    prefill its next chunk (from position s.done).
    Raises:
        ValueError: a rejection-rule verify without draft_probs (admission prevents it).
    """
    s.forward_ms += ms
    if s.op == "prefill":
        return _absorb_chunk(s, out)
    params = s.sampling
    if s.op == "decode":
        token = choose(_allowed(s, out.logits), params, s.position + 1)
        _commit_token(s, token)
        lp = token_logprobs(out.logits.reshape(1, -1), [token], params.logprobs)
        result = StepResult(token, top2_margin(out.logits)[1], out.taps, range(s.position, s.position + 1),
                            s.forward_ms, tuple(lp))
        s.committed.add(result.rows, result.positions, token, result.margin)
        return result
    n, ids = s.position, s.ids
    if s.stepwise:
        i = s.done
        s.rows.append(out.taps)
        s.done += 1
        token = _judge_row(s, out.logits, i)
        if token is None:
            return None
        result = VerifyResult(i, token, top2_margin(out.logits)[1], torch.cat(s.rows), range(n, n + i + 1),
                              i + 1, 0, s.forward_ms, tuple(s.logprobs), admitted=len(ids) - 1)
    else:  # a verify block is a transaction: judged row by row, then rolled back to what it accepted
        a = 0
        while (token := _judge_row(s, out.logits[a], a)) is None:
            a += 1
        copied = model.rollback(s.state, out.undo, keep=a + 1)
        result = VerifyResult(a, token, top2_margin(out.logits[a])[1], out.taps[: a + 1], range(n, n + a + 1),
                              len(ids), copied, s.forward_ms, tuple(s.logprobs), admitted=len(ids) - 1)
    s.committed.add(result.rows, result.positions, result.bonus_token, result.margin)
    return result


def _judge_row(s: SessionRecord, row: torch.Tensor, i: int) -> int | None:
    """Judge row i ([V] logits of position s.position + i) of a verify block and record the
    logprob of the token taken at the next position: None when draft i + 1 is accepted, else
    the token chosen there (the correction, or past the last draft the bonus token)."""
    params = s.sampling
    token = judge(_allowed(s, row), s.ids, i, params, s.position, s.draft_probs)
    taken = s.ids[i + 1] if token is None else token
    _commit_token(s, taken)
    s.logprobs += token_logprobs(row.reshape(1, -1), [taken], params.logprobs)
    return token


def _allowed(s: SessionRecord, row: torch.Tensor) -> torch.Tensor:
    """The logits row [V] a token is chosen from (and a draft judged by): the session's
    controls applied on the row's device after the tokens committed so far, which in a
    verify block include the rows before this one (`services.common.controls`): logit_bias,
    penalties, min_tokens and bad_words, then the grammar mask. A drafted token the grammar
    forbids can then never be the target's choice: a mismatch at that position. The raw row
    still gives the logprobs (vLLM's default, raw) and the gate's margin."""
    return row if s.controls is None else s.controls.apply(row)


def _commit_token(s: SessionRecord, token: int) -> None:
    """Advance the session's controls past a token it commits (the only place they advance:
    a rejected draft is never counted)."""
    if s.controls is not None:
        s.controls.accept(token)


def _absorb_chunk(s: SessionRecord, out) -> StepResult | None:
    """Take one prefill chunk's ForwardOutput (logits [V] fp32 of its last position, taps
    [<= keep, T*D] fp32 of its last positions, prompt_logits [S, V] fp32 when the prefill
    asked for prompt logprobs) into `s`; once the chunk that ends the prompt is in, commit
    the prefill (the one place a prefill completes) and return its result: the next token
    and margin of position n-1, the tap rows of the last min(n, keep) and the prompt
    tokens' logprob records."""
    if out.prompt_logits is not None:
        _score_prompt(s, s.done, out.prompt_logits)
    s.done = s.state.next_position  # a prompt starts at 0: positions forwarded so far
    tail = torch.cat([*s.rows, out.taps])[-s.keep:] if s.keep else out.taps[:0]
    s.rows = [tail]  # only the rows the result can still return are held
    if s.done < len(s.ids):
        return None
    n = s.done
    token = choose(_allowed(s, out.logits), s.sampling, n)
    _commit_token(s, token)
    result = StepResult(token, top2_margin(out.logits)[1], tail, range(n - tail.shape[0], n), s.forward_ms,
                        tuple(token_logprobs(out.logits.reshape(1, -1), [token], s.sampling.logprobs)),
                        prompt_logprobs=tuple(s.prompt_records))
    s.committed.add(result.rows, result.positions, token, result.margin)
    s.prefilled = True  # only once the whole prompt is in
    return result


def _score_prompt(s: SessionRecord, start: int, logits: torch.Tensor) -> None:
    """Record the logprobs of the prompt tokens a chunk's rows predict: logits [S, V] fp32 of
    positions start..start+S-1 give the raw logprob (and top s.prompt_logprobs alternatives)
    of x[start+1..start+S], those inside the prompt (the last position's row predicts the
    first generated token instead). Each row on its own (`token_logprobs`), so a record is the
    one a decode at that position would give for that token whenever their logits agree."""
    targets = s.ids[start + 1:start + 1 + logits.shape[0]]
    if targets:
        s.prompt_records += token_logprobs(logits[:len(targets)], targets, s.prompt_logprobs, ranks=True)


def abandon(s: SessionRecord) -> None:
    """The request in flight failed part way (the record `s` held by the caller): a prefill
    that forwarded some chunks leaves its session empty again, so the prompt can be sent again."""
    if s.op == "prefill" and s.state.next_position > 0 and not s.prefilled:
        s.state.reset()
