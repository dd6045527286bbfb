from dspark_proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CommitRequest(_message.Message):
    __slots__ = ("rows", "first_position", "token_ids", "token_first_position", "constraint", "constraint_first_position", "controls", "controls_first_position")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    CONTROLS_FIELD_NUMBER: _ClassVar[int]
    CONTROLS_FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    rows: _common_pb2.Tensor
    first_position: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_first_position: int
    constraint: _common_pb2.Constraint
    constraint_first_position: int
    controls: _common_pb2.LogitsControls
    controls_first_position: int
    def __init__(self, rows: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., first_position: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., token_first_position: _Optional[int] = ..., constraint: _Optional[_Union[_common_pb2.Constraint, _Mapping]] = ..., constraint_first_position: _Optional[int] = ..., controls: _Optional[_Union[_common_pb2.LogitsControls, _Mapping]] = ..., controls_first_position: _Optional[int] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("anchor", "seed_position", "sampling")
    ANCHOR_FIELD_NUMBER: _ClassVar[int]
    SEED_POSITION_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    anchor: int
    seed_position: int
    sampling: _common_pb2.SamplingParams
    def __init__(self, anchor: _Optional[int] = ..., seed_position: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class DrafterRequest(_message.Message):
    __slots__ = ("trace", "commit", "draft", "session_tag")
    TRACE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    SESSION_TAG_FIELD_NUMBER: _ClassVar[int]
    trace: _common_pb2.TraceContext
    commit: CommitRequest
    draft: DraftRequest
    session_tag: int
    def __init__(self, trace: _Optional[_Union[_common_pb2.TraceContext, _Mapping]] = ..., commit: _Optional[_Union[CommitRequest, _Mapping]] = ..., draft: _Optional[_Union[DraftRequest, _Mapping]] = ..., session_tag: _Optional[int] = ...) -> None: ...

class DrafterResponse(_message.Message):
    __slots__ = ("tokens", "confidence_logits", "committed_through", "timing", "session_tag", "draft_probs")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_LOGITS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_THROUGH_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    SESSION_TAG_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    confidence_logits: _containers.RepeatedScalarFieldContainer[float]
    committed_through: int
    timing: _common_pb2.ComputeTiming
    session_tag: int
    draft_probs: _common_pb2.Tensor
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., confidence_logits: _Optional[_Iterable[float]] = ..., committed_through: _Optional[int] = ..., timing: _Optional[_Union[_common_pb2.ComputeTiming, _Mapping]] = ..., session_tag: _Optional[int] = ..., draft_probs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...
