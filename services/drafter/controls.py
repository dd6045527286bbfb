"""The drafter drafts from the rows the generation's logits controls and grammar leave
(docs/sampling.md, docs/structured.md).

`SessionControls` is one drafter session's `services.common.controls.ControlState` over the
generation's committed tokens (the commits' token ids from the generation's first output
position on; the prompt before it is what repetition_penalty counts as seen). `guide(anchor,
seed_position)` opens a `DraftGuide` for one draft: it accepts the anchor tentatively,
transforms each slot's logits (logit_bias, penalties with the counts of the committed tokens
plus the draft's earlier slots, min_tokens, bad_words, the grammar mask) before the slot's
chooser picks, advances over the pick, and `end()` rolls every tentative token back, so the
committed state only ever holds committed tokens. The verifier applies the same rule to the
same tokens (`services.verifier.work`), so a draft's q is drawn from the rows the verifier
judges it by, and a greedy draft is the target's choice whenever the logits agree. A session
primed again (a failover, or a session id reused) starts a new `SessionControls` from the
priming commit, which carries every committed token from position 0.

Drafts only steer speculation: a guide that loses step (a committed token the grammar
refuses, a token id gap, a corrupted oracle draft) stops transforming for the rest of that
draft or session instead of failing, and the verifier's rule still decides every emitted token.

Dimension legend: V = vocab_size.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from services.common.constraint import GrammarVocab, resolve_vocab
from services.common.constraint_wire import constraint_from_proto
from services.common.controls import ControlState, control_state
from services.common.controls_wire import controls_from_proto
from services.common.grammar import GrammarError, GrammarState

log = logging.getLogger("dspark.drafter.controls")
Chooser = Callable[[int, torch.Tensor], torch.Tensor]  # (slot j, logits [1, V]) -> token [1]


class SessionControls:
    """A drafter session's controls over its committed tokens.

    Args:
        state: a fresh `ControlState` of the generation (its grammar and logits controls).
        first_position: the position of the generation's first output token (the prompt's length).
    Not thread safe: the session's requests arrive one at a time.
    """

    def __init__(self, state: ControlState, first_position: int):
        self.state, self.next_position, self.lost = state, int(first_position), False

    def observe(self, first_position: int, token_ids: Sequence[int]) -> None:
        """Accept the committed tokens of positions first_position.. that the state has not
        seen (prompt positions are skipped). A gap or a refused token loses the session's step."""
        if self.lost:
            return
        skip = self.next_position - int(first_position)
        if skip < 0:
            self._lose(f"committed tokens from position {first_position}, expected {self.next_position}")
            return
        for t in list(token_ids)[skip:]:
            try:
                self.state.accept(int(t))
            except GrammarError as exc:
                self._lose(str(exc))
                return
            self.next_position += 1

    def guide(self, anchor: int, seed_position: int) -> "DraftGuide | None":
        """The guide of a draft after `anchor` (the token at seed_position + 1), or None when the
        state is not at seed_position + 1 (lost, or a commit missing): the draft is blind."""
        if self.lost or self.next_position != int(seed_position) + 1:
            return None
        return DraftGuide(self.state, anchor)

    def _lose(self, why: str) -> None:
        self.lost = True
        log.warning("drafter controls lost step (%s): drafting from the raw rows from here", why)


class DraftGuide:
    """One draft under the controls: transforms and follows its slots, then `end()` rolls back."""

    def __init__(self, state: ControlState, anchor: int):
        self.state, self.checkpoint, self.dead = state, state.accepted, False
        self.took(anchor)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] or [1, V] -> the row the slot chooses from (`ControlState.apply`;
        unchanged once dead)."""
        return logits if self.dead else self.state.apply(logits)

    def took(self, token: int) -> None:
        """Advance over the slot's token; a token the grammar refuses ends the guiding of this draft."""
        if self.dead:
            return
        try:
            self.state.accept(int(token))
        except GrammarError:
            self.dead = True

    def wrap(self, choose: Chooser) -> Chooser:
        """A chooser that transforms each slot's logits, lets `choose` pick, and follows the pick."""
        def guided(j: int, logits: torch.Tensor) -> torch.Tensor:
            token = choose(j, self.apply(logits))
            self.took(int(token.reshape(-1)[0]))
            return token
        return guided

    def end(self) -> None:
        """Undo every token of this draft (the anchor included): the committed state is back."""
        self.state.rollback_to(self.checkpoint)


class DraftControls:
    """The controls of a drafter's sessions, by session id, set by their priming commits.

    Args:
        vocab_size: V of the served model.
        eos_token_id: its eos.
        vocab: a `GrammarVocab`, a callable making it, or None (`resolve_vocab`; built on first use).
    A session id's entry is replaced by the next priming commit on that id, so a stale one
    (its stream ended) is at most one per id ever opened, and never read by another session.
    """

    def __init__(self, vocab_size: int, eos_token_id: int, vocab=None):
        self.vocab_size, self.eos_token_id, self._vocab = int(vocab_size), int(eos_token_id), vocab
        self._by_sid: dict[int, SessionControls] = {}

    @property
    def vocab(self) -> GrammarVocab:
        if not isinstance(self._vocab, GrammarVocab):
            self._vocab = resolve_vocab(self._vocab, self.vocab_size, self.eos_token_id)
        return self._vocab

    def commit(self, sid: int, commit) -> None:
        """Follow a landed `CommitRequest`: a priming one (tokens from position 0) sets the
        session's grammar and logits controls from its fields (or clears them); every one
        feeds its tokens."""
        if commit.token_first_position == 0:
            self._by_sid.pop(sid, None)
            state = self._prime(commit)
            if state is not None:
                first = commit.constraint_first_position if commit.HasField("constraint") \
                    else commit.controls_first_position
                self._by_sid[sid] = SessionControls(state, first)
        session = self._by_sid.get(sid)
        if session is not None:
            session.observe(commit.token_first_position, commit.token_ids)

    def _prime(self, commit) -> ControlState | None:
        """The state a priming commit sets (None: unconstrained and no controls, or a field the
        drafter cannot read: the gateway checked it already, so drafts go blind, not the session)."""
        grammar, controls = None, None
        try:
            if commit.HasField("constraint"):
                c = constraint_from_proto(commit.constraint, "commit.constraint")
                grammar = GrammarState(self.vocab.compile(c), self.vocab_size, self.eos_token_id)
            if commit.HasField("controls"):
                controls = controls_from_proto(commit.controls, "commit.controls")
        except ValueError as exc:
            log.warning("drafter: commit's constraint or controls unusable (%s): drafting from the raw rows", exc)
            return None
        prompt = list(commit.token_ids)[:commit.controls_first_position] if controls is not None else []
        return control_state(controls, self.vocab_size, prompt, grammar)

    def guide(self, sid: int, anchor: int, seed_position: int) -> DraftGuide | None:
        """The guide of session `sid`'s next draft (None: no controls, or out of step)."""
        session = self._by_sid.get(sid)
        return None if session is None else session.guide(anchor, seed_position)
