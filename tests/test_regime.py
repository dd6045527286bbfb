"""The gateway's regime policy: gated rounds run plain where the gateway measures more tokens
per ms without drafting (docs/gate.md §14).

Unit level, on a hand-driven clock: the buckets, the window (settle, measure, close), the
exploration of a new bucket, the choice with its hysteresis, the probe schedule, the prior from a
lower bucket, a change of load, idleness, one generation alone, the Stats view and the errors.
Service level (in process, port 0, real channels, sequential verify): a policy whose evidence
says plain runs gated rounds plain without a drafter session, a generation left alone primes a
new one and drafts, Stats reports the policy, and the tokens are plain decode's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from fractions import Fraction

import numpy as np
import pytest

from dspark_proto.v1 import gateway_pb2
from services.gateway.gate import GateConfig
from services.gateway.regime import REGIMES, RegimeConfig, RegimePolicy, bucket_name, bucket_of
from services_fixtures import collect, gen_request, service_loop, start_stack

# probe_budget 1.0: a gap never lengthens the probe interval (its own test sets one).
CFG = RegimeConfig(window_ms=99.5, decay=1.0, hysteresis=0.1, explore=1, probe_min=2, probe_max=8, probe_budget=1.0)


class Clock:
    """Feeds rounds to a policy on a hand-driven clock (s)."""

    def __init__(self, policy: RegimePolicy):
        self.policy, self.t = policy, 0.0

    def rounds(self, in_flight: int, committed: int, n: int, dt_s: float) -> None:
        for _ in range(n):
            self.t += dt_s
            self.policy.record(in_flight, committed, self.t)


def _rate(policy: RegimePolicy, bucket: int, regime: str) -> float | None:
    return policy.buckets[bucket].rates[regime].tok_per_ms


def test_buckets_cover_every_concurrency_and_name_their_range():
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 1000)] == [0, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]
    assert [bucket_name(i) for i in range(7)] == ["1", "2", "3-4", "5-8", "9-16", "17-32", "33+"]
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="in_flight="):
            bucket_of(bad)


def test_a_new_bucket_measures_gate_then_plain_and_chooses_the_faster():
    """Window 1 (gate, prior of an empty bucket): 4 rounds settle, then 3 tokens every 10 ms
    until 100 ms: 0.3 tok/ms. Window 2 (plain, the regime without evidence): 4 rounds settle,
    then 1 token every 2 ms: 0.5 tok/ms. Plain beats gate by more than the 10 % hysteresis."""
    policy = RegimePolicy(CFG)
    clock = Clock(policy)
    assert policy.may_draft(4) is True and policy.window.regime == "gate" and policy.window.settle == 4
    clock.rounds(4, 3, 4, 0.01)
    assert policy.window.settle == 0 and policy.window.t_start == pytest.approx(0.04)
    clock.rounds(4, 3, 10, 0.01)
    assert _rate(policy, 2, "gate") == pytest.approx(30 / 100)
    assert policy.window.regime == "plain" and policy.may_draft(4) is False and policy.window.settle == 4
    clock.rounds(4, 1, 4 + 50, 0.002)
    assert _rate(policy, 2, "plain") == pytest.approx(50 / 100)
    assert policy.choice(2) == "plain"
    # The same regime continues without settling: measuring resumes where the last window ended.
    assert policy.window.regime == "plain" and policy.window.settle == 0
    assert policy.window.t_start == pytest.approx(clock.t)


def test_plain_needs_the_hysteresis_to_win():
    for plain_tokens, expected in ((109, "gate"), (111, "plain")):  # against 1.00 tok/ms, hysteresis 10 %
        policy = RegimePolicy(CFG)
        policy.buckets[3].rates["gate"].add(100, 100.0, 1.0)
        policy.buckets[3].rates["plain"].add(plain_tokens, 100.0, 1.0)
        assert policy.choice(3) == expected


def test_a_choice_changes_only_when_the_other_regime_beats_it_by_the_hysteresis():
    policy = RegimePolicy(CFG)             # hysteresis 10 %
    b = policy.buckets[2]
    b.rates["gate"].add(105, 100.0, 1.0)   # 1.05 tok/ms
    b.rates["plain"].add(100, 100.0, 1.0)  # 1.00
    for chosen in REGIMES:                 # 5 % apart: whichever is chosen stays
        b.chosen = chosen
        assert policy.choice(2) == chosen
    b.rates["gate"].add(20, 0.0, 1.0)      # gate 1.25: past the hysteresis
    b.chosen = "plain"
    assert policy.choice(2) == "gate"


def test_probe_schedule_doubles_while_probes_confirm_and_resets_when_one_changes_the_choice():
    policy = RegimePolicy(CFG)
    clock = Clock(policy)
    policy.may_draft(2)
    clock.rounds(2, 3, 2 + 10, 0.01)      # gate window: 0.3 tok/ms
    clock.rounds(2, 1, 2 + 50, 0.002)     # plain window: 0.5 tok/ms -> plain
    regimes = []
    for _ in range(8):                    # each window: a regime at its rate, recorded as it runs
        regimes.append((policy.window.regime, policy.window.probe))
        if policy.window.regime == "plain":
            clock.rounds(2, 1, policy.window.settle + 50, 0.002)
        else:
            clock.rounds(2, 3, policy.window.settle + 10, 0.01)
    # probe_min 2: plain, probe; then every 4th; then every 8th (probe_max).
    assert regimes == [("plain", False), ("gate", True), ("plain", False), ("plain", False), ("plain", False),
                       ("gate", True), ("plain", False), ("plain", False)]
    assert policy.buckets[1].probes == 2 and policy.buckets[1].probe_every == 8
    # A probe that finds gate faster now changes the choice and resets the interval.
    b = policy.buckets[1]
    b.since_probe = b.probe_every - 1
    while policy.window.regime == "plain":
        clock.rounds(2, 1, policy.window.settle + 50, 0.002)
    assert policy.window.probe
    clock.rounds(2, 30, policy.window.settle + 10, 0.01)  # gate now 3.0 tok/ms in its window
    assert policy.choice(1) == "gate" and b.probe_every == CFG.probe_min


def test_a_wide_gap_lengthens_the_probe_interval_to_keep_probes_within_their_budget():
    """Gate measured 0.3 tok/ms against plain's 0.5 (a 40 % gap): with probe_budget 0.1 every
    ceil(0.4 / 0.1) = 4th window probes, not every probe_min = 2nd; the Stats view reports
    that interval. A near tie (plain 0.31) keeps the doubling schedule's 2."""
    for plain_dt, first_probe in ((0.002, 4), (0.0032, 2)):
        policy = RegimePolicy(dataclasses.replace(CFG, probe_budget=0.1, hysteresis=0.0))
        clock = Clock(policy)
        policy.may_draft(2)
        rates = {"gate": (3, 0.01), "plain": (1, plain_dt)}  # 0.3 and 0.5 (or 0.31) tok/ms
        seen = [_run_window(policy, clock, 2, rates) for _ in range(2)]
        assert seen == [("gate", False), ("plain", False)] and policy.choice(1) == "plain"
        assert policy.to_dict()["buckets"][0]["probe_every"] == first_probe
        seen = [_run_window(policy, clock, 2, rates) for _ in range(first_probe + 1)]
        assert [probe for _, probe in seen].index(True) == first_probe - 1, seen  # every n-th window


