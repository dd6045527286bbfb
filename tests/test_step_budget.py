"""The verifier's step budget (services.common.budget): admission on hand-computed steps, the
cut of a block to its prefix, and that it reads nothing but the estimates, the table and the
rate (non-anticipation)."""

from __future__ import annotations

import pytest

from services.common.budget import StepBudget, StepTimes, admit_drafts, check_survival

# 10 ms at 1 row, +2/3 ms per row to 4 rows, then +2 ms per row (a step that turns row-bound)
TABLE = StepTimes((1.0, 4.0, 8.0, 16.0), (10.0, 12.0, 20.0, 36.0))


def test_three_sessions_hand_computed():
    """Blocks A (.9 .8 .5), B (.6 .3), C (.95 .9 .85 .2) beside one decode: base rows 4 (three
    anchors and the decode), lambda 0.2 tokens/ms. By survival: C0 .95, A0 .9, C1 .9, C2 .85,
    A1 .8, B0 .6, A2 .5, B1 .3, C3 .2; value(N) = sum of the first N - 0.2 * ms(4 + N) =
    -2.4, -1.85, -1.35, -0.85, -0.4, 0.0, 0.2, 0.3, 0.2, 0.0 for N = 0..9: N = 7, so A keeps 3,
    B 1 and C 3 (a position pays while its survival >= 0.2 * 2 ms = 0.4)."""
    blocks = [(0.9, 0.8, 0.5), (0.6, 0.3), (0.95, 0.9, 0.85, 0.2)]
    assert admit_drafts(blocks, 4, TABLE, 0.2) == [3, 1, 3]


def test_every_count_is_weighed_not_only_the_next_position():
    """A step that jumps 20 ms at its 9th row and is flat after: one more draft alone does not
    pay for the jump, eight do (value 8 * 0.5 - 0.1 * 30 = 1.0 > 0 - 0.1 * 10 = -1.0)."""
    table = StepTimes((1.0, 8.0, 9.0, 16.0), (10.0, 10.0, 30.0, 30.0))
    blocks = [(0.5,) * 4, (0.5,) * 4]
    assert admit_drafts(blocks, 8, table, 0.1) == [4, 4]
    assert admit_drafts([(0.5,)], 8, table, 0.1) == [0]


def test_free_rows_and_a_cold_rate_admit_everything():
    blocks = [(0.3, 0.1), (0.05,)]
    assert admit_drafts(blocks, 2, TABLE, 0.0) == [2, 1]
    assert admit_drafts(blocks, 2, StepTimes((1.0,), (10.0,)), 5.0) == [2, 1]


def test_ties_go_to_earlier_positions_and_blocks():
    """Equal survivals: position 0 of the second block before position 1 of the first; with
    room for exactly two, the first block keeps 1 and the second 1."""
    table = StepTimes((1.0, 4.0, 5.0), (0.0, 0.0, 100.0))
    assert admit_drafts([(0.7, 0.7), (0.7, 0.7)], 2, table, 1.0) == [1, 1]


@pytest.mark.parametrize("survival, drafts, named", [
    ((0.5, 0.6), 2, "survival[1]=0.6"), ((1.5,), 1, "survival[0]=1.5"), ((float("nan"),), 1, "survival[0]=nan"),
    ((0.5,), 2, "1 entries for 2 drafts"),
])
def test_bad_estimates_name_the_value(survival, drafts, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        check_survival(survival, drafts)


def test_bad_rate_names_the_value():
    with pytest.raises(ValueError, match="rate=-1"):
        admit_drafts([(0.5,)], 1, TABLE, -1.0)


class _Block:
    """A step request as the budget sees it; `outcome` is what its verify will accept, which
    the budget must never read."""

    def __init__(self, survival, outcome=0):
        self.survival, self.outcome, self.kept = survival, outcome, len(survival or ())

    def trim(self, drafts):
        self.kept, self.survival = drafts, self.survival[:drafts] or None


def test_apply_cuts_blocks_and_leaves_others():
    budget = StepBudget(lambda: (TABLE, 0.2))
    a, b, c, plain = _Block((0.9, 0.8, 0.5)), _Block((0.6, 0.3)), _Block((0.95, 0.9, 0.85, 0.2)), _Block(None)
    # rows: the three blocks whole (4 + 3 + 5) and the decode (1)
    assert budget.apply([a, b, plain, c], 4 + 3 + 5 + 1) == [3, 1, 3]
    assert (a.kept, b.kept, c.kept, plain.survival) == (3, 1, 3, None)
    assert StepBudget(lambda: (None, 0.2)).apply([_Block((0.1,))], 2) is None


def test_admission_never_depends_on_the_outcome():
    """Non-anticipation: the same estimates, table and rate give the same cut whatever the
    blocks will accept. A variant that peeks at the outcome (admits exactly what will be
    accepted) is caught by this very check."""
    def cut(apply, outcomes):
        blocks = [_Block((0.9, 0.7, 0.4), o) for o in outcomes]
        apply(blocks)
        return [b.kept for b in blocks]

    budget = StepBudget(lambda: (TABLE, 0.15))
    honest = lambda blocks: budget.apply(blocks, 4 * len(blocks))  # noqa: E731

    def peeking(blocks):
        for b in blocks:
            b.trim(min(b.outcome, len(b.survival)))

    for apply in (honest, peeking):
        same = cut(apply, [0, 0, 0]) == cut(apply, [3, 1, 2]) == cut(apply, [2, 2, 0])
        assert same is (apply is honest)
