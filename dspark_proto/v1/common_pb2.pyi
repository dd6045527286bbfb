from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingRule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAMPLING_RULE_DEFAULT: _ClassVar[SamplingRule]
    SAMPLING_RULE_COUPLED: _ClassVar[SamplingRule]
    SAMPLING_RULE_REJECTION: _ClassVar[SamplingRule]
SAMPLING_RULE_DEFAULT: SamplingRule
SAMPLING_RULE_COUPLED: SamplingRule
SAMPLING_RULE_REJECTION: SamplingRule

class Tensor(_message.Message):
    __slots__ = ("data", "dtype", "shape")
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, data: _Optional[bytes] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class TraceContext(_message.Message):
    __slots__ = ("traceparent", "tracestate")
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    traceparent: str
    tracestate: str
    def __init__(self, traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ...) -> None: ...

class ComputeTiming(_message.Message):
    __slots__ = ("forward_ms", "queue_ms", "rollback_bytes")
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_BYTES_FIELD_NUMBER: _ClassVar[int]
    forward_ms: float
    queue_ms: float
    rollback_bytes: int
    def __init__(self, forward_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., rollback_bytes: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelIdentity(_message.Message):
    __slots__ = ("role", "config_hash", "vocab_size", "block_size", "window_size", "target_layer_ids", "row_width", "tp", "max_seq_len", "confidence_head", "noise_token_id", "eos_token_id", "max_sessions", "open_sessions", "drafter_kind", "steps", "batch_size_last", "batch_size_mean", "step_ms_last", "step_ms_mean", "session_state_bytes", "max_sessions_rule", "prefill_chunk", "prefill_steps", "drafter_steps", "drafter_batch_size_mean", "drafter_batch_size_max", "drafter_step_ms_mean", "step_table_rows", "step_table_ms", "step_table_samples", "step_table_source", "committed_tokens_per_ms", "committed_tokens")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    ROW_WIDTH_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_HEAD_FIELD_NUMBER: _ClassVar[int]
    NOISE_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    OPEN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_KIND_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_LAST_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_MEAN_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_LAST_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_MEAN_FIELD_NUMBER: _ClassVar[int]
    SESSION_STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_RULE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    PREFILL_STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_BATCH_SIZE_MEAN_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_BATCH_SIZE_MAX_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_STEP_MS_MEAN_FIELD_NUMBER: _ClassVar[int]
    STEP_TABLE_ROWS_FIELD_NUMBER: _ClassVar[int]
    STEP_TABLE_MS_FIELD_NUMBER: _ClassVar[int]
    STEP_TABLE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    STEP_TABLE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKENS_PER_MS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    role: str
    config_hash: str
    vocab_size: int
    block_size: int
    window_size: int
    target_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    row_width: int
    tp: int
    max_seq_len: int
    confidence_head: bool
    noise_token_id: int
    eos_token_id: int
    max_sessions: int
    open_sessions: int
    drafter_kind: str
    steps: int
    batch_size_last: int
    batch_size_mean: float
    step_ms_last: float
    step_ms_mean: float
    session_state_bytes: int
    max_sessions_rule: str
    prefill_chunk: int
    prefill_steps: int
    drafter_steps: int
    drafter_batch_size_mean: float
    drafter_batch_size_max: int
    drafter_step_ms_mean: float
    step_table_rows: _containers.RepeatedScalarFieldContainer[float]
    step_table_ms: _containers.RepeatedScalarFieldContainer[float]
    step_table_samples: _containers.RepeatedScalarFieldContainer[int]
    step_table_source: str
    committed_tokens_per_ms: float
    committed_tokens: int
    def __init__(self, role: _Optional[str] = ..., config_hash: _Optional[str] = ..., vocab_size: _Optional[int] = ..., block_size: _Optional[int] = ..., window_size: _Optional[int] = ..., target_layer_ids: _Optional[_Iterable[int]] = ..., row_width: _Optional[int] = ..., tp: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., confidence_head: _Optional[bool] = ..., noise_token_id: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., max_sessions: _Optional[int] = ..., open_sessions: _Optional[int] = ..., drafter_kind: _Optional[str] = ..., steps: _Optional[int] = ..., batch_size_last: _Optional[int] = ..., batch_size_mean: _Optional[float] = ..., step_ms_last: _Optional[float] = ..., step_ms_mean: _Optional[float] = ..., session_state_bytes: _Optional[int] = ..., max_sessions_rule: _Optional[str] = ..., prefill_chunk: _Optional[int] = ..., prefill_steps: _Optional[int] = ..., drafter_steps: _Optional[int] = ..., drafter_batch_size_mean: _Optional[float] = ..., drafter_batch_size_max: _Optional[int] = ..., drafter_step_ms_mean: _Optional[float] = ..., step_table_rows: _Optional[_Iterable[float]] = ..., step_table_ms: _Optional[_Iterable[float]] = ..., step_table_samples: _Optional[_Iterable[int]] = ..., step_table_source: _Optional[str] = ..., committed_tokens_per_ms: _Optional[float] = ..., committed_tokens: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "rule", "logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    rule: SamplingRule
    logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., rule: _Optional[_Union[SamplingRule, str]] = ..., logprobs: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_ids", "top_logprobs", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., rank: _Optional[int] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "grammar", "choice")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    grammar: str
    choice: ChoiceList
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class LogitsControls(_message.Message):
    __slots__ = ("logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "stop_ids", "bad_words")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    logit_bias: _containers.ScalarMap[int, float]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    stop_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenIds]
    def __init__(self, logit_bias: _Optional[_Mapping[int, float]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., stop_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...
