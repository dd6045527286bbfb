"""Sampling parameters and token logprobs <-> their `dspark.v1` messages.

Owns the wire form of `dsv4.sampling.SamplingParams` (common.proto `SamplingParams`,
`SamplingRule`) and of one token's logprobs (`TokenLogprob`); every rule about what a value
may be is `SamplingParams`' own, so a bad value raises the same ValueError, naming the field,
whichever service decodes it.

Wire conventions: an unset message (all fields zero) is greedy; top_p 0 means 1 (unset),
because proto3 cannot tell an unset float from 0 and top_p 0 would keep nothing; the rule
SAMPLING_RULE_DEFAULT takes the receiver's configured default.
"""

from __future__ import annotations

from dataclasses import dataclass

from dspark_proto.v1 import common_pb2
from dsv4.sampling import GREEDY, RULES, SamplingParams

RULE_ENUM = {"coupled": common_pb2.SAMPLING_RULE_COUPLED, "rejection": common_pb2.SAMPLING_RULE_REJECTION}
_RULE_NAME = {v: k for k, v in RULE_ENUM.items()}


def rule_name(value: int, default: str, field: str = "rule") -> str:
    """A `SamplingRule` enum value -> "coupled" | "rejection"; DEFAULT (0) -> `default`.

    Raises:
        ValueError: `default` not in RULES, or a value that is no SamplingRule (named as `field`).
    """
    if default not in RULES:
        raise ValueError(f"default rule={default!r}: must be one of {', '.join(RULES)}")
    if value == common_pb2.SAMPLING_RULE_DEFAULT:
        return default
    if value not in _RULE_NAME:
        raise ValueError(f"{field}={value}: not a SamplingRule (0 default, 1 coupled, 2 rejection)")
    return _RULE_NAME[value]


def params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """The wire form of `params` (the rule always explicit, never DEFAULT)."""
    return common_pb2.SamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
        seed=params.seed, rule=RULE_ENUM[params.rule], logprobs=params.logprobs)


def params_from_proto(msg: common_pb2.SamplingParams | None, default_rule: str = "coupled") -> SamplingParams:
    """Decode a `SamplingParams` message; None or an all-default message is greedy.

    Floats arrive as float32: they are widened as sent, so both ends of a session compute with
    the same values (the gateway sends what it validated, already float32-exact).
    Raises:
        ValueError: from `SamplingParams` (the field named) or `rule_name`.
    """
    if msg is None or msg == common_pb2.SamplingParams():
        return GREEDY
    return SamplingParams(temperature=float(msg.temperature), top_p=float(msg.top_p) or 1.0, top_k=int(msg.top_k),
                          min_p=float(msg.min_p), seed=int(msg.seed), rule=rule_name(msg.rule, default_rule),
                          logprobs=int(msg.logprobs))


@dataclass(frozen=True)
class TokenLogprob:
    """One chosen token's logprob under the target's raw distribution (log-softmax before
    temperature and filters) and its top alternatives, most likely first (natural log)."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if len(self.top_ids) != len(self.top_logprobs):
            raise ValueError(f"token logprob of {self.token_id}: {len(self.top_ids)} top ids but "
                             f"{len(self.top_logprobs)} top logprobs")

    def to_proto(self) -> common_pb2.TokenLogprob:
        return common_pb2.TokenLogprob(token_id=self.token_id, logprob=self.logprob, top_ids=list(self.top_ids),
                                       top_logprobs=list(self.top_logprobs))

    @classmethod
    def from_proto(cls, msg: common_pb2.TokenLogprob) -> TokenLogprob:
        """Raises ValueError when the top ids and top logprobs differ in count."""
        return cls(int(msg.token_id), float(msg.logprob), tuple(msg.top_ids), tuple(msg.top_logprobs))


def f32(x: float) -> float:
    """`x` rounded to float32, as it will arrive over the wire (so a validated value and the
    value every backend computes with are the same number)."""
    return float(common_pb2.SamplingParams(temperature=x).temperature)
