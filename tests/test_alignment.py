"""The step loops' alignment rules (services/common/alignment.py) and the schedule's use of
them, on a clock the test passes in: every value is hand-computed, no time is measured."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings, strategies as st

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


def test_a_session_late_by_more_than_the_cap_is_not_awaited():
    """Answered at t = 0, due at 10 ms; at t = 2 s it is late by more than the 1 s cap: every
    rule that awaits away sessions leaves it (it is idle, or gone without closing), while one
    due within the cap is still awaited."""
    table = StepTimes((1.0, 100.0), (10.0, 10.0))
    for make in (lambda: Lockstep(1.0), lambda: PingPong(1.0), lambda: RateGather(lambda: (table, 1.0), 1.0)):
        assert make().plan(2.0, 0.01, [2], [back(4, 0.010)]) == (set(), 2.0), make().name
        assert make().plan(0.5, 0.01, [2], [back(4, 0.010)]) == ({4}, 1.5), make().name


ALIGNMENTS = {
    "free": lambda cap: Free(), "gather": lambda cap: Gather(cap), "lockstep": Lockstep, "pingpong": PingPong,
    "rate": lambda cap: RateGather(lambda: (StepTimes((1.0, 64.0), (10.0, 12.0)), 1.0), cap),
    "rate-one-point": lambda cap: RateGather(lambda: (StepTimes((4.0,), (10.0,)), 1.0), cap)}


@settings(max_examples=60, deadline=None, derandomize=True)
@given(name=st.sampled_from(sorted(ALIGNMENTS)), cap=st.sampled_from([0.0, 0.02, 0.05]),
       fates=st.lists(st.sampled_from(["back", "slow", "silent", "close"]), min_size=1, max_size=8),
       gaps=st.lists(st.integers(0, 80), min_size=8, max_size=8))
def test_no_step_waits_past_the_cap_and_no_request_starves(name, cap, fates, gaps):
    """Sessions each coming back after their own gap (ms), one gap past the cap, staying
    silent while open, or closing while awaited: every wait is within the cap, silent
    sessions cost a bounded number of waits (not one per step), and every queued request is
    taken within two steps (ping-pong defers the other cohort by one). Simulated clock: the
    test advances `now`; nothing is timed."""
    s = Schedule(cap, frozenset({"verify"}), alignment=ALIGNMENTS[name](cap))
    now, step_s, age, timeouts = 0.0, 0.01, {}, 0
    s.admit(*[Req(i, "decode") for i in range(len(fates))], now=now)
    due: dict[int, float] = {}
    for step in range(40):
        for sid, t in sorted(due.items()):
            if t <= now:
                del due[sid]
                s.admit(Req(sid, "decode"), now=now)
        if not s.pending():
            now = min(due.values()) if due else now + step_s
            continue
        wait = s.wait_s(now, step_s)
        assert 0.0 <= wait <= cap + 1e-12
        while wait > 0:  # an arrival inside the wait ends it early when awaited
            nxt = min([t for t in due.values() if t <= now + wait], default=None)
            if nxt is None:  # waited out the deadline: an awaited session did not come
                now, timeouts = now + wait, timeouts + 1
                break
            now = nxt
            for sid in [k for k, t in due.items() if t <= now]:
                del due[sid]
                s.admit(Req(sid, "decode"), now=now)
            wait = s.wait_s(now, step_s)
        taken = s.take()
        for r in s.queue:
            age[r.sid] = age.get(r.sid, 0) + 1
            assert age[r.sid] <= 1, f"session {r.sid} queued through two steps"
        now += step_s
        for r in taken.requests:
            age.pop(r.sid, None)
            s.release(r, now, answered=True)
            fate = fates[r.sid]
            if fate == "close":
                s.forget(r.sid)
            elif fate in ("back", "slow") and step < 30:
                due[r.sid] = now + gaps[r.sid] / 1e3 + (2 * cap if fate == "slow" else 0.0)
    # a session's gap is learned after its first return and then exact, so a wait runs out
    # only on a session's first gaps or its silence: a bounded count, never one every step
    assert timeouts <= 2 * len(fates) + 2, timeouts
