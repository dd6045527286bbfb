"""The step loops' gathering and the verifier's multi-prompt prefill steps
(services/common/step_queue.py, services/verifier/batcher.py):
  * on the smallest loop over `StepQueue` (a step answers what is queued): with a gather
    window, a session answered by a step that sends its next request late still shares the
    next step with the one that sent at once; without one, or when the previous step took
    no time (the window's other bound), the early session steps alone; a session that took
    longer than the window to come back after an answer of one kind is not waited for
    after the next such answer (and is after another kind's), nor is one whose answer
    sends it to the other backend first (`AWAY_KINDS`); a closed session is
    forgotten, so the next step does not wait for it even with a window far longer than
    the test's deadline;
  * through a real `StepLoop` on the random tiny model in exact numerics:
    short prompts queued behind a long one complete in the steps the long one's last chunk
    leaves room in (two prompts completed by one step), never more than C prompt tokens
    per step, each prompt's result bitwise the one-shot prefill's;
  * bad windows are refused naming the value (loop, settings object, environment).
No timing is asserted: only which requests shared which step, and results.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import pytest
import torch

from services.common.settings import BackendSettings
from services.common.schedule import Schedule
from services.common.step_queue import StepQueue
from services.settings import backend_settings
from services.verifier.batcher import StepLoop
from services.verifier.engine import VerifierEngine
from verifier_fixtures import StepVerifier
from model_fixtures import tiny_trunk_with

TIMEOUT_S = 120.0
LATE_S = 1.0  # how late the slow session sends: far inside the window, far beyond a wake-up


@pytest.fixture(scope="module")
def trunk():
    return tiny_trunk_with("exact")


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass(eq=False)
class _Req:
    sid: int
    future: Future
    op: str = ""
    left: int = 0


class RecordingLoop(StepQueue):
    """The smallest step loop: a step answers every queued request with the step's index
    and records which sessions shared it; it reports each step as taking `step_s` (the
    bound of the next gather, with gather_s). It takes its first step once `go` is set, so
    the requests queued before that share it."""

    def __init__(self, gather_s: float, step_s: float = 1e6):
        super().__init__("verifier", None, None, logging.getLogger("test"), Schedule(gather_s, frozenset({"away"})))
        self.step_s = step_s
        self.steps: list[list[int]] = []
        self.go = threading.Event()
        self._start()

    def submit(self, sid: int, kind: str = "") -> Future:
        request = _Req(sid, Future(), kind)
        self._enqueue(request)
        return request.future

    def _loop(self) -> None:
        self.go.wait(TIMEOUT_S)
        super()._loop()

    def _step(self, step) -> None:
        self.steps.append(sorted(r.sid for r in step.requests))
        self._last_step_s = self.step_s
        for r in step.requests:
            self._finish(r, len(self.steps))


def two_sessions_one_late(gather_s: float, step_s: float = 1e6, *kind: str) -> list[list[int]]:
    """Sessions 1 and 2 share a first step (session 2's answer of `kind`, if given); then
    session 1 sends again at once and session 2 LATE_S later. Returns the steps' sessions."""
    loop = RecordingLoop(gather_s, step_s)
    try:
        first = [loop.submit(1), loop.submit(2, *kind)]
        loop.go.set()
        assert [f.result(TIMEOUT_S) for f in first] == [1, 1]
        early = loop.submit(1)
        time.sleep(LATE_S)
        late = loop.submit(2)
        early.result(TIMEOUT_S), late.result(TIMEOUT_S)
    finally:
        loop.close()
    return loop.steps


def test_a_late_session_shares_the_next_step_with_a_window():
    assert two_sessions_one_late(30.0) == [[1, 2], [1, 2]]


def test_without_a_window_the_early_session_steps_alone():
    assert two_sessions_one_late(0.0) == [[1, 2], [1], [2]]


def test_the_window_is_at_most_the_previous_steps_duration():
    assert two_sessions_one_late(30.0, step_s=0.0) == [[1, 2], [1], [2]]


@pytest.mark.parametrize("kind, steps", [("slow", [[1, 2], [1, 2], [1], [2]]), ("other", [[1, 2], [1, 2], [1, 2]])])
def test_a_session_slow_to_return_after_such_an_answer_is_not_waited_for(kind, steps):
    loop = RecordingLoop(30.0)
    try:
        first = [loop.submit(1), loop.submit(2, "slow")]
        loop.go.set()
        [f.result(TIMEOUT_S) for f in first]
        loop.step_s = LATE_S / 2  # from the second step on, the window is shorter than LATE_S
        early = loop.submit(1)
        time.sleep(LATE_S)  # session 2 takes LATE_S after a "slow" answer: the loop learns it
        late = loop.submit(2, kind)
        early.result(TIMEOUT_S), late.result(TIMEOUT_S)
        early = loop.submit(1)
        time.sleep(LATE_S / 4)  # back within the window, but a "slow" answer's gap is LATE_S
        late = loop.submit(2)
        early.result(TIMEOUT_S), late.result(TIMEOUT_S)
    finally:
        loop.close()
    assert loop.steps == steps


def test_a_session_sent_to_the_other_backend_is_not_waited_for():
    # a short window: after session 2's step the loop waits it out for session 1, which the
    # test never sends again (30 s of nothing before)
    assert two_sessions_one_late(2.0, 1e6, "away") == [[1, 2], [1], [2]]


def test_a_closed_session_is_not_waited_for():
    loop = RecordingLoop(1e6)  # only `forget` can end this wait within the test's deadline
    try:
        first = [loop.submit(1), loop.submit(2)]
        loop.go.set()
        [f.result(TIMEOUT_S) for f in first]
        loop.forget(2)
        loop.forget(12345)  # an id the loop never saw: ignored
        assert loop.submit(1).result(TIMEOUT_S) == 2
    finally:
        loop.close()
    assert loop.steps == [[1, 2], [1]]



class ClosingInStepLoop(RecordingLoop):
    """A RecordingLoop whose first step sees session 2 closed while it runs (the servicer's
    `forget` on a cancel landing between the forward and the answers)."""

    def _finish(self, r, result=None, error=None):
        if len(self.steps) == 1 and r.sid == 2:
            self.forget(2)
        super()._finish(r, result, error)


def test_a_session_closed_during_its_step_is_not_waited_for_after_it():
    loop = ClosingInStepLoop(1e6)  # only the forget inside the step can spare the next one the wait
    try:
        first = [loop.submit(2), loop.submit(1)]
        loop.go.set()
        [f.result(TIMEOUT_S) for f in first]
        assert loop.submit(1).result(TIMEOUT_S) == 2
        assert 2 not in loop.schedule.returning() and 2 not in loop.schedule.gone()
    finally:
        loop.close()
    assert loop.steps == [[1, 2], [1]]

def test_short_prompts_share_the_steps_a_long_prompt_leaves_room_in(trunk):
    chunk, long_len, short_len = 8, 75, 5
    engine = StepVerifier(VerifierEngine(trunk, max_sessions=8))
    prompts = [ids(long_len, 4)] + [ids(short_len, 5 + i) for i in range(3)]
    refs = []
    for p in prompts:
        sid = engine.open_session()
        refs.append(engine.prefill(sid, p))
        engine.close_session(sid)
    records = []
    steps = StepLoop(engine, records.append, prefill_chunk=chunk)
    try:
        futures = [steps.submit(engine.admit_prefill(engine.open_session(), p)) for p in prompts]
        got = [f.result(TIMEOUT_S) for f in futures]
    finally:
        steps.close()
    for i, (a, b) in enumerate(zip(got, refs)):
        assert a.next_token == b.next_token and a.positions == b.positions, f"prompt {i}"
        assert a.margin == b.margin and torch.equal(a.rows, b.rows), f"prompt {i}"
    assert all(r.prefill_rows <= chunk for r in records)
    assert sum(r.prefill_rows for r in records) == long_len + 3 * short_len
    assert sum(r.prefills_done for r in records) == 4
    # the long prompt's last chunk (3 tokens) leaves 5 of the 8: the first short prompt fits
    assert max(r.prefills_done for r in records) == 2
    assert len(records) == -(-(long_len + 3 * short_len) // chunk)  # every step's prompt budget was used


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), "0.02", True])
def test_a_bad_gather_window_is_refused_naming_the_value(trunk, bad):
    engine = VerifierEngine(trunk, max_sessions=1)
    with pytest.raises(ValueError, match="gather_s="):
        StepLoop(engine, gather_s=bad)


@pytest.mark.parametrize("bad", [-1, 1001, 2.5, "5", True])
def test_a_bad_step_gather_setting_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="step_gather_ms="):
        BackendSettings(step_gather_ms=bad)


@pytest.mark.parametrize("raw", ["-1", "abc", "1.5", "", "1001"])
def test_a_bad_step_gather_variable_is_refused_naming_it(raw):
    with pytest.raises(ValueError, match=f"DSPARK_STEP_GATHER_MS={raw!r}"):
        backend_settings({"DSPARK_STEP_GATHER_MS": raw})
    assert backend_settings({"DSPARK_STEP_GATHER_MS": "0"}).step_gather_ms == 0
    assert backend_settings({}).step_gather_ms == 50 and BackendSettings().step_gather_ms == 0