def _run_window(policy: RegimePolicy, clock: Clock, in_flight: int, rate: dict[str, tuple[int, float]]) -> tuple:
    """Feed the open window until it closes, at `rate[regime]` = (tokens per round, s per round);
    returns (regime, probe) of the window fed."""
    w = policy.window
    tokens, dt = rate[w.regime]
    while policy.window is w:
        clock.rounds(in_flight, tokens, 1, dt)
    return w.regime, w.probe


def test_exploration_measures_each_regime_twice_in_mirrored_order_before_choosing():
    """explore=2: gate, plain, plain, gate (prior first), and no choice of the bucket's own
    until the fourth window closes. Gate is faster but only its mean decides: its first
    window is slow (a burst), and with explore=1 that one window would have chosen plain."""
    policy = RegimePolicy(RegimeConfig(window_ms=99.5, decay=1.0, hysteresis=0.1, explore=2, probe_min=2, probe_max=8))
    clock = Clock(policy)
    policy.may_draft(2)
    order = [_run_window(policy, clock, 2, {"gate": (1, 0.01), "plain": (1, 0.005)})]  # gate 0.1 tok/ms
    assert policy.buckets[1].chosen is None and policy.choice(1) == "gate"  # the prior until explored
    for _ in range(3):
        order.append(_run_window(policy, clock, 2, {"gate": (6, 0.01), "plain": (1, 0.005)}))  # gate 0.6
        if len(order) < 4:
            assert policy.buckets[1].chosen is None
    assert [r for r, _ in order] == ["gate", "plain", "plain", "gate"] and not any(p for _, p in order)
    assert _rate(policy, 1, "gate") == pytest.approx(0.35, rel=0.05) and _rate(policy, 1, "plain") == pytest.approx(0.2)
    assert policy.choice(1) == "gate" and policy.window.regime == "gate"


