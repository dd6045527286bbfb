"""GateConfig: the DSPARK_GATE* env vars (docs/gate.md §8), defaults, overrides and errors
naming variable and value."""

import dataclasses
import math

import numpy as np
import pytest

from services.gateway.gate import ENV_VARS, GateConfig
from services.settings import gate_config
from services.settings_vars import REMOVED

FOUR_HUNDRED_ONES = "1" * 400

SEED_DEFAULTS = {
    "enabled": False,
    "margin_threshold": 0.0,
    "win_factor": 1.15,
    "decay": 0.9,
    "draft_ms": 196.0,
    "verify_base_ms": 300.0,
    "verify_slope_ms": 109.0,
    "plain_ms": 303.0,
}


def test_env_names_are_the_seeds():
    assert sorted(ENV_VARS.values()) == sorted([
        "DSPARK_GATE",
        "DSPARK_GATE_MARGIN_THRESHOLD",
        "DSPARK_GATE_MARGIN",
        "DSPARK_GATE_DECAY",
        "DSPARK_GATE_DRAFT_MS",
        "DSPARK_GATE_VERIFY_BASE_MS",
        "DSPARK_GATE_VERIFY_SLOPE_MS",
        "DSPARK_GATE_PLAIN_MS",
    ])


def test_defaults_from_empty_environment_are_the_seeds():
    config = gate_config({})
    assert {k: getattr(config, k) for k in SEED_DEFAULTS} == SEED_DEFAULTS
    assert config == GateConfig()


def test_unrelated_variables_are_ignored():
    assert gate_config({"DSPARK_GATE_FOO": "x", "PATH": "/bin"}) == GateConfig()


def test_overrides_parse_every_variable():
    env = {
        "DSPARK_GATE": "1",
        "DSPARK_GATE_MARGIN_THRESHOLD": "4.0",
        "DSPARK_GATE_MARGIN": "1.3",
        "DSPARK_GATE_DECAY": "1",
        "DSPARK_GATE_DRAFT_MS": "20.5",
        "DSPARK_GATE_VERIFY_BASE_MS": "30",
        "DSPARK_GATE_VERIFY_SLOPE_MS": " 2 ",
        "DSPARK_GATE_PLAIN_MS": "25",
    }
    config = gate_config(env)
    assert config == GateConfig(True, 4.0, 1.3, 1.0, 20.5, 30.0, 2.0, 25.0)
    cost = config.cost_model()
    assert (cost.draft_ms, cost.verify_base_ms, cost.verify_slope_ms, cost.plain_ms) == (20.5, 30.0, 2.0, 25.0)


@pytest.mark.parametrize(
    ("raw", "expected"), [("0", False), ("1", True), ("true", True), ("FALSE", False), ("True", True)]
)
def test_gate_switch_words(raw, expected):
    assert gate_config({"DSPARK_GATE": raw}).enabled is expected


@pytest.mark.parametrize(("var", "raw"), [
    ("DSPARK_GATE", "yes"),
    ("DSPARK_GATE", "2"),
    ("DSPARK_GATE", ""),
    ("DSPARK_GATE_MARGIN_THRESHOLD", "-1"),
    ("DSPARK_GATE_MARGIN_THRESHOLD", "four"),
    ("DSPARK_GATE_MARGIN", "0.99"),
    ("DSPARK_GATE_MARGIN", "abc"),
    ("DSPARK_GATE_DECAY", "0"),
    ("DSPARK_GATE_DECAY", "1.01"),
    ("DSPARK_GATE_DECAY", "nan"),
    ("DSPARK_GATE_DRAFT_MS", "-5"),
    ("DSPARK_GATE_DRAFT_MS", ""),
    ("DSPARK_GATE_VERIFY_BASE_MS", "-0.5"),
    ("DSPARK_GATE_VERIFY_SLOPE_MS", "x109"),
    ("DSPARK_GATE_VERIFY_SLOPE_MS", "inf"),
    ("DSPARK_GATE_PLAIN_MS", "-303"),
    ("DSPARK_GATE_PLAIN_MS", "0"),
    # only ASCII decimal forms: int() and float() would take these
    ("DSPARK_GATE_DECAY", "٣"),
    ("DSPARK_GATE_MARGIN", "3_0"),
    ("DSPARK_GATE_MARGIN", "+3"),
    ("DSPARK_GATE_DRAFT_MS", "١٢"),
    ("DSPARK_GATE_DRAFT_MS", "1_0"),
    ("DSPARK_GATE_DRAFT_MS", "+5"),
    ("DSPARK_GATE_DECAY", "infinity"),
    # costs outside [0, 1e7] ms (plain_ms >= 1e-3) would give inf or 0 tok/s
    ("DSPARK_GATE_PLAIN_MS", "5e-324"),
    ("DSPARK_GATE_PLAIN_MS", "0.0009"),
    ("DSPARK_GATE_DRAFT_MS", "1e306"),
    ("DSPARK_GATE_VERIFY_SLOPE_MS", "10000001"),
])
def test_invalid_value_names_variable_and_value(var, raw):
    with pytest.raises(ValueError) as info:
        gate_config({var: raw})
    message = str(info.value)
    assert f"{var}=" in message
    assert repr(raw) in message


