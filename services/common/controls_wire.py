"""Logits controls <-> their `dspark.v1.LogitsControls` message (common.proto).

Owns the wire meaning of `services.common.controls.LogitsControls` (repetition_penalty 0 means
unset, i.e. 1; logit_bias as a map, sorted by token id on the way in) and the field path
named in errors. Every check of a value is `LogitsControls`'; it never applies a control.
"""

from __future__ import annotations

from dspark_proto.v1 import common_pb2
from services.common.controls import LogitsControls


def controls_from_proto(msg: common_pb2.LogitsControls, field: str = "controls") -> LogitsControls:
    """A wire `LogitsControls` -> validated `LogitsControls`. The floats keep their float32
    wire values, so the verifier and the drafter apply the same numbers.

    Raises:
        ValueError: any value `LogitsControls` refuses, the message prefixed with `field`.
    """
    try:
        return LogitsControls(
            logit_bias=tuple(sorted((int(t), float(b)) for t, b in msg.logit_bias.items())),
            presence_penalty=float(msg.presence_penalty), frequency_penalty=float(msg.frequency_penalty),
            repetition_penalty=float(msg.repetition_penalty) or 1.0, min_tokens=int(msg.min_tokens),
            stop_ids=tuple(int(t) for t in msg.stop_ids), bad_words=tuple(tuple(w.ids) for w in msg.bad_words))
    except ValueError as exc:
        raise ValueError(f"{field}.{exc}") from None


def controls_to_proto(c: LogitsControls) -> common_pb2.LogitsControls:
    """`LogitsControls` -> its wire message."""
    msg = common_pb2.LogitsControls(presence_penalty=c.presence_penalty, frequency_penalty=c.frequency_penalty,
                                    repetition_penalty=c.repetition_penalty, min_tokens=c.min_tokens,
                                    stop_ids=list(c.stop_ids))
    for token, bias in c.logit_bias:
        msg.logit_bias[token] = bias
    for word in c.bad_words:
        msg.bad_words.add(ids=list(word))
    return msg
