"""One structured log line per generation the gateway ends (logger `dspark.requests`).

This module owns the line's fields (the request id comes from `services.gateway.requests`);
`services.common.logs` writes the fields as text or JSON (`DSPARK_LOG_FORMAT`). It
decides nothing and counts nothing: the servicer hands over the generation's final event.

Fields: request_id, spec_mode, finish_reason (stop | length | abort: the client went away |
error: a backend failed), prompt_tokens, completion_tokens, ttft_ms (None before a first
token), duration_ms (admission to the end), rounds, submitted and accepted drafts, and
acceptance = accepted / submitted (None when no draft was verified, e.g. spec off). A
generation that ended without its final event (aborted, cancelled, failed) still reports the
completion tokens it streamed and its TTFT; its round counts are None (they are folded only
at the end).
"""

from __future__ import annotations

import logging
import time

from services.common.logs import FIELDS
from services.gateway.events import FinalEvent, GenerationParams

log = logging.getLogger("dspark.requests")


class RequestLine:
    """Times one generation and logs its line once, when it ends.

    Use as a context manager around the streaming of the generation: call `streamed(n)` for
    each message of n tokens sent and `finished(event)` with the final event; leaving the
    block without it logs finish_reason "error" for an exception and "abort" for a cancel or a
    closed stream, with the tokens streamed so far.
    Args:
        request_id: the id the line carries.
        params: the validated request (spec mode, prompt length).
    """

    def __init__(self, request_id: str, params: GenerationParams):
        self.request_id, self.params = request_id, params
        self.t0 = time.perf_counter()
        self.done = False
        self.completion_tokens = 0
        self.ttft_ms: float | None = None

    def streamed(self, tokens: int) -> None:
        """A message carrying `tokens` completion tokens went out (the first one sets TTFT, ms)."""
        if tokens and self.ttft_ms is None:
            self.ttft_ms = (time.perf_counter() - self.t0) * 1e3
        self.completion_tokens += tokens

    def finished(self, event: FinalEvent) -> None:
        """Log the line of a generation that sent its final message."""
        c = event.counters
        self._emit(event.finish_reason, event.prompt_tokens, event.completion_tokens, event.time_to_first_token_ms,
                   c.rounds, c.submitted, c.accepted)

    def __enter__(self) -> RequestLine:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.done:
            reason = "error" if exc_type is not None and issubclass(exc_type, Exception) else "abort"
            self._emit(reason, len(self.params.prompt_ids), self.completion_tokens, self.ttft_ms, None, None, None)

    def _emit(self, reason: str, prompt: int, completion: int | None, ttft_ms: float | None,
              rounds: int | None, submitted: int | None, accepted: int | None) -> None:
        self.done = True
        fields = {"request_id": self.request_id, "spec_mode": self.params.spec, "finish_reason": reason,
                  "prompt_tokens": prompt, "completion_tokens": completion,
                  "ttft_ms": None if ttft_ms is None else round(ttft_ms, 3),
                  "duration_ms": round((time.perf_counter() - self.t0) * 1e3, 3),
                  "rounds": rounds, "submitted": submitted, "accepted": accepted,
                  "acceptance": round(accepted / submitted, 4) if submitted else None}
        log.info("request finished", extra={FIELDS: fields})
