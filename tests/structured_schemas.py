"""The JSON Schemas of the structured-output tests and bench (docs/structured.md): nested
objects, arrays, enums, bounded numbers, strings with patterns and optional fields. Every one
bounds its output (string lengths, array sizes, integer ranges), so a generation completes
within the tiny model's 256 positions whatever the random weights write."""

from __future__ import annotations

_S = {"type": "string", "maxLength": 6}
_I = {"type": "integer", "minimum": -50, "maximum": 999}

SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": _S, "age": _I}, "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": _S, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{4}$"}}, "required": ["id"]},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {"x": _I, "y": _I},
                                            "required": ["x", "y"]}}, "required": ["p"]},
    {"type": "object", "properties": {"a": _I, "b": _S}, "required": ["a"]},
    {"type": "array", "items": _I, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}, "note": _S}, "required": ["level", "note"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"k": _S, "v": _I}, "required": ["k", "v"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
     "required": ["date"]},
    {"type": "object", "properties": {"kind": {"const": "point"}, "v": _I}, "required": ["kind", "v"]},
    {"type": "object", "properties": {"x": {"anyOf": [_I, {"type": "null"}]}}, "required": ["x"]},
    {"type": "object", "properties": {"flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4}},
     "required": ["flags"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": _S, "role": {"enum": ["admin", "user"]}}, "required": ["name", "role"]}, "active": {"type": "boolean"}},
     "required": ["user", "active"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}, "n": _I},
     "required": ["code", "n"]},
    {"type": "object", "properties": {"m": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": _I}}}, "required": ["m"]},
    {"type": "object", "properties": {"opt1": _S, "opt2": _I, "req": {"type": "boolean"}}, "required": ["req"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "score": _I},
     "required": ["answer", "score"]},
    {"type": "object", "properties": {"t": {"type": "string", "minLength": 1, "maxLength": 3}, "u": _S},
     "required": ["t", "u"]},
    {"type": "object", "properties": {"sub": {"type": "object", "properties": {"deep": {"type": "object",
        "properties": {"z": _I}, "required": ["z"]}}, "required": ["deep"]}}, "required": ["sub"]},
]
