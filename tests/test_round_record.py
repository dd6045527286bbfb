"""RoundRecord and the RoundStats fold: decisions and reasons, validation, the per-generation /
gate / policy views, merging, the recorded-rounds line and the Prometheus counters of a record."""

import json

import pytest

from services.gateway.gate import CostModel, LengthChoice
from services.gateway.metrics import GatewayMetrics
from services.gateway.record import DECISIONS, SPECULATION_KEYS, Reason, RoundRecord, RoundStats, drafted_reason
from services.analysis.replay import replayed_round
from services.gateway.rounds import Round, RoundLog, dump_rounds, parse_rounds

COST = CostModel()  # draft 196, verify 300 + 109 n, plain 303 (ms)


def drafted(k, max_n, accepted, conf=(8.0, 8.0, 8.0, 8.0, 8.0), **kw):
    """A drafted round of len(conf) drafts whose length was chosen as k under the cap max_n."""
    return RoundRecord(drafted_reason(len(conf), LengthChoice(k, max_n)), len(conf), k, accepted, COST,
                       confidence_logits=conf, **kw)


def plain(reason, **kw):
    return RoundRecord(reason, 0, 0, 0, COST, **kw)


@pytest.mark.parametrize(("record", "reason", "decision"), [
    (drafted(5, 5, 5), Reason.FULL, "full"),
    (drafted(2, 5, 2), Reason.COST, "truncated"),
    (drafted(0, 5, 0), Reason.COST, "skipped_after_draft"),
    (drafted(3, 3, 1), Reason.BUDGET, "capped"),     # max_tokens left room for 3 of the 5
    (drafted(0, 0, 0), Reason.BUDGET, "capped"),     # a recorded round that submitted nothing, replayed as is
    (plain(Reason.NO_ROOM), Reason.NO_ROOM, "capped"),
    (plain(Reason.ANCHOR_MARGIN), Reason.ANCHOR_MARGIN, "margin_skipped"),
    (plain(Reason.RECENT_LOSS), Reason.RECENT_LOSS, "margin_skipped"),
    (plain(Reason.NO_DRAFTER), Reason.NO_DRAFTER, "plain"),
    (plain(Reason.DRAFTER_FAILED), Reason.DRAFTER_FAILED, "plain"),
])
def test_reason_and_decision(record, reason, decision):
    assert record.reason is reason
    assert record.decision == decision and decision in DECISIONS
    assert record.committed == record.accepted + 1


def test_modelled_cost_of_each_kind_of_round():
    assert drafted(2, 5, 1).modelled_ms == 196 + 300 + 2 * 109
    assert drafted(0, 5, 0).modelled_ms == 196 + 303  # the draft was paid, then a plain step
    assert plain(Reason.ANCHOR_MARGIN).modelled_ms == 303


@pytest.mark.parametrize(("make", "message"), [
    (lambda: RoundRecord(Reason.FULL, 2, 3, 0, COST), "submitted=3 <= drafted=2"),
    (lambda: RoundRecord(Reason.FULL, 3, 2, 3, COST), "accepted=3 <= submitted=2"),
    (lambda: RoundRecord(Reason.FULL, 3, 1.0, 0, COST), "submitted=1.0 must be an integer"),
    (lambda: RoundRecord(Reason.FULL, True, 0, 0, COST), "drafted=True must be an integer"),
    (lambda: RoundRecord("full", 3, 3, 0, COST), "reason='full' must be a Reason"),
    (lambda: RoundRecord(Reason.FULL, 0, 0, 0, COST), "reason=full does not fit drafted=0"),
    (lambda: RoundRecord(Reason.ANCHOR_MARGIN, 2, 0, 0, COST), "reason=anchor_margin does not fit drafted=2"),
    (lambda: RoundRecord(Reason.FULL, 3, 3, 0, COST, confidence_logits=(1.0,)), "submitted=3 exceeds 1"),
    (lambda: RoundRecord(Reason.NO_DRAFTER, 0, 0, 0, COST, plain_ms=float("nan")), "plain_ms=nan"),
    (lambda: RoundRecord(Reason.NO_DRAFTER, 0, 0, 0, COST, verify_ms=-1.0), "verify_ms=-1.0"),
])
def test_record_validation_names_the_field(make, message):
    with pytest.raises(ValueError, match=message.replace("(", "\\(").replace(")", "\\)")):
        make()


def test_record_is_immutable():
    r = drafted(5, 5, 5)
    with pytest.raises(AttributeError):
        r.submitted = 1


def scripted_generation():
    """A margin skip, a full block, a cut, a cut to 0, a capped zero-accept, and a plain step,
    as RoundRecords; plus one round from a drafter without a confidence head."""
    return [
        plain(Reason.ANCHOR_MARGIN, anchor_margin=1.0),
        drafted(5, 5, 5),
        drafted(2, 5, 2, conf=(8.0, 8.0, -2.0, -2.0, -2.0)),
        drafted(0, 5, 0, conf=(-2.0,) * 5),
        drafted(3, 3, 0, conf=(8.0, 8.0, 8.0)),
        plain(Reason.NO_ROOM),
        RoundRecord(Reason.FULL, 4, 4, 1, COST),  # no confidences: the gate never saw it
    ]


def test_one_fold_gives_the_speculation_counters():
    stats = RoundStats()
    for r in scripted_generation():
        stats.add(r)
    spec = stats.speculation_dict()
    assert list(spec) == [*SPECULATION_KEYS, "acceptance_rate", "mean_acceptance_length"]
    assert (spec["rounds"], spec["drafted"], spec["submitted"], spec["accepted"]) == (7, 22, 14, 8)
    assert (spec["verify_rounds"], spec["plain_rounds"]) == (4, 3)
    assert (spec["margin_skipped_rounds"], spec["truncated_rounds"], spec["skipped_after_draft"]) == (1, 1, 1)
    assert spec["acceptance_rate"] == pytest.approx(8 / 14)
    assert spec["mean_acceptance_length"] == pytest.approx((8 + 4) / 4)
    assert (stats.tokens, stats.time_ms) == (15, 303 + 1041 + 714 + 499 + 823 + 303 + 932)


