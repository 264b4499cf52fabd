"""Domain types of the executor interface (ferrum's PrefillInput, DecodeOutput, ...).

Plain dataclasses with NumPy payloads, so neither the service nor tests need torch to
read them. Token ids are Python ints; tensors crossing the boundary are HostTensors.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from executors.errors import InvalidParameter


class DType(enum.Enum):
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    INT32 = "int32"
    INT64 = "int64"
    UINT32 = "uint32"
    INT8 = "int8"
    UINT8 = "uint8"
    BOOL = "bool"


FLOAT_OUTPUT_DTYPES = (DType.FLOAT32, DType.BFLOAT16, DType.FLOAT16)


@dataclass(frozen=True, slots=True)
class HostTensor:
    """A tensor in host memory. BFLOAT16 data is held as its raw uint16 bits."""

    dtype: DType
    array: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)


@dataclass(frozen=True, slots=True)
class KvCacheHandle:
    """Identifies a sequence's cache and its state after a call (ferrum KvCacheHandle).

    On input only cache_id and sequence_length are read; the rest describes the cache.
    """

    cache_id: str
    sequence_length: int
    block_ids: tuple[int, ...] = ()
    block_size: int = 0
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    device: str = "cpu"


class LogitsKind(enum.Enum):
    FULL = "full"
    ARGMAX = "argmax"
    TOP_K = "top_k"
    SAMPLE = "sample"


MAX_TOP_K = 1024


@dataclass(frozen=True, slots=True)
class LogitsPolicy:
    """What an item returns for its next token; FULL float32 unless asked otherwise."""

    kind: LogitsKind = LogitsKind.FULL
    full_dtype: DType = DType.FLOAT32
    k: int = 0  # TOP_K
    temperature: float = 1.0  # SAMPLE; 0 means greedy
    top_k: int = 0  # SAMPLE; 0 keeps all
    top_p: float = 1.0  # SAMPLE
    seed: int | None = None  # SAMPLE

    def validate(self, vocab_size: int, where: str) -> None:
        """Raise InvalidParameter naming `where` unless the policy fits a vocabulary."""
        if self.kind is LogitsKind.FULL and self.full_dtype not in FLOAT_OUTPUT_DTYPES:
            raise InvalidParameter(
                f"{where}.full.dtype must be FLOAT32, BFLOAT16 or FLOAT16, got {self.full_dtype.name}",
                field=f"{where}.full.dtype",
            )
        if self.kind is LogitsKind.TOP_K and not 1 <= self.k <= min(vocab_size, MAX_TOP_K):
            raise InvalidParameter(
                f"{where}.top_k.k must be in [1, {min(vocab_size, MAX_TOP_K)}], got {self.k}",
                field=f"{where}.top_k.k",
            )
        if self.kind is LogitsKind.SAMPLE:
            if not (math.isfinite(self.temperature) and self.temperature >= 0):
                raise InvalidParameter(
                    f"{where}.sample.temperature must be finite and >= 0, got {self.temperature}",
                    field=f"{where}.sample.temperature",
                )
            if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
                raise InvalidParameter(
                    f"{where}.sample.top_p must be in (0, 1], got {self.top_p}",
                    field=f"{where}.sample.top_p",
                )
            if self.top_k < 0:
                raise InvalidParameter(f"{where}.sample.top_k must be >= 0", field=f"{where}.sample.top_k")


@dataclass(frozen=True, slots=True)
class LogitsResult:
    """The next-token output for one position, in the form its policy asked for."""

    kind: LogitsKind
    logits: HostTensor | None = None  # FULL: [vocab]
    token_id: int | None = None  # ARGMAX, SAMPLE
    logprob: float | None = None  # ARGMAX, SAMPLE: under the model's softmax
    sampling_logprob: float | None = None  # SAMPLE: under the sampled distribution
    top_token_ids: tuple[int, ...] = ()  # TOP_K
    top_logprobs: tuple[float, ...] = ()  # TOP_K


Metadata = dict[str, Any]


@dataclass(slots=True)
class PrefillInput:
    """One sequence's prompt, or the next chunk of it (ferrum PrefillInput)."""

    input_ids: Sequence[int]
    kv_cache: KvCacheHandle | None = None
    position_ids: Sequence[int] | None = None
    attention_mask: Sequence[int] | None = None
    metadata: Metadata = field(default_factory=dict)
    logits_policy: LogitsPolicy = LogitsPolicy()