def test_a_gate_window_after_a_plain_one_leaves_the_waking_rounds_unmeasured():
    """4 in flight. Gate (0.3 tok/ms), then plain (0.5) is chosen; its probe of gate comes
    after a plain window, so it settles 8 rounds: 4 started under plain, and 4 more, each
    generation's first drafted round, which primes a new drafter session (slow here: 1 token
    in 50 ms). The steady rounds that follow (0.6 tok/ms) turn the bucket to gate. Settling
    only 4 rounds would have measured the 4 priming rounds alone (0.02 tok/ms: the window
    reaches its length and its 4 rounds with them), and plain would have held."""
    policy = RegimePolicy(dataclasses.replace(CFG, decay=0.01))
    clock = Clock(policy)
    assert policy.may_draft(4) is True and policy.window.settle == 4
    rates = {"gate": (3, 0.01), "plain": (1, 0.002)}
    assert [_run_window(policy, clock, 4, rates)[0] for _ in range(3)] == ["gate", "plain", "plain"]
    assert policy.choice(2) == "plain"
    w = policy.window
    assert w.regime == "gate" and w.probe and w.settle == 8
    clock.rounds(4, 1, 4, 0.002)      # rounds that started under plain
    clock.rounds(4, 1, 4, 0.05)       # each generation wakes and primes its drafter
    assert w.settle == 0
    _run_window(policy, clock, 4, {"gate": (6, 0.01)})
    assert _rate(policy, 2, "gate") == pytest.approx(0.6, rel=0.01) and policy.choice(2) == "gate"
    assert policy.window.regime == "gate" and policy.window.settle == 0   # gate runs on: no settling
    policy.idle()
    assert policy.last_regime is None       # nobody in flight, so nobody asleep


def test_a_dropped_probe_window_is_run_again_at_the_bucket_s_next_window():
    policy = RegimePolicy(CFG)             # explore 1, probe_min 2
    clock = Clock(policy)
    policy.may_draft(2)
    rates = {"gate": (3, 0.01), "plain": (1, 0.002)}   # plain 0.5 vs gate 0.3 tok/ms
    _run_window(policy, clock, 2, rates)
    _run_window(policy, clock, 2, rates)
    _run_window(policy, clock, 2, rates)   # plain, chosen
    assert policy.window.probe and policy.window.regime == "gate"
    clock.rounds(2, 3, 3, 0.01)            # the burst ends under the probe
    policy.idle()
    assert policy.window is None and policy.discarded == 1
    assert policy.may_draft(2) is True and policy.window.probe and policy.window.regime == "gate"
    assert policy.buckets[1].probes == 2   # the probe, asked again


def test_an_unexplored_bucket_starts_in_the_choice_of_the_nearest_lower_bucket():
    policy = RegimePolicy(CFG)
    policy.buckets[2].rates["gate"].add(1, 10.0, 1.0)
    policy.buckets[2].rates["plain"].add(10, 10.0, 1.0)
    assert policy.choice(4) == "plain"
    assert policy.may_draft(16) is False and policy.window.bucket == 4 and policy.window.regime == "plain"


def test_above_a_bucket_that_chose_plain_no_gate_window_runs_until_that_choice_turns():
    """More load never favours drafting: while bucket 3-4 chooses plain, bucket 9-16 runs
    plain windows only (no exploration of gate, no probe); once 3-4 turns to gate, 9-16
    explores, the regime behind on windows (gate) first."""
    policy = RegimePolicy(CFG)
    clock = Clock(policy)
    low = policy.buckets[2]
    low.rates["gate"].add(1, 10.0, 1.0)
    low.rates["plain"].add(10, 10.0, 1.0)
    policy.may_draft(16)
    seen = [_run_window(policy, clock, 16, {"gate": (1, 0.001), "plain": (1, 0.01)}) for _ in range(6)]
    assert seen == [("plain", False)] * 6
    assert policy.buckets[4].rates["gate"].windows == 0 and policy.buckets[4].rates["plain"].windows == 6
    low.rates["gate"].add(1000, 10.0, 1.0)   # 3-4 now measures gate far ahead: its choice turns
    assert policy.choice(2) == "gate"
    seen = [_run_window(policy, clock, 16, {"gate": (1, 0.001), "plain": (1, 0.01)}) for _ in range(2)]
    assert seen == [("plain", False), ("gate", False)]  # the open window, then exploration


