"""The worker's operations that shorten or end a KvCacheExecutor's caches outside a step.

TruncateKv, ReleaseCache, the lease reaper, shutdown's release of everything, and the
undoing of caches a call created for a caller that went away. Each keeps the two records
of a cache in step: its block table (the KvCacheManager) and its state (the CacheRegistry:
owner, lease, last step, claims). All of them run on the executor's worker thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from executors.errors import FailedPrecondition
from executors.step_items import StepResult
from executors.types import ReleaseResult, TruncateResult

if TYPE_CHECKING:
    from executors.kv_executor import KvCacheExecutor


def truncate_now(ex: KvCacheExecutor, cache_id: str, new_length: int, identity: str | None) -> TruncateResult:
    ex.kv.get(cache_id)  # NOT_FOUND before an ownership check
    ex.caches.touch(cache_id, identity, "cache_id")
    before = ex.kv.get(cache_id).num_tokens
    freed = ex.kv.truncate(cache_id, new_length)
    if new_length < before:
        ex.caches.forget_step(cache_id)  # the last step is undone: nothing to replay
    ex.caches.claim(cache_id)
    return TruncateResult(kv_cache=ex._handle(cache_id), freed_blocks=freed)


def release_now(ex: KvCacheExecutor, cache_id: str, identity: str | None,
                expected_length: int | None) -> ReleaseResult:
    if cache_id in ex.kv:
        ex.caches.touch(cache_id, identity, "cache_id")
        length = ex.kv.get(cache_id).num_tokens
        if expected_length is not None and expected_length != length:
            raise FailedPrecondition(
                f"cache {cache_id!r} holds {length} tokens, not the expected_length {expected_length}: it was not "
                "released", field="expected_length", reason="STALE_CACHE_HANDLE", cache_id=cache_id,
                cache_length=length)
    freed = ex.kv.release(cache_id)
    ex.caches.remove(cache_id)
    return ReleaseResult(released=freed is not None, freed_blocks=freed or 0)


def undo_created(ex: KvCacheExecutor, results: list[StepResult]) -> None:
    """The caller went away before it learned of these caches: release them, unless a
    later call has completed on one since (a retry that got it by replay owns it now),
    whichever order the worker ran the two in."""
    for r in results:
        if r.created and r.cache_id in ex.kv and ex.caches.unclaimed(r.cache_id, r.serial):
            ex.kv.release(r.cache_id)
            ex.caches.remove(r.cache_id)


def reap_now(ex: KvCacheExecutor, ttl_s: float) -> list[str]:
    expired = ex.caches.idle(ttl_s)
    for cache_id in expired:
        ex.kv.release(cache_id)
        ex.caches.remove(cache_id)
    ex.caches.leases_expired += len(expired)
    return expired


def release_all_now(ex: KvCacheExecutor) -> int:
    ex.caches.clear()
    return ex.kv.release_all()