@dataclass(frozen=True, slots=True)
class PrefillOutput:
    logits: LogitsResult
    kv_cache: KvCacheHandle


@dataclass(slots=True)
class DecodeInput:
    """One decode step (ferrum DecodeInput)."""

    token_id: int
    kv_cache: KvCacheHandle
    position_id: int | None = None
    metadata: Metadata = field(default_factory=dict)
    logits_policy: LogitsPolicy = LogitsPolicy()


@dataclass(frozen=True, slots=True)
class DecodeOutput:
    logits: LogitsResult
    kv_cache: KvCacheHandle


@dataclass(slots=True)
class UnifiedBatchItem:
    """A prefill chunk or decode step inside a unified batch (ferrum UnifiedBatchItem)."""

    seq_id: str
    q_tokens: Sequence[int]
    pos_offset: int
    is_final_chunk: bool
    metadata: Metadata = field(default_factory=dict)
    logits_policy: LogitsPolicy = LogitsPolicy()
    # Instead of q_tokens: the token the cache's latest step sampled (the proto's comment says when).
    feed_sampled_token: bool = False

    @property
    def token_count(self) -> int:
        return 1 if self.feed_sampled_token else len(self.q_tokens)


@dataclass(frozen=True, slots=True)
class UnifiedItemResult:
    seq_id: str
    logits: LogitsResult | None  # only for final items
    kv_cache: KvCacheHandle


class ForwardKind(enum.Enum):
    LOGITS = "logits"
    HIDDEN_STATES = "hidden_states"
    TOKEN_LOGPROBS = "token_logprobs"


@dataclass(frozen=True, slots=True)
class VerifyOutput:
    outputs: list[LogitsResult]  # one per token
    kv_cache: KvCacheHandle


@dataclass(frozen=True, slots=True)
class TruncateResult:
    kv_cache: KvCacheHandle
    freed_blocks: int


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    released: bool
    freed_blocks: int


# -- info, capabilities, status ------------------------------------------------------------


class ModelType(enum.Enum):
    LLAMA = "llama"
    MISTRAL = "mistral"
    QWEN = "qwen"
    PHI = "phi"
    GEMMA = "gemma"
    CODE = "code"
    EMBEDDING = "embedding"
    CLIP = "clip"
    CUSTOM = "custom"


@dataclass(frozen=True, slots=True)
class RankInfo:
    """One tensor-parallel rank: the process that holds one shard of the model."""

    rank: int  # 0 .. tensor_parallel_size - 1
    device: str  # the device its shard lives on: "cuda:0", "cpu"
    host: str  # hostname of its process
    pid: int  # process id of its process


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    """How the model is split over processes. The default is one process, unsplit."""

    tensor_parallel_size: int = 1
    backend: str = ""  # torch.distributed backend: "gloo", "nccl"; "" for one process
    launcher: str = ""  # "spawn" (the service started its ranks), "torchrun"; "" for one process
    ranks: tuple[RankInfo, ...] = ()  # one per rank, in rank order; () for one process


@dataclass(frozen=True, slots=True)
class ModelInfo:
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
    dtype: DType
    device: str
    version: str | None = None
    license: str | None = None
    metadata: Metadata = field(default_factory=dict)
    parallel: ParallelLayout | None = None  # None: one process (reported as tensor_parallel_size 1)


class AttentionType(enum.Enum):
    MULTI_HEAD = "multi_head"
    MULTI_QUERY = "multi_query"
    GROUPED_QUERY = "grouped_query"
    FLASH = "flash"
    PAGED = "paged"
    SLIDING_WINDOW = "sliding_window"


@dataclass(frozen=True, slots=True)
class MemoryRequirements:
    parameter_memory: int
    activation_memory_per_token: int
    kv_cache_memory_per_token: int
    overhead_memory: int


@dataclass(frozen=True, slots=True)
class ExecutorCapabilities:
    max_batch_size: int
    max_sequence_length: int
    attention_mechanisms: tuple[AttentionType, ...]
    supports_dynamic_batching: bool
    supports_continuous_batching: bool
    supports_speculative_decoding: bool
    supports_tensor_parallelism: bool
    supports_pipeline_parallelism: bool
    supported_dtypes: tuple[DType, ...]
    supported_devices: tuple[str, ...]  # device types: "cpu", "cuda"
    memory_requirements: MemoryRequirements
    kv_capacity: int | None
    supports_native_unified_decode: bool
    kv_block_size: int
    kv_total_blocks: int
    supports_prefix_caching: bool = False
    max_lora_adapters: int = 0  # 0: no LoRA support
    max_lora_rank: int = 0
    supports_kv_transfer: bool = False  # ExportKv, ImportKv, ListCaches
    tensor_parallel_size: int = 1  # ranks the model is split over; 1: one process


