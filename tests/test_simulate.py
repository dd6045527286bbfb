"""`dspark simulate` (services/simulate): an exact hand-computed schedule, determinism, bad inputs.

The shared-code guarantee (the simulator decides as a live gateway does) is in
tests/test_simulate_live.py. No timing is measured: every time here is virtual.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from services.cli import main
from services.common.budget import StepTimes
from services.gateway.rounds import Round
from services.simulate.engine import Gateway, RecordedText, RunConfig, StreamSpec
from services.simulate.models import ServiceModel, from_single_stream, load_model, parse_calibrate
from services.simulate.run import Lengths, Load, arm_registry, parse_lengths, simulate_cell, stream_specs

ROUND = Round("w", (5.0, 5.0), 2, 1)  # two drafts, the first accepted: a verified round yields 2 tokens


def _hand_model() -> ServiceModel:
    # verifier step = 8 + 2 * rows ms; a draft 4 ms, a commit 1 ms, whatever the sessions
    return ServiceModel("hand", StepTimes((1.0, 100.0), (10.0, 208.0)), StepTimes((1.0,), (4.0,)),
                        StepTimes((1.0,), (1.0,)))


def test_two_streams_follow_the_hand_computed_schedule():
    """Two streams of fixed k = 2, a 1-token prompt and 5 output tokens, no gather, no
    network, stream 1 sent 1 ms after stream 0: each step is worked out by hand
    (docs/simulate.md §3.1 walks through it). s0 prefill [0,10]; s1 prefill [10,20]; s0
    commit [10,11] (the prime: its first token streams at 11, as the served gateway streams it
    after the prime), draft [11,15], verify of 3 rows [20,34] (2 tokens); s1 commit [20,21] (first token),
    draft [21,25], verify [34,48]; s0 commit [34,35], draft [35,39], budget caps k to 1,
    verify of 2 rows [48,60] (done: 5 tokens); s1 commit [48,49], draft [49,53], verify [60,72]."""
    specs = [stream_spec(0), stream_spec(1, arrival_ms=1.0)]
    config = RunConfig(block_size=2, gather_s=0.0, max_seq_len=64)
    f = simulate_cell(_hand_model(), config, arm_registry(2)["k2"], specs)
    assert f["tokens"] == 10 and f["wall_s"] == pytest.approx(0.072)
    assert f["aggregate_tok_s"] == pytest.approx(10 / 0.072, abs=1e-5)
    assert f["ttft_p50_ms"] == pytest.approx(15.5) and f["ttft_p99_ms"] == pytest.approx(19.91)  # 11 and 20 ms
    # per-token gaps: s0 23/2, 26/2 ms; s1 27/2, 24/2 ms
    assert f["itl_p50_ms"] == pytest.approx(12.5) and f["itl_p99_ms"] == pytest.approx(13.5)
    assert f["verifier_steps"] == 6 and f["verifier_util"] == pytest.approx(1.0)
    assert f["sessions_per_step"] == pytest.approx(1.0)
    assert f["drafter_steps"] == 8 and f["drafter_util"] == pytest.approx(20 / 72, abs=1e-6)
    assert f["rounds"] == 4 and f["drafts_per_round"] == pytest.approx(1.5)


def test_requests_arriving_together_share_a_step():
    """The same two streams sent at the same instant (docs/simulate.md §3.2): a loop takes its
    step after every arrival of that instant, so the two prompts, then each pair of commits,
    drafts and verifies (the replies of one shared step arrive together) share every step,
    by hand: prefill of 2 rows [0,12]; commits [12,13] (first tokens); drafts [13,17]; verify of 6 rows
    [17,37] (2 tokens each); commits [37,38]; drafts [38,42] (k capped to 1); verify of 4
    rows [42,58] (done). Before this rule the first arrival of an instant took a step alone
    and the pair alternated, as in the schedule above."""
    specs = [stream_spec(0), stream_spec(1)]
    config = RunConfig(block_size=2, gather_s=0.0, max_seq_len=64)
    f = simulate_cell(_hand_model(), config, arm_registry(2)["k2"], specs)
    assert f["tokens"] == 10 and f["wall_s"] == pytest.approx(0.058)
    assert f["ttft_p50_ms"] == pytest.approx(13.0) and f["ttft_p99_ms"] == pytest.approx(13.0)
    # per-token gaps of both streams: 24/2 ms twice, then 21/2 ms twice
    assert f["itl_p50_ms"] == pytest.approx(11.25) and f["itl_p99_ms"] == pytest.approx(12.0)
    assert f["verifier_steps"] == 3 and f["verifier_util"] == pytest.approx((12 + 20 + 16) / 58, abs=1e-6)
    assert f["sessions_per_step"] == pytest.approx(2.0)
    assert f["drafter_steps"] == 4 and f["drafter_util"] == pytest.approx(10 / 58, abs=1e-6)
    assert f["rounds"] == 4 and f["drafts_per_round"] == pytest.approx(1.5)


def test_every_reply_takes_a_gateway_turn():
    """One stream of k = 2, gateway_ms 1 (docs/simulate.md §2): the gateway's one event loop
    handles each reply, the drafter's too, before the next call goes out. By hand: prefill
    [0,10], turn [10,11]; commit [11,12], turn [12,13] (the first token); draft [13,17], turn [17,18]; verify of 3
    rows [18,32], turn [32,33] (3 tokens out); commit [33,34], turn [34,35]; draft [35,39], turn
    [39,40]; verify of 2 rows (k capped to 1) [40,52], turn [52,53]: 5 tokens in 53 ms (49 ms
    when only the verifier's replies took a turn)."""
    model = dataclasses.replace(_hand_model(), gateway_ms=1.0)
    f = simulate_cell(model, RunConfig(block_size=2, gather_s=0.0, max_seq_len=64), arm_registry(2)["k2"],
                      [stream_spec(0)])
    assert f["tokens"] == 5 and f["wall_s"] == pytest.approx(0.053)
    assert f["ttft_p50_ms"] == pytest.approx(13.0) and f["itl_p50_ms"] == pytest.approx(10.0)  # 20/2 twice
    assert f["verifier_util"] == pytest.approx((10 + 14 + 12) / 53, abs=1e-6)
    assert f["drafter_util"] == pytest.approx(10 / 53, abs=1e-6)


def stream_spec(stream: int, arrival_ms: float = 0.0):
    return StreamSpec(stream, arrival_ms, 1, 5, RecordedText([ROUND]), 0)


def test_gathering_lets_two_decodes_share_a_step():
    """Plain decode, gather 50 ms, stream 1 sent 1 ms after stream 0. Stream 0's prefill runs
    alone [0, 10]. Stream 1's prefill is queued, but the step waits (up to min(50, 10) ms) for
    stream 0, answered and expected back at once: its decode shares the step [10, 22] (3 rows:
    8 + 6 ms). From then on both decode in steps of 2 rows (12 ms): three shared, then stream
    1's last alone (10 ms)."""
    specs = [stream_spec(0), stream_spec(1, arrival_ms=1.0)]
    config = RunConfig(block_size=2, gather_s=0.05, max_seq_len=64)
    f = simulate_cell(_hand_model(), config, arm_registry(2)["plain"], specs)
    assert f["tokens"] == 10 and f["verifier_steps"] == 6
    assert f["sessions_per_step"] == pytest.approx((2 + 2 + 2 + 1) / 4)  # the steps without a prompt chunk
    assert f["wall_s"] == pytest.approx((10 + 12 + 3 * 12 + 10) / 1e3)


def _grid_json(capsys, *extra: str) -> str:
    code = main(["simulate", "--costs", "seed", "--streams", "1", "3", "--arms", "plain", "k3", "gated",
                 "--output", "24", "--json", *extra])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


def test_same_seed_gives_byte_identical_json_and_another_seed_differs(capsys):
    """Two runs with --seed 5 print the same bytes; --seed 6 draws other rounds (the
    synthetic workloads' streams start elsewhere), so some figure moves."""
    a, b, c = (_grid_json(capsys, "--seed", seed) for seed in ("5", "5", "6"))
    assert a == b
    assert json.loads(a)["cells"] != json.loads(c)["cells"]


def test_every_arm_of_a_cell_sees_the_same_streams():
    groups = {"a": [ROUND, Round("a", (1.0,), 1, 0)], "b": [ROUND]}
    one = stream_specs(Load(4), groups, Lengths(8, 16), Lengths(32, 32), 3)
    two = stream_specs(Load(4), groups, Lengths(8, 16), Lengths(32, 32), 3)
    assert [(s.prompt, s.offset, s.text.drafted[0].workload) for s in one] == \
        [(s.prompt, s.offset, s.text.drafted[0].workload) for s in two]


def test_cycle_order_replays_bench_servings_streams():
    """`--order cycle`: stream s's generation j replays workload (s * per_stream + j) mod W in
    the rounds' order (b before a here, as the file holds them), each from its first drafted
    round, with that workload's prompt length; the open loop cycles by arrival."""
    drafted_b, drafted_a = Round("b", (5.0,), 1, 1), Round("a", (5.0, 5.0), 2, 0)
    groups = {"b": [Round("b", (), 0, 0), drafted_b, drafted_b], "a": [drafted_a]}
    prompt = parse_lengths("a=7,b=9", "--prompt")
    specs = stream_specs(Load(2, per_stream=3), groups, prompt, Lengths(32, 32), 0, order="cycle")
    chains = []
    for first in specs:
        chain, spec = [], first
        while spec is not None:
            chain.append((spec.text.drafted[0].workload, spec.prompt, spec.text.start(spec.offset)))
            spec = spec.then
        chains.append(chain)
    # b's first round did not draft: its first drafted round starts at text position 1
    assert chains == [[("b", 9, 1), ("a", 7, 0), ("b", 9, 1)], [("a", 7, 0), ("b", 9, 1), ("a", 7, 0)]]
    arrivals = stream_specs(Load(rate=5.0, requests=3), groups, prompt, Lengths(8, 8), 0, order="cycle")
    assert [s.text.drafted[0].workload for s in arrivals] == ["b", "a", "b"]
    with pytest.raises(ValueError, match="order='sorted'"):
        stream_specs(Load(1), groups, prompt, Lengths(8, 8), 0, order="sorted")


def test_open_loop_arrivals_start_at_zero_and_rise():
    specs = stream_specs(Load(rate=10.0, requests=5), {"w": [ROUND]}, Lengths(4, 4), Lengths(8, 8), 0)
    times = [s.arrival_ms for s in specs]
    assert times[0] == 0.0 and times == sorted(times) and len(set(times)) == 5


def test_single_stream_sources_keep_the_stated_costs():
    """The seed shape: plain 303 at one row, verify(n) = 300 + 109 n at n + 1 rows."""
    seed = load_model("seed")
    cost = seed.single_stream(5)
    assert cost.plain_ms == 303.0 and cost.draft_ms == 196.0
    assert [cost.verify_ms(n) for n in (1, 5)] == [409.0, 845.0]
    fit = parse_calibrate("DEEPSEEK_DSPARK_GATE_DRAFT_MS=12.5\nDEEPSEEK_DSPARK_GATE_VERIFY_BASE_MS=30\n"
                          "DEEPSEEK_DSPARK_GATE_VERIFY_SLOPE_MS=3\nDEEPSEEK_DSPARK_GATE_PLAIN_MS=28\n", "fit.env")
    model = from_single_stream(fit, "fit.env")
    assert model.verifier_ms(1, 1) == 28.0 and model.verifier_ms(2, 1) == 33.0 and model.verifier_ms(4, 1) == 39.0



def test_dspark_calibrate_output_is_a_cost_source(tmp_path, capsys):
    """What `dspark calibrate` prints (DSPARK_GATE_*_MS lines) is what `--costs FILE` reads: the
    bundled always-k recording fits draft and verify costs (no plain steps: exit 1), and with the
    plain cost added by hand the file drives a simulation. The deprecated DEEPSEEK_ spelling of
    older fits still parses to the same costs."""
    assert main(["calibrate", "tests/data/bundled_rounds.json"]) == 1
    printed = capsys.readouterr().out
    fitted = {line.split("=")[0]: float(line.split("=")[1]) for line in printed.split()}
    assert set(fitted) == {"DSPARK_GATE_DRAFT_MS", "DSPARK_GATE_VERIFY_BASE_MS", "DSPARK_GATE_VERIFY_SLOPE_MS"}
    costs = parse_calibrate(printed, "fit.env")
    assert costs == {"draft_ms": fitted["DSPARK_GATE_DRAFT_MS"], "verify_base_ms": fitted["DSPARK_GATE_VERIFY_BASE_MS"],
                     "verify_slope_ms": fitted["DSPARK_GATE_VERIFY_SLOPE_MS"]}
    assert parse_calibrate(printed.replace("DSPARK_GATE_", "DEEPSEEK_DSPARK_GATE_"), "old.env") == costs
    path = tmp_path / "fit.env"
    path.write_text(printed + "DSPARK_GATE_PLAIN_MS=60\n")
    code, out, err = _run_cli(capsys, "--costs", str(path), "--arms", "plain", "k1", "--streams", "1",
                              "--output", "16", "--json")
    assert code == 0 and err == "", err
    model = json.loads(out)["inputs"]["model"]
    assert model["verifier"]["ms"][0] == 60.0 and model["drafter"]["draft"]["ms"][0] == costs["draft_ms"]

def test_a_flat_calibrate_fit_with_a_dear_first_row_simulates(capsys, tmp_path):
    """A fit whose verify line is flat above a cheap plain step (slope 0, what calibrate prints
    from a noisy recording) gives a table whose point at two rows is exact: interpolating to it
    rounded 117.266 up to 117.26600000000002, above the flat rows after it, and the step table
    (and a -3.6e-15 verify slope) was refused."""
    path = tmp_path / "c.env"
    path.write_text("DSPARK_GATE_DRAFT_MS=12.792\nDSPARK_GATE_VERIFY_BASE_MS=117.266\n"
                    "DSPARK_GATE_VERIFY_SLOPE_MS=0.000\nDSPARK_GATE_PLAIN_MS=46.519\n")
    code, out, err = _run_cli(capsys, "--costs", str(path), "--arms", "plain", "k1", "--streams", "1", "2",
                              "--output", "8", "--json")
    assert code == 0 and err == "", err
    assert json.loads(out)["cells"]["1"]["plain"]["aggregate_tok_s"] > 0
    table = StepTimes((1.0, 2.0, 8192.0), (46.519, 117.266, 117.266))
    assert [table.ms_at(r) for r in (1, 2, 3)] == [46.519, 117.266, 117.266]


def test_gpu_roofline_is_fitted_at_one_row():
    from services.simulate.models import roofline_check
    rows = {name: (model, peer) for name, model, peer in roofline_check()}
    assert rows["plain"][0] == pytest.approx(72.7) and rows["draft"][0] == pytest.approx(24.0)
    assert rows["verify(5)"][0] > rows["verify(1)"][0] > rows["plain"][0]


def _run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """`dspark simulate ARGS` in process: (exit code, stdout, stderr)."""
    code = main(["simulate", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("content, named", [
    ('{"verifier": {"rows": [1, 2], "ms": [10, -1]}, "drafter": {"draft": {"sessions": [1], "ms": [3]}}}', "ms[1]=-1"),
    ('{"verifier": {"rows": [1, 2], "ms": [10, 9]}, "drafter": {"draft": {"sessions": [1], "ms": [3]}}}', "ms[1]=9"),
    ('{"verifier": {"rows": [1], "ms": [10]}, "drafter": {"draft": {"sessions": [1, 2], "ms": [3, 2.5]}}}',
     "ms[1]=2.5"),
    # a free step (0 ms at one row, no rpc) is a valid table but leaves the gate no cost to weigh
    ('{"verifier": {"rows": [1, 64], "ms": [0, 0]}, "drafter": {"draft": {"sessions": [1], "ms": [0]}}}',
     "plain_ms=0.0"),
])
def test_a_bad_cost_file_is_one_error_line_naming_the_value(tmp_path, capsys, content, named):
    path = tmp_path / "shape.json"
    path.write_text(content)
    code, out, err = _run_cli(capsys, "--costs", str(path), "--streams", "1")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and named in err and err.startswith("dspark simulate: error:"), err


@pytest.mark.parametrize("args, named", [
    (["--streams", "0"], "--streams 0"),
    (["--rate", "0"], "--rate 0.0"),
    (["--rate", "-2.5"], "--rate -2.5"),
    (["--arms", "k9"], "'k9'"),
    (["--output", "uniform:9:3"], "uniform:9:3"),
    (["--prompt", "nosuch=5"], "no length for workload"),  # the synthetic workloads need one each
    (["--prompt", "a=1,a=2"], "a=1,a=2"),
])
def test_bad_load_arguments_are_one_error_line(capsys, args, named):
    code, out, err = _run_cli(capsys, *args)
    assert code == 2 and out == "" and err.count("\n") == 1 and named in err, err


def test_an_empty_rounds_file_is_one_error_line(tmp_path, capsys):
    path = tmp_path / "rounds.json"
    path.write_text('{"format": "dspark-rounds", "version": 1, "metadata": {}, "rounds": []}')
    code, out, err = _run_cli(capsys, "--rounds", str(path), "--streams", "1")
    assert code == 2 and out == "" and err.count("\n") == 1 and "rounds.json" in err, err


def test_the_recording_is_read_at_the_generations_text_position():
    """Recorded rounds [drafted a=1, not drafted, drafted a=3] start at text positions 0, 2, 3
    and cover 7 tokens. A draft reads the first drafted round at or after its position: a
    generation that moved on by plain tokens reaches the next recorded round (it does not meet
    the round it skipped again), and the text wraps."""
    a, skipped, b = Round("w", (1.0, 1.0), 2, 1), Round("w", (), 0, 0), Round("w", (2.0,) * 4, 4, 3)
    text = RecordedText([a, skipped, b])
    assert text.length == 7 and text.starts == [0, 3]
    assert all(text.at(t) is a for t in (0, 4, 7, 14))  # 4 is inside b: the next start is 7, a again
    assert all(text.at(t) is b for t in (1, 2, 3, 10))
    assert text.start(1) == 3
    with pytest.raises(ValueError, match="without a drafted one"):
        RecordedText([skipped])


def test_a_gated_stream_that_stops_drafting_moves_on_through_the_recording():
    """A poor stretch (two rounds of 0 accepted) then good rounds: k1 from the start meets the
    poor rounds once, then accepts every good round; its decisions follow the text position."""
    poor, good = Round("w", (-9.0,) * 5, 5, 0), Round("w", (9.0,) * 5, 5, 5)
    gw = Gateway(_hand_model(), RunConfig(block_size=5, gather_s=0.0, max_seq_len=64), arm_registry(5)["k1"])
    gw.start([StreamSpec(0, 0.0, 1, 16, RecordedText([poor, poor] + [good] * 6), 0)])
    gw.run()
    # rounds 1-2 read the poor rounds (1 token each), then position 2 reads good (accepted 1)
    assert [acc for _, _, acc in gw.decisions[0]][:4] == [0, 0, 1, 1]


def test_the_gateway_takes_verifier_replies_one_at_a_time():
    """gateway_ms = 3 on a flat 10 ms verifier step, plain decode, no gather or network. One
    stream: prefill [0, 10], its reply's turn [10, 13] (token 1), decode [13, 23], turn [23, 26]
    (token 2), decode [26, 36], turn [36, 39] (token 3). Two streams at gateway_ms = 12: s0's
    prefill [0, 10] and turn [10, 22]; s1's prefill [10, 20] waits for that turn to end, so its
    turn is [22, 34], not [20, 32]."""
    flat = StepTimes((1.0, 100.0), (10.0, 10.0))
    model = ServiceModel("turns", flat, StepTimes((1.0,), (4.0,)), StepTimes((1.0,), (1.0,)), gateway_ms=3.0)
    config = RunConfig(block_size=2, gather_s=0.0, max_seq_len=64)
    one = simulate_cell(model, config, arm_registry(2)["plain"], [StreamSpec(0, 0.0, 1, 3, RecordedText([ROUND]), 0)])
    assert one["wall_s"] == pytest.approx(0.039) and one["itl_p50_ms"] == pytest.approx(13.0)
    slow = dataclasses.replace(model, gateway_ms=12.0)
    two = simulate_cell(slow, config, arm_registry(2)["plain"],
                        [StreamSpec(s, 0.0, 1, 1, RecordedText([ROUND]), 0) for s in range(2)])
    assert two["ttft_p50_ms"] == pytest.approx(28.0) and two["wall_s"] == pytest.approx(0.034)
    with pytest.raises(ValueError, match="gateway_ms"):
        ServiceModel("bad", flat, flat, flat, gateway_ms=-1.0)


@pytest.mark.parametrize("cores, ends", [(1, [20.0, 20.0]), (2, [10.0, 10.0]), (1, None)])
def test_a_shared_pool_slows_its_jobs_down_by_processor_sharing(cores, ends):
    """Two 10 ms jobs started together end at 20 ms on one core (each at half speed) and at
    10 ms on two. A 10 ms job with a 5 ms one beside it on one core: both run at half speed
    until the short one ends at 10 ms, then the long one alone ends at 15 ms."""
    from services.simulate.loops import Clock, Pool
    clock = Clock()
    pool = Pool(clock, cores)
    done: list[float] = []
    if ends is None:
        pool.run(10.0, lambda: done.append(clock.now))
        pool.run(5.0, lambda: done.append(clock.now))
        clock.run()
        assert done == [10.0, 15.0]
        return
    for _ in range(2):
        pool.run(10.0, lambda: done.append(clock.now))
    clock.run()
    assert done == ends


def test_a_busy_machine_slows_only_the_jobs_that_overlap():
    """Two cores with one other program's job always runnable (`background` 1): one of our
    jobs alone gets a whole core, the model's speed, so a 12 ms job ends at 12 ms. Two of ours
    together get 2/3 of a core each (2 cores over 3 jobs): two 12 ms jobs end at 18 ms, where
    an idle pool of two cores ends them at 12. A 12 ms and a 6 ms job: both at 2/3 until the
    short one ends at 9 ms (6 / (2/3)), the long one then has 12 - 6 = 6 ms left alone: 15 ms.
    With background 2 one job alone gets 2/3 of a core (the model's speed, measured so), two
    get 1/2: 12 ms jobs end at 12 alone and at 16 together (12 / (3/4))."""
    from services.simulate.loops import Clock, Pool

    def ends(background: float, works: list[float]) -> list[float]:
        clock, done = Clock(), []
        pool = Pool(clock, 2, background)
        for w in works:
            pool.run(w, lambda: done.append(clock.now))
        clock.run()
        return done

    assert ends(1.0, [12.0]) == [12.0]
    assert ends(1.0, [12.0, 12.0]) == [pytest.approx(18.0)] * 2
    assert ends(0.0, [12.0, 12.0]) == [12.0, 12.0]
    assert ends(1.0, [12.0, 6.0]) == [pytest.approx(9.0), pytest.approx(15.0)]
    assert ends(2.0, [12.0]) == [pytest.approx(12.0)]
    assert ends(2.0, [12.0, 12.0]) == [pytest.approx(16.0)] * 2
    with pytest.raises(ValueError, match="background=-1"):
        Pool(Clock(), 2, -1.0)


@pytest.mark.parametrize("shared, ends", [(False, [28.0, 38.0]), (True, [36.0, 46.0])])
def test_a_services_event_loop_answers_one_call_at_a_time_beside_its_steps(shared, ends):
    """verifier_loop call_ms 4 (the verifier's gRPC work on each call, outside its steps) on a
    flat 10 ms step, two plain streams of 2 tokens, no gather, network or gateway turn. Both
    prefills share the step [0, 10]; the event loop answers s0 [10, 14] (token 1, s0's decode
    submitted), then s1 [14, 18]. Separate hardware: s0's decode steps [14, 24] beside s1's
    turn, s0's reply turn [24, 28] (s0 ends), s1's decode [24, 34] and turn [34, 38]. One
    shared core: s1's turn and s0's decode share it from 14 (s1's turn ends at 22, the step
    at 28), then s0's turn and s1's decode from 28 (the turn ends at 36, the step at 42), s1's
    turn [42, 46]."""
    from services.simulate.models import CallCost
    flat = StepTimes((1.0, 100.0), (10.0, 10.0))
    model = ServiceModel("loops", flat, StepTimes((1.0,), (4.0,)), StepTimes((1.0,), (1.0,)),
                         verifier_loop=CallCost(4.0))
    config = RunConfig(block_size=2, gather_s=0.0, max_seq_len=64, shared_compute=shared, cores=1)
    gw = Gateway(model, config, arm_registry(2)["plain"])
    gw.start([StreamSpec(s, 0.0, 1, 2, RecordedText([ROUND]), 0) for s in range(2)])
    gw.run()
    assert [gw.traces[s][0].end * 1e3 for s in range(2)] == pytest.approx(ends)
    with pytest.raises(ValueError, match="row_ms=-1"):
        CallCost(0.0, -1.0)
