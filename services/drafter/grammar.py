"""The drafter drafts inside the generation's grammar (docs/structured.md).

`SessionGrammar` is one drafter session's matcher over the generation's committed tokens
(the commits' token ids from the constraint's first position on). `guide(anchor,
seed_position)` opens a `DraftGuide` for one draft: it accepts the anchor tentatively, masks
each slot's logits before the slot's chooser picks, advances over the pick, and `end()`
rolls every tentative token back, so the committed matcher only ever holds committed tokens.
A session primed again (a failover, or a session id reused) starts a new `SessionGrammar`
from the priming commit, which carries every committed token from position 0.

Drafts only steer speculation: a guide that loses step with the grammar (a committed token it
refuses, a token id gap, a corrupted oracle draft) stops masking for the rest of that draft or
session instead of failing, and the verifier's mask still decides every emitted token.

Dimension legend: V = vocab_size.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from services.common.constraint import GrammarVocab, resolve_vocab
from services.common.constraint_wire import constraint_from_proto
from services.common.grammar import GrammarError, GrammarState

log = logging.getLogger("dspark.drafter.grammar")
Chooser = Callable[[int, torch.Tensor], torch.Tensor]  # (slot j, logits [1, V]) -> token [1]


class SessionGrammar:
    """A drafter session's matcher over its committed tokens.

    Args:
        state: a fresh `GrammarState` of the generation's constraint.
        first_position: the position of the generation's first output token (the prompt's length).
    Not thread safe: the session's requests arrive one at a time.
    """

    def __init__(self, state: GrammarState, first_position: int):
        self.state, self.next_position, self.lost = state, int(first_position), False

    def observe(self, first_position: int, token_ids: Sequence[int]) -> None:
        """Accept the committed tokens of positions first_position.. that the matcher has not
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
        matcher is not at seed_position + 1 (lost, or a commit missing): the draft is blind."""
        if self.lost or self.next_position != int(seed_position) + 1:
            return None
        return DraftGuide(self.state, anchor)

    def _lose(self, why: str) -> None:
        self.lost = True
        log.warning("drafter grammar lost step (%s): drafting without the mask from here", why)


class DraftGuide:
    """One draft inside the grammar: masks and follows its slots, then `end()` rolls back."""

    def __init__(self, state: GrammarState, anchor: int):
        self.state, self.checkpoint, self.dead = state, state.accepted, False
        self.took(anchor)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] or [1, V] -> the same with forbidden tokens at -inf (unchanged once dead)."""
        return logits if self.dead else self.state.mask(logits)

    def took(self, token: int) -> None:
        """Advance over the slot's token; a token the grammar refuses ends the masking of this draft."""
        if self.dead:
            return
        try:
            self.state.accept(int(token))
        except GrammarError:
            self.dead = True

    def wrap(self, choose: Chooser) -> Chooser:
        """A chooser that masks each slot's logits, lets `choose` pick, and follows the pick."""
        def guided(j: int, logits: torch.Tensor) -> torch.Tensor:
            token = choose(j, self.mask(logits))
            self.took(int(token.reshape(-1)[0]))
            return token
        return guided

    def end(self) -> None:
        """Undo every token of this draft (the anchor included): the committed matcher is back."""
        self.state.rollback_to(self.checkpoint)


class DraftGrammars:
    """The grammars of a drafter's sessions, by session id, set by their priming commits.

    Args:
        vocab_size: V of the served model.
        eos_token_id: its eos.
        vocab: a `GrammarVocab`, a callable making it, or None (`resolve_vocab`; built on first use).
    A session id's entry is replaced by the next priming commit on that id, so a stale one
    (its stream ended) is at most one per id ever opened, and never read by another session.
    """

    def __init__(self, vocab_size: int, eos_token_id: int, vocab=None):
        self.vocab_size, self.eos_token_id, self._vocab = int(vocab_size), int(eos_token_id), vocab
        self._by_sid: dict[int, SessionGrammar] = {}

    @property
    def vocab(self) -> GrammarVocab:
        if not isinstance(self._vocab, GrammarVocab):
            self._vocab = resolve_vocab(self._vocab, self.vocab_size, self.eos_token_id)
        return self._vocab

    def commit(self, sid: int, commit) -> None:
        """Follow a landed `CommitRequest`: a priming one (tokens from position 0) sets the
        session's grammar from its constraint (or clears it); every one feeds its tokens."""
        if commit.token_first_position == 0:
            self._by_sid.pop(sid, None)
            if commit.HasField("constraint"):
                try:
                    c = constraint_from_proto(commit.constraint, "commit.constraint")
                    state = GrammarState(self.vocab.compile(c), self.vocab_size, self.eos_token_id)
                except ValueError as exc:  # the gateway compiled it already: drafts go blind, not the session
                    log.warning("drafter: constraint not compiled (%s): drafting without the mask", exc)
                    return
                self._by_sid[sid] = SessionGrammar(state, commit.constraint_first_position)
        grammar = self._by_sid.get(sid)
        if grammar is not None:
            grammar.observe(commit.token_first_position, commit.token_ids)

    def guide(self, sid: int, anchor: int, seed_position: int) -> DraftGuide | None:
        """The guide of session `sid`'s next draft (None: unconstrained, or out of step)."""
        grammar = self._by_sid.get(sid)
        return None if grammar is None else grammar.guide(anchor, seed_position)
