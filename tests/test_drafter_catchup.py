"""The drafter keeps up while k = 0 (docs/gate.md §5b "A skipped round sends the drafter nothing").

Rounds that submit no draft must still bring the drafter every committed row before it drafts
again; a drafter that missed them would draft from stale rings once speculation resumes, and
acceptance would collapse while the output stayed right (the verifier decides every token), so
only acceptance shows such a bug. Each test runs one generation twice through the real
services (in-process verifier, DSpark drafter and gateway on port 0, real channels) on the
bundled trained model (assets/dspark-small) in exact numerics, batched verify:

* the reference speculates (spec `always`, k = the block) from its first round;
* the quiet run is held at k = 0 for its first R >= QUIET_ROUNDS[path] rounds, then speculates
  the same way. R is chosen so that its first speculating round is anchored at a position P
  where the reference also starts a round.

Three ways a round drafts nothing, each through the path the services run (a `RoundPolicy`
whose decisions say so, put where the scheduler builds its policy):

* `margin`: the pre-draft decision skips (`Reason.ANCHOR_MARGIN`): the link holds the rows back
  (`DrafterLink.commit(defer=True)`), sends them once MAX_DEFERRED_ROWS have piled up, and
  flushes the rest before the next draft (R is past the bound, so both happen);
* `regime`: the regime keeps the generation plain from its start: the link is asleep (no
  drafter session) and the first drafting round primes a new session from the verifier's kept
  rows (`DrafterLink.wake`);
* `cut`: the round drafts and the length choice cuts it to 0: the rows go with each round.

From P on both runs must stream the same rounds (each round's tokens, so each round's
accepted drafts), the same text, no drafter failure or failover; and at every seed position
both drafted from, the drafter's rings (read in its forward) must be bitwise equal. The
drafter's commits are checked to have taken the path named (held, re-primed, every round).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from services.gateway import scheduler as scheduler_module
from services.gateway.gate import Reason
from services.gateway.round_policy import RoundPolicy
from services.gateway.scheduler import MAX_DEFERRED_ROWS
from services_fixtures import BUNDLED, Generation, bundled_draft_module, gen_request, start_exact_stack

pytestmark = pytest.mark.skipif(not (BUNDLED / "config.json").is_file(), reason=f"bundled model absent: {BUNDLED}")

PATHS = ("margin", "regime", "cut")
# k = 0 rounds at least, before the quiet run speculates; held rows pass the deferral bound
QUIET_ROUNDS = {"margin": MAX_DEFERRED_ROWS + 4, "regime": 20, "cut": 20}
AFTER_ROUNDS = 10   # speculating rounds compared from P on, at least
# longer than the drafter's window (64): the prompt's commit and a re-priming one hold a full window
PROMPT = ("The history of the city begins with a small harbour where fishermen brought their boats in at dusk. "
          "Over the centuries the harbour grew into a port, the port into a market town, and the market town "
          "into the busy city we know today, with its bridges, its narrow streets and its old stone walls.")
# max_tokens: the quiet tokens, then AFTER_ROUNDS rounds and a few more at the case's acceptance
CASES = {"greedy": {"max_tokens": 64}, "sampled": {"max_tokens": 58, "temperature": 0.8, "seed": 20261207}}
# The sampled case runs with the slow tests (the suite's time budget): the link's paths are the
# greedy case's; what it adds is drafts drawn with the request's seed at their positions.
MATRIX = [("greedy", path) for path in PATHS] + [pytest.param("sampled", path, marks=pytest.mark.slow)
                                                 for path in PATHS]


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

    def regime_drafts(self, in_flight: int, pos: int = 0, emitted: int = 0, primed: bool = False) -> bool:
        return not (self.path == "regime" and self._quiet) and super().regime_drafts(in_flight, pos, emitted, primed)

    def pre_draft(self, anchor_margin):
        if self.path == "margin" and self._quiet:
            return Reason.ANCHOR_MARGIN
        return super().pre_draft(anchor_margin)

    def choose(self, confidences, drafted: int, pos: int, emitted: int):
        if self.path == "cut" and self._quiet:
            return Reason.COST, 0
        return super().choose(confidences, drafted, pos, emitted)

    def observe(self, *args, **kwargs) -> None:
        self.rounds += 1
        super().observe(*args, **kwargs)


@dataclass
class Run:
    """One generation as the client saw it, the drafter's rings at each draft (rings[seed] =
    one [W, Dh] tensor per stage, as the drafter's forward read them; the last draft of that
    seed position) and the positions of each commit it wrote, in order."""

    gen: Generation
    rings: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    commits: list[list[int]] = field(default_factory=list)

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
    k = 0 by `path`; the drafter's rings recorded at every draft it computes, and the
    positions of every commit it writes (one generation at a time: every call is this one's)."""
    module = bundled_draft_module()
    draft_rows, write = module._draft_rows, module.write_main_kv_batch
    run = Run(Generation())

    def reading(rings, anchors, seeds, choose=None):  # calls through: only copies what it reads
        for session_rings, seed in zip(rings, seeds):
            run.rings[seed] = [r.detach().clone() for r in session_rings]
        return draft_rows(rings, anchors, seeds, choose)

    def writing(states, rows, positions):  # calls through: only notes the positions
        run.commits.extend([int(p) for p in ps] for ps in positions)
        return write(states, rows, positions)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, "_draft_rows", reading)
        mp.setattr(module, "write_main_kv_batch", writing)
        mp.setattr(QuietStart, "quiet", quiet)
        mp.setattr(QuietStart, "path", path)
        mp.setattr(scheduler_module, "RoundPolicy", QuietStart)
        run.gen = stack.generate(req, "batched")
    return run


