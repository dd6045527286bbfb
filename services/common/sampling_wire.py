"""Sampling parameters and logprob records <-> their `dspark.v1` messages (common.proto).

Owns the wire meaning of `SamplingParams` (top_p 0 means unset, i.e. 1; SAMPLING_RULE_DEFAULT
means the receiving service's default rule) and of `TokenLogprob`; every check of a value
is `dsv4.sampling.SamplingParams`'s, re-raised with the message's field path so a client
reads which field was wrong. It never decides how tokens are chosen.
"""

from __future__ import annotations

from dspark_proto.v1 import common_pb2
from dsv4.sampling import RULES, SEED_LIMIT, SamplingParams, TokenLogprob

_RULE_NAMES = {common_pb2.SAMPLING_RULE_COUPLED: "coupled", common_pb2.SAMPLING_RULE_REJECTION: "rejection"}
_RULE_ENUMS = {name: enum for enum, name in _RULE_NAMES.items()}


def params_from_proto(msg: common_pb2.SamplingParams, default_rule: str = "coupled",
                      field: str = "sampling") -> SamplingParams:
    """A wire `SamplingParams` -> validated `dsv4.sampling.SamplingParams`.

    The floats keep their float32 wire values (0.7 arrives as 0.699999988...), so every
    service that reads the same message samples with the same numbers. top_p 0 reads as 1;
    rule SAMPLING_RULE_DEFAULT reads as `default_rule`.
    Raises:
        ValueError: an unknown default_rule or rule enum value, a seed >= 2**63, or any value
            `SamplingParams` refuses (NaN, negative temperature, top_p outside (0, 1],
            top_k < 0, min_p outside [0, 1], logprobs outside 0..20); the message names
            `field`.<name> and the value.
    """
    if default_rule not in RULES:
        raise ValueError(f"default_rule={default_rule!r}: must be one of {', '.join(RULES)}")
    if msg.rule != common_pb2.SAMPLING_RULE_DEFAULT and msg.rule not in _RULE_NAMES:
        raise ValueError(f"{field}.rule={msg.rule}: not a SamplingRule (0 default, 1 coupled, 2 rejection)")
    if msg.seed >= SEED_LIMIT:
        raise ValueError(f"{field}.seed={msg.seed}: must lie in [0, 2**63)")
    try:
        return SamplingParams(temperature=float(msg.temperature), top_p=float(msg.top_p) or 1.0,
                              top_k=int(msg.top_k), min_p=float(msg.min_p), seed=int(msg.seed),
                              rule=_RULE_NAMES.get(msg.rule, default_rule), logprobs=int(msg.logprobs))
    except ValueError as exc:
        raise ValueError(f"{field}.{exc}") from None


def params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """`dsv4.sampling.SamplingParams` -> its wire message (the rule always explicit)."""
    return common_pb2.SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                     min_p=params.min_p, seed=params.seed, rule=_RULE_ENUMS[params.rule],
                                     logprobs=params.logprobs)


def logprob_to_proto(record: TokenLogprob) -> common_pb2.TokenLogprob:
    """One logprob record -> `TokenLogprob` (logprobs travel as float32)."""
    return common_pb2.TokenLogprob(token_id=record.token_id, logprob=record.logprob,
                                   top_ids=list(record.top_ids), top_logprobs=list(record.top_logprobs),
                                   rank=record.rank)


def logprob_from_proto(msg: common_pb2.TokenLogprob) -> TokenLogprob:
    """`TokenLogprob` message -> record. Raises ValueError when top_ids and top_logprobs differ in length."""
    if len(msg.top_ids) != len(msg.top_logprobs):
        raise ValueError(f"TokenLogprob of token {msg.token_id}: {len(msg.top_ids)} top_ids but "
                         f"{len(msg.top_logprobs)} top_logprobs")
    return TokenLogprob(msg.token_id, msg.logprob, tuple(msg.top_ids), tuple(msg.top_logprobs), msg.rank)
