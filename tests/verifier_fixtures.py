"""Verifier step loops for the tests: `StepVerifier` (blocking calls, each through a step loop
of its own; `services.verifier.batcher`) and `loop_of`, one shared loop per engine for the
in-process gateway sessions (`LocalVerifierSession`)."""

from __future__ import annotations

from services.verifier.batcher import StepLoop, StepVerifier

__all__ = ["StepVerifier", "loop_of"]

_LOOPS: dict[int, StepLoop] = {}


def loop_of(engine) -> StepLoop:
    """One step loop per engine (default prompt chunk, as a served verifier), kept for the
    process: what in-process sessions (`LocalVerifierSession`) of that engine share."""
    loop = _LOOPS.get(id(engine))
    if loop is None or loop.engine is not engine:
        loop = _LOOPS[id(engine)] = StepLoop(engine)
    return loop