@pytest.mark.parametrize(("var", "digits"), [
    ("DSPARK_GATE_MARGIN_THRESHOLD", 400),
    ("DSPARK_GATE_DECAY", 5000),  # past int()'s 4300-digit limit
    ("DSPARK_GATE_DRAFT_MS", 400),
    ("DSPARK_GATE_MARGIN", 5000),
])
def test_huge_integer_text_is_a_value_error_naming_the_variable(var, digits):
    with pytest.raises(ValueError, match=f"^{var}='1111") as info:
        gate_config({var: "1" * digits})
    assert len(str(info.value)) < 200  # the value is elided, the message stays one short line


def test_min_draft_is_no_longer_a_setting():
    # DSPARK_GATE_MIN_DRAFT was deleted (issue #38: no measurement supported a floor); an old
    # deployment's variable sets no floor, and the entry point warns that it is no longer read
    assert "DSPARK_GATE_MIN_DRAFT" not in ENV_VARS.values()
    assert gate_config({"DSPARK_GATE_MIN_DRAFT": "2"}) == GateConfig()
    assert "DSPARK_GATE_MIN_DRAFT" in REMOVED


@pytest.mark.parametrize("raw", ["-0", "-0.0", "-0e5"])
def test_minus_zero_cost_and_threshold_become_plus_zero(raw):
    config = gate_config({"DSPARK_GATE_DRAFT_MS": raw, "DSPARK_GATE_MARGIN_THRESHOLD": raw})
    assert config.draft_ms == 0.0 and math.copysign(1.0, config.draft_ms) == 1.0
    assert math.copysign(1.0, config.margin_threshold) == 1.0


@pytest.mark.parametrize(("raw", "expected"), [("1.5e2", 150.0), (".5", 0.5), ("2.", 2.0), ("1E-3", 0.001)])
def test_cost_accepts_ascii_decimal_and_exponent_forms(raw, expected):
    assert gate_config({"DSPARK_GATE_PLAIN_MS": raw}).plain_ms == expected


@pytest.mark.parametrize(("field", "value"), [
    ("win_factor", 0.5), ("decay", 0.0), ("position_classes", 0), ("position_classes", 1.0), ("draft_ms", -1.0),
    ("enabled", 1), ("position_classes", True), ("position_classes", 1.5),
    ("win_factor", float("nan")), ("decay", float("inf")),
    ("plain_ms", 5e-324), ("draft_ms", 1e306), ("margin_threshold", "4"),
])
def test_direct_construction_validates_and_names_field(field, value):
    with pytest.raises(ValueError) as info:
        dataclasses.replace(GateConfig(), **{field: value})
    assert str(info.value).startswith(f"{field}={value!r} must be ")


@pytest.mark.parametrize("field", ["position_classes", "draft_ms", "win_factor", "decay", "plain_ms"])
def test_huge_integer_field_is_a_value_error_not_overflow(field):
    with pytest.raises(ValueError, match=f"^{field}=1111.* \\(400 digits\\) must be"):
        dataclasses.replace(GateConfig(), **{field: int(FOUR_HUNDRED_ONES)})


def test_numpy_numbers_are_accepted_and_normalised():
    config = GateConfig(position_classes=np.int64(2), draft_ms=np.float32(20.0), win_factor=np.float64(1.3))
    assert (config.position_classes, config.draft_ms, config.win_factor) == (2, 20.0, 1.3)
    assert (type(config.position_classes), type(config.draft_ms), type(config.win_factor)) == (int, float, float)
    with pytest.raises(ValueError, match="position_classes=np.True_"):
        GateConfig(position_classes=np.bool_(True))


def test_a_round_must_cost_time():
    with pytest.raises(ValueError, match="draft_ms \\+ verify_base_ms \\+ verify_slope_ms = 0 must be >= 0.001 ms"):
        GateConfig(draft_ms=0.0, verify_base_ms=0.0, verify_slope_ms=0.0)
    assert GateConfig(draft_ms=0.0, verify_base_ms=0.0, verify_slope_ms=0.001).cost_model().round_ms(1) == 0.001


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        GateConfig().win_factor = 2.0
