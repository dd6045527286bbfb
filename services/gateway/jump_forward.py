"""Jump-forward: the tokens a generation's grammar forces, submitted as certain drafts.

Where the output constraint allows exactly one token (eos excluded), every sampling rule
chooses that token (a one-token distribution wins every draw), so the gateway can put it
into a verify block without asking the model for it: a run of m forced tokens after the
anchor becomes one verify of [anchor, f1..fm] instead of m + 1 decode steps
(docs/structured.md §6). The verifier still judges them like any drafts, over its own masked
rows, so jump-forward changes how many forwards a generation takes, never its tokens: a
forced token the verifier's grammar did not force would be a mismatch there, corrected from
the masked row, as for any draft.

`JumpForward` holds the gateway's copy of the generation's matcher over its committed
tokens. It must not choose tokens, talk to a backend, or decide a round's other drafts.

Dimension legend: V = vocab_size, m = forced tokens of a run.
"""

from __future__ import annotations

import logging

import torch

from services.common.constraint import Constraint, GrammarVocab
from services.common.grammar import GrammarError, GrammarState

log = logging.getLogger(__name__)


class JumpForward:
    """The forced runs of one constrained generation.

    Args:
        vocab: the gateway's grammar vocabulary (`Scheduler.grammar_vocab`); `constraint`
            compiles against it (cached: it compiled at admission).
        constraint: the generation's output constraint.
        vocab_size: V, the logits width. eos_token_id: the stop token.
    Not thread safe: one generation's task uses it.
    """

    def __init__(self, vocab: GrammarVocab, constraint: Constraint, vocab_size: int, eos_token_id: int):
        self._state: GrammarState | None = GrammarState(vocab.compile(constraint), vocab_size, eos_token_id)
        self.vocab_size = int(vocab_size)

    @property
    def active(self) -> bool:
        """False once the gateway's matcher fell out of step with the verifier (then no forced
        runs: the generation goes on with the rounds it would have had)."""
        return self._state is not None

    def commit(self, tokens: list[int]) -> None:
        """Advance past tokens the verifier committed (the first token, then each round's
        accepted drafts and its bonus token). A token this matcher refuses means the gateway's
        vocabulary differs from the verifier's: jump-forward turns itself off, logged."""
        if self._state is None:
            return
        try:
            for t in tokens:
                self._state.accept(t)
        except GrammarError as exc:
            log.warning("jump-forward off for this generation: the gateway's grammar refused a committed "
                        "token (%s); its vocabulary differs from the verifier's", exc)
            self._state = None

    def forced(self, limit: int) -> list[int]:
        """The run of tokens forced after the committed ones, at most `limit` (none when
        inactive). Costs one bitmask fill per forced token plus one."""
        return [] if self._state is None or limit <= 0 else self._state.forced_run(limit)

    def probs(self, forced: list[int]) -> torch.Tensor:
        """[m, V] fp32: the drafting distribution of forced tokens, one-hot (what a drafter
        masked inside the grammar would have drawn them from). Under the rejection rule the
        verifier accepts draft t with probability min(1, p'(t) / q(t)) = p'(t) = 1: the
        masked target allows t alone."""
        q = torch.zeros(len(forced), self.vocab_size, dtype=torch.float32)
        q[torch.arange(len(forced)), torch.tensor(forced, dtype=torch.long)] = 1.0
        return q