class ExecutorState(enum.Enum):
    INITIALIZING = "initializing"
    READY = "ready"
    BUSY = "busy"
    ERROR = "error"
    SHUTDOWN = "shutdown"


@dataclass(frozen=True, slots=True)
class MemoryUsage:
    allocated_bytes: int
    used_bytes: int
    peak_bytes: int
    utilization_percent: float


@dataclass(frozen=True, slots=True)
class KvPoolStatus:
    total_blocks: int
    used_blocks: int
    free_blocks: int
    block_size: int
    active_caches: int
    block_allocations: int
    allocation_failures: int
    leases_expired: int = 0
    cached_blocks: int = 0
    window_freed_blocks: int = 0  # returned to the pool as sliding windows moved past them, since start


@dataclass(frozen=True, slots=True)
class ExpertLoad:
    """Rows a mixture-of-experts model's routers sent to each expert since start."""

    num_experts: int
    experts_per_token: int
    sparse_layers: tuple[int, ...]
    layer_tokens_per_expert: tuple[tuple[int, ...], ...]  # [sparse layer][expert]

    @property
    def tokens_per_expert(self) -> tuple[int, ...]:
        return tuple(sum(col) for col in zip(*self.layer_tokens_per_expert))


@dataclass(frozen=True, slots=True)
class RankMemory:
    """One tensor-parallel rank's memory, in bytes."""

    rank: int
    parameter_bytes: int  # this rank's shard of the weights (+ packed copies)
    kv_pool_bytes: int  # this rank's KV pool (its KV heads only)
    lora_bytes: int  # this rank's shards of loaded LoRA adapters
    device_allocated_bytes: int  # CUDA allocator's bytes in use; 0 on CPU
    device_peak_bytes: int  # CUDA allocator's peak; 0 on CPU


@dataclass(frozen=True, slots=True)
class ExecutorStatus:
    state: ExecutorState
    is_ready: bool
    current_batch_size: int
    prefill_operations: int
    decode_operations: int
    avg_prefill_time_ms: float
    avg_decode_time_ms: float
    memory_usage: MemoryUsage
    last_operation_unix_s: float | None
    kv_pool: KvPoolStatus
    expert_load: ExpertLoad | None = None  # mixtures of experts only
    ranks: tuple[RankMemory, ...] = ()  # one per tensor-parallel rank, in rank order; () for one process


@dataclass(frozen=True, slots=True)
class DecodeBatchMetrics:
    calls: int
    total_items: int
    avg_items_per_call: float
    max_items: int
    last_items: int
    force_full_logits_calls: int
    singleton_fast_path_calls: int
    unsupported_fallback_calls: int
    lora_fallback_calls: int
    bucket_calls: dict[str, int]  # keys m1, m2, m3_4, m5_8, m9_16, m17_32, m_gt_32


@dataclass(frozen=True, slots=True)
class ExecutorLockMetrics:
    samples: int
    total_wait_time_us: int
    avg_wait_time_ms: float


@dataclass(frozen=True, slots=True)
class CacheMetrics:
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
    kv_dtype: DType
    decode_batch: DecodeBatchMetrics
    executor_lock: ExecutorLockMetrics


@dataclass(frozen=True, slots=True)
class LoraMetrics:
    enabled: bool
    adapter_count: int
    active_cache_bindings: int
    projection_applications: int
    position: str
    source: str


@dataclass(frozen=True, slots=True)
class LoraSource:
    """Where LoadLoraAdapter finds a PEFT adapter: a directory under the server's adapter
    directory, or the two files' contents sent inline. Exactly one is set."""

    path: str | None = None
    config_json: bytes | None = None
    safetensors: bytes | None = None


@dataclass(frozen=True, slots=True)
class LoraAdapterInfo:
    name: str
    rank: int
    alpha: float
    scaling: float
    target_modules: tuple[str, ...]
    source: str  # the directory, or "inline"
    num_parameters: int
    bytes: int
    bound_caches: int
    loaded_at_unix_s: float
