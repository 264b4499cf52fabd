"""What a KvCacheExecutor reports about itself: GetStatus and the cache metrics.

Read, never written: the executor's stats (stats.py), its block manager and KV pool, its
CacheRegistry (leases expired) and its worker (time calls waited for it). Both are called
from the event loop while the worker runs; every figure is a plain read, so a step in
flight may show half-counted, which is harmless here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from executors.descriptions import (
    CacheMetrics,
    ExecutorLockMetrics,
    ExecutorState,
    ExecutorStatus,
    KvPoolStatus,
    MemoryUsage,
)
from executors.types import DType

if TYPE_CHECKING:
    from executors.kv_executor import KvCacheExecutor


def used_bytes(ex: KvCacheExecutor) -> int:
    """The weights and the KV blocks in use."""
    return ex.parameter_bytes + ex.kv.stats().used_blocks * ex.pool.bytes_per_block


def executor_status(ex: KvCacheExecutor) -> ExecutorStatus:
    s, kv = ex.stats, ex.kv.stats()
    allocated = ex.parameter_bytes + ex.pool.total_bytes
    used = used_bytes(ex)
    return ExecutorStatus(
        state=s.state,
        is_ready=s.state in (ExecutorState.READY, ExecutorState.BUSY),
        current_batch_size=s.current_batch_size,
        prefill_operations=s.prefill_operations,
        decode_operations=s.decode_operations,
        avg_prefill_time_ms=s.avg_prefill_time_ms,
        avg_decode_time_ms=s.avg_decode_time_ms,
        memory_usage=MemoryUsage(
            allocated_bytes=allocated,
            used_bytes=used,
            peak_bytes=max(ex.peak_used_bytes, used),
            utilization_percent=100.0 * used / allocated if allocated else 0.0,
        ),
        last_operation_unix_s=s.last_operation_unix_s,
        kv_pool=KvPoolStatus(
            total_blocks=kv.total_blocks,
            used_blocks=kv.used_blocks,
            free_blocks=kv.free_blocks,
            block_size=kv.block_size,
            active_caches=kv.active_caches,
            block_allocations=kv.block_allocations,
            allocation_failures=kv.allocation_failures,
            leases_expired=ex.caches.leases_expired,
            cached_blocks=kv.cached_blocks,
            window_freed_blocks=kv.window_freed_blocks,
        ),
    )


def cache_metrics(ex: KvCacheExecutor) -> CacheMetrics:
    w, prefix = ex.worker, ex.kv.prefix_stats()
    return CacheMetrics(
        position="real-kv-reuse",
        source="paged-block-prefix-cache",
        enabled=prefix.enabled,
        hits=prefix.hits,
        misses=prefix.misses,
        evictions=prefix.evictions,
        saved_prefill_tokens=prefix.saved_tokens,
        entries=prefix.entries,
        bytes=prefix.entries * ex.pool.bytes_per_block,
        block_size=ex.kv.block_size,
        kv_dtype=DType(str(ex.pool.dtype).removeprefix("torch.")),
        decode_batch=ex.stats.decode_batch_metrics(),
        executor_lock=ExecutorLockMetrics(
            samples=w.wait_samples,
            total_wait_time_us=w.total_wait_ns // 1000,
            avg_wait_time_ms=w.total_wait_ns / w.wait_samples / 1e6 if w.wait_samples else 0.0,
        ),
    )