def test_the_gate_view_counts_only_what_the_gate_decided():
    stats = RoundStats()
    for r in scripted_generation():
        stats.add(r)
    g = stats.gate.to_dict()
    # asked pre-draft in all but the no-room round; chose the length of the four with confidences
    assert (g["rounds"], g["margin_skipped_rounds"], g["drafted_rounds"], g["verified_rounds"]) == (6, 1, 4, 3)
    assert (g["drafted"], g["submitted"], g["accepted"]) == (18, 10, 7)
    assert (g["truncated"], g["skipped_after_draft"]) == (1, 1)
    assert (g["zero_accept_rounds"], g["zero_accept_cost_ms"]) == (1, 196 + 300 + 3 * 109 - 303)
    assert g["buckets"][5] == {"range": ">= 6.0", "observed": 8, "matched": 7, "match_rate": 7 / 8}
    assert g["buckets"][0]["observed"] == 0  # position 2 of the cut round was never verified


def test_merge_adds_counters_and_ors_the_failure_flag():
    one, two, total = RoundStats(), RoundStats(drafter_failovers=1, drafter_failed=True), RoundStats()
    one.add(drafted(5, 5, 5))
    two.add(drafted(2, 5, 1))
    two.add(plain(Reason.DRAFTER_FAILED))
    total.merge(one)
    total.merge(two)
    assert (total.rounds, total.submitted, total.accepted, total.drafter_failovers) == (3, 7, 6, 1)
    assert total.drafter_failed is True
    assert total.gate.bucket_observed[5] == 5 + 2
    assert total.gate.rounds == 3  # a failed draft was still asked for by the margin gate


def test_policy_view_keeps_the_replay_keys():
    stats = RoundStats()
    for r in scripted_generation()[:5]:
        stats.add(r)
    d = stats.policy_dict()
    assert list(d) == ["rounds", "tokens", "time_ms", "submitted", "accepted", "truncated", "skipped_after_draft",
                       "margin_skipped_rounds", "zero_accept_rounds", "zero_accept_cost_ms", "tok_s"]
    assert (d["rounds"], d["tokens"], d["truncated"], d["zero_accept_rounds"]) == (5, 12, 1, 1)
    assert d["tok_s"] == pytest.approx(1000 * 12 / (303 + 1041 + 714 + 499 + 823))


def test_the_recorded_line_round_trips_through_the_file_format():
    r = drafted(3, 5, 2, conf=(2.5, 1.0, 0.0, -1.0, 4.0), anchor_margin=3.5, draft_ms=190.0, verify_ms=640.0)
    line = r.to_round("code")
    assert line == Round("code", (2.5, 1.0, 0.0, -1.0, 4.0), 3, 2, anchor_margin=3.5, draft_ms=190.0, verify_ms=640.0)
    assert parse_rounds(json.loads(dump_rounds(RoundLog((line,))))).rounds == (line,)
    # a round that drafted nothing is a line without confidences, kept for its plain-decode time
    undrafted = plain(Reason.ANCHOR_MARGIN, anchor_margin=0.5, plain_ms=70.0).to_round("code")
    assert undrafted == Round("code", (), 0, 0, anchor_margin=0.5, plain_ms=70.0)
    assert parse_rounds(json.loads(dump_rounds(RoundLog((undrafted,))))).rounds == (undrafted,)
    blind = RoundRecord(Reason.FULL, 5, 5, 2, COST)  # drafted by a drafter with no confidence head
    with pytest.raises(ValueError, match="drafted round without confidence logits"):
        blind.to_round("code")


def test_replayed_rounds_are_records_with_the_policy_choice():
    rec = Round("w", (5.0, 5.0, 5.0, 5.0), 4, 3, anchor_margin=2.0)
    assert replayed_round(rec, 2, COST).decision == "truncated"
    assert replayed_round(rec, 0, COST).decision == "skipped_after_draft"
    assert replayed_round(rec, 4, COST).decision == "full"
    assert (replayed_round(rec, 4, COST).accepted, replayed_round(rec, 2, COST).accepted) == (3, 2)
    skipped = replayed_round(rec, None, COST, Reason.ANCHOR_MARGIN)
    assert (skipped.decision, skipped.drafted, skipped.anchor_margin) == ("margin_skipped", 0, 2.0)
    with pytest.raises(ValueError, match="n=5"):
        replayed_round(rec, 5, COST)


def test_metrics_count_a_record():
    metrics = GatewayMetrics()
    try:
        for r in scripted_generation():
            metrics.record_round(r, "always")

        def value(name, labels=None):  # the exporter adds scope labels: match on ours only
            return sum(s.value for family in metrics.registry.collect() for s in family.samples
                       if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()))

        assert value("spec_decode_rounds_total") == 7
        assert value("spec_decode_drafted_tokens_total") == 22
        assert (value("spec_decode_num_drafts_total"), value("spec_decode_plain_rounds_total")) == (4, 3)
        assert (value("spec_decode_num_draft_tokens_total"), value("spec_decode_num_accepted_tokens_total")) == (14, 8)
        assert value("spec_decode_num_accepted_tokens_per_pos_total", {"position": "1"}) == 2
        assert value("spec_decode_truncated_rounds_total") == value("spec_decode_margin_skipped_rounds_total") == 1
        assert value("spec_decode_skipped_after_draft_rounds_total") == 1
    finally:
        metrics.close()
