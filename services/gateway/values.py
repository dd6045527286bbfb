"""Validation of gate/round values and settings.

This module owns the value checks shared by the gate, the round records and the settings
parser: short reprs for error messages, integer and finite-float checks, and the range rules
and text parsers of the GateConfig/CostModel settings (docs/gate.md §8). It must not read the
environment or hold state. Errors are ValueErrors naming the setting and its value."""

from __future__ import annotations

import math
import numbers
import re
import reprlib

# Cost bounds (ms): every cost is in [0, MAX_COST_MS]; plain_ms and a verified round's fixed part
# (draft + verify base + verify slope) are >= MIN_COST_MS, so tok/s and time sums stay finite.
MIN_COST_MS = 1e-3
MAX_COST_MS = 1e7
# Position classes of the gate's survival estimate (services.gateway.survival): at most 16.
MAX_POSITION_CLASSES = 16

_SWITCH_WORDS = {"1": True, "true": True, "0": False, "false": False}
# ASCII decimal forms only: no '+', '_', non-ASCII digits, inf or nan (float() and int() take them all).
_INT_TEXT = re.compile(r"-?[0-9]+")
_DECIMAL_TEXT = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


_SHORT = reprlib.Repr()  # keyword arguments need Python 3.12
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxlong, _SHORT.maxother = 2, 60, 40, 60


def short_repr(value: object) -> str:
    """repr(value) elided to a few dozen characters (reprlib), so a 400-digit integer, a long
    string or a deeply nested list cannot flood a one-line error."""
    if isinstance(value, int) and value.bit_length() > 128:
        if value.bit_length() > 14000:  # str() of > 4300 digits raises
            return f"<integer of ~{int(value.bit_length() * math.log10(2)) + 1} digits>"
        return f"{_SHORT.repr(value)} ({len(str(abs(value)))} digits)"
    return _SHORT.repr(value)


def is_integer(value: object) -> bool:
    """True for int and numpy integers; False for bool (a flag is not a count) and everything else."""
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def finite_float(value: object) -> float | None:
    """`value` as a finite float (-0.0 made 0.0), or None for a non-number, bool, NaN, inf or an
    integer too large for a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number + 0.0 if math.isfinite(number) else None


_COST_RULE = (lambda v: 0.0 <= v <= MAX_COST_MS, f"in [0, {MAX_COST_MS:g}] (ms)")
# Field -> (predicate on the normalised value, rule in words).
_RULES = {
    "margin_threshold": (lambda v: v >= 0, ">= 0"),
    "win_factor": (lambda v: v >= 1.0, ">= 1"),
    "decay": (lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    "draft_ms": _COST_RULE,
    "verify_base_ms": _COST_RULE,
    "verify_slope_ms": _COST_RULE,
    "plain_ms": (lambda v: MIN_COST_MS <= v <= MAX_COST_MS, f"in [{MIN_COST_MS:g}, {MAX_COST_MS:g}] (ms)"),
    "prior_weight": (lambda v: v > 0, "> 0"),
    "position_classes": (lambda v: 1 <= v <= MAX_POSITION_CLASSES, f"an integer in [1, {MAX_POSITION_CLASSES}]"),
}
# Fields whose values are integers (ASCII decimal digits when parsed from text).
_INTEGER_FIELDS = ("position_classes",)


def rule_text(field_name: str) -> str:
    """The valid values of GateConfig field `field_name`, in words (docs/settings.md).
    Raises KeyError for a field that is not a setting."""
    return "0, 1, true, false" if field_name == "enabled" else _RULES[field_name][1]


def check_setting(field_name: str, value: object, name: str, raw: str | None = None) -> bool | int | float:
    """The validated, normalised value of GateConfig field `field_name` (int, float or bool).

    Raises ValueError naming `name` (field, env var or CLI flag) and the value (`raw` if given).
    """
    shown = short_repr(raw if raw is not None else value)
    if field_name == "enabled":
        if not isinstance(value, bool):
            raise ValueError(f"{name}={shown} must be a bool")
        return value
    ok, rule = _RULES[field_name]
    if field_name in _INTEGER_FIELDS:
        if not is_integer(value) or not ok(value):
            raise ValueError(f"{name}={shown} must be {rule}")
        return int(value)
    number = finite_float(value)
    if number is None:
        raise ValueError(f"{name}={shown} must be a finite number")
    if not ok(number):
        raise ValueError(f"{name}={shown} must be {rule}")
    return number


def parse_setting(field_name: str, raw: str, name: str) -> bool | int | float:
    """Parse the text `raw` of field `field_name` (env var or CLI flag `name`) and validate it.

    Accepts only ASCII decimal forms (surrounding spaces ignored): an integer `-?[0-9]+` for
    position_classes, a decimal or exponent number for the rest, 0/1/true/false for enabled.
    Raises ValueError naming `name` and `raw`.
    """
    text = raw.strip(" \t\r\n")
    if field_name == "enabled":
        if text.lower() not in _SWITCH_WORDS:
            raise ValueError(f"{name}={short_repr(raw)} is not one of 0, 1, true, false")
        return _SWITCH_WORDS[text.lower()]
    if field_name in _INTEGER_FIELDS:
        if not _INT_TEXT.fullmatch(text):
            raise ValueError(f"{name}={short_repr(raw)} is not an integer (ASCII decimal digits)")
        if len(text.lstrip("-")) > 20:  # int() refuses > 4300 digits; anything this long is out of range
            raise ValueError(f"{name}={short_repr(raw)} must be {_RULES[field_name][1]}")
        return check_setting(field_name, int(text), name, raw)
    value = decimal(raw)
    if value is None:
        raise ValueError(f"{name}={short_repr(raw)} is not a number (ASCII decimal digits)")
    return check_setting(field_name, value, name, raw)


def decimal(raw: str) -> float | None:
    """The number `raw` spells in plain ASCII decimal or exponent form (ASCII spaces, tabs and
    line ends around it ignored), else None. float() alone also takes '1_0', other scripts'
    digits, 'infinity' and padding such as U+3000: spellings an operator reading a manifest
    would not take for the number a service then uses."""
    text = raw.strip(" \t\r\n")
    return float(text) if _DECIMAL_TEXT.fullmatch(text) else None
