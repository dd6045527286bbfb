"""A forced regime for the service tests: the gateway's model regime with its choice scripted.

`ForcedRegime` drives a live gateway's sleep, wake, back-off and cancel paths at chosen loads
(tests/test_adversarial_regime.py): set it as `gateway.scheduler.regime`.
"""

from __future__ import annotations

import bisect
import collections
from typing import Mapping

from services.common.budget import StepTimes
from services.gateway.gate import GateConfig
from services.gateway.load_regime import ModelRegime
from services_fixtures import block_size


class ForcedRegime(ModelRegime):
    """A `ModelRegime` whose choice is scripted, for tests that force the gateway's sleep,
    wake, back-off and cancel paths at chosen loads.

    `script` maps the lowest in_flight of a range (up to the next key) to "draft" or "plain",
    or to a tuple of them cycled one per ask in that range (a regime that keeps switching):
    {2: "plain", 5: ("draft", "draft", "plain")} runs 2-4 in flight plain and from 5 up drafts
    with every third ask plain. `may_draft(in_flight, held_rows, tokens_left)` answers the
    script whatever the rows held or the tokens left; below the lowest key it is the model's
    (alone: always, the gate decides). `decides_length`, `observe` and the Stats view are the
    model's, over a flat step table (10 ms at any rows) and the gate's default costs.
    `answers` counts each answer given ("draft" / "plain"); assign `script` to turn the regime
    mid-run. Raises ValueError on an answer other than "draft" or "plain"."""

    def __init__(self, script: Mapping[int, str | tuple[str, ...]], block: int | None = None):
        super().__init__(block_size() if block is None else block,
                         lambda: StepTimes((1.0,), (10.0,)), GateConfig().cost_model)
        self.answers: collections.Counter[str] = collections.Counter()
        self.script = script

    @property
    def script(self) -> dict[int, tuple[str, ...]]:
        return self._script

    @script.setter
    def script(self, script: Mapping[int, str | tuple[str, ...]]) -> None:
        cycles = {int(n): (a,) if isinstance(a, str) else tuple(a) for n, a in sorted(script.items())}
        if any(a not in ("draft", "plain") for answers in cycles.values() for a in answers):
            raise ValueError(f"script={dict(script)!r}: answers must be 'draft' or 'plain'")
        self._script, self._asked = cycles, collections.Counter()

    def may_draft(self, in_flight: int, held_rows: int = 0, tokens_left: int = 0) -> bool:
        keys = list(self._script)
        i = bisect.bisect_right(keys, in_flight) - 1
        if i < 0:
            return super().may_draft(in_flight, held_rows, tokens_left)
        cycle = self._script[keys[i]]
        answer = cycle[self._asked[keys[i]] % len(cycle)]
        self._asked[keys[i]] += 1
        self.answers[answer] += 1
        return answer == "draft"
