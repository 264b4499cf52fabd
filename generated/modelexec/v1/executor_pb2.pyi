import datetime

from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DataType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATA_TYPE_UNSPECIFIED: _ClassVar[DataType]
    DATA_TYPE_FLOAT32: _ClassVar[DataType]
    DATA_TYPE_FLOAT16: _ClassVar[DataType]
    DATA_TYPE_BFLOAT16: _ClassVar[DataType]
    DATA_TYPE_INT32: _ClassVar[DataType]
    DATA_TYPE_INT64: _ClassVar[DataType]
    DATA_TYPE_UINT32: _ClassVar[DataType]
    DATA_TYPE_INT8: _ClassVar[DataType]
    DATA_TYPE_UINT8: _ClassVar[DataType]
    DATA_TYPE_BOOL: _ClassVar[DataType]

class DeviceType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEVICE_TYPE_UNSPECIFIED: _ClassVar[DeviceType]
    DEVICE_TYPE_CPU: _ClassVar[DeviceType]
    DEVICE_TYPE_CUDA: _ClassVar[DeviceType]
    DEVICE_TYPE_ROCM: _ClassVar[DeviceType]
    DEVICE_TYPE_METAL: _ClassVar[DeviceType]

class HandleDetail(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HANDLE_DETAIL_UNSPECIFIED: _ClassVar[HandleDetail]
    HANDLE_DETAIL_FULL: _ClassVar[HandleDetail]
    HANDLE_DETAIL_COMPACT: _ClassVar[HandleDetail]

class LogitsKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOGITS_KIND_UNSPECIFIED: _ClassVar[LogitsKind]
    LOGITS_KIND_FULL: _ClassVar[LogitsKind]
    LOGITS_KIND_ARGMAX: _ClassVar[LogitsKind]
    LOGITS_KIND_TOP_K: _ClassVar[LogitsKind]
    LOGITS_KIND_SAMPLE: _ClassVar[LogitsKind]

class ForwardOutput(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FORWARD_OUTPUT_UNSPECIFIED: _ClassVar[ForwardOutput]
    FORWARD_OUTPUT_LOGITS: _ClassVar[ForwardOutput]
    FORWARD_OUTPUT_HIDDEN_STATES: _ClassVar[ForwardOutput]
    FORWARD_OUTPUT_TOKEN_LOGPROBS: _ClassVar[ForwardOutput]

class ModelType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_TYPE_UNSPECIFIED: _ClassVar[ModelType]
    MODEL_TYPE_LLAMA: _ClassVar[ModelType]
    MODEL_TYPE_MISTRAL: _ClassVar[ModelType]
    MODEL_TYPE_QWEN: _ClassVar[ModelType]
    MODEL_TYPE_PHI: _ClassVar[ModelType]
    MODEL_TYPE_GEMMA: _ClassVar[ModelType]
    MODEL_TYPE_CODE: _ClassVar[ModelType]
    MODEL_TYPE_EMBEDDING: _ClassVar[ModelType]
    MODEL_TYPE_CLIP: _ClassVar[ModelType]
    MODEL_TYPE_CUSTOM: _ClassVar[ModelType]

class AttentionType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ATTENTION_TYPE_UNSPECIFIED: _ClassVar[AttentionType]
    ATTENTION_TYPE_MULTI_HEAD: _ClassVar[AttentionType]
    ATTENTION_TYPE_MULTI_QUERY: _ClassVar[AttentionType]
    ATTENTION_TYPE_GROUPED_QUERY: _ClassVar[AttentionType]
    ATTENTION_TYPE_FLASH: _ClassVar[AttentionType]
    ATTENTION_TYPE_PAGED: _ClassVar[AttentionType]
    ATTENTION_TYPE_SLIDING_WINDOW: _ClassVar[AttentionType]

class ExecutorState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXECUTOR_STATE_UNSPECIFIED: _ClassVar[ExecutorState]
    EXECUTOR_STATE_INITIALIZING: _ClassVar[ExecutorState]
    EXECUTOR_STATE_READY: _ClassVar[ExecutorState]
    EXECUTOR_STATE_BUSY: _ClassVar[ExecutorState]
    EXECUTOR_STATE_ERROR: _ClassVar[ExecutorState]
    EXECUTOR_STATE_SHUTDOWN: _ClassVar[ExecutorState]
DATA_TYPE_UNSPECIFIED: DataType
DATA_TYPE_FLOAT32: DataType
DATA_TYPE_FLOAT16: DataType
DATA_TYPE_BFLOAT16: DataType
DATA_TYPE_INT32: DataType
DATA_TYPE_INT64: DataType
DATA_TYPE_UINT32: DataType
DATA_TYPE_INT8: DataType
DATA_TYPE_UINT8: DataType
DATA_TYPE_BOOL: DataType
DEVICE_TYPE_UNSPECIFIED: DeviceType
DEVICE_TYPE_CPU: DeviceType
DEVICE_TYPE_CUDA: DeviceType
DEVICE_TYPE_ROCM: DeviceType
DEVICE_TYPE_METAL: DeviceType
HANDLE_DETAIL_UNSPECIFIED: HandleDetail
HANDLE_DETAIL_FULL: HandleDetail
HANDLE_DETAIL_COMPACT: HandleDetail
LOGITS_KIND_UNSPECIFIED: LogitsKind
LOGITS_KIND_FULL: LogitsKind
LOGITS_KIND_ARGMAX: LogitsKind
LOGITS_KIND_TOP_K: LogitsKind
LOGITS_KIND_SAMPLE: LogitsKind
FORWARD_OUTPUT_UNSPECIFIED: ForwardOutput
FORWARD_OUTPUT_LOGITS: ForwardOutput
FORWARD_OUTPUT_HIDDEN_STATES: ForwardOutput
FORWARD_OUTPUT_TOKEN_LOGPROBS: ForwardOutput
MODEL_TYPE_UNSPECIFIED: ModelType
MODEL_TYPE_LLAMA: ModelType
MODEL_TYPE_MISTRAL: ModelType
MODEL_TYPE_QWEN: ModelType
MODEL_TYPE_PHI: ModelType
MODEL_TYPE_GEMMA: ModelType
MODEL_TYPE_CODE: ModelType
MODEL_TYPE_EMBEDDING: ModelType
MODEL_TYPE_CLIP: ModelType
MODEL_TYPE_CUSTOM: ModelType
ATTENTION_TYPE_UNSPECIFIED: AttentionType
ATTENTION_TYPE_MULTI_HEAD: AttentionType
ATTENTION_TYPE_MULTI_QUERY: AttentionType
ATTENTION_TYPE_GROUPED_QUERY: AttentionType
ATTENTION_TYPE_FLASH: AttentionType
ATTENTION_TYPE_PAGED: AttentionType
ATTENTION_TYPE_SLIDING_WINDOW: AttentionType
EXECUTOR_STATE_UNSPECIFIED: ExecutorState
EXECUTOR_STATE_INITIALIZING: ExecutorState
EXECUTOR_STATE_READY: ExecutorState
EXECUTOR_STATE_BUSY: ExecutorState
EXECUTOR_STATE_ERROR: ExecutorState
EXECUTOR_STATE_SHUTDOWN: ExecutorState

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DataType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DataType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Device(_message.Message):
    __slots__ = ("type", "index")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    type: DeviceType
    index: int
    def __init__(self, type: _Optional[_Union[DeviceType, str]] = ..., index: _Optional[int] = ...) -> None: ...

class BlockTable(_message.Message):
    __slots__ = ("block_ids", "sequence_length", "block_size", "held_blocks")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    sequence_length: int
    block_size: int
    held_blocks: int
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., sequence_length: _Optional[int] = ..., block_size: _Optional[int] = ..., held_blocks: _Optional[int] = ...) -> None: ...

class KvCacheHandle(_message.Message):
    __slots__ = ("cache_id", "block_table", "num_layers", "num_kv_heads", "head_dim", "device")
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    cache_id: str
    block_table: BlockTable
    num_layers: int
    num_kv_heads: int
    head_dim: int
    device: Device
    def __init__(self, cache_id: _Optional[str] = ..., block_table: _Optional[_Union[BlockTable, _Mapping]] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., device: _Optional[_Union[Device, _Mapping]] = ...) -> None: ...

class FullLogits(_message.Message):
    __slots__ = ("dtype",)
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    dtype: DataType
    def __init__(self, dtype: _Optional[_Union[DataType, str]] = ...) -> None: ...

class ArgmaxToken(_message.Message):
    __slots__ = ("top_logprobs",)
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    top_logprobs: int
    def __init__(self, top_logprobs: _Optional[int] = ...) -> None: ...

class TopKLogprobs(_message.Message):
    __slots__ = ("k",)
    K_FIELD_NUMBER: _ClassVar[int]
    k: int
    def __init__(self, k: _Optional[int] = ...) -> None: ...

class SampleToken(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "min_p", "top_logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    min_p: float
    top_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., min_p: _Optional[float] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class LogitsAdjustments(_message.Message):
    __slots__ = ("penalized_token_ids", "penalized_token_counts", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "allowed_token_ids", "banned_token_ids")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    PENALIZED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PENALIZED_TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BANNED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    penalized_token_ids: _containers.RepeatedScalarFieldContainer[int]
    penalized_token_counts: _containers.RepeatedScalarFieldContainer[int]
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    banned_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, penalized_token_ids: _Optional[_Iterable[int]] = ..., penalized_token_counts: _Optional[_Iterable[int]] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., banned_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LogitsPolicy(_message.Message):
    __slots__ = ("full", "argmax", "top_k", "sample", "adjustments")
    FULL_FIELD_NUMBER: _ClassVar[int]
    ARGMAX_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    ADJUSTMENTS_FIELD_NUMBER: _ClassVar[int]
    full: FullLogits
    argmax: ArgmaxToken
    top_k: TopKLogprobs
    sample: SampleToken
    adjustments: LogitsAdjustments
    def __init__(self, full: _Optional[_Union[FullLogits, _Mapping]] = ..., argmax: _Optional[_Union[ArgmaxToken, _Mapping]] = ..., top_k: _Optional[_Union[TopKLogprobs, _Mapping]] = ..., sample: _Optional[_Union[SampleToken, _Mapping]] = ..., adjustments: _Optional[_Union[LogitsAdjustments, _Mapping]] = ...) -> None: ...

class LogitsOutput(_message.Message):
    __slots__ = ("kind", "logits", "token_id", "logprob", "sampling_logprob", "top_token_ids", "top_logprobs")
    KIND_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    kind: LogitsKind
    logits: Tensor
    token_id: int
    logprob: float
    sampling_logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, kind: _Optional[_Union[LogitsKind, str]] = ..., logits: _Optional[_Union[Tensor, _Mapping]] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., sampling_logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class CallTiming(_message.Message):
    __slots__ = ("queue_ns", "executor_ns", "total_ns")
    QUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    queue_ns: int
    executor_ns: int
    total_ns: int
    def __init__(self, queue_ns: _Optional[int] = ..., executor_ns: _Optional[int] = ..., total_ns: _Optional[int] = ...) -> None: ...

class PrefillInput(_message.Message):
    __slots__ = ("input_ids", "attention_mask", "position_ids", "kv_cache", "metadata", "logits_policy")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _struct_pb2.Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ...) -> None: ...
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_MASK_FIELD_NUMBER: _ClassVar[int]
    POSITION_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    LOGITS_POLICY_FIELD_NUMBER: _ClassVar[int]
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    attention_mask: _containers.RepeatedScalarFieldContainer[int]
    position_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_cache: KvCacheHandle
    metadata: _containers.MessageMap[str, _struct_pb2.Value]
    logits_policy: LogitsPolicy
    def __init__(self, input_ids: _Optional[_Iterable[int]] = ..., attention_mask: _Optional[_Iterable[int]] = ..., position_ids: _Optional[_Iterable[int]] = ..., kv_cache: _Optional[_Union[KvCacheHandle, _Mapping]] = ..., metadata: _Optional[_Mapping[str, _struct_pb2.Value]] = ..., logits_policy: _Optional[_Union[LogitsPolicy, _Mapping]] = ...) -> None: ...

class PrefillOutput(_message.Message):
    __slots__ = ("logits", "kv_cache")
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    logits: LogitsOutput
    kv_cache: KvCacheHandle
    def __init__(self, logits: _Optional[_Union[LogitsOutput, _Mapping]] = ..., kv_cache: _Optional[_Union[KvCacheHandle, _Mapping]] = ...) -> None: ...

class DecodeInput(_message.Message):
    __slots__ = ("token_id", "kv_cache", "position_id", "metadata", "logits_policy")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _struct_pb2.Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ...) -> None: ...
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    POSITION_ID_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    LOGITS_POLICY_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    kv_cache: KvCacheHandle
    position_id: int
    metadata: _containers.MessageMap[str, _struct_pb2.Value]
    logits_policy: LogitsPolicy
    def __init__(self, token_id: _Optional[int] = ..., kv_cache: _Optional[_Union[KvCacheHandle, _Mapping]] = ..., position_id: _Optional[int] = ..., metadata: _Optional[_Mapping[str, _struct_pb2.Value]] = ..., logits_policy: _Optional[_Union[LogitsPolicy, _Mapping]] = ...) -> None: ...

