"""The paged KV cache: a block pool, per-sequence block tables, ref counts, prefix reuse.

Bookkeeping (block_allocator, block_table, manager) is plain Python and knows nothing of
tensors; kv_pool holds the K and V tensors those block ids index.
"""

from kvcache.block_allocator import BlockAllocator
from kvcache.block_table import BlockTable
from kvcache.errors import (
    CacheAlreadyExists,
    CacheNotFound,
    DuplicateCache,
    InvalidCacheId,
    InvalidLength,
    KvCacheError,
    KvCacheExhausted,
)
from kvcache.manager import KvCacheManager, KvPoolStats
from kvcache.prefix_cache import PrefixCacheStats

__all__ = [
    "BlockAllocator",
    "BlockTable",
    "CacheAlreadyExists",
    "CacheNotFound",
    "DuplicateCache",
    "InvalidCacheId",
    "InvalidLength",
    "KvCacheError",
    "KvCacheExhausted",
    "KvCacheManager",
    "KvPoolStats",
    "PrefixCacheStats",
]
