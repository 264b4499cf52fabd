"""What an executor says of itself (ferrum's ModelInfo, ExecutorCapabilities, ExecutorStatus,
the metrics): GetInfo, GetCapabilities, GetStatus and the metrics RPCs in domain form.

Plain dataclasses and enums like executors/types.py (the step's data), which this module
uses only for DType and Metadata.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from executors.types import DType, Metadata


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
