"""`--record-rounds` output and the `dspark generate` client against real services (port 0)."""

from __future__ import annotations

import json
import subprocess
import sys

from services_fixtures import gen_request, collect, oracle_stack  # noqa: F401
from services.gateway.gate import GateConfig
from services.analysis.replay import replay_log
from services.gateway.rounds import RoundLog, load_rounds, save_rounds


def test_recorded_rounds_match_the_generation_and_replay(oracle_stack, tmp_path):  # noqa: F811
    """Every round is recorded in the replay format with the generation's counts: a drafted
    one with its confidences, one that drafted nothing (speculation off here) with its plain
    decode time, which `dspark calibrate` then fits plain_ms from."""
    recorder: list = []

    async def run():
        gw = await oracle_stack.start_gateway("sequential", recorder=recorder)
        try:
            return [await collect(gw.stub, gen_request("record me", max_tokens=30, spec="gated")),
                    await collect(gw.stub, gen_request("record me too", max_tokens=12, spec="off"))]
        finally:
            await gw.close()

    gated, off = oracle_stack.loop.run(run())
    drafted = [r for r in recorder if r.confidence_logits]
    plain = [r for r in recorder if not r.confidence_logits]
    assert len(recorder) == gated.stats.rounds + off.stats.rounds
    assert len(plain) == off.stats.rounds + gated.stats.plain_rounds + gated.stats.margin_skipped_rounds > 0
    assert sum(r.submitted for r in drafted) == gated.stats.submitted
    assert sum(r.accepted for r in drafted) == gated.stats.accepted
    assert all(r.workload == "live" and len(r.confidence_logits) == 5 for r in drafted)
    assert all(r.submitted == r.accepted == 0 and r.plain_ms > 0 and r.draft_ms is None for r in plain)
    path = tmp_path / "rounds.json"
    save_rounds(RoundLog(tuple(recorder), {"source": "test"}), path)
    loaded = load_rounds(path)
    assert loaded.rounds == tuple(recorder)
    report = replay_log(loaded, GateConfig())
    assert [w.name for w in report.workloads] == ["live"] and report.workloads[0].rounds == len(recorder)
    fit = subprocess.run([sys.executable, "-m", "services.cli", "calibrate", str(path)], capture_output=True,
                         text=True, timeout=120)
    assert fit.returncode == 0, fit.stderr
    assert {line.split("=")[0] for line in fit.stdout.split()} == {
        "DSPARK_GATE_DRAFT_MS", "DSPARK_GATE_VERIFY_BASE_MS",
        "DSPARK_GATE_VERIFY_SLOPE_MS", "DSPARK_GATE_PLAIN_MS"}


def test_generate_cli_streams_json_lines(oracle_stack):  # noqa: F811
    gw = oracle_stack.gateway("sequential")
    ref = oracle_stack.generate(gen_request("cli prompt", max_tokens=12, spec="off"))
    res = subprocess.run(
        [sys.executable, "-m", "services.cli", "generate", "cli prompt", "--target", gw.target,
         "--max-tokens", "12", "--spec", "always", "--ignore-eos", "--json", "--timeout", "60"],
        capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    messages = [json.loads(line) for line in res.stdout.splitlines()]
    tokens = [t for m in messages for t in m.get("token_ids", [])]
    assert tokens == ref.token_ids
    final = messages[-1]
    assert final["finished"] and final["finish_reason"] == "length"
    assert final["usage"]["completion_tokens"] == 12


def test_generate_cli_reports_a_bad_request_and_exits_nonzero(oracle_stack):  # noqa: F811
    gw = oracle_stack.gateway("sequential")
    res = subprocess.run(
        [sys.executable, "-m", "services.cli", "generate", "", "--target", gw.target, "--timeout", "30"],
        capture_output=True, text=True, timeout=120)
    assert res.returncode == 1
    assert "INVALID_ARGUMENT" in res.stderr and "empty prompt" in res.stderr
