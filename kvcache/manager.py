"""KvCacheManager: the per-sequence block tables on top of one BlockAllocator."""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvcache.block_allocator import BlockAllocator
from kvcache.block_table import BlockTable
from kvcache.errors import (
    CacheAlreadyExists,
    CacheNotFound,
    DuplicateCache,
    InvalidCacheId,
    InvalidLength,
    KvCacheExhausted,
)

CACHE_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")
RELEASED_IDS_REMEMBERED = 4096


@dataclass(frozen=True, slots=True)
class KvPoolStats:
    total_blocks: int
    used_blocks: int
    free_blocks: int
    block_size: int
    active_caches: int
    block_allocations: int
    allocation_failures: int


class KvCacheManager:
    """Owns every sequence's BlockTable; all block movement goes through here.

    Growth is all-or-nothing across a whole batch (`extend_many`), so a batch that does not
    fit changes no cache. Ids of released caches are remembered (a bounded number) so a
    repeated release can succeed idempotently and a late decode can say "was released".
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self._tables: dict[str, BlockTable] = {}
        self._released: OrderedDict[str, None] = OrderedDict()
        self._next_id = 0

    # -- lookup ---------------------------------------------------------------------------
    def __contains__(self, cache_id: str) -> bool:
        return cache_id in self._tables

    def __len__(self) -> int:
        return len(self._tables)

    def cache_ids(self) -> list[str]:
        return list(self._tables)

    def get(self, cache_id: str) -> BlockTable:
        try:
            return self._tables[cache_id]
        except KeyError:
            raise CacheNotFound(cache_id, released=cache_id in self._released) from None

    # -- lifecycle ------------------------------------------------------------------------
    def create(self, cache_id: str | None = None) -> tuple[str, BlockTable]:
        """Register an empty cache under cache_id, or under a fresh id when None."""
        if cache_id is None:
            cache_id = self._fresh_id()
        elif not CACHE_ID_PATTERN.fullmatch(cache_id):
            raise InvalidCacheId(cache_id, "use 1 to 128 characters from [A-Za-z0-9._:-]")
        elif cache_id in self._tables:
            raise CacheAlreadyExists(cache_id)
        table = BlockTable(self.block_size)
        self._tables[cache_id] = table
        self._released.pop(cache_id, None)
        return cache_id, table

    def extend_many(self, targets: Sequence[tuple[str, int]]) -> None:
        """Grow each named cache to hold its target length and set its length to it.

        All or nothing: if the blocks needed by all targets together are not free, raise
        KvCacheExhausted and change nothing. Each cache may appear once.
        """
        seen: set[str] = set()
        for cid, _ in targets:
            if cid in seen:
                raise DuplicateCache(cid)
            seen.add(cid)
        tables = [(self.get(cid), length) for cid, length in targets]
        for (cid, length), (table, _) in zip(targets, tables):
            if length < table.num_tokens:
                raise InvalidLength(cid, length, table.num_tokens, action="extend")
        needed = sum(t.blocks_missing(length) for t, length in tables)
        if needed > self.allocator.num_free:
            self.allocator.allocation_failures += 1
            raise KvCacheExhausted(needed, self.allocator.num_free, self.allocator.num_total)
        for table, length in tables:
            table.block_ids.extend(self.allocator.allocate(table.blocks_missing(length)))
            table.num_tokens = length

    def extend(self, cache_id: str, length: int) -> None:
        self.extend_many([(cache_id, length)])

    def truncate(self, cache_id: str, length: int) -> int:
        """Shorten a cache to `length` tokens; returns the number of blocks freed."""
        table = self.get(cache_id)
        if length < 0 or length > table.num_tokens:
            raise InvalidLength(cache_id, length, table.num_tokens)
        keep = table.blocks_for(length)
        freed = self._drop_blocks(table.block_ids[keep:])
        del table.block_ids[keep:]
        table.num_tokens = length
        return freed

    def release(self, cache_id: str) -> int | None:
        """Free a cache; returns blocks freed, or None if it was already released.

        An id that was never known raises CacheNotFound, so a typo is not silently accepted.
        """
        table = self._tables.pop(cache_id, None)
        if table is None:
            if cache_id in self._released:
                return None
            raise CacheNotFound(cache_id, released=False)
        self._remember_released(cache_id)
        return self._drop_blocks(table.block_ids)

    def release_all(self) -> int:
        """Free every cache; returns how many there were."""
        ids = list(self._tables)
        for cid in ids:
            self.release(cid)
        return len(ids)

    # -- accounting -----------------------------------------------------------------------
    def stats(self) -> KvPoolStats:
        a = self.allocator
        return KvPoolStats(
            total_blocks=a.num_total,
            used_blocks=a.num_used,
            free_blocks=a.num_free,
            block_size=self.block_size,
            active_caches=len(self._tables),
            block_allocations=a.block_allocations,
            allocation_failures=a.allocation_failures,
        )

    def check_invariants(self) -> None:
        """Every block is free or held, and held exactly as often as tables reference it."""
        self.allocator.check_invariants()
        refs: dict[int, int] = {}
        for cid, table in self._tables.items():
            assert len(table.block_ids) == table.blocks_for(table.num_tokens), (
                f"{cid}: {len(table.block_ids)} blocks for {table.num_tokens} tokens"
            )
            for b in table.block_ids:
                refs[b] = refs.get(b, 0) + 1
        for b in range(self.allocator.num_total):
            assert self.allocator.ref_count(b) == refs.get(b, 0), f"block {b} ref count"

    # -- internals ------------------------------------------------------------------------
    def _drop_blocks(self, block_ids: Iterable[int]) -> int:
        # Tail blocks first, so the end of a sequence is reused before its prefix.
        return sum(self.allocator.decref(b) for b in reversed(list(block_ids)))

    def _fresh_id(self) -> str:
        while True:
            self._next_id += 1
            cid = f"kv-{self._next_id}"
            if cid not in self._tables:
                return cid

    def _remember_released(self, cache_id: str) -> None:
        self._released[cache_id] = None
        if len(self._released) > RELEASED_IDS_REMEMBERED:
            self._released.popitem(last=False)
