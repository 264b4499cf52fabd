"""BlockAllocator: a fixed pool of block ids with ref counts and a free list."""

from __future__ import annotations

from collections import deque

from kvcache.errors import KvCacheExhausted


class BlockAllocator:
    """Hands out physical block ids 0..num_blocks-1.

    Every block is either free (ref count 0, on the free list) or held (ref count >= 1),
    never both. Ref counts let several caches share a prefix block later on; a block goes
    back to the free list when its last holder lets go. The free list is FIFO: a freed block
    is reused as late as possible, which keeps its contents around longest for prefix reuse.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.block_allocations = 0  # blocks handed out since start
        self.allocation_failures = 0  # allocate() calls refused for lack of blocks

    @property
    def num_total(self) -> int:
        return len(self._ref_counts)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_total - self.num_free

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[self._checked(block_id)]

    def _checked(self, block_id: int) -> int:
        # A negative id would silently index from the end of the list.
        if not 0 <= block_id < len(self._ref_counts):
            raise ValueError(f"block id {block_id} is outside the pool [0, {len(self._ref_counts)})")
        return block_id

    def allocate(self, n: int) -> list[int]:
        """Take n free blocks, each with ref count 1; all or none."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            self.allocation_failures += 1
            raise KvCacheExhausted(n, len(self._free), self.num_total)
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._ref_counts[b] = 1
        self.block_allocations += n
        return blocks

    def incref(self, block_id: int) -> None:
        """Add a holder to a block that is already held (prefix sharing)."""
        if self._ref_counts[self._checked(block_id)] < 1:
            raise ValueError(f"block {block_id} is free; allocate it instead of sharing it")
        self._ref_counts[block_id] += 1

    def decref(self, block_id: int) -> bool:
        """Drop one holder; returns True when that freed the block."""
        count = self._ref_counts[self._checked(block_id)]
        if count < 1:
            raise ValueError(f"block {block_id} is already free")
        self._ref_counts[block_id] = count - 1
        if count == 1:
            self._free.append(block_id)
            return True
        return False

    def check_invariants(self) -> None:
        """Raise AssertionError unless the free list is exactly the blocks with ref count 0."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        zero = {b for b, c in enumerate(self._ref_counts) if c == 0}
        assert free == zero, f"free list {sorted(free)} != unreferenced blocks {sorted(zero)}"
        assert all(c >= 0 for c in self._ref_counts)
