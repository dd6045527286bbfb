"""The shared-code guarantee of `dspark simulate`: it decides every round as a live gateway does.

A live gateway (the real in-process stack: verifier, live oracle drafter corrupting one draft
slot in 3 positions, gateway, all over gRPC) runs one gated generation and records its rounds
(`--record-rounds`' format). The simulator replays those rounds for one stream with the same
gate settings and costs, and must submit the same k and accept the same tokens in every
round. Then the gate's length rule is changed (monkeypatched to cut every block to
max_n // 2, in the module both import it from): the live gateway's k sequence changes, and
the simulator's, on the rounds the changed gateway recorded, changes identically. With
configured costs (so no step table) and one stream the gate's decisions depend only on those
round inputs, so any difference would be a policy written twice.
"""

from __future__ import annotations

import pytest

from services.gateway import gate as gate_module
from services.common.budget import StepTimes
from services.gateway.rounds import Round
from services.simulate.engine import Gateway, RecordedText, RunConfig, StreamSpec
from services.simulate.models import ServiceModel
from services.simulate.run import arm_registry
from tests.services_fixtures import collect, gen_request, start_stack, tiny_tokenizer, tiny_trunk  # noqa: F401

PROMPT, MAX_TOKENS = "the shared policy", 24


@pytest.fixture(scope="module")
def corrupting_stack():
    stack = start_stack("oracle", corrupt_every=3)
    yield stack
    stack.close()


def _live(stack) -> tuple[list[tuple[int, int]], list[Round]]:
    """(submitted, accepted) per round of one gated generation, and its recorded rounds."""
    recorder: list[Round] = []

    async def run():
        gw = await stack.start_gateway("batched", recorder=recorder)
        try:
            return await collect(gw.stub, gen_request(PROMPT, max_tokens=MAX_TOKENS, spec="gated"))
        finally:
            await gw.close()

    gen = stack.loop.run(run())
    assert len(gen.token_ids) == MAX_TOKENS
    return [(r.submitted, r.accepted) for r in recorder], recorder


def _simulated(recorded: list[Round], gate_costs) -> list[tuple[int, int]]:
    """(submitted, accepted) per round of the simulator's one stream over `recorded`."""
    flat = StepTimes((1.0,), (1.0,))
    model = ServiceModel("flat", flat, flat, flat)
    config = RunConfig(block_size=5, max_seq_len=tiny_trunk().cfg.max_seq_len, gate_costs=gate_costs)
    gw = Gateway(model, config, arm_registry(5)["gate-only"])
    gw.start([StreamSpec(0, 0.0, len(tiny_tokenizer().encode(PROMPT)), MAX_TOKENS, RecordedText(recorded), 0)])
    gw.run()
    return [(k, accepted) for _, k, accepted in gw.decisions[0]]


def test_the_simulator_decides_every_round_as_the_live_gateway(corrupting_stack, monkeypatch):
    costs = corrupting_stack.gate_config.cost_model()
    live, recorded = _live(corrupting_stack)
    assert any(a < s for s, a in live) and any(s == 5 for s, _ in live)  # misses happen, full blocks too
    assert _simulated(recorded, costs) == live

    real = gate_module.length_decision
    monkeypatch.setattr(gate_module, "length_decision",
                        lambda survival, max_n, *a, **kw: (max_n // 2, ()) if max_n else real(survival, max_n, *a, **kw))
    changed, recorded_changed = _live(corrupting_stack)
    assert changed != live and max(s for s, _ in changed) <= 2  # the change shows in the live gateway
    assert _simulated(recorded_changed, costs) == changed  # and identically in the simulator


def test_a_verifiers_profiled_step_table_is_a_cost_source():
    """`--costs info:HOST:PORT` reads a real verifier's Info: its start-up profile's table
    becomes the verifier model (1 row = the table's first point); a verifier without a
    profile is refused with one error naming the target."""
    from services.app import start_verifier, verifier_engine
    from services.common.settings import BackendSettings
    from services.simulate.models import load_model
    from services.verifier.step_profile import StepProfileSettings
    from tests.services_fixtures import service_loop

    loop = service_loop()

    async def start(profile):
        engine = verifier_engine(tiny_trunk(), BackendSettings(max_sessions=4))
        return await start_verifier(engine, step_profile=profile)

    profiled = loop.run(start(StepProfileSettings(sessions=2, repeats=1, prompt_tokens=4, budget_s=30.0)), 60)
    bare = loop.run(start(None), 60)
    try:
        model = load_model(f"info:127.0.0.1:{profiled.port}")
        assert model.verifier.rows[0] == 1.0 and model.verifier.ms[0] > 0
        assert model.verifier_ms(1, 1) == model.verifier.ms[0]
        with pytest.raises(ValueError, match=f"info:127.0.0.1:{bare.port}: the verifier reports no step table"):
            load_model(f"info:127.0.0.1:{bare.port}")
    finally:
        loop.run(profiled.stop(0), 30)
        loop.run(bare.stop(0), 30)