class DecodeOutput(_message.Message):
    __slots__ = ("logits", "kv_cache")
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    logits: LogitsOutput
    kv_cache: KvCacheHandle
    def __init__(self, logits: _Optional[_Union[LogitsOutput, _Mapping]] = ..., kv_cache: _Optional[_Union[KvCacheHandle, _Mapping]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("input", "handle_detail")
    INPUT_FIELD_NUMBER: _ClassVar[int]
    HANDLE_DETAIL_FIELD_NUMBER: _ClassVar[int]
    input: PrefillInput
    handle_detail: HandleDetail
    def __init__(self, input: _Optional[_Union[PrefillInput, _Mapping]] = ..., handle_detail: _Optional[_Union[HandleDetail, str]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("output", "timing")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    output: PrefillOutput
    timing: CallTiming
    def __init__(self, output: _Optional[_Union[PrefillOutput, _Mapping]] = ..., timing: _Optional[_Union[CallTiming, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("input", "handle_detail")
    INPUT_FIELD_NUMBER: _ClassVar[int]
    HANDLE_DETAIL_FIELD_NUMBER: _ClassVar[int]
    input: DecodeInput
    handle_detail: HandleDetail
    def __init__(self, input: _Optional[_Union[DecodeInput, _Mapping]] = ..., handle_detail: _Optional[_Union[HandleDetail, str]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("output", "timing")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    output: DecodeOutput
    timing: CallTiming
    def __init__(self, output: _Optional[_Union[DecodeOutput, _Mapping]] = ..., timing: _Optional[_Union[CallTiming, _Mapping]] = ...) -> None: ...

class BatchPrefillRequest(_message.Message):
    __slots__ = ("inputs", "handle_detail")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    HANDLE_DETAIL_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[PrefillInput]
    handle_detail: HandleDetail
    def __init__(self, inputs: _Optional[_Iterable[_Union[PrefillInput, _Mapping]]] = ..., handle_detail: _Optional[_Union[HandleDetail, str]] = ...) -> None: ...

class BatchPrefillResponse(_message.Message):
    __slots__ = ("outputs", "timing")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[PrefillOutput]
    timing: CallTiming
    def __init__(self, outputs: _Optional[_Iterable[_Union[PrefillOutput, _Mapping]]] = ..., timing: _Optional[_Union[CallTiming, _Mapping]] = ...) -> None: ...

class BatchDecodeRequest(_message.Message):
    __slots__ = ("inputs", "handle_detail")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    HANDLE_DETAIL_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[DecodeInput]
    handle_detail: HandleDetail
    def __init__(self, inputs: _Optional[_Iterable[_Union[DecodeInput, _Mapping]]] = ..., handle_detail: _Optional[_Union[HandleDetail, str]] = ...) -> None: ...

class BatchDecodeResponse(_message.Message):
    __slots__ = ("outputs", "timing")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[DecodeOutput]
    timing: CallTiming
    def __init__(self, outputs: _Optional[_Iterable[_Union[DecodeOutput, _Mapping]]] = ..., timing: _Optional[_Union[CallTiming, _Mapping]] = ...) -> None: ...

class UnifiedBatchItem(_message.Message):
    __slots__ = ("seq_id", "q_tokens", "pos_offset", "is_final_chunk", "metadata", "logits_policy", "feed_sampled_token")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _struct_pb2.Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ...) -> None: ...
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    Q_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POS_OFFSET_FIELD_NUMBER: _ClassVar[int]
    IS_FINAL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    LOGITS_POLICY_FIELD_NUMBER: _ClassVar[int]
    FEED_SAMPLED_TOKEN_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    q_tokens: _containers.RepeatedScalarFieldContainer[int]
    pos_offset: int
    is_final_chunk: bool
    metadata: _containers.MessageMap[str, _struct_pb2.Value]
    logits_policy: LogitsPolicy
    feed_sampled_token: bool
    def __init__(self, seq_id: _Optional[str] = ..., q_tokens: _Optional[_Iterable[int]] = ..., pos_offset: _Optional[int] = ..., is_final_chunk: _Optional[bool] = ..., metadata: _Optional[_Mapping[str, _struct_pb2.Value]] = ..., logits_policy: _Optional[_Union[LogitsPolicy, _Mapping]] = ..., feed_sampled_token: _Optional[bool] = ...) -> None: ...

class UnifiedBatch(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[UnifiedBatchItem]
    def __init__(self, items: _Optional[_Iterable[_Union[UnifiedBatchItem, _Mapping]]] = ...) -> None: ...

class UnifiedItemResult(_message.Message):
    __slots__ = ("seq_id", "logits", "kv_cache")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    logits: LogitsOutput
    kv_cache: KvCacheHandle
    def __init__(self, seq_id: _Optional[str] = ..., logits: _Optional[_Union[LogitsOutput, _Mapping]] = ..., kv_cache: _Optional[_Union[KvCacheHandle, _Mapping]] = ...) -> None: ...

class UnifiedDecodeRequest(_message.Message):
    __slots__ = ("batch", "handle_detail")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    HANDLE_DETAIL_FIELD_NUMBER: _ClassVar[int]
    batch: UnifiedBatch
    handle_detail: HandleDetail
    def __init__(self, batch: _Optional[_Union[UnifiedBatch, _Mapping]] = ..., handle_detail: _Optional[_Union[HandleDetail, str]] = ...) -> None: ...

class UnifiedDecodeResponse(_message.Message):
    __slots__ = ("results", "timing")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[UnifiedItemResult]
    timing: CallTiming
    def __init__(self, results: _Optional[_Iterable[_Union[UnifiedItemResult, _Mapping]]] = ..., timing: _Optional[_Union[CallTiming, _Mapping]] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("input_ids", "output", "dtype")
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    output: ForwardOutput
    dtype: DataType
    def __init__(self, input_ids: _Optional[_Iterable[int]] = ..., output: _Optional[_Union[ForwardOutput, str]] = ..., dtype: _Optional[_Union[DataType, str]] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("output", "kind", "timing")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    output: Tensor
    kind: ForwardOutput
    timing: CallTiming
    def __init__(self, output: _Optional[_Union[Tensor, _Mapping]] = ..., kind: _Optional[_Union[ForwardOutput, str]] = ..., timing: _Optional[_Union[CallTiming, _Mapping]] = ...) -> None: ...

class ForwardVerifyRequest(_message.Message):
    __slots__ = ("kv_cache", "tokens", "logits_policy", "handle_detail")
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGITS_POLICY_FIELD_NUMBER: _ClassVar[int]
    HANDLE_DETAIL_FIELD_NUMBER: _ClassVar[int]
    kv_cache: KvCacheHandle
    tokens: _containers.RepeatedScalarFieldContainer[int]
    logits_policy: LogitsPolicy
    handle_detail: HandleDetail
    def __init__(self, kv_cache: _Optional[_Union[KvCacheHandle, _Mapping]] = ..., tokens: _Optional[_Iterable[int]] = ..., logits_policy: _Optional[_Union[LogitsPolicy, _Mapping]] = ..., handle_detail: _Optional[_Union[HandleDetail, str]] = ...) -> None: ...

class ForwardVerifyResponse(_message.Message):
    __slots__ = ("outputs", "kv_cache", "timing")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[LogitsOutput]
    kv_cache: KvCacheHandle
    timing: CallTiming
    def __init__(self, outputs: _Optional[_Iterable[_Union[LogitsOutput, _Mapping]]] = ..., kv_cache: _Optional[_Union[KvCacheHandle, _Mapping]] = ..., timing: _Optional[_Union[CallTiming, _Mapping]] = ...) -> None: ...

class TruncateKvRequest(_message.Message):
    __slots__ = ("cache_id", "new_length")
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_LENGTH_FIELD_NUMBER: _ClassVar[int]
    cache_id: str
    new_length: int
    def __init__(self, cache_id: _Optional[str] = ..., new_length: _Optional[int] = ...) -> None: ...

class TruncateKvResponse(_message.Message):
    __slots__ = ("kv_cache", "freed_blocks", "timing")
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    FREED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    kv_cache: KvCacheHandle
    freed_blocks: int
    timing: CallTiming
    def __init__(self, kv_cache: _Optional[_Union[KvCacheHandle, _Mapping]] = ..., freed_blocks: _Optional[int] = ..., timing: _Optional[_Union[CallTiming, _Mapping]] = ...) -> None: ...

class ReleaseCacheRequest(_message.Message):
    __slots__ = ("cache_id", "expected_length")
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    cache_id: str
    expected_length: int
    def __init__(self, cache_id: _Optional[str] = ..., expected_length: _Optional[int] = ...) -> None: ...

class ReleaseCacheResponse(_message.Message):
    __slots__ = ("released", "freed_blocks", "timing")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    FREED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    released: bool
    freed_blocks: int
    timing: CallTiming
    def __init__(self, released: _Optional[bool] = ..., freed_blocks: _Optional[int] = ..., timing: _Optional[_Union[CallTiming, _Mapping]] = ...) -> None: ...

class RankInfo(_message.Message):
    __slots__ = ("rank", "device", "host", "pid")
    RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    rank: int
    device: Device
    host: str
    pid: int
    def __init__(self, rank: _Optional[int] = ..., device: _Optional[_Union[Device, _Mapping]] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class ParallelLayout(_message.Message):
    __slots__ = ("tensor_parallel_size", "backend", "launcher", "ranks")
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    LAUNCHER_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    tensor_parallel_size: int
    backend: str
    launcher: str
    ranks: _containers.RepeatedCompositeFieldContainer[RankInfo]
    def __init__(self, tensor_parallel_size: _Optional[int] = ..., backend: _Optional[str] = ..., launcher: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[RankInfo, _Mapping]]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "model_type", "model_type_name", "num_parameters", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size", "max_sequence_length", "dtype", "device", "version", "license", "metadata", "parallel")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _struct_pb2.Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ...) -> None: ...
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LICENSE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    model_type: ModelType
    model_type_name: str
    num_parameters: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_sequence_length: int
    dtype: DataType
    device: Device
    version: str
    license: str
    metadata: _containers.MessageMap[str, _struct_pb2.Value]
    parallel: ParallelLayout
    def __init__(self, model_id: _Optional[str] = ..., model_type: _Optional[_Union[ModelType, str]] = ..., model_type_name: _Optional[str] = ..., num_parameters: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_sequence_length: _Optional[int] = ..., dtype: _Optional[_Union[DataType, str]] = ..., device: _Optional[_Union[Device, _Mapping]] = ..., version: _Optional[str] = ..., license: _Optional[str] = ..., metadata: _Optional[_Mapping[str, _struct_pb2.Value]] = ..., parallel: _Optional[_Union[ParallelLayout, _Mapping]] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("info", "server_version", "executor_name", "timing")
    INFO_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_NAME_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    info: ModelInfo
    server_version: str
    executor_name: str
    timing: CallTiming
    def __init__(self, info: _Optional[_Union[ModelInfo, _Mapping]] = ..., server_version: _Optional[str] = ..., executor_name: _Optional[str] = ..., timing: _Optional[_Union[CallTiming, _Mapping]] = ...) -> None: ...

class MemoryRequirements(_message.Message):
    __slots__ = ("parameter_memory", "activation_memory_per_token", "kv_cache_memory_per_token", "overhead_memory")
    PARAMETER_MEMORY_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_MEMORY_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_MEMORY_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_MEMORY_FIELD_NUMBER: _ClassVar[int]
    parameter_memory: int
    activation_memory_per_token: int
    kv_cache_memory_per_token: int
    overhead_memory: int
    def __init__(self, parameter_memory: _Optional[int] = ..., activation_memory_per_token: _Optional[int] = ..., kv_cache_memory_per_token: _Optional[int] = ..., overhead_memory: _Optional[int] = ...) -> None: ...

class ServiceLimits(_message.Message):
    __slots__ = ("max_message_bytes", "max_batch_size", "max_tokens_per_request", "max_concurrent_rpcs", "cache_ttl_seconds")
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_RPCS_FIELD_NUMBER: _ClassVar[int]
    CACHE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    max_message_bytes: int
    max_batch_size: int
    max_tokens_per_request: int
    max_concurrent_rpcs: int
    cache_ttl_seconds: float
    def __init__(self, max_message_bytes: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., max_tokens_per_request: _Optional[int] = ..., max_concurrent_rpcs: _Optional[int] = ..., cache_ttl_seconds: _Optional[float] = ...) -> None: ...

class ExecutorCapabilities(_message.Message):
    __slots__ = ("max_batch_size", "max_sequence_length", "attention_mechanisms", "supports_dynamic_batching", "supports_continuous_batching", "supports_speculative_decoding", "supports_tensor_parallelism", "supports_pipeline_parallelism", "supported_dtypes", "supported_devices", "memory_requirements", "kv_capacity", "supports_native_unified_decode", "kv_block_size", "kv_total_blocks", "limits", "supports_prefix_caching", "max_lora_adapters", "max_lora_rank", "supports_kv_transfer", "tensor_parallel_size")
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_MECHANISMS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_DYNAMIC_BATCHING_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_CONTINUOUS_BATCHING_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_SPECULATIVE_DECODING_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_TENSOR_PARALLELISM_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_PIPELINE_PARALLELISM_FIELD_NUMBER: _ClassVar[int]
    SUPPORTED_DTYPES_FIELD_NUMBER: _ClassVar[int]
    SUPPORTED_DEVICES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_REQUIREMENTS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_NATIVE_UNIFIED_DECODE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    max_batch_size: int
    max_sequence_length: int
    attention_mechanisms: _containers.RepeatedScalarFieldContainer[AttentionType]
    supports_dynamic_batching: bool
    supports_continuous_batching: bool
    supports_speculative_decoding: bool
    supports_tensor_parallelism: bool
    supports_pipeline_parallelism: bool
    supported_dtypes: _containers.RepeatedScalarFieldContainer[DataType]
    supported_devices: _containers.RepeatedScalarFieldContainer[DeviceType]
    memory_requirements: MemoryRequirements
    kv_capacity: int
    supports_native_unified_decode: bool
    kv_block_size: int
    kv_total_blocks: int
    limits: ServiceLimits
    supports_prefix_caching: bool
    max_lora_adapters: int
    max_lora_rank: int
    supports_kv_transfer: bool
    tensor_parallel_size: int
    def __init__(self, max_batch_size: _Optional[int] = ..., max_sequence_length: _Optional[int] = ..., attention_mechanisms: _Optional[_Iterable[_Union[AttentionType, str]]] = ..., supports_dynamic_batching: _Optional[bool] = ..., supports_continuous_batching: _Optional[bool] = ..., supports_speculative_decoding: _Optional[bool] = ..., supports_tensor_parallelism: _Optional[bool] = ..., supports_pipeline_parallelism: _Optional[bool] = ..., supported_dtypes: _Optional[_Iterable[_Union[DataType, str]]] = ..., supported_devices: _Optional[_Iterable[_Union[DeviceType, str]]] = ..., memory_requirements: _Optional[_Union[MemoryRequirements, _Mapping]] = ..., kv_capacity: _Optional[int] = ..., supports_native_unified_decode: _Optional[bool] = ..., kv_block_size: _Optional[int] = ..., kv_total_blocks: _Optional[int] = ..., limits: _Optional[_Union[ServiceLimits, _Mapping]] = ..., supports_prefix_caching: _Optional[bool] = ..., max_lora_adapters: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., supports_kv_transfer: _Optional[bool] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class GetCapabilitiesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetCapabilitiesResponse(_message.Message):
    __slots__ = ("capabilities", "timing")
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    capabilities: ExecutorCapabilities
    timing: CallTiming
    def __init__(self, capabilities: _Optional[_Union[ExecutorCapabilities, _Mapping]] = ..., timing: _Optional[_Union[CallTiming, _Mapping]] = ...) -> None: ...

class MemoryUsage(_message.Message):
    __slots__ = ("allocated_bytes", "used_bytes", "peak_bytes", "utilization_percent")
    ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    allocated_bytes: int
    used_bytes: int
    peak_bytes: int
    utilization_percent: float
    def __init__(self, allocated_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., peak_bytes: _Optional[int] = ..., utilization_percent: _Optional[float] = ...) -> None: ...

class KvPoolStatus(_message.Message):
    __slots__ = ("total_blocks", "used_blocks", "free_blocks", "block_size", "active_caches", "block_allocations", "allocation_failures", "leases_expired", "cached_blocks", "window_freed_blocks")
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_CACHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ALLOCATIONS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_FAILURES_FIELD_NUMBER: _ClassVar[int]
    LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FREED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    total_blocks: int
    used_blocks: int
    free_blocks: int
    block_size: int
    active_caches: int
    block_allocations: int
    allocation_failures: int
    leases_expired: int
    cached_blocks: int
    window_freed_blocks: int
    def __init__(self, total_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., active_caches: _Optional[int] = ..., block_allocations: _Optional[int] = ..., allocation_failures: _Optional[int] = ..., leases_expired: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., window_freed_blocks: _Optional[int] = ...) -> None: ...

class ExpertLoad(_message.Message):
    __slots__ = ("num_experts", "experts_per_token", "sparse_layers", "tokens_per_expert", "layer_tokens_per_expert")
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SPARSE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_EXPERT_FIELD_NUMBER: _ClassVar[int]
    LAYER_TOKENS_PER_EXPERT_FIELD_NUMBER: _ClassVar[int]
    num_experts: int
    experts_per_token: int
    sparse_layers: _containers.RepeatedScalarFieldContainer[int]
    tokens_per_expert: _containers.RepeatedScalarFieldContainer[int]
    layer_tokens_per_expert: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_experts: _Optional[int] = ..., experts_per_token: _Optional[int] = ..., sparse_layers: _Optional[_Iterable[int]] = ..., tokens_per_expert: _Optional[_Iterable[int]] = ..., layer_tokens_per_expert: _Optional[_Iterable[int]] = ...) -> None: ...

class RankMemory(_message.Message):
    __slots__ = ("rank", "parameter_bytes", "kv_pool_bytes", "lora_bytes", "device_allocated_bytes", "device_peak_bytes")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    LORA_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    parameter_bytes: int
    kv_pool_bytes: int
    lora_bytes: int
    device_allocated_bytes: int
    device_peak_bytes: int
    def __init__(self, rank: _Optional[int] = ..., parameter_bytes: _Optional[int] = ..., kv_pool_bytes: _Optional[int] = ..., lora_bytes: _Optional[int] = ..., device_allocated_bytes: _Optional[int] = ..., device_peak_bytes: _Optional[int] = ...) -> None: ...

class ExecutorStatus(_message.Message):
    __slots__ = ("state", "is_ready", "current_batch_size", "prefill_operations", "decode_operations", "avg_prefill_time_ms", "avg_decode_time_ms", "memory_usage", "last_operation", "kv_pool", "expert_load", "ranks")
    STATE_FIELD_NUMBER: _ClassVar[int]
    IS_READY_FIELD_NUMBER: _ClassVar[int]
    CURRENT_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_OPERATIONS_FIELD_NUMBER: _ClassVar[int]
    DECODE_OPERATIONS_FIELD_NUMBER: _ClassVar[int]
    AVG_PREFILL_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    AVG_DECODE_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USAGE_FIELD_NUMBER: _ClassVar[int]
    LAST_OPERATION_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_FIELD_NUMBER: _ClassVar[int]
    EXPERT_LOAD_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    state: ExecutorState
    is_ready: bool
    current_batch_size: int
    prefill_operations: int
    decode_operations: int
    avg_prefill_time_ms: float
    avg_decode_time_ms: float
    memory_usage: MemoryUsage
    last_operation: _timestamp_pb2.Timestamp
    kv_pool: KvPoolStatus
    expert_load: ExpertLoad
    ranks: _containers.RepeatedCompositeFieldContainer[RankMemory]
    def __init__(self, state: _Optional[_Union[ExecutorState, str]] = ..., is_ready: _Optional[bool] = ..., current_batch_size: _Optional[int] = ..., prefill_operations: _Optional[int] = ..., decode_operations: _Optional[int] = ..., avg_prefill_time_ms: _Optional[float] = ..., avg_decode_time_ms: _Optional[float] = ..., memory_usage: _Optional[_Union[MemoryUsage, _Mapping]] = ..., last_operation: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., kv_pool: _Optional[_Union[KvPoolStatus, _Mapping]] = ..., expert_load: _Optional[_Union[ExpertLoad, _Mapping]] = ..., ranks: _Optional[_Iterable[_Union[RankMemory, _Mapping]]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("status", "timing")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    status: ExecutorStatus
    timing: CallTiming
    def __init__(self, status: _Optional[_Union[ExecutorStatus, _Mapping]] = ..., timing: _Optional[_Union[CallTiming, _Mapping]] = ...) -> None: ...

class DecodeBatchBuckets(_message.Message):
    __slots__ = ("m1", "m2", "m3_4", "m5_8", "m9_16", "m17_32", "m_gt_32")
    M1_FIELD_NUMBER: _ClassVar[int]
    M2_FIELD_NUMBER: _ClassVar[int]
    M3_4_FIELD_NUMBER: _ClassVar[int]
    M5_8_FIELD_NUMBER: _ClassVar[int]
    M9_16_FIELD_NUMBER: _ClassVar[int]
    M17_32_FIELD_NUMBER: _ClassVar[int]
    M_GT_32_FIELD_NUMBER: _ClassVar[int]
    m1: int
    m2: int
    m3_4: int
    m5_8: int
    m9_16: int
    m17_32: int
    m_gt_32: int
    def __init__(self, m1: _Optional[int] = ..., m2: _Optional[int] = ..., m3_4: _Optional[int] = ..., m5_8: _Optional[int] = ..., m9_16: _Optional[int] = ..., m17_32: _Optional[int] = ..., m_gt_32: _Optional[int] = ...) -> None: ...

class DecodeBatchMetrics(_message.Message):
    __slots__ = ("schema_version", "calls", "total_items", "avg_items_per_call", "max_items", "last_items", "force_full_logits_calls", "singleton_fast_path_calls", "unsupported_fallback_calls", "lora_fallback_calls", "bucket_calls")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ITEMS_FIELD_NUMBER: _ClassVar[int]
    AVG_ITEMS_PER_CALL_FIELD_NUMBER: _ClassVar[int]
    MAX_ITEMS_FIELD_NUMBER: _ClassVar[int]
    LAST_ITEMS_FIELD_NUMBER: _ClassVar[int]
    FORCE_FULL_LOGITS_CALLS_FIELD_NUMBER: _ClassVar[int]
    SINGLETON_FAST_PATH_CALLS_FIELD_NUMBER: _ClassVar[int]
    UNSUPPORTED_FALLBACK_CALLS_FIELD_NUMBER: _ClassVar[int]
    LORA_FALLBACK_CALLS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_CALLS_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    calls: int
    total_items: int
    avg_items_per_call: float
    max_items: int
    last_items: int
    force_full_logits_calls: int
    singleton_fast_path_calls: int
    unsupported_fallback_calls: int
    lora_fallback_calls: int
    bucket_calls: DecodeBatchBuckets
    def __init__(self, schema_version: _Optional[int] = ..., calls: _Optional[int] = ..., total_items: _Optional[int] = ..., avg_items_per_call: _Optional[float] = ..., max_items: _Optional[int] = ..., last_items: _Optional[int] = ..., force_full_logits_calls: _Optional[int] = ..., singleton_fast_path_calls: _Optional[int] = ..., unsupported_fallback_calls: _Optional[int] = ..., lora_fallback_calls: _Optional[int] = ..., bucket_calls: _Optional[_Union[DecodeBatchBuckets, _Mapping]] = ...) -> None: ...

class ExecutorLockMetrics(_message.Message):
    __slots__ = ("schema_version", "samples", "total_wait_time_us", "avg_wait_time_ms")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_WAIT_TIME_US_FIELD_NUMBER: _ClassVar[int]
    AVG_WAIT_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    samples: int
    total_wait_time_us: int
    avg_wait_time_ms: float
    def __init__(self, schema_version: _Optional[int] = ..., samples: _Optional[int] = ..., total_wait_time_us: _Optional[int] = ..., avg_wait_time_ms: _Optional[float] = ...) -> None: ...

class CacheMetrics(_message.Message):
    __slots__ = ("position", "source", "enabled", "hits", "misses", "evictions", "saved_prefill_tokens", "entries", "bytes", "block_size", "kv_dtype", "decode_batch", "executor_lock")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    SAVED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    DECODE_BATCH_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_LOCK_FIELD_NUMBER: _ClassVar[int]
    position: str
    source: str
    enabled: bool
    hits: int
    misses: int
    evictions: int
    saved_prefill_tokens: int
    entries: int
    bytes: int
    block_size: int
    kv_dtype: DataType
    decode_batch: DecodeBatchMetrics
    executor_lock: ExecutorLockMetrics
    def __init__(self, position: _Optional[str] = ..., source: _Optional[str] = ..., enabled: _Optional[bool] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., saved_prefill_tokens: _Optional[int] = ..., entries: _Optional[int] = ..., bytes: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_dtype: _Optional[_Union[DataType, str]] = ..., decode_batch: _Optional[_Union[DecodeBatchMetrics, _Mapping]] = ..., executor_lock: _Optional[_Union[ExecutorLockMetrics, _Mapping]] = ...) -> None: ...

class GetCacheMetricsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetCacheMetricsResponse(_message.Message):
    __slots__ = ("metrics", "timing")
    METRICS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    metrics: CacheMetrics
    timing: CallTiming
    def __init__(self, metrics: _Optional[_Union[CacheMetrics, _Mapping]] = ..., timing: _Optional[_Union[CallTiming, _Mapping]] = ...) -> None: ...

class LoraMetrics(_message.Message):
    __slots__ = ("enabled", "adapter_count", "active_cache_bindings", "projection_applications", "position", "source")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_COUNT_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_CACHE_BINDINGS_FIELD_NUMBER: _ClassVar[int]
    PROJECTION_APPLICATIONS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    adapter_count: int
    active_cache_bindings: int
    projection_applications: int
    position: str
    source: str
    def __init__(self, enabled: _Optional[bool] = ..., adapter_count: _Optional[int] = ..., active_cache_bindings: _Optional[int] = ..., projection_applications: _Optional[int] = ..., position: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class GetLoraMetricsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoraMetricsResponse(_message.Message):
    __slots__ = ("metrics", "timing")
    METRICS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    metrics: LoraMetrics
    timing: CallTiming
    def __init__(self, metrics: _Optional[_Union[LoraMetrics, _Mapping]] = ..., timing: _Optional[_Union[CallTiming, _Mapping]] = ...) -> None: ...

class LoraAdapterInfo(_message.Message):
    __slots__ = ("name", "rank", "alpha", "scaling", "target_modules", "source", "num_parameters", "bytes", "bound_caches", "loaded_at")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    SCALING_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BOUND_CACHES_FIELD_NUMBER: _ClassVar[int]
    LOADED_AT_FIELD_NUMBER: _ClassVar[int]
    name: str
    rank: int
    alpha: float
    scaling: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    source: str
    num_parameters: int
    bytes: int
    bound_caches: int
    loaded_at: _timestamp_pb2.Timestamp
    def __init__(self, name: _Optional[str] = ..., rank: _Optional[int] = ..., alpha: _Optional[float] = ..., scaling: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ..., source: _Optional[str] = ..., num_parameters: _Optional[int] = ..., bytes: _Optional[int] = ..., bound_caches: _Optional[int] = ..., loaded_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class InlineLoraAdapter(_message.Message):
    __slots__ = ("adapter_config_json", "adapter_model_safetensors")
    ADAPTER_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_MODEL_SAFETENSORS_FIELD_NUMBER: _ClassVar[int]
    adapter_config_json: bytes
    adapter_model_safetensors: bytes
    def __init__(self, adapter_config_json: _Optional[bytes] = ..., adapter_model_safetensors: _Optional[bytes] = ...) -> None: ...

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("name", "path", "inline")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    INLINE_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    inline: InlineLoraAdapter
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., inline: _Optional[_Union[InlineLoraAdapter, _Mapping]] = ...) -> None: ...

class LoadLoraAdapterResponse(_message.Message):
    __slots__ = ("adapter", "timing")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    adapter: LoraAdapterInfo
    timing: CallTiming
    def __init__(self, adapter: _Optional[_Union[LoraAdapterInfo, _Mapping]] = ..., timing: _Optional[_Union[CallTiming, _Mapping]] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterResponse(_message.Message):
    __slots__ = ("adapter", "timing")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    adapter: LoraAdapterInfo
    timing: CallTiming
    def __init__(self, adapter: _Optional[_Union[LoraAdapterInfo, _Mapping]] = ..., timing: _Optional[_Union[CallTiming, _Mapping]] = ...) -> None: ...

class ListLoraAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLoraAdaptersResponse(_message.Message):
    __slots__ = ("adapters", "timing")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapterInfo]
    timing: CallTiming
    def __init__(self, adapters: _Optional[_Iterable[_Union[LoraAdapterInfo, _Mapping]]] = ..., timing: _Optional[_Union[CallTiming, _Mapping]] = ...) -> None: ...

class WarmupRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WarmupResponse(_message.Message):
    __slots__ = ("timing",)
    TIMING_FIELD_NUMBER: _ClassVar[int]
    timing: CallTiming
    def __init__(self, timing: _Optional[_Union[CallTiming, _Mapping]] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ("grace_seconds",)
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    grace_seconds: float
    def __init__(self, grace_seconds: _Optional[float] = ...) -> None: ...

class ShutdownResponse(_message.Message):
    __slots__ = ("released_caches", "timing")
    RELEASED_CACHES_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    released_caches: int
    timing: CallTiming
    def __init__(self, released_caches: _Optional[int] = ..., timing: _Optional[_Union[CallTiming, _Mapping]] = ...) -> None: ...

class StepSessionRequest(_message.Message):
    __slots__ = ("step_id", "batch", "handle_detail")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    HANDLE_DETAIL_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    batch: UnifiedBatch
    handle_detail: HandleDetail
    def __init__(self, step_id: _Optional[int] = ..., batch: _Optional[_Union[UnifiedBatch, _Mapping]] = ..., handle_detail: _Optional[_Union[HandleDetail, str]] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("code", "message", "reason", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    reason: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., reason: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class StepSessionResponse(_message.Message):
    __slots__ = ("step_id", "results", "error", "timing")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    results: _containers.RepeatedCompositeFieldContainer[UnifiedItemResult]
    error: StepError
    timing: CallTiming
    def __init__(self, step_id: _Optional[int] = ..., results: _Optional[_Iterable[_Union[UnifiedItemResult, _Mapping]]] = ..., error: _Optional[_Union[StepError, _Mapping]] = ..., timing: _Optional[_Union[CallTiming, _Mapping]] = ...) -> None: ...

class KvFingerprint(_message.Message):
    __slots__ = ("model_id", "weights_digest", "kv_dtype", "num_layers", "num_kv_heads", "head_dim", "device_type")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    weights_digest: str
    kv_dtype: DataType
    num_layers: int
    num_kv_heads: int
    head_dim: int
    device_type: DeviceType
    def __init__(self, model_id: _Optional[str] = ..., weights_digest: _Optional[str] = ..., kv_dtype: _Optional[_Union[DataType, str]] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., device_type: _Optional[_Union[DeviceType, str]] = ...) -> None: ...

class KvExportDescription(_message.Message):
    __slots__ = ("fingerprint", "cache_id", "block_size", "start_position", "end_position", "cache_length", "token_ids", "lora_adapter", "num_chunks", "total_bytes")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    END_POSITION_FIELD_NUMBER: _ClassVar[int]
    CACHE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    fingerprint: KvFingerprint
    cache_id: str
    block_size: int
    start_position: int
    end_position: int
    cache_length: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    lora_adapter: str
    num_chunks: int
    total_bytes: int
    def __init__(self, fingerprint: _Optional[_Union[KvFingerprint, _Mapping]] = ..., cache_id: _Optional[str] = ..., block_size: _Optional[int] = ..., start_position: _Optional[int] = ..., end_position: _Optional[int] = ..., cache_length: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., lora_adapter: _Optional[str] = ..., num_chunks: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("position_start", "position_count", "layer_start", "layer_count", "key", "value", "crc32")
    POSITION_START_FIELD_NUMBER: _ClassVar[int]
    POSITION_COUNT_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_COUNT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    position_start: int
    position_count: int
    layer_start: int
    layer_count: int
    key: bytes
    value: bytes
    crc32: int
    def __init__(self, position_start: _Optional[int] = ..., position_count: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_count: _Optional[int] = ..., key: _Optional[bytes] = ..., value: _Optional[bytes] = ..., crc32: _Optional[int] = ...) -> None: ...

class ExportKvRequest(_message.Message):
    __slots__ = ("cache_id", "start_position", "end_position", "max_chunk_bytes")
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    END_POSITION_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    cache_id: str
    start_position: int
    end_position: int
    max_chunk_bytes: int
    def __init__(self, cache_id: _Optional[str] = ..., start_position: _Optional[int] = ..., end_position: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class ExportKvResponse(_message.Message):
    __slots__ = ("description", "chunk")
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    description: KvExportDescription
    chunk: KvChunk
    def __init__(self, description: _Optional[_Union[KvExportDescription, _Mapping]] = ..., chunk: _Optional[_Union[KvChunk, _Mapping]] = ...) -> None: ...

class ImportKvStart(_message.Message):
    __slots__ = ("description", "cache_id", "check_only")
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    CHECK_ONLY_FIELD_NUMBER: _ClassVar[int]
    description: KvExportDescription
    cache_id: str
    check_only: bool
    def __init__(self, description: _Optional[_Union[KvExportDescription, _Mapping]] = ..., cache_id: _Optional[str] = ..., check_only: _Optional[bool] = ...) -> None: ...

class ImportKvRequest(_message.Message):
    __slots__ = ("start", "chunk")
    START_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    start: ImportKvStart
    chunk: KvChunk
    def __init__(self, start: _Optional[_Union[ImportKvStart, _Mapping]] = ..., chunk: _Optional[_Union[KvChunk, _Mapping]] = ...) -> None: ...

class ImportKvResponse(_message.Message):
    __slots__ = ("kv_cache", "imported_tokens", "replayed", "timing")
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    IMPORTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    kv_cache: KvCacheHandle
    imported_tokens: int
    replayed: bool
    timing: CallTiming
    def __init__(self, kv_cache: _Optional[_Union[KvCacheHandle, _Mapping]] = ..., imported_tokens: _Optional[int] = ..., replayed: _Optional[bool] = ..., timing: _Optional[_Union[CallTiming, _Mapping]] = ...) -> None: ...

class CacheInfo(_message.Message):
    __slots__ = ("cache_id", "sequence_length", "lora_adapter", "idle_seconds", "num_blocks")
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    cache_id: str
    sequence_length: int
    lora_adapter: str
    idle_seconds: float
    num_blocks: int
    def __init__(self, cache_id: _Optional[str] = ..., sequence_length: _Optional[int] = ..., lora_adapter: _Optional[str] = ..., idle_seconds: _Optional[float] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class ListCachesRequest(_message.Message):
    __slots__ = ("cache_ids",)
    CACHE_IDS_FIELD_NUMBER: _ClassVar[int]
    cache_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, cache_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ListCachesResponse(_message.Message):
    __slots__ = ("caches", "timing")
    CACHES_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    caches: _containers.RepeatedCompositeFieldContainer[CacheInfo]
    timing: CallTiming
    def __init__(self, caches: _Optional[_Iterable[_Union[CacheInfo, _Mapping]]] = ..., timing: _Optional[_Union[CallTiming, _Mapping]] = ...) -> None: ...
