"""`--record-rounds` output and the `dspark generate` client against real services (port 0)."""

from __future__ import annotations

import json
import subprocess
import sys

from services_fixtures import gen_request, collect, oracle_stack  # noqa: F401
from services.gateway.gate import GateConfig
from services.gateway.replay import replay_log
from services.gateway.rounds import RoundLog, load_rounds, save_rounds


def test_recorded_rounds_match_the_generation_and_replay(oracle_stack, tmp_path):  # noqa: F811
    """Every drafted round is recorded in the replay format with the generation's counts."""
    recorder: list = []

    async def run():
        gw = await oracle_stack.start_gateway("sequential", recorder=recorder)
        try:
            return await collect(gw.stub, gen_request("record me", max_tokens=30, spec="gated"))
        finally:
            await gw.close()

    gen = oracle_stack.loop.run(run())
    stats = gen.stats
    assert len(recorder) == stats.rounds - stats.plain_rounds + stats.skipped_after_draft
    assert sum(r.submitted for r in recorder) == stats.submitted
    assert sum(r.accepted for r in recorder) == stats.accepted
    assert all(r.workload == "live" and len(r.confidence_logits) == 5 for r in recorder)
    path = tmp_path / "rounds.json"
    save_rounds(RoundLog(tuple(recorder), {"source": "test"}), path)
    loaded = load_rounds(path)
    assert loaded.rounds == tuple(recorder)
    report = replay_log(loaded, GateConfig())
    assert [w.name for w in report.workloads] == ["live"] and report.workloads[0].rounds == len(recorder)


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