def test_one_generation_alone_is_left_to_its_gate():
    policy = RegimePolicy(CFG)
    clock = Clock(policy)
    for _ in range(5):
        assert policy.may_draft(1) is True
        clock.rounds(1, 1, 60, 0.01)
    assert all(r.windows == 0 for b in policy.buckets for r in b.rates.values())
    policy.buckets[1].rates["gate"].add(1, 10.0, 1.0)
    policy.buckets[1].rates["plain"].add(10, 10.0, 1.0)
    assert policy.window.bucket == 0 and policy.may_draft(2) is False  # others arrived: a window for 2 at once
    assert policy.window.bucket == 1 and policy.window.regime == "plain"
    assert policy.may_draft(1) is True     # alone again: drafting at once, whatever window is open


def test_a_change_of_load_opens_a_window_in_the_new_bucket_and_idle_drops_the_window():
    policy = RegimePolicy(CFG)
    clock = Clock(policy)
    policy.may_draft(4)
    clock.rounds(4, 1, 6, 0.001)           # 4 settle, 2 measured: 6 rounds in the bucket
    clock.rounds(16, 1, 10, 0.001)         # 10 off-bucket rounds: not more than 6 + 4 min rounds
    assert policy.window.bucket == 2 and policy.discarded == 0
    clock.rounds(16, 1, 1, 0.001)          # 11: the load moved on
    assert policy.window.bucket == 4 and policy.discarded == 1 and policy.window.settle == 16
    policy.idle()
    assert policy.window is None and policy.discarded == 2
    assert all(r.windows == 0 for b in policy.buckets for r in b.rates.values())


def _burst_over_a_plain_bucket() -> tuple[RegimePolicy, Clock, object]:
    """A policy whose 3-4 bucket chose plain on evidence (gate 0.1, plain 1.0 tok/ms), with a
    16-generation window open: (policy, its clock, the 3-4 bucket)."""
    policy = RegimePolicy(CFG)
    low = policy.buckets[2]
    low.rates["gate"].add(1, 10.0, 1.0)
    low.rates["plain"].add(10, 10.0, 1.0)
    low.chosen = "plain"
    policy.may_draft(16)
    return policy, Clock(policy), low


def test_a_draining_burst_runs_the_lower_bucket_s_choice_and_measures_it_only_once_the_load_holds():
    """A 16-generation window whose load falls to 4 (a burst's tail): the 3-4 bucket's window
    is a transit one, running its choice (plain here) and adding no evidence even when it runs
    its whole length; the window after it, the load having held, measures."""
    policy, clock, low = _burst_over_a_plain_bucket()
    clock.rounds(16, 1, 16 + 5, 0.001)     # settle, 5 measured
    clock.rounds(4, 1, 21 + 16 + 1, 0.001)  # the tail: off-bucket rounds outnumber in-bucket ones + 16
    w = policy.window
    assert w.bucket == 2 and w.transit and w.regime == "plain" and not w.probe
    assert policy.discarded == 1
    _run_window(policy, clock, 4, {"gate": (1, 0.001), "plain": (1, 0.01)})
    assert low.rates["plain"].windows == 1 and low.rates["gate"].windows == 1  # nothing added
    assert policy.window.bucket == 2 and not policy.window.transit
    _run_window(policy, clock, 4, {"gate": (1, 0.001), "plain": (1, 0.01)})
    assert low.rates["plain"].windows == 2   # the load held: measured
    assert policy.to_dict()["window"]["transit"] is False


