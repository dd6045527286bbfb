from dspark_proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERIFY_MODE_UNSPECIFIED: _ClassVar[VerifyMode]
    VERIFY_MODE_SEQUENTIAL: _ClassVar[VerifyMode]
    VERIFY_MODE_BATCHED: _ClassVar[VerifyMode]
VERIFY_MODE_UNSPECIFIED: VerifyMode
VERIFY_MODE_SEQUENTIAL: VerifyMode
VERIFY_MODE_BATCHED: VerifyMode

class PrefillRequest(_message.Message):
    __slots__ = ("token_ids", "sampling", "constraint", "prompt_logprobs", "controls")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CONTROLS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    constraint: _common_pb2.Constraint
    prompt_logprobs: int
    controls: _common_pb2.LogitsControls
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., constraint: _Optional[_Union[_common_pb2.Constraint, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ..., controls: _Optional[_Union[_common_pb2.LogitsControls, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("token_id", "position")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    position: int
    def __init__(self, token_id: _Optional[int] = ..., position: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("anchor", "drafts", "position", "mode", "draft_probs", "survival")
    ANCHOR_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    SURVIVAL_FIELD_NUMBER: _ClassVar[int]
    anchor: int
    drafts: _containers.RepeatedScalarFieldContainer[int]
    position: int
    mode: VerifyMode
    draft_probs: _common_pb2.Tensor
    survival: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, anchor: _Optional[int] = ..., drafts: _Optional[_Iterable[int]] = ..., position: _Optional[int] = ..., mode: _Optional[_Union[VerifyMode, str]] = ..., draft_probs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., survival: _Optional[_Iterable[float]] = ...) -> None: ...

class RowsRequest(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: _Optional[int] = ...) -> None: ...

class VerifierRequest(_message.Message):
    __slots__ = ("trace", "prefill", "decode", "verify", "rows")
    TRACE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    trace: _common_pb2.TraceContext
    prefill: PrefillRequest
    decode: DecodeRequest
    verify: VerifyRequest
    rows: RowsRequest
    def __init__(self, trace: _Optional[_Union[_common_pb2.TraceContext, _Mapping]] = ..., prefill: _Optional[_Union[PrefillRequest, _Mapping]] = ..., decode: _Optional[_Union[DecodeRequest, _Mapping]] = ..., verify: _Optional[_Union[VerifyRequest, _Mapping]] = ..., rows: _Optional[_Union[RowsRequest, _Mapping]] = ...) -> None: ...

class VerifierResponse(_message.Message):
    __slots__ = ("next_token", "margin", "accepted", "rows", "first_position", "next_position", "timing", "admitted", "step_rows", "committed_tokens_per_ms", "logprobs", "prompt_logprobs")
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MARGIN_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    NEXT_POSITION_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    STEP_ROWS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKENS_PER_MS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    next_token: int
    margin: float
    accepted: int
    rows: _common_pb2.Tensor
    first_position: int
    next_position: int
    timing: _common_pb2.ComputeTiming
    admitted: int
    step_rows: int
    committed_tokens_per_ms: float
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, next_token: _Optional[int] = ..., margin: _Optional[float] = ..., accepted: _Optional[int] = ..., rows: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., first_position: _Optional[int] = ..., next_position: _Optional[int] = ..., timing: _Optional[_Union[_common_pb2.ComputeTiming, _Mapping]] = ..., admitted: _Optional[int] = ..., step_rows: _Optional[int] = ..., committed_tokens_per_ms: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...
