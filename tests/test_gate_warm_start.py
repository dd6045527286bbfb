"""The gate's warm start (docs/gate.md §6, §6a, §10): sampling bands, the merge of finished
generations, max_weight scaling, the borrowed pre-draft rounds, the leave-one-workload-out
replay on hand-built rounds (exact values), the settings, and through real in-process
services: a warm-started gated generation streams plain decode's tokens, Stats reports the
bands, a sampled generation never borrows the greedy band, and the setting off keeps it cold.
"""

from __future__ import annotations

import json

import pytest

from dsv4.sampling import GREEDY, SamplingParams
from services.gateway.backends import LocalDrafterSession, LocalVerifierSession
from verifier_fixtures import loop_of
from services.gateway.gate import PROBE_FIRST, RECENT_ROUNDS, Calibration, Gate, GateConfig
from services.gateway.record import GateStats, Reason, RoundRecord
from services.analysis.replay import replay_log
from services.analysis.replay_warm import lowo_calibrations
from services.gateway.rounds import Round, RoundLog
from services.gateway.scheduler import FinalEvent, ModelLimits, Scheduler
from services.gateway.warm import (DEFAULT_MAX_WEIGHT, GREEDY_BAND, WarmBands, WarmStart, parse_warm_start,
                                   sampling_band)
from services.settings import gateway_settings
from services_fixtures import collect, gen_request, service_loop, start_stack, tiny_tokenizer

from dspark_proto.v1 import gateway_pb2

SEED = GateConfig()  # the reference costs: draft 196, verify 300 + 109 n, plain 303 ms
COST = SEED.cost_model()


def _gate_stats(*rounds: tuple[tuple[float, ...], int, int]) -> GateStats:
    """GateStats folded from (confidences, submitted, accepted) rounds, as a generation folds them."""
    out = GateStats()
    for conf, submitted, accepted in rounds:
        reason = Reason.FULL if submitted == len(conf) else Reason.COST
        out.add(RoundRecord(reason, len(conf), submitted, accepted, COST, confidence_logits=conf))
    return out


# ---------------------------------------------------------------------------- bands
@pytest.mark.parametrize("params, band", [
    (GREEDY, "greedy"),
    (SamplingParams(temperature=0.3), "coupled:T(0,0.5]:unfiltered"),
    (SamplingParams(temperature=0.5), "coupled:T(0,0.5]:unfiltered"),
    (SamplingParams(temperature=0.7, top_k=40, rule="rejection"), "rejection:T(0.5,1]:filtered"),
    (SamplingParams(temperature=1.0, top_p=0.9), "coupled:T(0.5,1]:filtered"),
    (SamplingParams(temperature=1.0, min_p=0.05), "coupled:T(0.5,1]:filtered"),
    (SamplingParams(temperature=1.5), "coupled:T>1:unfiltered"),
])
def test_sampling_band_separates_greedy_temperature_rule_and_filters(params, band):
    assert sampling_band(params) == band


def test_bands_merge_finished_generations_and_scale_to_max_weight():
    bands = WarmBands(WarmStart(max_weight=4.0))
    # 3 observed positions in bucket 5 (2 matched), then a miss in bucket 1
    bands.add(GREEDY_BAND, _gate_stats(((8.0, 8.0, 8.0), 3, 2), ((0.0, 8.0), 2, 0)), [(8.0, 8.0, 8.0), (0.0, 8.0)])
    bands.add(GREEDY_BAND, _gate_stats(((8.0,) * 5, 5, 5)), [(8.0,) * 5])  # 5 more matches in bucket 5
    bands.add(GREEDY_BAND, _gate_stats(((8.0,) * 5, 0, 0)), [(8.0,) * 5])  # verified nothing: left out
    cal = bands.calibration(GREEDY_BAND)
    # bucket 5 holds 7 of 8 matched: scaled to 4 observations, 3.5 matched; bucket 1 keeps 0/1
    assert cal.observed == (0.0, 1.0, 0.0, 0.0, 0.0, 4.0)
    assert cal.matched == (0.0, 0.0, 0.0, 0.0, 0.0, 3.5)
    assert cal.recent == () and cal.streak is None  # a band that is not losing lends no recent rounds
    assert bands.calibration("coupled:T(0.5,1]:unfiltered") is None  # another band stays cold
    view = bands.to_dict()
    assert view["max_weight"] == 4.0
    assert view["bands"]["greedy"] == {"generations": 2, "verified_rounds": 3, "observed": 9, "recent_rounds": 3,
                                       "lent_observed": [0.0, 1.0, 0.0, 0.0, 0.0, 4.0], "losing_generations": 0,
                                       "streak": None, "wake_ms": 0.0}


