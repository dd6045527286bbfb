"""Logits controls: the per-generation transform of the logits row a token is chosen from.

`LogitsControls` is what a request asks for (validated values, no state): `logit_bias`,
OpenAI's `presence_penalty` / `frequency_penalty` (over the generated tokens),
vLLM's `repetition_penalty` (over the prompt and the generated tokens), `min_tokens` (the
stop token ids masked until that many tokens are generated) and `bad_words` (token-id
sequences whose last token is banned where the tokens before it were just generated).

`ControlState` is one generation's state over them: the tokens it has generated (committed on
the verifier; committed plus a draft's earlier slots on the drafter), their counts on the
logits' device, and the generation's grammar matcher (`services.common.grammar.GrammarState`,
None when unconstrained). `apply(row)` returns the transformed copy of a logits row,
`accept(token)` advances past a token, `rollback_to(n)` undoes tentative tokens (the drafter's
block). Both the verifier (`services.verifier.work`) and the drafter
(`services.drafter.controls`) choose from `apply`'s rows, so a draft's q and the verifier's p
are distributions of the same rule and speculation stays lossless (docs/sampling.md).

Order of application (vLLM's): logit_bias -> min_tokens -> bad_words -> repetition_penalty
-> frequency and presence penalties -> the grammar mask; temperature and the filters come
after, in `dsv4.sampling`. The masks commute with the penalties (-inf stays -inf).

Dimension legend: V = vocab_size (the logits width).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from services.common.grammar import GrammarState

MAX_BIAS = 100.0  # OpenAI's logit_bias range [-100, 100]
MAX_PENALTY = 2.0  # OpenAI's presence / frequency range [-2, 2]
MAX_BIASED_TOKENS = 1024  # logit_bias entries per request (OpenAI caps at 300; we are wider)
MAX_BAD_WORDS = 128  # bad words per request (each tokenized up to two ways: as given, after a space)
MAX_BAD_WORD_SEQUENCES = 2 * MAX_BAD_WORDS  # their token-id spellings
MAX_BAD_WORD_TOKENS = 32  # tokens in one bad word


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r}: must be a finite number")
    return float(value)


@dataclass(frozen=True)
class LogitsControls:
    """A request's logits controls (the neutral values change nothing).

    logit_bias: (token id, bias) pairs, ids distinct, each bias in [-100, 100] logit units,
        added to the raw logit (-100 in practice bans a token, +100 forces it).
    presence_penalty, frequency_penalty: in [-2, 2]; logit -= frequency x count +
        presence x (count > 0), count = times the token was generated so far.
    repetition_penalty: > 0 (1 = off); a token seen in the prompt or generated so far has a
        positive logit divided by it and a negative one multiplied by it.
    min_tokens: >= 0; the ids of `stop_ids` are masked while fewer tokens were generated.
    stop_ids: the ids min_tokens masks (the gateway sets eos and the request's stop token ids).
    bad_words: token-id sequences; the last id of each is masked where the generated tokens
        end with the ones before it (a one-token word: always).
    Raises:
        ValueError: naming the field and the value: a NaN or infinite number, a bias outside
            [-100, 100], a penalty outside [-2, 2], repetition_penalty <= 0, min_tokens < 0,
            a negative or repeated token id, too many entries, an empty bad word.
    """

    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if len(self.logit_bias) > MAX_BIASED_TOKENS:
            raise ValueError(f"logit_bias: {len(self.logit_bias)} entries; at most {MAX_BIASED_TOKENS}")
        seen = set()
        for token, bias in self.logit_bias:
            _token(f"logit_bias key {token!r}", token)
            if token in seen:
                raise ValueError(f"logit_bias: token {token} given twice")
            seen.add(token)
            if not -MAX_BIAS <= _number(f"logit_bias[{token}]", bias) <= MAX_BIAS:
                raise ValueError(f"logit_bias[{token}]={bias:g}: must lie in [-{MAX_BIAS:g}, {MAX_BIAS:g}]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = _number(name, getattr(self, name))
            if not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise ValueError(f"{name}={v:g}: must lie in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
        if _number("repetition_penalty", self.repetition_penalty) <= 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty:g}: must be > 0 (1 is off)")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens={self.min_tokens!r}: must be an integer >= 0")
        for t in self.stop_ids:
            _token("min_tokens stop id", t)
        if len(self.bad_words) > MAX_BAD_WORD_SEQUENCES:
            raise ValueError(f"bad_words: {len(self.bad_words)} token sequences; at most {MAX_BAD_WORD_SEQUENCES}")
        for word in self.bad_words:
            if not 0 < len(word) <= MAX_BAD_WORD_TOKENS:
                raise ValueError(f"bad_words: a word of {len(word)} tokens; each needs 1..{MAX_BAD_WORD_TOKENS}")
            for t in word:
                _token("bad_words token id", t)

    @property
    def active(self) -> bool:
        """Whether any control changes a row (False: the neutral controls)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1 or (self.min_tokens and self.stop_ids) or self.bad_words)

    def check_vocab(self, vocab_size: int) -> None:
        """Raises ValueError naming the first token id (a logit_bias key, a stop id, a bad word's
        token) outside [0, vocab_size)."""
        for name, ids in (("logit_bias key", [t for t, _ in self.logit_bias]), ("min_tokens stop id", self.stop_ids),
                          ("bad_words token id", [t for w in self.bad_words for t in w])):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name} {bad[0]} outside [0, vocab_size={vocab_size})")

    def for_generation(self, stop_ids, vocab_size: int, max_tokens: int) -> "LogitsControls | None":
        """These controls for one generation: stop_ids set to `stop_ids` (what min_tokens
        masks: eos unless ignore_eos, and the request's stop token ids), checked against the
        model; None when they change nothing.

        Raises:
            ValueError: a token id outside [0, vocab_size) (named), or min_tokens > max_tokens.
        """
        c = dataclasses.replace(self, stop_ids=tuple(sorted(int(t) for t in stop_ids)))
        c.check_vocab(vocab_size)
        if c.min_tokens > max_tokens:
            raise ValueError(f"min_tokens={c.min_tokens}: must be <= max_tokens={max_tokens}")
        return c if c.active else None


