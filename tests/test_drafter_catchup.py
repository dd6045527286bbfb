"""The drafter keeps up while k = 0 (docs/gate.md §5b "A skipped round sends the drafter nothing").

Rounds that submit no draft must still bring the drafter every committed row before it drafts
again; a drafter that missed them would draft from stale rings once speculation resumes, and
acceptance would collapse while the output stayed right (the verifier decides every token), so
only acceptance shows such a bug. Each test runs one generation twice through the real
services (in-process verifier, DSpark drafter and gateway on port 0, real channels) on the
bundled trained model (assets/dspark-small) in exact numerics, batched verify:

* the reference speculates (spec `always`, k = the block) from its first round;
* the quiet run is held at k = 0 for its first R >= QUIET_ROUNDS rounds, then speculates the
  same way. R is chosen so that its first speculating round is anchored at a position P where
  the reference also starts a round.

Three ways a round drafts nothing, each through the path the services run (a `RoundPolicy`
whose decisions say so, put where the scheduler builds its policy):

* `margin`: the pre-draft decision skips (`Reason.ANCHOR_MARGIN`): the link holds the rows back
  (`DrafterLink.commit(defer=True)`) and flushes them before the next draft;
* `regime`: the regime keeps the generation plain from its start: the link is asleep (no
  drafter session) and the first drafting round primes a new session from the verifier's kept
  rows (`DrafterLink.wake`);
* `cut`: the round drafts and the length choice cuts it to 0: the rows go with each round.

From P on both runs must stream the same rounds (each round's tokens, so each round's
accepted drafts), the same text, no drafter failure or failover; and at every seed position
both drafted from, the drafter's rings (read in its forward) must be bitwise equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from services.gateway import scheduler as scheduler_module
from services.gateway.gate import Reason
from services.gateway.round_policy import RoundPolicy
from services_fixtures import BUNDLED, Generation, bundled_draft_module, gen_request, start_exact_stack

pytestmark = pytest.mark.skipif(not (BUNDLED / "config.json").is_file(), reason=f"bundled model absent: {BUNDLED}")

QUIET_ROUNDS = 20   # k = 0 rounds at least, before the quiet run speculates
AFTER_ROUNDS = 10   # speculating rounds compared from P on, at least
PROMPT = "The history of the city begins with a small harbour where fishermen"
# max_tokens: QUIET_ROUNDS tokens, then AFTER_ROUNDS rounds and a few more at the case's acceptance
CASES = {"greedy": {"max_tokens": 58}, "sampled": {"max_tokens": 40, "temperature": 0.8, "seed": 20261207}}
PATHS = ("margin", "regime", "cut")
# The sampled case of the paths without deferred rows runs with the slow tests (the suite's time budget).
MATRIX = [("greedy", path) for path in PATHS] + [
    ("sampled", "margin"), *(pytest.param("sampled", path, marks=pytest.mark.slow) for path in PATHS[1:])]


class QuietStart(RoundPolicy):
    """A `RoundPolicy` whose first `quiet` rounds (counted by `observe`, one per verify or decode)
    submit nothing, by `path` (the module docstring); afterwards it decides as its base.
    Class attributes, set by `_run` before the generation starts."""

    quiet = 0
    path = "margin"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds = 0

    @property
    def _quiet(self) -> bool:
        return self.rounds < self.quiet

    def regime_drafts(self, in_flight: int) -> bool:
        return not (self.path == "regime" and self._quiet) and super().regime_drafts(in_flight)

    def pre_draft(self, anchor_margin, others_inside: int):
        if self.path == "margin" and self._quiet:
            return Reason.ANCHOR_MARGIN
        return super().pre_draft(anchor_margin, others_inside)

    def choose(self, confidences, drafted: int, pos: int, emitted: int):
        if self.path == "cut" and self._quiet:
            return Reason.COST, 0
        return super().choose(confidences, drafted, pos, emitted)

    def observe(self, *args, **kwargs) -> None:
        self.rounds += 1
        super().observe(*args, **kwargs)


@dataclass
class Run:
    """One generation as the client saw it, and the drafter's rings at each draft: rings[seed]
    = one [W, Dh] tensor per stage, as the drafter's forward read them (the last draft of
    that seed position)."""

    gen: Generation
    rings: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    def rounds_from(self, prompt_len: int, position: int) -> list[list[int]]:
        """The tokens of each round anchored at `position` or later (the first message holds
        the first anchor, the last one none)."""
        anchor, out = prompt_len, []
        for chunk in self.gen.chunks[1:-1]:
            if anchor >= position:
                out.append(chunk)
            anchor += len(chunk)
        return out

    def anchors(self, prompt_len: int) -> list[int]:
        """The anchor position of every round."""
        out, anchor = [], prompt_len
        for chunk in self.gen.chunks[1:-1]:
            out.append(anchor)
            anchor += len(chunk)
        return out


@pytest.fixture(scope="module")
def stack():
    stack = start_exact_stack("dspark", model="bundled")
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def prompt_ids(stack) -> list[int]:
    return stack.tokenizer().encode(PROMPT)


def _request(prompt_ids: list[int], case: str):
    req = gen_request(ids=prompt_ids, max_tokens=CASES[case]["max_tokens"], spec="always",
                      temperature=CASES[case].get("temperature", 0.0))
    if "seed" in CASES[case]:
        req.seed = CASES[case]["seed"]
    return req


def _run(stack, req, quiet: int = 0, path: str = "margin") -> Run:
    """One generation through the stack's batched gateway, its first `quiet` rounds held at
    k = 0 by `path`, the drafter's rings recorded at every draft it computes."""
    module = bundled_draft_module()
    draft_rows = module._draft_rows
    run = Run(Generation())

    def reading(rings, anchors, seeds, choose=None):  # calls through: only copies what it reads
        for session_rings, seed in zip(rings, seeds):
            run.rings[seed] = [r.detach().clone() for r in session_rings]
        return draft_rows(rings, anchors, seeds, choose)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, "_draft_rows", reading)
        mp.setattr(QuietStart, "quiet", quiet)
        mp.setattr(QuietStart, "path", path)
        mp.setattr(scheduler_module, "RoundPolicy", QuietStart)
        run.gen = stack.generate(req, "batched")
    return run


