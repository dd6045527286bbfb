"""The step loops' alignment rules (services/common/alignment.py) and the schedule's use of
them, on a clock the test passes in: every value is hand-computed, no time is measured."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from services.common.alignment import (Free, Gather, Lockstep, PingPong, RateGather, Returning,
                                       default_alignment)
from services.common.budget import StepTimes
from services.common.schedule import ReturnGaps, Schedule


@dataclass(eq=False)
class Req:
    sid: int
    op: str = "verify"
    left: int = 0


def back(sid: int, due_s: float, away: bool = True) -> Returning:
    """A session answered at t = 0 and expected back at `due_s`."""
    return Returning(sid, 0.0, due_s, away, last_step=True)


def test_rate_gather_waits_only_while_sessions_per_ms_rise():
    """One session queued; two due at 2 and 50 ms. A flat 10 ms step: 1/10, 2/(2+10), 3/(50+10)
    sessions per ms, so it waits for the first only. A step of 10 ms a row: 1/10 > 2/(2+20),
    so it starts at once."""
    returning = [back(7, 0.002), back(8, 0.050)]
    flat = RateGather(lambda: (StepTimes((1.0, 100.0), (10.0, 10.0)), 1.0), cap_s=1.0)
    assert flat.plan(0.0, 0.01, [3], returning) == ({7}, 1.0)
    per_row = RateGather(lambda: (StepTimes((1.0, 100.0), (10.0, 1000.0)), 1.0), cap_s=1.0)
    assert per_row.plan(0.0, 0.01, [3], returning) == (set(), 0.0)
    # nothing due within the cap is awaited; without a table it gathers as `Gather(cap_s)`
    assert flat.plan(0.0, 0.01, [3], [back(9, 2.0)]) == (set(), 0.0)
    assert RateGather(lambda: (None, 1.0), 1.0).plan(0.0, 0.01, [3], [back(7, 0.002, away=False)]) == ({7}, 0.01)


def test_free_gather_and_lockstep():
    returning = [back(1, 0.01, away=False), back(2, 0.01, away=True), back(3, 5.0, away=True)]
    assert Free().plan(0.0, 0.1, [9], returning) == (set(), 0.0)
    assert Gather(0.05).plan(0.0, 0.1, [9], returning) == ({1}, 0.05)  # never an away session
    assert Lockstep(1.0).plan(0.0, 0.1, [9], returning) == ({1, 2}, 1.0)  # every one due within the cap


def test_ping_pong_serves_one_cohort_per_step_through_the_schedule():
    """Sessions 0..3 verify; cohort = sid % 2. A step answers 0 and 2 (away to the drafter) while
    1 and 3 wait: cohort 0's turn comes first, so the step waits for 0 and 2, takes only them,
    and the next step takes 1 and 3 at once."""
    s = Schedule(0.05, frozenset({"verify"}), alignment=PingPong(cap_s=1.0))
    first = [Req(0), Req(2)]
    s.admit(*first, now=0.0)
    assert [r.sid for r in s.take().requests] == [0, 2]  # turn 0, now turn 1
    for r in first:
        s.release(r, 0.1, answered=True)
    s.admit(Req(1), Req(3), now=0.1)
    assert s.wait_s(0.1, 0.1) == 0.0  # cohort 1 is queued and none of it is away
    assert [r.sid for r in s.take().requests] == [1, 3]
    s.admit(Req(0), now=0.15)
    assert s.wait_s(0.15, 0.1) == pytest.approx(1.0)  # cohort 0: session 2 is still drafting
    s.admit(Req(5), now=0.16)  # cohort 1 arrives meanwhile: it waits for its turn
    s.admit(Req(2), now=0.2)
    assert s.wait_s(0.2, 0.1) == 0.0
    assert sorted(r.sid for r in s.take().requests) == [0, 2]
    assert [r.sid for r in s.take().requests] == [5]


def test_a_session_never_seen_after_a_kind_is_expected_when_others_came_back():
    """A prefill is answered once per session: its gap comes from the sessions before it."""
    gaps = ReturnGaps()
    for sid, gap in ((1, 0.2), (2, 0.4)):
        gaps.answered(sid, "prefill", 0.0)
        gaps.sent(sid, gap)
    gaps.answered(3, "prefill", 1.0)
    assert gaps.expected(3) == pytest.approx(0.2 + 0.5 * (0.4 - 0.2))
    gaps.answered(4, "decode", 1.0)
    assert gaps.expected(4) == 0.0  # nothing known of that kind


def test_the_default_per_device_and_bad_caps():
    assert (default_alignment("cpu"), default_alignment("cuda:1")) == ("gather", "rate")
    for bad in (-1.0, float("inf")):
        with pytest.raises(ValueError, match="cap_s="):
            Lockstep(bad)
        with pytest.raises(ValueError, match="cap_s="):
            PingPong(bad)
