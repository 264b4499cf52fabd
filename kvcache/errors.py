"""Errors raised by the KV cache bookkeeping. The service maps each to a gRPC status."""

from __future__ import annotations


class KvCacheError(Exception):
    """Base of every KV cache error."""


class KvCacheExhausted(KvCacheError):
    """Not enough free blocks; nothing was allocated and no cache changed."""

    def __init__(self, blocks_needed: int, blocks_free: int, total_blocks: int) -> None:
        self.blocks_needed = blocks_needed
        self.blocks_free = blocks_free
        self.total_blocks = total_blocks
        super().__init__(
            f"KV cache exhausted: {blocks_needed} blocks needed, {blocks_free} of "
            f"{total_blocks} free; release finished caches or retry later"
        )


class CacheNotFound(KvCacheError):
    """No live cache has this id. `released` tells a recently released id from an unknown one."""

    def __init__(self, cache_id: str, released: bool) -> None:
        self.cache_id = cache_id
        self.released = released
        why = "was released" if released else "does not exist"
        super().__init__(f"KV cache {cache_id!r} {why}")


class CacheAlreadyExists(KvCacheError):
    """A caller-chosen cache id is already in use."""

    def __init__(self, cache_id: str) -> None:
        self.cache_id = cache_id
        super().__init__(f"KV cache {cache_id!r} already exists")


class InvalidCacheId(KvCacheError):
    """A caller-chosen cache id is malformed."""

    def __init__(self, cache_id: str, reason: str) -> None:
        self.cache_id = cache_id
        super().__init__(f"cache id {cache_id[:64]!r} is invalid: {reason}")


class DuplicateCache(KvCacheError):
    """One batch names the same cache twice; its growth would be ambiguous."""

    def __init__(self, cache_id: str) -> None:
        self.cache_id = cache_id
        super().__init__(f"KV cache {cache_id!r} appears twice in one batch")


class InvalidLength(KvCacheError):
    """A length the cache cannot take: truncating past its end, or "extending" backwards."""

    def __init__(self, cache_id: str, requested: int, current: int, action: str = "truncate") -> None:
        self.cache_id = cache_id
        self.requested = requested
        self.current = current
        super().__init__(f"cannot {action} KV cache {cache_id!r} to {requested} tokens: it holds {current}")


class LeftWindow(InvalidLength):
    """A truncation that would need positions whose blocks left every layer's sliding window
    and went back to the pool."""

    def __init__(self, cache_id: str, requested: int, current: int, kept_from: int) -> None:
        super().__init__(cache_id, requested, current)
        self.kept_from = kept_from
        message = (f"cannot truncate KV cache {cache_id!r} to {requested} tokens: it holds {current}, and the K "
                   f"and V of positions before {kept_from} left the sliding window and were freed (truncate by "
                   f"fewer tokens, or to 0)")
        self.args = (message,)
