"""The structured-output fields of the OpenAI-compatible endpoints -> one `Constraint`.

Owns the HTTP spellings of an output constraint (docs/structured.md): OpenAI's
`response_format` (`{"type": "text"}`, `{"type": "json_object"}`, `{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}`) and the vLLM / SGLang extras `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs` (`json`, `regex`,
`choice`, `grammar`, `json_object`). At most one may constrain a request. It checks shapes
only; the gateway compiles the constraint and refuses one its compiler refuses (a 400 whose
message names `constraint.<kind>`).
"""

from __future__ import annotations

from typing import Any

from dspark_proto.v1 import common_pb2
from services.common.constraint import ConstraintError, make_constraint
from services.common.constraint_wire import constraint_to_proto
from services.http.errors import invalid

GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                   "json_object": "json_object"}


def constraint_message(fields: dict[str, Any]) -> common_pb2.Constraint | None:
    """The wire constraint of a request body's structured-output fields (field -> value, None
    when absent), or None when none constrains the output.

    Raises:
        ApiError: 400 naming the field: two constraining fields, an unknown response_format
            type, a json_schema without a schema, a value of the wrong shape.
    """
    found = [(name, kind, spec) for name, kind, spec in _candidates(fields) if kind is not None]
    if not found:
        return None
    if len(found) > 1:
        raise invalid(found[1][0], f"{found[0][0]} and {found[1][0]} both constrain the output: send one")
    name, kind, spec = found[0]
    try:
        return constraint_to_proto(make_constraint(kind, spec, name))
    except ConstraintError as exc:
        raise invalid(name, str(exc)) from None


def _candidates(fields: dict[str, Any]):
    """(field, kind or None, spec) for each structured-output field present."""
    rf = fields.get("response_format")
    if rf is not None:
        yield ("response_format", *_response_format(rf))
    for name, kind in GUIDED.items():
        if fields.get(name) is not None:
            yield name, kind, fields[name]
    so = fields.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise invalid("structured_outputs", f"structured_outputs must be an object, got {type(so).__name__}")
        unknown = sorted(set(so) - set(STRUCTURED_KEYS))
        if unknown:
            raise invalid(f"structured_outputs.{unknown[0]}", f"structured_outputs.{unknown[0]}: not supported "
                          f"(one of {', '.join(STRUCTURED_KEYS)})")
        for key, kind in STRUCTURED_KEYS.items():
            value = so.get(key)
            if value is None or (kind == "json_object" and value is False):
                continue
            if kind == "json_object" and value is not True:
                raise invalid("structured_outputs.json_object", "structured_outputs.json_object must be true or false")
            yield f"structured_outputs.{key}", kind, value


def _response_format(rf: Any) -> tuple[str | None, Any]:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise invalid("response_format", 'response_format must be an object with a "type"')
    kind = rf["type"]
    if kind == "text":
        return None, None
    if kind == "json_object":
        return "json_object", ""
    if kind != "json_schema":
        raise invalid("response_format.type", f"response_format.type={kind!r}: must be text, json_object "
                      "or json_schema")
    js = rf.get("json_schema")
    if not isinstance(js, dict) or "schema" not in js:
        raise invalid("response_format.json_schema", 'response_format.json_schema needs a "schema" object '
                      '(and a "name"; "strict" is honoured: output always matches the schema)')
    return "json_schema", js["schema"]
