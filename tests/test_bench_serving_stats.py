"""The serving benchmark's arithmetic (services/analysis/serving_stats.py) and its argument handling, on fixed numbers.

No timing is measured here: the traces are written by hand, so every figure has one right value.
"""

from __future__ import annotations

import pytest

from bench.bench_serving import ARMS, WORKLOADS, best_fixed_arm, paired, parse_args, stream_prompts, summary
from services.analysis.serving_stats import GenerationTrace, Spread, cell_figures, percentile
from bench.soak import rss_report


def test_percentile_interpolates_between_ranks_and_refuses_bad_input():
    xs = [40.0, 10.0, 30.0, 20.0]
    assert percentile(xs, 0) == 10.0 and percentile(xs, 100) == 40.0
    assert percentile(xs, 50) == 25.0
    assert percentile(xs, 99) == pytest.approx(39.7)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError, match="q=101"):
        percentile(xs, 101)
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


def test_a_trace_shares_a_message_gap_among_its_tokens():
    g = GenerationTrace(10.0, [(10.1, 1), (10.5, 4), (10.6, 1)])
    assert g.tokens == 6 and g.end == 10.6
    assert g.ttft_ms == pytest.approx(100.0)
    assert g.itl_ms() == pytest.approx([100.0] * 4 + [100.0])
    assert GenerationTrace(1.0).ttft_ms is None and GenerationTrace(1.0).itl_ms() == []


def test_cell_figures_of_two_streams():
    # stream A: two generations back to back, 4 tokens in 2 s; stream B: one, 6 tokens in 1 s
    a = [GenerationTrace(0.0, [(0.5, 1), (1.0, 1)]), GenerationTrace(1.0, [(1.5, 1), (2.0, 1)])]
    b = [GenerationTrace(0.0, [(0.25, 1), (1.0, 5)])]
    f = cell_figures([a, b])
    assert f.tokens == 10 and f.wall_s == 2.0
    assert f.aggregate_tok_s == 5.0
    assert f.per_stream_tok_s == 4.0  # median of 2.0 and 6.0
    assert f.ttft_p50_ms == 500.0  # TTFTs 500, 500, 250
    assert f.itl_p50_ms == 150.0  # 500, 500, and 150 five times
    assert f.itl_p99_ms == pytest.approx(500.0)
    with pytest.raises(ValueError, match="no token"):
        cell_figures([[GenerationTrace(0.0)]])
    with pytest.raises(ValueError, match=">= 1 stream"):
        cell_figures([a, []])


def test_spreads_and_paired_ratios():
    assert Spread.of([30.0, 10.0, 20.0]) == Spread(20.0, 10.0, 30.0)
    assert Spread.of([6]).as_dict() == {"median": 6, "min": 6, "max": 6}
    with pytest.raises(ValueError, match="no values"):
        Spread.of([])
    # the load doubles between repetitions; the paired ratio stays 0.5 while the ratio of the
    # medians (15 / 20) would not
    gated, best = [10.0, 20.0, 40.0], [20.0, 40.0, 80.0]
    r = paired(3, lambda i: gated[i], lambda i: best[i])
    assert r == Spread(0.5, 0.5, 0.5)


def test_gated_is_compared_with_the_best_fixed_arm_not_each_repetition_s_luckiest():
    """plain and k1 each lead one repetition by luck (110 against 90); k2 gives 100 every
    time and is the best fixed arm (median 100 against 90). Gated, equal to k2, scores 1.0
    against it; against each repetition's maximum it would score 0.91 in the median."""
    cells = {"plain": [110.0, 90.0, 90.0], "k1": [90.0, 110.0, 90.0], "k2": [100.0] * 3, "gated": [100.0] * 3}
    raw = {"fast": {4: {a: [{"aggregate_tok_s": x} for x in xs] for a, xs in cells.items()}}}
    args = parse_args(["--streams", "4", "--arms", *cells, "--repeats", "3", "--numerics", "fast"])
    assert best_fixed_arm(raw["fast"][4], ["plain", "k1", "k2"]) == "k2"
    summ = summary(raw, args)
    assert summ["best_arm"] == {4: {"fast": "k2"}}
    assert summ["rows"][4]["gated/best fast"] == Spread(1.0, 1.0, 1.0)
    assert summ["rows"][4]["gated/rep-max fast"] == Spread(100 / 110, 100 / 110, 1.0)
    with pytest.raises(ValueError, match="no arms"):
        best_fixed_arm(raw["fast"][4], [])


def test_every_cell_covers_every_workload():
    for streams in (1, 2, 3, 4, 16):
        prompts = [p for i in range(streams) for p in stream_prompts(streams, i)]
        assert set(prompts) == set(WORKLOADS.values()), streams
    assert len(stream_prompts(1, 0)) == 4 and len(stream_prompts(16, 5)) == 1
    for streams in (2, 3, 8, 16):  # several per stream: each stream runs every workload
        for i in range(streams):
            assert sorted(stream_prompts(streams, i, 4)) == sorted(WORKLOADS.values()), (streams, i)


