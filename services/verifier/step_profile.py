"""The verifier's start-up step profile: batch steps over dummy sessions, timed by rows.

Before the verifier serves, this module opens a few throw-away sessions, prefills a short
prompt in each and times steps of chosen row counts (a verify block per session, split as
evenly as the block size allows), seeding the step table
(`services.verifier.step_table.LoadTracker.seed`). Each step is a step of the step loop
itself (every session's request submitted at once, so they share one step) and is timed as
the loop reports it (`StepRecord.ms`: the forward, the accept rule and the rollbacks), so the
timings are what a served step pays. The prompts and drafts are distinct tokens drawn from a
fixed seed, as served text is: a block of one repeated token routes every row to the same
experts and under-prices a mixture-of-experts step. The sessions are closed afterwards
whatever happens. It must run before the loop serves (its steps would otherwise share other
sessions' steps) and never reads the environment (`StepProfileSettings` comes from the entry
point).
"""

from __future__ import annotations

import logging
import queue
import random
import time
from dataclasses import dataclass

from dsv4.numerics import EXACT_ROWS
from services.verifier.batcher import StepLoop
from services.verifier.engine import VerifierEngine, VerifyResult
from services.verifier.step_table import ROW_BUCKETS, LoadTracker

log = logging.getLogger("dspark.verifier.profile")


@dataclass(frozen=True)
class StepProfileSettings:
    """How the start-up step profile runs.

    sessions: dummy sessions (>= 1; fewer when the engine has fewer free). The default 16
    times a full-block step of 16 generations (96 rows at block 5), a step the regime prices
    (docs/gate.md §14) but live steps rarely reach: beyond its last point the table only
    extends by its last segment's slope, which noise can leave flat. repeats: timed
    steps per row count (>= 1). prompt_tokens: each dummy prompt's length (tokens, >= 1).
    budget_s: wall-time limit of the whole profile (s, > 0); a profile cut short keeps what
    it timed. Raises ValueError naming the field and value when one is out of range.
    """

    sessions: int = 16
    repeats: int = 3
    prompt_tokens: int = 8
    budget_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("sessions", "repeats", "prompt_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an integer >= 1")
        if isinstance(self.budget_s, bool) or not isinstance(self.budget_s, (int, float)) \
                or not 0 < self.budget_s < 1e6:
            raise ValueError(f"budget_s={self.budget_s!r}: must be a number of seconds in (0, 1e6)")


def row_targets(sessions: int, per_session: int) -> list[int]:
    """Row counts to time (tokens): every bucket edge up to sessions * per_session, and that
    maximum itself. sessions, per_session >= 1."""
    top = sessions * per_session
    return sorted({r for r in ROW_BUCKETS if r <= top} | {top})


def split_rows(rows: int, sessions: int, per_session: int) -> list[int]:
    """Rows per session (each in 1..per_session, as many sessions as needed, the first
    ones larger) summing to `rows`. Raises ValueError when rows > sessions * per_session or
    rows < 1."""
    if not 1 <= rows <= sessions * per_session:
        raise ValueError(f"rows={rows}: must be in 1..{sessions * per_session}")
    used = -(-rows // per_session)
    base, extra = divmod(rows, used)
    return [base + (1 if i < extra else 0) for i in range(used)]


def profile_steps(steps: StepLoop, load: LoadTracker, settings: StepProfileSettings) -> int:
    """Time batch steps at every `row_targets` count into `load`; returns the steps timed.

    Row counts are visited in an order rotated per repeat, so slow drift spreads over all of
    them; one untimed step of the largest count comes first (first-call allocations). Stops
    early, keeping what it timed, when the budget runs out or a session nears max_seq_len.
    Raises what the model's forward raises (the sessions are closed first).
    """
    t0, engine = time.perf_counter(), steps.engine
    free = engine.max_sessions - engine.num_sessions
    sids = [engine.open_session() for _ in range(max(0, min(settings.sessions, free)))]
    tokens = random.Random(0)
    reports: queue.Queue = queue.Queue()
    hook, steps.on_step = steps.on_step, reports.put
    try:
        if not sids:
            return 0
        anchors = {sid: steps.prefill(sid, _prompt(engine, settings.prompt_tokens, tokens)).next_token
                   for sid in sids}
        per = min(engine.cfg.dspark_block_size + 1, EXACT_ROWS)
        targets, timed = row_targets(len(sids), per), 0
        _step(steps, anchors, split_rows(targets[-1], len(sids), per), tokens)
        for rep in range(settings.repeats):
            for i in range(len(targets)):
                rows = targets[(i + rep) % len(targets)]
                if time.perf_counter() - t0 > settings.budget_s or not _room(engine, sids, per):
                    return timed
                _drain(reports)
                _step(steps, anchors, split_rows(rows, len(sids), per), tokens)
                load.seed(rows, _last_step(reports).ms)
                timed += 1
        return timed
    finally:
        steps.on_step = hook
        for sid in sids:
            engine.close_session(sid)
            steps.forget(sid)  # else the schedule awaits these never-returning sessions (rate, lockstep, pingpong)
        log.info("step profile: %d dummy sessions in %.1f s", len(sids), time.perf_counter() - t0)


def _prompt(engine: VerifierEngine, n: int, tokens: random.Random) -> list[int]:
    """A dummy prompt of n token ids drawn from `tokens` (1..vocab_size - 1)."""
    return [tokens.randrange(1, engine.cfg.vocab_size) for _ in range(n)]


def _drain(reports: queue.Queue) -> None:
    """Drop the step reports of earlier steps (the prefills')."""
    while not reports.empty():
        reports.get_nowait()


def _last_step(reports: queue.Queue, timeout_s: float = 60.0):
    """The report of the step just answered: the loop publishes it after the step's last
    answer, so it may arrive a moment after the results. Raises queue.Empty past timeout_s."""
    return reports.get(timeout=timeout_s)


def _room(engine: VerifierEngine, sids: list[int], per: int) -> bool:
    """Every session can take one more block of `per` positions before max_seq_len."""
    return all(engine.next_position(sid) + per + 1 < engine.cfg.max_seq_len for sid in sids)


def _step(steps: StepLoop, anchors: dict[int, int], sizes: list[int], tokens: random.Random) -> None:
    """One step of the loop: session i forwards a block of sizes[i] tokens (its anchor and
    sizes[i] - 1 drafts drawn from `tokens`, or a decode for size 1), submitted together so
    they share the step; each next anchor is kept."""
    engine = steps.engine
    sids = sorted(anchors)[:len(sizes)]
    vocab = engine.cfg.vocab_size
    records = [engine.admit_decode(sid, anchors[sid], engine.next_position(sid)) if size == 1 else
               engine.admit_verify(sid, anchors[sid], [tokens.randrange(1, vocab) for _ in range(size - 1)],
                                   engine.next_position(sid), "batched") for sid, size in zip(sids, sizes)]
    results = [f.result() for f in steps.submit_all(records)]
    for sid, result in zip(sids, results):
        anchors[sid] = result.bonus_token if isinstance(result, VerifyResult) else result.next_token