def test_calibration_keeps_the_newest_recent_rounds():
    many = Calibration((0.0,) * 6, (0.0,) * 6, [(float(i),) for i in range(RECENT_ROUNDS + 4)])
    assert len(many.recent) == RECENT_ROUNDS and many.recent[-1] == (RECENT_ROUNDS + 3.0,)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_weight": 0.0}, "max_weight=0.0 must be a number in"),
    ({"max_weight": float("nan")}, "max_weight=nan"),
    ({"max_weight": True}, "max_weight=True"),
])
def test_warm_start_settings_refuse_bad_values_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WarmStart(**kwargs)


def test_calibration_refuses_a_nan_recent_confidence_naming_it():
    with pytest.raises(ValueError, match=r"confidence logit \[1\] is NaN"):
        Calibration((0.0,) * 6, (0.0,) * 6, [(1.0, float("nan"))])


def test_a_served_gateway_warm_starts_and_the_removed_variables_change_nothing():
    assert gateway_settings({}).warm_start is True and gateway_settings({}).warm_max_weight == DEFAULT_MAX_WEIGHT
    removed = gateway_settings({"DSPARK_GATE_WARM_START": "0", "DSPARK_GATE_WARM_WEIGHT": "2.5"})
    assert removed.warm_start is True and removed.warm_max_weight == DEFAULT_MAX_WEIGHT
    with pytest.raises(ValueError, match="--warm='2e6' must be <= 1e"):
        parse_warm_start("2e6", "--warm")


# ---------------------------------------------------------------------------- the gate
def test_borrowed_losing_rounds_skip_the_first_draft_and_probes_still_come():
    """A gate lent a calibration that says bucket 1 never matches and recent rounds all in
    bucket 1 skips its first round before drafting, and still probes PROBE_FIRST rounds in."""
    cal = Calibration((0.0,) * 6, (0.0, 10.0, 0.0, 0.0, 0.0, 0.0), [(0.0,) * 5] * 4)
    gate = Gate(GateConfig(enabled=True), cal)
    decisions = [gate.pre_draft(None) is None for _ in range(PROBE_FIRST)]
    assert decisions == [False] * (PROBE_FIRST - 1) + [True]
    assert gate.choose([0.0] * 5, 5).k == 1  # the probe verifies one draft
    cold = Gate(GateConfig(enabled=True), Calibration(cal.matched, cal.observed))
    assert cold.pre_draft(None) is None  # counts alone: the first round drafts ...
    assert cold.choose([0.0] * 5, 5).k == 0  # ... and the lent estimates cut it before verify


# ---------------------------------------------------------------------------- replay
def _two_workloads() -> RoundLog:
    """Two workloads whose drafts (all in bucket 1) never match: a (10 rounds), b (6 rounds)."""
    rounds = [Round("a", (0.0,) * 5, 5, 0)] * 10 + [Round("b", (0.0,) * 5, 5, 0)] * 6
    return RoundLog(rounds)


def test_lowo_calibration_comes_from_the_other_workload_only():
    # Cold, each workload drafts its first round (one miss observed) and is suspended after it.
    cals = lowo_calibrations(_two_workloads().workloads(), SEED, WarmStart())
    one_miss = Calibration((0.0,) * 6, (0.0, 1.0, 0.0, 0.0, 0.0, 0.0))
    assert cals == {"a": one_miss, "b": one_miss}
    assert lowo_calibrations({"a": _two_workloads().workloads()["a"]}, SEED, WarmStart()) == {"a": None}