def test_arguments_quick_and_validation():
    args = parse_args(["--quick", "--repeats", "2"])
    assert args.streams == [1, 4] and args.arms == ["plain", "k5", "gated"] and args.repeats == 2
    assert args.per_stream == 1 and parse_args([]).per_stream == 4
    assert args.warmup == 0 and parse_args([]).warmup == 1 and parse_args(["--quick", "--warmup", "2"]).warmup == 2
    with pytest.raises(SystemExit):
        parse_args(["--warmup", "-1"])
    full = parse_args(["--arms", "gated", "plain", "--checkpoint", ""])
    assert full.arms == ["plain", "gated"] and full.checkpoint is None and full.streams == [1, 2, 4, 8, 16, 32]
    assert ARMS["k3"][1] == 3 and ARMS["plain"][1] == 0
    with pytest.raises(SystemExit):
        parse_args(["--max-tokens", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--per-stream", "0"])


def test_rss_report_starts_after_the_warm_up():
    mib = 2**20
    samples = [{"t_s": 0.0, "gateway": 50 * mib}, {"t_s": 10.0, "gateway": 100 * mib},
               {"t_s": 20.0, "gateway": 104 * mib}, {"t_s": 30.0, "gateway": 102 * mib}]
    r = rss_report(samples, 5.0)["gateway"]
    assert r == {"warm_mib": 100.0, "end_mib": 102.0, "max_mib": 104.0, "growth_pct": pytest.approx(2.0)}
    with pytest.raises(ValueError, match="no RSS sample after the warm-up of 40 s"):
        rss_report(samples, 40.0)


def test_regime_lines_print_the_model_per_in_flight_its_survival_and_legs():
    """What bench_serving prints after its grid, from a real ModelRegime's Stats view: per
    in_flight the modelled rates and the choice; the pooled survival; the legs per bucket."""
    from bench.bench_serving import regime_lines
    from services.common.budget import StepTimes
    from services.gateway.decision import CostModel
    from services.gateway.load_regime import ModelRegime
    cost = CostModel(draft_ms=3.0, verify_base_ms=10.0, verify_slope_ms=1.0, plain_ms=11.0, commit_ms=1.0)
    regime = ModelRegime(5, lambda: StepTimes((1.0, 8.0, 16.0, 48.0), (10.0, 12.0, 20.0, 60.0)), lambda: cost)
    regime.observe(3, (1.0, 1.0, 0.0, 0.0, 0.0), 40.0)
    lines = regime_lines("fast", {"enabled": True, **regime.to_dict()})
    g2, g256 = regime.goodput(2), regime.goodput(256)
    assert lines[1] == (f"regime fast in flight    2: {'draft' if g2.drafts else 'plain':<5}  "
                        f"plain {g2.plain:.3f} tok/ms  draft {g2.draft:.3f} tok/ms")
    assert lines[8].startswith(f"regime fast in flight  256: {'draft' if g256.drafts else 'plain'}")
    assert len(lines) == 9 + 2
    assert lines[-2] == "regime fast survival per draft " + " ".join(f"{s:.2f}" for s in regime.survival) + "  (1 blocks)"
    assert lines[-1] == "regime fast drafter legs ms per bucket: 3-4 40.0"
    assert regime_lines("exact", {"enabled": False}) == ["regime exact: off"]
    cold = ModelRegime(5, lambda: None, lambda: cost).to_dict()
    assert regime_lines("fast", {"enabled": True, **cold})[0] == (
        "regime fast: no step table, every gated round left to its gate")


def test_off_step_cpu_leaves_out_the_step_loops_named_thread():
    """A thread named as a step loop names itself (`step_queue._name_os_thread`, what every
    StepQueue's thread does) and spins 0.4 s: bench_serving's off-step CPU of this process
    leaves those seconds out, its total CPU keeps them (Linux /proc)."""
    import os
    import threading
    import time

    from bench.bench_serving import cpu_s, off_step_cpu_s
    from services.common.step_queue import _name_os_thread

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    me = {"me": os.getpid()}
    off0, cpu0 = off_step_cpu_s(me)["me"], cpu_s(me)["me"]
    ready, done = threading.Event(), threading.Event()

    def step_loop() -> None:
        _name_os_thread("test-steps")
        spin(0.4)
        ready.set()
        done.wait(5)  # alive while measured: a finished thread leaves /proc/PID/task

    t = threading.Thread(target=step_loop)
    t.start()
    ready.wait(5)
    off1, cpu1 = off_step_cpu_s(me)["me"], cpu_s(me)["me"]
    done.set()
    t.join()
    assert cpu1 - cpu0 >= 0.38 and off1 - off0 <= 0.1