@pytest.fixture(scope="module")
def references() -> dict[str, Run]:
    """The runs that speculate from their first round, by case (filled on first use)."""
    return {}


@pytest.mark.parametrize("case, path", MATRIX)
def test_speculation_after_quiet_rounds_accepts_as_if_it_never_stopped(stack, prompt_ids, references, case, path):
    n = len(prompt_ids)
    if case not in references:
        references[case] = _run(stack, _request(prompt_ids, case))
    ref = references[case]
    position = next(a for a in ref.anchors(n) if a >= n + QUIET_ROUNDS[path])  # P: the reference starts a round there
    quiet = _run(stack, _request(prompt_ids, case), position - n, path)

    assert quiet.gen.final is not None and ref.gen.final is not None
    assert quiet.gen.token_ids == ref.gen.token_ids and quiet.gen.final.text == ref.gen.final.text
    # the quiet rounds: one token each
    assert quiet.anchors(n)[:position - n + 1] == list(range(n, position + 1))
    expected = ref.rounds_from(n, position)
    got = quiet.rounds_from(n, position)
    assert len(expected) >= AFTER_ROUNDS
    assert [len(r) - 1 for r in got] == [len(r) - 1 for r in expected]  # accepted drafts per round
    assert got == expected
    assert sum(len(r) - 1 for r in expected) > 0  # the comparison saw drafts accepted
    s = quiet.gen.stats
    assert not s.drafter_failed and s.drafter_failovers == 0
    assert not ref.gen.stats.drafter_failed and ref.gen.stats.drafter_failovers == 0
    assert s.margin_skipped_rounds == (position - n if path == "margin" else 0)
    assert s.skipped_after_draft == (position - n if path == "cut" else 0)
    # the drafter read the same rings wherever both drafted: from P - 1 on, and before it
    # wherever the quiet run drafted (a cut round) at a seed the reference drafted from too
    shared = sorted(set(quiet.rings) & set(ref.rings))
    assert {p for p in quiet.rings if p >= position - 1} == {p for p in ref.rings if p >= position - 1}
    assert position - 1 in shared
    for seed in shared:
        for stage, (a, b) in enumerate(zip(quiet.rings[seed], ref.rings[seed])):
            assert torch.equal(a, b), f"seed position {seed}, stage {stage}: the rings differ"
    _assert_commits(quiet.commits, n, position, path, stack.drafter_engine.identity()["window_size"])


def _assert_commits(commits: list[list[int]], n: int, position: int, path: str, window: int) -> None:
    """The drafter's commits of the quiet run (positions each, in order) took `path` while k = 0:
    a prompt of `n` tokens, the first speculating round anchored at `position`. Every commit
    continues the one before it."""
    before = [c for c in commits if c[0] < position]
    prompt = list(range(max(0, n - window), n))  # the prompt's last min(n, W) rows
    if path == "margin":  # the prompt; the held rows, MAX_DEFERRED_ROWS at a time, then the rest
        held = list(range(n, position))
        bounded = [held[i:i + MAX_DEFERRED_ROWS] for i in range(0, len(held), MAX_DEFERRED_ROWS)]
        assert before == [prompt, *bounded]
    elif path == "regime":  # asleep: nothing, then one priming commit of the verifier's kept rows
        assert before == [list(range(max(0, position - window), position))]
    else:  # drafted every round: the rows go with each
        assert before == [prompt, *([p] for p in range(n, position))]
    assert all(b[0] == a[-1] + 1 for a, b in zip(commits, commits[1:]))