def test_warm_replay_on_hand_built_rounds_gives_the_exact_result():
    """Cold: the first round verifies the whole block (1041 ms for one token), then plain steps.
    Warm: bucket 1 is lent 0 of 1 matched, so its estimate is (0 + 1 * 1.0) / (1 + 1) = 0.5;
    at the plain rate k = 1 is worth 1.5 - 605/303 tokens, the best choice, and a cut from 5
    wins by more than the margin: the first round verifies one draft (605 ms), then plain steps."""
    log = _two_workloads()
    cold = replay_log(log, SEED, ["gated"], references=False)
    warm = replay_log(log, SEED, ["gated"], references=False, warm=WarmStart())
    for report, first_ms, submitted in ((cold, 1041.0, 5), (warm, 605.0, 1)):
        a, b = (w.results["gated"] for w in report.workloads)
        assert (a.tokens, a.time_ms, a.submitted) == (10, first_ms + 9 * 303.0, submitted)
        assert (b.tokens, b.time_ms, b.submitted) == (6, first_ms + 5 * 303.0, submitted)
    assert warm.warm == WarmStart() and cold.warm is None


# ---------------------------------------------------------------------------- services
def _final(sched: Scheduler, stack, params) -> FinalEvent:
    """Run one generation in process over the stack's real engines; its FinalEvent."""
    async def run():
        verifier, drafter = LocalVerifierSession(loop_of(stack.verifier_engine)), LocalDrafterSession(stack.drafter_engine)
        try:
            return [ev async for ev in sched.generate(params, verifier, drafter)][-1]
        finally:
            await verifier.close()
            await drafter.close()
    return service_loop().run(run())


@pytest.fixture(scope="module")
def stack():
    s = start_stack("dspark")  # random draft weights: drafts mostly rejected, a losing calibration
    yield s
    s.close()


def test_a_sampled_generation_never_borrows_the_greedy_band(stack):
    cfg = stack.verifier_engine.cfg
    limits = ModelLimits(cfg.vocab_size, cfg.max_seq_len, cfg.eos_token_id, cfg.dspark_block_size, True)
    sched = Scheduler(limits, tiny_tokenizer(), GateConfig(), "sequential", "configured", warm=WarmStart())
    assert _final(sched, stack, sched.params("warm the greedy band", (), 24, "gated")).counters.verify_rounds > 0
    lent = sched.stats.warm.calibration(GREEDY_BAND)
    assert sum(lent.observed) > 0
    # max_tokens = 2 drafts nothing, so the gate's final weights are what it was lent
    greedy = _final(sched, stack, sched.params("a", (), 2, "gated"))
    assert [b["weight"] for b in greedy.gate["buckets"]] == list(lent.observed)
    sampled = _final(sched, stack, sched.params("a", (), 2, "gated", sampling=SamplingParams(temperature=1.0, seed=3)))
    assert [b["weight"] for b in sampled.gate["buckets"]] == [0.0] * 6
    always = _final(sched, stack, sched.params("a", (), 2, "always"))
    assert [b["weight"] for b in always.gate["buckets"]] == [0.0] * 6  # only gated generations borrow


def test_warm_started_generation_streams_plain_decode_tokens_and_stats_show_the_band(stack):
    loop = service_loop()
    prompts = ("warm start one", "warm start two", "warm start three")
    warm_gw = loop.run(stack.start_gateway("sequential", warm_start=True))
    cold_gw = loop.run(stack.start_gateway("sequential"))
    try:
        async def run(gw, spec, prompt):
            return await collect(gw.stub, gen_request(prompt, max_tokens=24, spec=spec))

        async def stats(gw):
            return json.loads((await gw.stub.Stats(gateway_pb2.StatsRequest(), timeout=10)).json)
        verified = []
        for prompt in prompts:  # one after another: each later one warm-starts from the earlier
            gated = loop.run(run(warm_gw, "gated", prompt))
            plain = loop.run(run(warm_gw, "off", prompt))
            assert gated.token_ids == plain.token_ids and len(gated.token_ids) == 24
            verified.append(gated.final.spec_stats.submitted > 0)
        band = loop.run(stats(warm_gw))["warm_start"]["bands"]["greedy"]
        folded = loop.run(stats(warm_gw))["gate"]
        # random draft weights lose: a generation may continue the band's losing streak and draft
        # nothing (docs/gate.md §6); the band merges exactly the generations that verified a draft
        assert verified[0] and band["generations"] == sum(verified)
        assert band["verified_rounds"] == folded["verified_rounds"] > 0
        assert band["observed"] == sum(b["observed"] for b in folded["buckets"])
        loop.run(run(cold_gw, "gated", prompts[0]))
        assert loop.run(stats(cold_gw))["warm_start"] is None  # the setting off: no bands, every gate cold
        assert cold_gw.scheduler.stats.warm is None
    finally:
        loop.run(warm_gw.close())
        loop.run(cold_gw.close())
