"""KvCacheManager: the per-sequence block tables on top of one BlockAllocator."""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from kvcache.block_allocator import BlockAllocator
from kvcache.block_table import FREED, BlockTable
from kvcache.copy_on_write import Swap, plan_writes
from kvcache.errors import (
    CacheAlreadyExists,
    CacheNotFound,
    DuplicateCache,
    InvalidCacheId,
    InvalidLength,
    KvCacheExhausted,
    LeftWindow,
)
from kvcache.holds import Hold, HoldsMixin
from kvcache.prefix_cache import PrefixCacheMixin

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
    cached_blocks: int  # free blocks that still hold a reusable prefix
    window_freed_blocks: int = 0  # blocks returned to the pool because a sliding window left them


class KvCacheManager(HoldsMixin, PrefixCacheMixin):
    """Owns every sequence's BlockTable; all block movement goes through here.

    Growth is all-or-nothing across a whole batch (`extend_many`), so a batch that does not
    fit changes no cache. Ids of released caches are remembered (a bounded number) so a
    repeated release can succeed idempotently and a late decode can say "was released".

    Prefix reuse (on unless `prefix_caching=False`): once a step's K and V are written, the
    executor `commit`s its tokens, and every block they fill gets its chain hash
    (prefix_cache.py, prefix_hash.py). A prefill first calls `match_prefix`, which appends cached blocks
    holding its leading tokens to the table (shared, ref-counted) so that only the rest is
    computed. A write into a block that someone else also holds copies it first
    (`extend_many` returns the (source, destination) block pairs the pool must copy before
    the forward writes), so sharers never see each other's tokens.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.allocator = BlockAllocator(num_blocks)
        self.prefix_lookups = 0
        self.prefix_hits = 0
        self.prefix_saved_tokens = 0
        self._tables: dict[str, BlockTable] = {}
        self._released: OrderedDict[str, None] = OrderedDict()
        self._next_id = 0
        self.window: int | None = None  # enable_sliding
        self.window_reserve = 0
        self.window_freed_blocks = 0
        self._holds: dict[int, Hold] = {}
        self._next_hold = 0

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
    def create(self, cache_id: str | None = None, namespace: str = "",
               avoid: Collection[str] = ()) -> tuple[str, BlockTable]:
        """Register an empty cache under cache_id, or under a fresh id when None, never one in
        `avoid` (the ids callers name elsewhere in the same call).

        `namespace` separates caches whose K and V differ for equal tokens (the LoRA
        adapter): they never share blocks."""
        if cache_id is None:
            cache_id = self._fresh_id(avoid)
        elif not CACHE_ID_PATTERN.fullmatch(cache_id):
            raise InvalidCacheId(cache_id, "use 1 to 128 characters from [A-Za-z0-9._:-]")
        elif cache_id in self._tables:
            raise CacheAlreadyExists(cache_id)
        table = BlockTable(self.block_size, namespace=namespace)
        self._tables[cache_id] = table
        self._released.pop(cache_id, None)
        return cache_id, table

    def extend_many(self, targets: Sequence[tuple[str, int]],
                    swapped: list[Swap] | None = None) -> list[tuple[int, int]]:
        """Grow each named cache to hold its target length and set its length to it.

        All or nothing: if the blocks needed by all targets together are not free, raise
        KvCacheExhausted and change nothing. Each cache may appear once. Returns the
        (source, destination) blocks to copy before writing: a cache whose partly filled
        last block is shared gets a private copy of it (copy-on-write, copy_on_write.py).
        `swapped`, when given, receives each such swap, for `unswap` should the step fail.
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
        plan = plan_writes(self.allocator, self.block_size, tables)
        needed = sum(t.blocks_missing(length) for t, length in tables) + plan.count(True)
        if needed > self.allocator.num_free:
            self.allocator.allocation_failures += 1
            raise KvCacheExhausted(needed, self.allocator.num_free, self.allocator.num_total)
        copies: list[tuple[int, int]] = []
        for copy, (table, length) in zip(plan, tables):
            if copy:
                last = table.block_ids[-1]
                (private,) = self.allocator.allocate(1)
                copies.append((last, private))
                table.block_ids[-1] = private
                table.changed(len(table.block_ids) - 1)
                self.allocator.decref(last)
                if swapped is not None:
                    swapped.append((table, len(table.block_ids) - 1, last, private))
            elif copy is not None:
                # Written in place: its hash describes tokens about to be overwritten.
                self.allocator.drop_hash(table.block_ids[-1])
            table.block_ids.extend(self.allocator.allocate(table.blocks_missing(length)))
            table.num_tokens = length
        return copies

    def unswap(self, swapped: Sequence[Swap]) -> None:
        """Undo extend_many's copy-on-write swaps, for a step that failed (before or after
        its copies and forward ran): each table gets its shared block back, each private
        copy goes back to the pool. Call it before any truncate or release."""
        for table, index, shared, private in reversed(swapped):
            self.allocator.incref(shared)
            table.block_ids[index] = shared
            table.changed(index)
            self.allocator.decref(private)

    def extend(self, cache_id: str, length: int) -> list[tuple[int, int]]:
        return self.extend_many([(cache_id, length)])

    def truncate(self, cache_id: str, length: int) -> int:
        """Shorten a cache to `length` tokens; returns the number of blocks freed."""
        table = self.get(cache_id)
        if length < 0 or length > table.num_tokens:
            raise InvalidLength(cache_id, length, table.num_tokens)
        if length and table.freed_blocks and length - self.window + 1 < table.freed_blocks * self.block_size:
            raise LeftWindow(cache_id, length, table.num_tokens, table.freed_blocks * self.block_size)
        if length == 0:
            table.freed_blocks = 0
        keep = table.blocks_for(length)
        freed = self._drop_blocks(table.block_ids[keep:])
        del table.block_ids[keep:]
        table.changed(keep)
        del table.tokens[length:]
        # A cut block keeps its hash (its K and V are intact) until this cache writes into it.
        del table.block_hashes[length // self.block_size:]
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

    # -- sliding windows --------------------------------------------------------------------
    def enable_sliding(self, window: int, reserve: int) -> None:
        """Every layer reads keys at most `window` positions back: `slide` may return blocks
        behind that to the pool, keeping `reserve` positions more so that a truncation by up
        to `reserve` tokens (rejected speculative drafts) still finds its window's K and V."""
        self.window, self.window_reserve = window, reserve

    def slide(self, cache_id: str) -> int:
        """Return to the pool the cache's blocks wholly before its window (less the reserve);
        their table entries become FREED. A block others share (a cached prefix) stays theirs;
        a hashed block goes back as a cached one. Returns how many entries were dropped (the
        pool's count of blocks actually freed is window_freed_blocks). No-op without a window."""
        if self.window is None:
            return 0
        table = self.get(cache_id)
        upto = max(0, table.num_tokens - self.window + 1 - self.window_reserve) // self.block_size
        freed = 0
        if upto > table.freed_blocks:  # most steps move no block: their ids_tuple stays
            table.changed(table.freed_blocks)
        for i in range(table.freed_blocks, upto):
            freed += self.allocator.decref(table.block_ids[i])
            table.block_ids[i] = FREED
        self.window_freed_blocks += freed
        dropped = upto - table.freed_blocks if upto > table.freed_blocks else 0
        table.freed_blocks = max(table.freed_blocks, upto)
        return dropped

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
            cached_blocks=a.num_cached_free,
            window_freed_blocks=self.window_freed_blocks,
        )

    def check_invariants(self) -> None:
        """Every block is free or held, and held exactly as often as tables reference it."""
        self.allocator.check_invariants()
        refs: dict[int, int] = {}
        for cid, table in self._tables.items():
            assert len(table.block_ids) == table.blocks_for(table.num_tokens), (
                f"{cid}: {len(table.block_ids)} blocks for {table.num_tokens} tokens"
            )
            assert len(table.tokens) <= table.num_tokens, f"{cid}: more tokens than positions"
            assert len(table.block_hashes) <= len(table.tokens) // self.block_size, f"{cid}: hash of an unfilled block"
            assert all(b == FREED for b in table.block_ids[:table.freed_blocks]), f"{cid}: freed blocks"
            assert table.copies_in_step(), f"{cid}: ids_array or ids_tuple differs from block_ids"
            live = table.block_ids[table.freed_blocks:]
            assert FREED not in live, f"{cid}: a freed block after a live one"
            for b, h in zip(table.block_ids, table.block_hashes):
                assert b == FREED or self.allocator.hash_of(b) in (None, h), f"{cid}: block {b} cached under another prefix"
            for b in live:
                refs[b] = refs.get(b, 0) + 1
        for hold in self._holds.values():
            for b in hold.block_ids:
                refs[b] = refs.get(b, 0) + 1
        for b in range(self.allocator.num_total):
            assert self.allocator.ref_count(b) == refs.get(b, 0), f"block {b} ref count"

    # -- internals ------------------------------------------------------------------------
    def _drop_blocks(self, block_ids: Iterable[int]) -> int:
        # Tail blocks first, so the end of a sequence is reused before its prefix.
        return sum(self.allocator.decref(b) for b in reversed(list(block_ids)) if b != FREED)

    def _fresh_id(self, avoid: Collection[str]) -> str:
        while True:
            self._next_id += 1
            cid = f"kv-{self._next_id}"
            # Nor a released id: a late call naming it (a retried release) must not reach a new cache.
            if cid not in self._tables and cid not in self._released and cid not in avoid:
                return cid

    def _remember_released(self, cache_id: str) -> None:
        self._released[cache_id] = None
        if len(self._released) > RELEASED_IDS_REMEMBERED:
            self._released.popitem(last=False)
