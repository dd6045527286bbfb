"""Output constraints <-> their `dspark.v1.Constraint` message (common.proto).

Owns the wire form of `services.common.constraint.Constraint`: which oneof field carries
which kind, and the field path named in errors. It never compiles a constraint.
"""

from __future__ import annotations

import json

from dspark_proto.v1 import common_pb2
from services.common.constraint import Constraint, ConstraintError, make_constraint


def constraint_from_proto(msg: common_pb2.Constraint, field: str = "constraint") -> Constraint | None:
    """A wire `Constraint` -> `Constraint`, or None when no kind is set (unconstrained).

    Raises:
        ConstraintError: json_object false, empty text, bad choices (each names `field.kind`).
    """
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    path = f"{field}.{kind}"
    if kind == "json_object":
        if not msg.json_object:
            raise ConstraintError(f"{path}: false sets no constraint: leave the constraint unset instead")
        return make_constraint(kind, "", path)
    if kind == "choice":
        return make_constraint(kind, list(msg.choice.choices), path)
    return make_constraint(kind, getattr(msg, kind), path)


def constraint_to_proto(c: Constraint) -> common_pb2.Constraint:
    """`Constraint` -> its wire message (the spec as normalised by `make_constraint`)."""
    msg = common_pb2.Constraint()
    if c.kind == "json_object":
        msg.json_object = True
    elif c.kind == "choice":
        msg.choice.choices.extend(json.loads(c.spec))
    else:
        setattr(msg, c.kind, c.spec)
    return msg
