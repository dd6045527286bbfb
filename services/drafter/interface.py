"""The drafter engine interface: what the drafter servicer and the gateway's in-process
backend call, whichever drafter (DSpark module, scripted oracle, live oracle) is behind it.

This module owns the contract only; it holds no state and runs no model. Token observation
is part of the contract rather than an optional attribute: every drafter says with
`observes_tokens` whether it wants the committed token ids, and callers feed them through
`feed_tokens`, so a drafter that needs them cannot be silently skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

from dsv4.sampling import SamplingParams


@dataclass(frozen=True)
class SampledDraft:
    """A draft under sampling parameters: tokens (n ids of positions seed_position+2..),
    confidence [n] fp32 raw logits (None without a head) and probs [n, V] fp32 on CPU, the
    distribution q each token was drawn from (what the rejection rule needs)."""

    tokens: list[int]
    confidence: torch.Tensor | None
    probs: torch.Tensor


@runtime_checkable
class Drafter(Protocol):
    """A drafter engine with per-generation sessions.

    Dimension legend: R = committed rows in one call, T*D = row_width (the tap width),
    n = drafted tokens (<= block_size).

    Drafters may subclass this Protocol explicitly to inherit `observes_tokens = False`
    and the refusing `observe_tokens` below.
    """

    #: True when the drafter needs the committed token ids (`observe_tokens`); the token ids
    #: of a commit are then fed before its rows.
    observes_tokens: bool = False

    @property
    def max_sessions(self) -> int:
        """Sessions allowed open at once."""
        ...

    @property
    def num_sessions(self) -> int:
        """Sessions open now."""
        ...

    def identity(self) -> dict:
        """The identity dict of `services.drafter.engine.drafter_identity`."""
        ...

    def open_session(self) -> int:
        """Open a session with nothing committed; returns its id.

        Raises:
            SessionLimitError: max_sessions are open.
        """
        ...

    def close_session(self, sid: int) -> None:
        """Free a session; unknown or closed ids are a no-op."""
        ...

    def commit(self, sid: int, rows: torch.Tensor, positions: Sequence[int]) -> None:
        """Commit the verifier's tap rows [R, T*D] (fp32 or bf16) of `positions`.

        Raises:
            ValueError: bad rows or positions (named); the session is unchanged then.
            UnknownSessionError: `sid` not open.
        """
        ...

    def draft(self, sid: int, anchor: int, seed_position: int) -> tuple[list[int], torch.Tensor | None]:
        """Draft after `anchor` (the committed token at seed_position + 1).

        Returns (n token ids for positions seed_position+2.., confidence logits [n] fp32 on
        CPU, or None without a confidence head).
        Raises:
            ValueError: bad anchor or seed_position (named), nothing committed.
            UnknownSessionError: `sid` not open.
        """
        ...

    def draft_sampled(self, sid: int, anchor: int, seed_position: int, params: SamplingParams) -> SampledDraft:
        """Draft under `params` (dsv4.sampling): the token of position q is chosen with noise
        keyed by (params.seed, q). This default suits drafters whose proposal does not depend
        on the params (the scripted oracle): `draft`'s tokens, drawn from a one-hot q.

        Raises:
            ValueError, UnknownSessionError: as `draft`.
        """
        tokens, conf = self.draft(sid, anchor, seed_position)
        vocab = self.identity()["vocab_size"]
        probs = torch.nn.functional.one_hot(torch.tensor(tokens, dtype=torch.int64), vocab).float()
        return SampledDraft(list(tokens), conf, probs.reshape(len(tokens), vocab))

    def draft_guided(self, sid: int, anchor: int, seed_position: int, params: SamplingParams,
                     guide) -> SampledDraft:
        """Draft inside a grammar: `guide` (`services.drafter.controls.DraftGuide`) masks each
        slot's logits before the slot is chosen under `params` and follows the choice. This
        default, for drafters whose proposal reads no logits (the scripted oracle), is
        `draft_sampled` unguided. Raises: as `draft`."""
        return self.draft_sampled(sid, anchor, seed_position, params)

    def observe_tokens(self, sid: int, first_position: int, token_ids: Sequence[int]) -> None:
        """Take the committed token ids of positions first_position.. (called only when
        `observes_tokens` is True).

        Raises:
            NotImplementedError: this drafter does not observe tokens (the default).
            ValueError: ids or position that do not continue the session (named).
        """
        raise NotImplementedError(f"{type(self).__name__} does not observe tokens (observes_tokens is False)")


def feed_tokens(drafter: Drafter, sid: int, first_position: int, token_ids: Sequence[int]) -> None:
    """Pass a commit's token ids to `drafter` when it observes tokens and there are any.

    Raises:
        ValueError, UnknownSessionError: from `drafter.observe_tokens`.
    """
    if drafter.observes_tokens and len(token_ids) > 0:
        drafter.observe_tokens(sid, first_position, list(token_ids))
