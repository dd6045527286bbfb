"""Oracle drafter: the verifier's own greedy continuation, corrupted where a script says so.

Owns scripted drafts for tests (the `Drafter` interface); it never runs a model and validates
the rows it is sent but never uses them, so its drafts depend only on the script.

Same interface as `DrafterEngine` (open_session, commit, draft, close_session, identity). A draft from anchor x[p+1] at seed position p proposes the script's tokens of
positions p+2..p+B+1 (only those before max_seq_len, as every drafter:
`dsv4.draft_args.draft_length`), each replaced by (token + 1) % vocab_size where the script
corrupts that position, with the script's confidence logit for that position. The anchor
must be the script's token at p+1; an anchor past the script's end is an error (the script
has no continuation there), while block positions past the end propose `filler_token`. Tests
use it to drive the verifier with drafts of known quality (full, partial and zero acceptance);
the service form is `services.drafter.live_oracle` (`dspark serve drafter --oracle`).

Commits are validated exactly like the DSpark engine's (`dsv4.draft_args.check_commit`: rows'
type, shape, dtype and finiteness; integer positions that continue the last committed one;
the seed position must be the last committed position); rows are otherwise ignored, so a
resent position is not compared with its first row (it cannot change a proposal).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from dsv4.config import ModelConfig
from dsv4.draft_args import as_int_list, check_commit, check_draft_args, check_seed, draft_length
from dsv4.scalars import as_int
from services.common.sessions import SessionHost, SessionTable
from services.drafter.engine import drafter_identity
from services.drafter.interface import Drafter


@dataclass(frozen=True)
class OracleScript:
    """tokens: the reference sequence by absolute position (prompt + the verifier's greedy
    continuation); corrupt: positions whose proposal is replaced by (token + 1) % vocab;
    confidence: position -> confidence logit, `default_confidence` elsewhere; positions past
    the script propose `filler_token`.

    Raises ValueError naming the value: a token, corrupt position, confidence position or
    filler_token that is not an integer >= 0 (bool and float included; the vocabulary bound
    is checked by `OracleDrafter`), an empty script, or a confidence that is not a finite
    real number. Sequences are stored as tuple / frozenset / dict of ints.
    """

    tokens: tuple[int, ...]
    corrupt: frozenset[int] = frozenset()
    confidence: Mapping[int, float] = field(default_factory=dict)
    default_confidence: float = 4.0
    filler_token: int = 0

    def __post_init__(self) -> None:
        tokens = tuple(as_int_list("tokens", self.tokens))
        empty = hasattr(self.corrupt, "__len__") and len(self.corrupt) == 0
        corrupt = frozenset() if empty else frozenset(as_int_list("corrupt", self.corrupt))
        if not isinstance(self.confidence, Mapping):
            raise ValueError(f"confidence must be a mapping position -> logit, got {type(self.confidence).__name__}")
        confidence = {as_int("confidence position", q): _finite("confidence", c) for q, c in self.confidence.items()}
        filler = as_int("filler_token", self.filler_token)
        for name, values in (("tokens", tokens), ("corrupt", corrupt), ("confidence position", confidence),
                             ("filler_token", (filler,))):
            bad = [v for v in values if v < 0]
            if bad:
                raise ValueError(f"{name} value {bad[0]}: must be >= 0")
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "corrupt", corrupt)
        object.__setattr__(self, "confidence", confidence)
        object.__setattr__(self, "default_confidence", _finite("default_confidence", self.default_confidence))
        object.__setattr__(self, "filler_token", filler)


def _finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r}: must be a finite real number")
    return float(value)


@dataclass
class _OracleSession:
    script: OracleScript
    last_position: int = -1


class OracleDrafter(SessionHost[_OracleSession], Drafter):
    """Scripted drafter (see the module docstring).

    Args:
        cfg: the model config (vocab, block size, row width, window for commit checks).
        script: the default script of new sessions.
        max_sessions: open sessions allowed at once (an integer >= 1).
    Raises:
        ValueError: a script token outside [0, vocab_size), max_sessions not an integer >= 1.
    """

    def __init__(self, cfg: ModelConfig, script: OracleScript, max_sessions: int = 16):
        self.cfg = cfg
        self.script = self._checked(script)
        self._table: SessionTable[_OracleSession] = SessionTable(max_sessions)

    def _checked(self, script: OracleScript) -> OracleScript:
        if not isinstance(script, OracleScript):
            raise ValueError(f"script must be an OracleScript, got {type(script).__name__}")
        bad = [t for t in (*script.tokens, script.filler_token) if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"script token {bad[0]} outside [0, vocab_size={self.cfg.vocab_size})")
        return script

    def identity(self) -> dict:
        """See `drafter_identity` (kind "oracle"; it always reports confidences)."""
        return drafter_identity(self.cfg, True, 1, "oracle")

    def open_session(self, script: OracleScript | None = None) -> int:
        """Open a session following `script` (default: the drafter's). Raises SessionLimitError when full."""
        return self._table.open(_OracleSession(self.script if script is None else self._checked(script)))

    def last_position(self, sid: int) -> int:
        return self._table.get(sid).last_position

    def commit(self, sid: int, rows: torch.Tensor, positions: Sequence[int]) -> None:
        """Record committed positions (rows are validated, not used). Raises like `DrafterEngine.commit`."""
        with self._table.locked(sid) as s:
            pos = check_commit(self.cfg, s.last_position, rows, positions)
            s.last_position = max(s.last_position, pos[-1])

    def draft(self, sid: int, anchor: int, seed_position: int) -> tuple[list[int], torch.Tensor]:
        """The script's block after `anchor`: (tokens of positions p+2..p+n+1, confidence logits
        [n] fp32), n = min(B, max_seq_len - p - 2) (`dsv4.draft_args.draft_length`).

        Raises:
            ValueError: anchor or seed_position not an integer, anchor outside [0, vocab_size),
                seed_position not the last committed position (both named), no room for the
                anchor, an anchor position past the script's end, or an anchor that is not the
                script's token at seed_position + 1 (the generation left the script, so its
                "greedy continuation" no longer applies).
        """
        anchor, p = check_draft_args(self.cfg, anchor, seed_position)
        with self._table.locked(sid) as s:
            check_seed(s.last_position, p)
            n = draft_length(self.cfg, p)
            script, V = s.script, self.cfg.vocab_size
            if p + 1 >= len(script.tokens):
                raise ValueError(f"anchor position {p + 1} is past the script's end ({len(script.tokens)} tokens): "
                                 f"the script has no continuation to propose")
            if anchor != script.tokens[p + 1]:
                raise ValueError(f"anchor={anchor} at position {p + 1} is not the script's token "
                                 f"{script.tokens[p + 1]}")
            tokens, conf = [], []
            for q in range(p + 2, p + 2 + n):
                t = script.tokens[q] if q < len(script.tokens) else script.filler_token
                tokens.append((t + 1) % V if q in script.corrupt else t)
                conf.append(script.confidence.get(q, script.default_confidence))
            return tokens, torch.tensor(conf, dtype=torch.float32)


def greedy_script(steps, prompt: Sequence[int], n_new: int) -> tuple[int, ...]:
    """Prompt + `n_new` tokens of plain greedy decoding by a verifier step loop `steps`
    (`services.verifier.batcher.StepLoop`), in a session of its own: what the oracle proposes."""
    engine = steps.engine
    sid = engine.open_session()
    try:
        step = steps.prefill(sid, list(prompt))
        tokens = [*map(int, prompt), step.next_token]
        for pos in range(len(prompt), len(prompt) + n_new - 1):
            tokens.append(steps.decode(sid, tokens[-1], pos).next_token)
        return tuple(tokens)
    finally:
        engine.close_session(sid)
