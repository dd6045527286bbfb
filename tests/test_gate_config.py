"""GateConfig: the seed's env vars, defaults, overrides and errors naming variable and value."""

import dataclasses

import pytest

from services.gateway.gate import ENV_VARS, GateConfig

SEED_DEFAULTS = {
    "enabled": False,
    "margin_threshold": 0.0,
    "margin": 1.15,
    "min_draft": 0,
    "decay": 0.9,
    "draft_ms": 196.0,
    "verify_base_ms": 300.0,
    "verify_slope_ms": 109.0,
    "plain_ms": 303.0,
}


def test_env_names_are_the_seeds():
    assert sorted(ENV_VARS.values()) == sorted([
        "DEEPSEEK_DSPARK_GATE",
        "DEEPSEEK_DSPARK_GATE_MARGIN_THRESHOLD",
        "DEEPSEEK_DSPARK_GATE_MARGIN",
        "DEEPSEEK_DSPARK_GATE_MIN_DRAFT",
        "DEEPSEEK_DSPARK_GATE_DECAY",
        "DEEPSEEK_DSPARK_GATE_DRAFT_MS",
        "DEEPSEEK_DSPARK_GATE_VERIFY_BASE_MS",
        "DEEPSEEK_DSPARK_GATE_VERIFY_SLOPE_MS",
        "DEEPSEEK_DSPARK_GATE_PLAIN_MS",
    ])


def test_defaults_from_empty_environment_are_the_seeds():
    config = GateConfig.from_env({})
    assert {k: getattr(config, k) for k in SEED_DEFAULTS} == SEED_DEFAULTS
    assert config == GateConfig()


def test_unrelated_variables_are_ignored():
    assert GateConfig.from_env({"DEEPSEEK_DSPARK_GATE_FOO": "x", "PATH": "/bin"}) == GateConfig()


def test_overrides_parse_every_variable():
    env = {
        "DEEPSEEK_DSPARK_GATE": "1",
        "DEEPSEEK_DSPARK_GATE_MARGIN_THRESHOLD": "4.0",
        "DEEPSEEK_DSPARK_GATE_MARGIN": "1.3",
        "DEEPSEEK_DSPARK_GATE_MIN_DRAFT": "2",
        "DEEPSEEK_DSPARK_GATE_DECAY": "1",
        "DEEPSEEK_DSPARK_GATE_DRAFT_MS": "20.5",
        "DEEPSEEK_DSPARK_GATE_VERIFY_BASE_MS": "30",
        "DEEPSEEK_DSPARK_GATE_VERIFY_SLOPE_MS": " 2 ",
        "DEEPSEEK_DSPARK_GATE_PLAIN_MS": "25",
    }
    config = GateConfig.from_env(env)
    assert config == GateConfig(True, 4.0, 1.3, 2, 1.0, 20.5, 30.0, 2.0, 25.0)
    assert isinstance(config.min_draft, int)
    cost = config.cost_model()
    assert (cost.draft_ms, cost.verify_base_ms, cost.verify_slope_ms, cost.plain_ms) == (20.5, 30.0, 2.0, 25.0)


@pytest.mark.parametrize(
    ("raw", "expected"), [("0", False), ("1", True), ("true", True), ("FALSE", False), ("True", True)]
)
def test_gate_switch_words(raw, expected):
    assert GateConfig.from_env({"DEEPSEEK_DSPARK_GATE": raw}).enabled is expected


@pytest.mark.parametrize(("var", "raw"), [
    ("DEEPSEEK_DSPARK_GATE", "yes"),
    ("DEEPSEEK_DSPARK_GATE", "2"),
    ("DEEPSEEK_DSPARK_GATE", ""),
    ("DEEPSEEK_DSPARK_GATE_MARGIN_THRESHOLD", "-1"),
    ("DEEPSEEK_DSPARK_GATE_MARGIN_THRESHOLD", "four"),
    ("DEEPSEEK_DSPARK_GATE_MARGIN", "0.99"),
    ("DEEPSEEK_DSPARK_GATE_MARGIN", "abc"),
    ("DEEPSEEK_DSPARK_GATE_MIN_DRAFT", "-1"),
    ("DEEPSEEK_DSPARK_GATE_MIN_DRAFT", "1.5"),
    ("DEEPSEEK_DSPARK_GATE_DECAY", "0"),
    ("DEEPSEEK_DSPARK_GATE_DECAY", "1.01"),
    ("DEEPSEEK_DSPARK_GATE_DECAY", "nan"),
    ("DEEPSEEK_DSPARK_GATE_DRAFT_MS", "-5"),
    ("DEEPSEEK_DSPARK_GATE_DRAFT_MS", ""),
    ("DEEPSEEK_DSPARK_GATE_VERIFY_BASE_MS", "-0.5"),
    ("DEEPSEEK_DSPARK_GATE_VERIFY_SLOPE_MS", "x109"),
    ("DEEPSEEK_DSPARK_GATE_VERIFY_SLOPE_MS", "inf"),
    ("DEEPSEEK_DSPARK_GATE_PLAIN_MS", "-303"),
    ("DEEPSEEK_DSPARK_GATE_PLAIN_MS", "0"),
])
def test_invalid_value_names_variable_and_value(var, raw):
    with pytest.raises(ValueError) as info:
        GateConfig.from_env({var: raw})
    message = str(info.value)
    assert f"{var}=" in message
    assert repr(raw) in message


@pytest.mark.parametrize(("field", "value"), [
    ("margin", 0.5), ("decay", 0.0), ("min_draft", -2), ("min_draft", 1.0), ("draft_ms", -1.0), ("prior_weight", 0.0),
    ("enabled", 1),
])
def test_direct_construction_validates_and_names_field(field, value):
    with pytest.raises(ValueError, match=f"{field}={value!r}"):
        dataclasses.replace(GateConfig(), **{field: value})


def test_a_round_must_cost_time():
    with pytest.raises(ValueError, match="must be > 0"):
        GateConfig(draft_ms=0.0, verify_base_ms=0.0, verify_slope_ms=0.0)


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        GateConfig().margin = 2.0