def _token(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r}: must be a token id (an integer >= 0)")


NO_CONTROLS = LogitsControls()


class ControlState:
    """One generation's controls and grammar over the tokens it generated.

    Args:
        controls: the request's `LogitsControls`.
        vocab_size: V, the logits width.
        prompt_ids: the prompt's token ids (repetition_penalty counts them as seen).
        grammar: the generation's `GrammarState`, or None (unconstrained).
    Not thread safe (callers hold the session's lock). Counts live on the device of the rows
    `apply` is given, built there on first use and kept in step with `accept` / `rollback_to`.
    """

    def __init__(self, controls: LogitsControls, vocab_size: int, prompt_ids=(), grammar: GrammarState | None = None):
        self.controls, self.vocab_size, self.grammar = controls, int(vocab_size), grammar
        self.prompt_ids = [int(t) for t in prompt_ids] if controls.repetition_penalty != 1 else []
        self.generated: list[int] = []  # the tokens accepted so far (committed, then tentative)
        # the grammar's own count after each token (eos after termination does not advance it)
        self._grammar_at: list[int] = []
        self._grammar_base = 0 if grammar is None else grammar.accepted
        self._device: torch.device | None = None
        self._counts: torch.Tensor | None = None  # [V] fp32 of generated[:_synced]
        self._synced = 0
        self._bias: torch.Tensor | None = None  # [V] fp32 dense logit_bias
        self._prompt_seen: torch.Tensor | None = None  # [V] bool

    @property
    def accepted(self) -> int:
        """Tokens accepted so far (`rollback_to` takes such a count)."""
        return len(self.generated)

    def apply(self, row: torch.Tensor) -> torch.Tensor:
        """The row a token is chosen from: logits `row` ([V] or [1, V], any float dtype, any
        device) -> a transformed fp32 copy of the same shape on the same device (the row
        itself when nothing applies). Raises GrammarError as `GrammarState.mask`."""
        c = self.controls
        if not c.active:
            return row if self.grammar is None else self.grammar.mask(row)
        x = row.reshape(-1).to(torch.float32, copy=True)
        self._sync(x.device)
        if c.logit_bias:
            x += self._bias
        ended = self.grammar is not None and self.grammar.finished  # eos alone may follow: min_tokens yields
        if c.min_tokens and len(self.generated) < c.min_tokens and not ended:
            x[list(c.stop_ids)] = -math.inf
        banned = self._banned()
        if banned:
            x[banned] = -math.inf
        present = self._counts > 0 if c.repetition_penalty != 1 or c.presence_penalty else None
        if c.repetition_penalty != 1:
            r = c.repetition_penalty  # divided, not multiplied by 1/r: vLLM's rounding
            x = torch.where(self._prompt_seen | present, torch.where(x > 0, x / r, x * r), x)
        if c.frequency_penalty:
            x -= c.frequency_penalty * self._counts
        if c.presence_penalty:
            x -= c.presence_penalty * present.float()
        if self.grammar is not None:
            x = self.grammar.mask(x)
        return x.reshape(row.shape)

    def accept(self, token: int) -> None:
        """Advance past `token` (the grammar first: a token it refuses raises GrammarError and
        leaves the state unchanged)."""
        if self.grammar is not None:
            self.grammar.accept(token)
            self._grammar_at.append(self.grammar.accepted)
        self.generated.append(int(token))

    def rollback_to(self, accepted: int) -> None:
        """Undo the tokens accepted after the count `accepted`."""
        n = int(accepted)
        if n >= len(self.generated):
            return
        if self.grammar is not None:
            self.grammar.rollback_to(self._grammar_at[n - 1] if n else self._grammar_base)
            del self._grammar_at[n:]
        if self._counts is not None and self._synced > n:
            self._counts.index_add_(0, self._ids(self.generated[n:self._synced]),
                                    torch.full((self._synced - n,), -1.0, device=self._device))
            self._synced = n
        del self.generated[n:]

    # ------------------------------------------------------------------ internals
    def _ids(self, tokens) -> torch.Tensor:
        return torch.tensor(tokens, dtype=torch.long).to(self._device, non_blocking=True)

    def _sync(self, device: torch.device) -> None:
        """The dense tensors on `device`, counts covering every generated token."""
        if self._device != device:
            self._device, self._synced = device, 0
            v = self.vocab_size
            self._counts = torch.zeros(v, dtype=torch.float32, device=device)
            self._bias = torch.zeros(v, dtype=torch.float32, device=device)
            if self.controls.logit_bias:
                ids, biases = zip(*self.controls.logit_bias)
                self._bias[self._ids(list(ids))] = torch.tensor(biases, dtype=torch.float32).to(device)
            self._prompt_seen = torch.zeros(v, dtype=torch.bool, device=device)
            if self.prompt_ids:
                self._prompt_seen[self._ids(self.prompt_ids)] = True
        if self._synced < len(self.generated):
            new = self.generated[self._synced:]
            self._counts.index_add_(0, self._ids(new), torch.ones(len(new), device=device))
            self._synced = len(self.generated)

    def _banned(self) -> list[int]:
        """The bad words' last tokens banned after the tokens generated so far."""
        out, g = [], self.generated
        for word in self.controls.bad_words:
            head = list(word[:-1])
            if not head or (len(g) >= len(head) and g[len(g) - len(head):] == head):
                out.append(word[-1])
        return out


def control_state(controls: LogitsControls | None, vocab_size: int, prompt_ids=(),
                  grammar: GrammarState | None = None) -> ControlState | None:
    """The generation's `ControlState`, or None when it has neither active controls nor a grammar."""
    if (controls is None or not controls.active) and grammar is None:
        return None
    return ControlState(controls or NO_CONTROLS, vocab_size, prompt_ids, grammar)
