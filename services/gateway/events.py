"""What a generation is given and what it yields: the request, the model's limits, the events
streamed to the client, and the process totals folded from finished generations.

Owns these value types only; it runs nothing (the round loop is `services.gateway.scheduler`)
and talks to no backend. Counts in tokens, times in ms.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from services.common.constraint import Constraint
from services.common.controls import LogitsControls
from dsv4.sampling import GREEDY, SamplingParams, TokenLogprob
from services.gateway.record import RoundStats
from services.gateway.gate import Streak
from services.gateway.warm import WarmBands, sampling_band


@dataclass(frozen=True)
class ModelLimits:
    """What the scheduler must know about the served model (from the verifier's identity)."""

    vocab_size: int
    max_seq_len: int
    eos_token_id: int
    block_size: int
    confidence_head: bool = True
    # Ids the verifier guarantees it never emits: a draft holding one is invalid. None today
    # (the target's argmax spans the whole vocabulary); a verifier that masked ids would list them.
    reserved_token_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class GenerationParams:
    """A validated request. Counts in tokens."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    spec: str
    stop_token_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()
    label: str = "live"
    request_id: str = ""  # the client's or generated id (span attribute `gen_ai.response.id`)
    # How tokens are chosen (greedy, or seeded sampling under a rule); the seed is always set
    # by the time a generation runs (the servicer draws one when the request had none).
    sampling: SamplingParams = GREEDY
    max_drafts: int = 0  # drafted tokens a round may submit at most (0 = the block size)
    constraint: Constraint | None = None  # the output constraint (docs/structured.md); compiled at admission
    # logits controls (docs/sampling.md), stop_ids set to the stop token ids; None: none
    controls: LogitsControls | None = None
    # Prompt logprobs: None = not asked; else the top alternatives per prompt token (0..20).
    prompt_logprobs: int | None = None
    # Stop strings are looked for only after this many tokens (the request's min_tokens; kept
    # here because `controls` is None when min_tokens masks no token, e.g. with ignore_eos)
    min_tokens: int = 0


@dataclass(frozen=True)
class TokenEvent:
    """Tokens committed and streamed in one round (after stop checks), their text delta and
    one `TokenLogprob` per token (the target's raw distribution; empty when the verifier sent
    none). prompt_logprobs: the first event of a generation that asked for them, one record
    per prompt token after the first (else empty)."""

    token_ids: list[int]
    text_delta: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class FinalEvent:
    """End of a generation: finish reason ("stop" | "length"), counts, stats and timings (ms)."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    text: str
    text_delta: str
    counters: RoundStats  # folded from the generation's round records
    gate: dict
    time_to_first_token_ms: float
    # finish "stop": the stop token id (eos included) or stop string that ended it; else None
    matched_stop: int | str | None = None
    # What the warm start of later generations learns from this one: its sampling parameters
    # (they pick the band) and the confidence logits of its last drafted rounds, oldest first.
    sampling: SamplingParams = GREEDY
    recent_confidences: tuple[tuple[float, ...], ...] = ()
    # Its gate's losing streak at the end (`Gate.streak`), which the band's next generations
    # continue; None: it did not end losing, or its probes are cheap.
    streak: Streak | None = None
    # A prompt scored without generating (max_tokens 0): its prompt logprobs, as TokenEvent's.
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass
class ProcessStats:
    """Process-wide totals over finished generations (the `Gateway.Stats` RPC). Thread-safe.

    `totals` merges each finished generation's `RoundStats`; a generation still running or one
    that failed adds nothing. `warm`: the warm start's sampling bands (None: warm start off),
    which merge each finished generation's gate counters into its band.
    """

    generations: int = 0
    completion_tokens: int = 0
    totals: RoundStats = field(default_factory=RoundStats)
    warm: WarmBands | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, final: FinalEvent) -> None:
        """Count one finished generation, merge its round counters and, with a warm start, its
        gate counters into its sampling band."""
        with self._lock:
            self.generations += 1
            self.completion_tokens += final.completion_tokens
            self.totals.merge(final.counters)
        if self.warm is not None:
            self.warm.add(sampling_band(final.sampling), final.counters.gate, final.recent_confidences,
                          final.streak)

    def to_dict(self) -> dict:
        """JSON-ready: generations, completion_tokens, `speculation` (the summed counters),
        `gate` (the gate's view, per-bucket counts included) and `warm_start` (per sampling
        band what a new gate borrows, `WarmBands.to_dict`; None when off)."""
        with self._lock:
            speculation = self.totals.speculation_dict()
            speculation.pop("drafter_failed")  # a per-generation flag; drafter failures are counted apart
            out = {"generations": self.generations, "completion_tokens": self.completion_tokens,
                   "speculation": speculation, "gate": self.totals.gate.to_dict()}
        out["warm_start"] = None if self.warm is None else self.warm.to_dict()
        return out
