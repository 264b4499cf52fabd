"""Descriptions of the executor as modelexec.v1 messages: model info, capabilities, status,
cache and LoRA metrics, the tensor-parallel layout (GetInfo, GetCapabilities, GetStatus, the
metrics and LoRA calls). The step path's conversions are in service/convert.py.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from executors import descriptions as desc
from generated.modelexec.v1 import executor_pb2 as pb
from service.convert import ATTENTION_TO_PB, DEVICE_TYPE_TO_PB, DTYPE_TO_PB, MODEL_TYPE_TO_PB, STATE_TO_PB
from service.convert_results import device


def _value_map(target: Any, values: dict[str, Any]) -> None:
    for key, value in values.items():
        json_format.ParseDict(value, target[key])


def parallel_layout(layout: desc.ParallelLayout | None) -> pb.ParallelLayout:
    """None (a single process) as tensor_parallel_size 1 with no ranks, so that a client
    always reads the size from ModelInfo.parallel."""
    if layout is None:
        layout = desc.ParallelLayout()
    return pb.ParallelLayout(
        tensor_parallel_size=layout.tensor_parallel_size,
        backend=layout.backend,
        launcher=layout.launcher,
        ranks=[pb.RankInfo(rank=r.rank, device=device(r.device), host=r.host, pid=r.pid) for r in layout.ranks],
    )


def rank_memory(m: desc.RankMemory) -> pb.RankMemory:
    return pb.RankMemory(
        rank=m.rank,
        parameter_bytes=m.parameter_bytes,
        kv_pool_bytes=m.kv_pool_bytes,
        lora_bytes=m.lora_bytes,
        device_allocated_bytes=m.device_allocated_bytes,
        device_peak_bytes=m.device_peak_bytes,
    )


def model_info(i: desc.ModelInfo) -> pb.ModelInfo:
    out = pb.ModelInfo(
        model_id=i.model_id,
        model_type=MODEL_TYPE_TO_PB[i.model_type],
        model_type_name=i.model_type_name,
        num_parameters=i.num_parameters,
        hidden_size=i.hidden_size,
        num_layers=i.num_layers,
        num_heads=i.num_heads,
        num_kv_heads=i.num_kv_heads,
        head_dim=i.head_dim,
        vocab_size=i.vocab_size,
        max_sequence_length=i.max_sequence_length,
        dtype=DTYPE_TO_PB[i.dtype],
        device=device(i.device),
        parallel=parallel_layout(i.parallel),
    )
    if i.version is not None:
        out.version = i.version
    if i.license is not None:
        out.license = i.license
    _value_map(out.metadata, i.metadata)
    return out


def capabilities(c: desc.ExecutorCapabilities, limits: pb.ServiceLimits) -> pb.ExecutorCapabilities:
    m = c.memory_requirements
    out = pb.ExecutorCapabilities(
        max_batch_size=c.max_batch_size,
        max_sequence_length=c.max_sequence_length,
        attention_mechanisms=[ATTENTION_TO_PB[a] for a in c.attention_mechanisms],
        supports_dynamic_batching=c.supports_dynamic_batching,
        supports_continuous_batching=c.supports_continuous_batching,
        supports_speculative_decoding=c.supports_speculative_decoding,
        supports_tensor_parallelism=c.supports_tensor_parallelism,
        supports_pipeline_parallelism=c.supports_pipeline_parallelism,
        supported_dtypes=[DTYPE_TO_PB[d] for d in c.supported_dtypes],
        supported_devices=[DEVICE_TYPE_TO_PB[d] for d in c.supported_devices],
        memory_requirements=pb.MemoryRequirements(
            parameter_memory=m.parameter_memory,
            activation_memory_per_token=m.activation_memory_per_token,
            kv_cache_memory_per_token=m.kv_cache_memory_per_token,
            overhead_memory=m.overhead_memory,
        ),
        supports_native_unified_decode=c.supports_native_unified_decode,
        kv_block_size=c.kv_block_size,
        kv_total_blocks=c.kv_total_blocks,
        limits=limits,
        supports_prefix_caching=c.supports_prefix_caching,
        supports_kv_transfer=c.supports_kv_transfer,
        max_lora_adapters=c.max_lora_adapters,
        max_lora_rank=c.max_lora_rank,
        tensor_parallel_size=c.tensor_parallel_size,
    )
    if c.kv_capacity is not None:
        out.kv_capacity = c.kv_capacity
    return out


def status(s: desc.ExecutorStatus) -> pb.ExecutorStatus:
    mu, kv = s.memory_usage, s.kv_pool
    out = pb.ExecutorStatus(
        state=STATE_TO_PB[s.state],
        is_ready=s.is_ready,
        current_batch_size=s.current_batch_size,
        prefill_operations=s.prefill_operations,
        decode_operations=s.decode_operations,
        avg_prefill_time_ms=s.avg_prefill_time_ms,
        avg_decode_time_ms=s.avg_decode_time_ms,
        memory_usage=pb.MemoryUsage(
            allocated_bytes=mu.allocated_bytes,
            used_bytes=mu.used_bytes,
            peak_bytes=mu.peak_bytes,
            utilization_percent=mu.utilization_percent,
        ),
        kv_pool=pb.KvPoolStatus(
            total_blocks=kv.total_blocks,
            used_blocks=kv.used_blocks,
            free_blocks=kv.free_blocks,
            block_size=kv.block_size,
            active_caches=kv.active_caches,
            block_allocations=kv.block_allocations,
            allocation_failures=kv.allocation_failures,
            leases_expired=kv.leases_expired,
            cached_blocks=kv.cached_blocks,
            window_freed_blocks=kv.window_freed_blocks,
        ),
        ranks=[rank_memory(m) for m in s.ranks],
    )
    if s.expert_load is not None:
        e = s.expert_load
        out.expert_load.CopyFrom(pb.ExpertLoad(
            num_experts=e.num_experts, experts_per_token=e.experts_per_token, sparse_layers=e.sparse_layers,
            tokens_per_expert=e.tokens_per_expert,
            layer_tokens_per_expert=[n for row in e.layer_tokens_per_expert for n in row]))
    if s.last_operation_unix_s is not None:
        out.last_operation.FromNanoseconds(int(s.last_operation_unix_s * 1e9))
    return out


def cache_metrics(m: desc.CacheMetrics) -> pb.CacheMetrics:
    d, lock = m.decode_batch, m.executor_lock
    return pb.CacheMetrics(
        position=m.position,
        source=m.source,
        enabled=m.enabled,
        hits=m.hits,
        misses=m.misses,
        evictions=m.evictions,
        saved_prefill_tokens=m.saved_prefill_tokens,
        entries=m.entries,
        bytes=m.bytes,
        block_size=m.block_size,
        kv_dtype=DTYPE_TO_PB[m.kv_dtype],
        decode_batch=pb.DecodeBatchMetrics(
            schema_version=1,
            calls=d.calls,
            total_items=d.total_items,
            avg_items_per_call=d.avg_items_per_call,
            max_items=d.max_items,
            last_items=d.last_items,
            force_full_logits_calls=d.force_full_logits_calls,
            singleton_fast_path_calls=d.singleton_fast_path_calls,
            unsupported_fallback_calls=d.unsupported_fallback_calls,
            lora_fallback_calls=d.lora_fallback_calls,
            bucket_calls=pb.DecodeBatchBuckets(**d.bucket_calls),
        ),
        executor_lock=pb.ExecutorLockMetrics(
            schema_version=1,
            samples=lock.samples,
            total_wait_time_us=lock.total_wait_time_us,
            avg_wait_time_ms=lock.avg_wait_time_ms,
        ),
    )


def lora_adapter_info(i: desc.LoraAdapterInfo) -> pb.LoraAdapterInfo:
    out = pb.LoraAdapterInfo(
        name=i.name,
        rank=i.rank,
        alpha=i.alpha,
        scaling=i.scaling,
        target_modules=i.target_modules,
        source=i.source,
        num_parameters=i.num_parameters,
        bytes=i.bytes,
        bound_caches=i.bound_caches,
    )
    out.loaded_at.FromNanoseconds(int(i.loaded_at_unix_s * 1e9))
    return out


def lora_metrics(m: desc.LoraMetrics) -> pb.LoraMetrics:
    return pb.LoraMetrics(
        enabled=m.enabled,
        adapter_count=m.adapter_count,
        active_cache_bindings=m.active_cache_bindings,
        projection_applications=m.projection_applications,
        position=m.position,
        source=m.source,
    )
