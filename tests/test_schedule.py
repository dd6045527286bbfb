"""The step loops' pure schedule (services/common/schedule.py), on a clock the test passes in:
admission one request per session; the gather window (min of gather_s and the last step's
duration) waits only for answered sessions expected back within it, ends when they have
sent, at its deadline, or when they close, and never for an away kind; a session learned to
be slow after one kind of answer is not awaited after that kind; chunk filling forwards the
prompt part way first, then the oldest prompts, never more than C tokens per step. Every
value is exact: no timing is measured."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from services.common.schedule import Schedule, fill_chunks


@dataclass(eq=False)
class Req:
    sid: int
    op: str = "decode"
    left: int = 0


def answered_step(s: Schedule, reqs: list[Req], now: float) -> None:
    """Run one step over what is queued at `now` and answer every request of it."""
    step = s.take()
    assert [r.sid for r in step.requests] == [r.sid for r in reqs]
    for r in step.requests:
        s.release(r, now, answered=True)


def test_one_request_per_session_and_release_frees_it():
    s = Schedule()
    r = Req(1)
    s.admit(r, now=0.0)
    with pytest.raises(ValueError, match="session 1 already has a request in flight"):
        s.admit(Req(1), now=0.0)
    assert s.pending() and s.wait_s(0.0, 0.0) == 0.0
    assert s.take().requests == [r] and not s.pending() and s.in_flight(1)
    s.release(r, 0.1, answered=False)
    assert not s.in_flight(1) and s.returning() == frozenset()


def one_back(gather_s: float) -> Schedule:
    """Sessions 1 and 2 answered by a step at t = 1 s; session 1 sent again at once."""
    s = Schedule(gather_s=gather_s)
    a, b = Req(1), Req(2)
    s.admit(a, now=0.0), s.admit(b, now=0.0)
    answered_step(s, [a, b], now=1.0)
    s.admit(Req(1), now=1.0)
    return s


def test_the_gather_waits_for_answered_sessions_until_they_send_or_the_window_ends():
    s = one_back(0.5)
    assert s.wait_s(1.0, last_step_s=2.0) == pytest.approx(0.5)  # window min(0.5, 2.0) from now
    assert s.wait_s(1.2, 2.0) == pytest.approx(0.3)
    s.admit(Req(2), now=1.3)
    assert s.wait_s(1.3, 2.0) == 0.0  # every awaited session is back
    assert sorted(r.sid for r in s.take().requests) == [1, 2]


def test_the_window_is_bounded_by_the_last_step_and_ends_at_its_deadline():
    s = one_back(10.0)
    assert s.wait_s(1.0, last_step_s=0.25) == pytest.approx(0.25)
    assert s.wait_s(1.25, 0.25) == 0.0
    assert [r.sid for r in s.take().requests] == [1]


def test_no_wait_without_a_window_for_away_kinds_or_closed_sessions():
    for gather_s, op, close in [(0.0, "decode", False), (1.0, "verify", False), (1.0, "decode", True)]:
        s = Schedule(gather_s, away_kinds=frozenset({"verify"}))
        a, b = Req(1), Req(2, op)
        s.admit(a, now=0.0), s.admit(b, now=0.0)
        answered_step(s, [a, b], now=1.0)
        if close:
            s.forget(2)
        s.admit(Req(1), now=1.0)
        assert s.wait_s(1.0, 5.0) == 0.0, (gather_s, op, close)


def test_a_session_slow_after_one_kind_of_answer_is_not_awaited_after_it():
    s = Schedule(gather_s=1.0)
    a, b = Req(1), Req(2, "slow")
    s.admit(a, now=0.0), s.admit(b, now=0.0)
    answered_step(s, [a, b], now=0.0)
    a, b = Req(1), Req(2, "slow")
    s.admit(a, now=0.0)
    assert s.wait_s(0.0, 5.0) == pytest.approx(1.0)  # nothing learned yet: session 2 awaited
    s.admit(b, now=3.0)  # 3 s after a "slow" answer
    answered_step(s, [a, b], now=3.0)
    s.admit(Req(1), now=3.0)
    assert s.wait_s(3.0, 5.0) == 0.0  # a 3 s gap is beyond the 1 s window


def test_a_session_forgotten_in_its_step_is_not_expected_back():
    s = Schedule(gather_s=1.0)
    a, b = Req(1), Req(2)
    s.admit(a, now=0.0), s.admit(b, now=0.0)
    s.take()
    s.forget(2)
    s.release(a, 1.0, True), s.release(b, 1.0, True)
    assert s.returning() == {1} and s.gone() == frozenset()


def test_chunks_fill_the_prompt_budget_part_way_prompt_first():
    s = Schedule(prefill_chunk=8)
    long, short1, short2, dec = Req(1, "prefill", 11), Req(2, "prefill", 5), Req(3, "prefill", 5), Req(4)
    for r in (long, short1, short2, dec):
        s.admit(r, now=0.0)
    step = s.take()
    assert step.requests == [dec, long] and step.chunk(long) == 8 and step.chunk(dec) == 0
    long.left = 3
    s.carry(long)
    step = s.take()
    assert step.requests == [long, short1] and (step.chunk(long), step.chunk(short1)) == (3, 5)
    assert step.carried == {id(long)} and s.queue == [short2]


def test_fill_chunks_never_exceeds_the_budget():
    reqs = [Req(i, "prefill", n) for i, n in enumerate([3, 4, 9, 2])]
    taken, chunks = fill_chunks(reqs, 10)
    assert taken == reqs[:3] and [chunks[id(r)] for r in taken] == [3, 4, 3]


@pytest.mark.parametrize("kw, name", [({"gather_s": -1}, "gather_s="), ({"gather_s": float("nan")}, "gather_s="),
                                      ({"prefill_chunk": 0}, "prefill_chunk="), ({"prefill_chunk": 2.5}, "prefill_chunk=")])
def test_bad_values_are_refused_naming_them(kw, name):
    with pytest.raises(ValueError, match=name):
        Schedule(**kw)