_REFERENCES: dict[str, Run] = {}


def _reference(stack, prompt_ids: list[int], case: str) -> Run:
    """The run that speculates from its first round (once per case and module)."""
    if case not in _REFERENCES:
        _REFERENCES[case] = _run(stack, _request(prompt_ids, case))
    return _REFERENCES[case]


@pytest.mark.parametrize("case, path", MATRIX)
def test_speculation_after_quiet_rounds_accepts_as_if_it_never_stopped(stack, prompt_ids, case, path):
    n = len(prompt_ids)
    ref = _reference(stack, prompt_ids, case)
    position = next(a for a in ref.anchors(n) if a >= n + QUIET_ROUNDS)  # P: the reference starts a round there
    quiet = _run(stack, _request(prompt_ids, case), position - n, path)

    assert quiet.gen.final is not None and ref.gen.final is not None
    assert quiet.gen.token_ids == ref.gen.token_ids and quiet.gen.final.text == ref.gen.final.text
    s = quiet.gen.stats
    assert not s.drafter_failed and s.drafter_failovers == 0
    assert not ref.gen.stats.drafter_failed and ref.gen.stats.drafter_failovers == 0
    # the quiet rounds: one token each, nothing submitted
    assert quiet.anchors(n)[:position - n + 1] == list(range(n, position + 1))
    if path == "margin":
        assert s.margin_skipped_rounds == position - n
    expected = ref.rounds_from(n, position)
    got = quiet.rounds_from(n, position)
    assert len(expected) >= AFTER_ROUNDS
    assert [len(r) - 1 for r in got] == [len(r) - 1 for r in expected]  # accepted drafts per round
    assert got == expected
    assert sum(len(r) - 1 for r in expected) > 0  # the comparison saw drafts accepted
    # the drafter read the same rings wherever both drafted: from P - 1 on, and before it
    # wherever the quiet run drafted (a cut round) at a seed the reference drafted from too
    shared = sorted(set(quiet.rings) & set(ref.rings))
    assert {p for p in quiet.rings if p >= position - 1} == {p for p in ref.rings if p >= position - 1}
    assert position - 1 in shared
    for seed in shared:
        for stage, (a, b) in enumerate(zip(quiet.rings[seed], ref.rings[seed])):
            assert torch.equal(a, b), f"seed position {seed}, stage {stage}: the rings differ"