def test_a_drain_that_reaches_a_lower_bucket_as_the_window_closes_opens_a_transit_window():
    """90 rounds measured at 16 in flight, then the burst drains to 4 just before the window
    closes (too few rounds to give it up): the 3-4 window that follows is a transit one and
    the drain's next window adds no evidence to 3-4."""
    policy, clock, low = _burst_over_a_plain_bucket()
    clock.rounds(16, 1, 16 + 90, 0.001)    # settle, then 90 measured rounds (90 ms)
    clock.rounds(4, 1, 12, 0.001)          # the drain: the window closes under it
    w = policy.window
    assert w.bucket == 2 and w.transit and w.regime == "plain"
    clock.rounds(4, 1, 4 + 120, 0.001)     # the drain goes on for a whole window
    assert low.rates["plain"].windows == 1 and low.rates["gate"].windows == 1   # nothing added


def test_a_window_mostly_outside_its_bucket_adds_no_evidence():
    policy = RegimePolicy(CFG)
    clock = Clock(policy)
    policy.may_draft(8)                    # bucket 3, min_rounds 8
    clock.rounds(8, 1, 8, 0.01)            # settle
    clock.rounds(8, 1, 6, 0.01)
    clock.rounds(4, 1, 3, 0.01)            # 3 measured rounds off-bucket
    clock.rounds(8, 1, 2, 0.01)            # past 99.5 ms: closes with 3 of 10 or 11 off (> a quarter)
    assert policy.buckets[3].rates["gate"].windows == 0 and policy.discarded == 1


def test_a_window_of_mostly_ungated_rounds_adds_no_evidence():
    """Plain-mode or fixed-k generations run as they asked whatever the regime: a window
    they dominate measures them, not the regime."""
    policy = RegimePolicy(CFG)
    policy.may_draft(2)
    for i in range(2 + 10):
        policy.record(2, 1, 0.01 * (i + 1), gated=i % 3 == 0)  # 3 or 4 of 10 measured rounds gated
    assert policy.buckets[1].rates["gate"].windows == 0 and policy.discarded == 1
    assert policy.window is None           # ungated rounds open no window and spend no probe
    policy.record(2, 1, 0.125)
    assert policy.window is None and policy.buckets[1].since_probe == 0
    policy.may_draft(2)
    for i in range(13, 13 + 2 + 10):
        policy.record(2, 1, 0.01 * (i + 1), gated=i % 2 == 0)  # half gated: kept
    assert policy.buckets[1].rates["gate"].windows == 1


def test_bad_values_are_named():
    policy = RegimePolicy(CFG)
    for kwargs, match in (({"committed": 0}, "committed="), ({"committed": True}, "committed="),
                          ({"now_s": float("nan")}, "now_s="), ({"in_flight": 0}, "in_flight=")):
        args = {"in_flight": 2, "committed": 1, "now_s": 1.0, **kwargs}
        with pytest.raises(ValueError, match=match):
            policy.record(**args)
    for field, value in (("window_ms", 0), ("decay", 0), ("decay", 1.5), ("decay", True), ("hysteresis", -0.1), ("explore", 0),
                         ("probe_min", 0), ("probe_max", 1.5), ("probe_budget", 0), ("probe_budget", 1.5),
                         ("probe_budget", float("nan"))):
        with pytest.raises(ValueError, match=f"{field}="):
            RegimeConfig(**{field: value})
    with pytest.raises(ValueError, match="probe_max=2"):
        RegimeConfig(probe_min=4, probe_max=2)
    with pytest.raises(ValueError, match="probe_max=604801: must be <= 604800"):
        RegimeConfig(probe_max=604_801)


def test_a_bad_bucket_or_config_is_named():
    policy = RegimePolicy(CFG)
    for bucket, match in ((-1, "bucket=-1"), (len(policy.buckets), f"bucket={len(policy.buckets)}: must be <="),
                          (1.0, "bucket=1.0"), (True, "bucket=True")):
        with pytest.raises(ValueError, match=match):
            policy.choice(bucket)
    with pytest.raises(TypeError, match="config='fast': must be a RegimeConfig"):
        RegimePolicy("fast")


def test_config_floats_of_other_number_types_become_plain_floats():
    cfg = RegimeConfig(window_ms=np.float32(250.0), decay=Fraction(1, 2), hysteresis=np.float64(0.1), probe_budget=1)
    values = (cfg.window_ms, cfg.decay, cfg.hysteresis, cfg.probe_budget)
    assert values == (250.0, 0.5, 0.1, 1.0) and all(type(v) is float for v in values)
    json.dumps(dataclasses.asdict(cfg))  # what Stats carries must serialise


