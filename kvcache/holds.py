"""Holds: blocks held outside every table while a cache moves between executors.

An export pins the blocks of the positions it streams (one more holder each): a step that
writes into one copies it first, since it is shared, and a release or truncate leaves it
held, so the stream carries the snapshot of the moment it began. An import reserves all
the blocks it will write before it reads any K or V, and turns them into a cache only
when the whole stream has arrived (`adopt`), so until then no table points at them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.errors import InvalidLength, KvCacheExhausted


@dataclass(frozen=True, slots=True)
class Hold:
    """Blocks held outside every table: an export's snapshot (`pin`) or an import's
    reservation (`reserve`). Counted by the pool as used until `drop_hold`."""

    key: int
    block_ids: tuple[int, ...]
    first_block: int  # the logical block index of block_ids[0] in its sequence
    copies: tuple[tuple[int, int], ...] = ()  # (source, destination) blocks to copy into it first


class HoldsMixin:
    """Mixed into KvCacheManager (its allocator, tables, create and _drop_blocks)."""

    def pin(self, cache_id: str, start: int, end: int) -> Hold:
        """Hold the blocks of positions [start, end) of a cache: a writer into one of them
        copies it first (it is shared), and a release or truncate leaves it in place, so
        they keep these positions' K and V until `drop_hold`."""
        table = self.get(cache_id)
        if not 0 <= start <= end <= table.num_tokens:
            raise InvalidLength(cache_id, end, table.num_tokens, action="export up to")
        first, last = start // self.block_size, table.blocks_for(end)
        blocks = tuple(table.block_ids[first:last])
        for b in blocks:
            self.allocator.incref(b)
        return self._add_hold(blocks, first)

    def reserve(self, start: int, end: int, extend: str | None = None) -> Hold:
        """Blocks for positions [start, end) of a sequence being imported, outside every
        table until `adopt`. With `extend` (a cache of `start` tokens), a partly filled last
        block of it is copied into the first reserved block, so the import writes behind its
        end without touching what it or its sharers hold. All or nothing: KvCacheExhausted."""
        bs = self.block_size
        copy_from = None
        if extend is not None:
            table = self.get(extend)
            if table.num_tokens != start:
                raise InvalidLength(extend, start, table.num_tokens, action="import from position")
            copy_from = table.block_ids[-1] if start % bs else None
        first = start // bs
        needed = -(-end // bs) - first
        if needed > self.allocator.num_free:
            self.allocator.allocation_failures += 1
            raise KvCacheExhausted(needed, self.allocator.num_free, self.allocator.num_total)
        blocks = tuple(self.allocator.allocate(needed))
        copies = ((copy_from, blocks[0]),) if copy_from is not None else ()
        return self._add_hold(blocks, first, copies)

    def adopt(self, hold: Hold, cache_id: str | None, end: int, namespace: str = "",
              extend: str | None = None) -> str:
        """Turn a reservation whose K and V are written into a cache of `end` tokens: a new
        one (cache_id, or a fresh id when None), or `extend` grown to `end`."""
        if extend is not None:
            table = self.get(extend)
            if hold.copies:  # its partly filled last block gives way to the written copy
                old = table.block_ids.pop()
                table.changed(len(table.block_ids))
                self.allocator.decref(old)
                del table.block_hashes[len(table.block_ids):]
            table.block_ids.extend(hold.block_ids)
            table.num_tokens = end
            cache_id = extend
        else:
            cache_id, table = self.create(cache_id, namespace=namespace)
            table.block_ids.extend(hold.block_ids)
            table.num_tokens = end
        del self._holds[hold.key]
        return cache_id

    def drop_hold(self, hold: Hold) -> int:
        """Give up a pin or an unadopted reservation; returns blocks freed. Idempotent."""
        if self._holds.pop(hold.key, None) is None:
            return 0
        return self._drop_blocks(hold.block_ids)

    @property
    def holds(self) -> int:
        return len(self._holds)

    def _add_hold(self, blocks: tuple[int, ...], first: int, copies: tuple[tuple[int, int], ...] = ()) -> Hold:
        self._next_hold += 1
        hold = Hold(self._next_hold, blocks, first, copies)
        self._holds[hold.key] = hold
        return hold