def test_ungated_traffic_that_moves_the_load_up_opens_no_window_and_spends_no_probe():
    """A window given up because the load moved to a higher bucket: when ungated rounds moved
    it, no window opens there (the next gated round opens one), and the bucket's probe
    schedule is untouched; a gated round that moves it opens the window at once."""
    for gated, opened in ((False, False), (True, True)):
        policy = RegimePolicy(CFG)
        target = policy.buckets[3]                # "5-8", explored: gate leads by a mile
        target.rates["gate"].add(100, 1.0, 1.0)
        target.rates["plain"].add(1, 1.0, 1.0)
        policy.may_draft(2)                       # a window of bucket 1 ("2")
        for i in range(40):
            policy.record(8, 1, 0.001 * (i + 1), gated=gated)  # bucket 3 ("5-8")
            if policy.window is None or policy.window.bucket != 1:
                break
        assert policy.discarded == 1
        assert (policy.window is not None) == opened, gated
        assert target.since_probe == int(opened)  # a window opened in an explored bucket counts one


def test_stats_view_lists_measured_buckets_and_the_open_window():
    policy = RegimePolicy(CFG)
    clock = Clock(policy)
    policy.may_draft(2)
    clock.rounds(2, 3, 2 + 10, 0.01)
    view = json.loads(json.dumps(policy.to_dict()))
    assert view["window"] == {"in_flight": "2", "regime": "plain", "probe": False, "transit": False, "settling": True}
    assert view["buckets"] == [{"in_flight": "2", "choice": "gate", "probes": 0, "probe_every": 2,
                                "gate": {"windows": 1, "tok_per_ms": pytest.approx(0.3)},
                                "plain": {"windows": 0, "tok_per_ms": None}}]


# ---------------------------------------------------------------------------- services
def test_a_plain_regime_lets_the_drafter_go_and_a_lone_generation_wakes_it():
    """Through real in-process services under sequential verify, with evidence that plain is
    faster at 2 generations in flight: a gated generation running beside a short plain one
    runs its rounds plain (reason `regime`) with no drafter session; once alone it primes a
    new drafter session from the verifier's kept rows and drafts. Its tokens equal plain
    decode's, Stats reports the policy, and no session is left open."""
    loop = service_loop()
    stack = start_stack("dspark", gate_config=GateConfig(enabled=True))
    try:
        gw = loop.run(stack.start_gateway("sequential", regime=True))
        try:
            policy = gw.scheduler.regime = RegimePolicy(RegimeConfig(window_ms=60_000.0, explore=1))
            policy.buckets[1].rates["gate"].add(1, 1000.0, 1.0)
            policy.buckets[1].rates["plain"].add(1000, 1000.0, 1.0)
            reference = loop.run(collect(gw.stub, gen_request("the regime policy", max_tokens=32, spec="off")))

            async def beside():
                return await asyncio.gather(collect(gw.stub, gen_request("the regime policy", max_tokens=32,
                                                                         spec="gated")),
                                            collect(gw.stub, gen_request("a short neighbour", max_tokens=6,
                                                                         spec="off")))
            gated, _ = loop.run(beside())
            assert gated.token_ids == reference.token_ids
            assert gated.stats.plain_rounds >= 3 and gated.stats.drafted > 0  # slept, then woke and drafted
            assert not gated.stats.drafter_failed and gated.stats.drafter_failovers == 0
            assert gw.scheduler.in_flight == 0 and policy.window is None  # idle dropped it
            assert not any(loop.run(stack.await_idle()).values())

            async def stats_json():
                return (await gw.stub.Stats(gateway_pb2.StatsRequest(), timeout=10)).json
            view = json.loads(loop.run(stats_json()))["regime"]
            assert view["enabled"] is True and view["buckets"][0]["in_flight"] == "2"
            assert view["buckets"][0]["choice"] == "plain"
        finally:
            loop.run(gw.close())
        off = loop.run(stack.start_gateway("sequential", regime=False))
        try:
            assert off.scheduler.regime is None

            async def off_stats():
                return (await off.stub.Stats(gateway_pb2.StatsRequest(), timeout=10)).json
            assert json.loads(loop.run(off_stats()))["regime"] == {"enabled": False}
        finally:
            loop.run(off.close())
    finally:
        stack.close()
