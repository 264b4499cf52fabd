"""BlockTable: one sequence's logical-to-physical block map."""

from __future__ import annotations

from dataclasses import dataclass, field

# The block_ids entry of a logical block returned to the pool because every layer's sliding
# window has moved past it (KvCacheManager.slide): its positions are never read again.
FREED = -1


@dataclass(slots=True)
class BlockTable:
    """Logical block i of the sequence lives in physical block block_ids[i].

    Token position p sits in block block_ids[p // block_size] at offset p % block_size,
    i.e. at flat slot block_ids[p // block_size] * block_size + p % block_size of a pool
    viewed as [num_blocks * block_size, ...].

    For prefix reuse the table also knows its tokens (those committed after their K and V
    were written; `tokens` may lag `num_tokens` only while a step is running) and the chain
    hash of each full block (`block_hashes[i]` names blocks 0..i), under `namespace`.
    """

    block_size: int
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    namespace: str = ""
    tokens: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    freed_blocks: int = 0  # leading logical blocks returned to the pool (block_ids FREED there)
    # Logical blocks from this one on are never offered for reuse: their K and V (or those
    # before them) came from an import, which its caller could have forged.
    unshared_from: int | None = None

    @property
    def capacity(self) -> int:
        """Tokens the held blocks can store."""
        return len(self.block_ids) * self.block_size

    def blocks_for(self, length: int) -> int:
        """Blocks needed to hold `length` tokens."""
        return -(-length // self.block_size)

    def blocks_missing(self, length: int) -> int:
        """Blocks to add so that `length` tokens fit (0 when they already do)."""
        return max(0, self.blocks_for(length) - len(self.block_ids))

    def slot(self, position: int) -> int:
        block, offset = divmod(position, self.block_size)
        return self.block_ids[block] * self.block_size + offset

    def slots(self, start: int, end: int) -> list[int]:
        """Flat slot of every position in [start, end)."""
        bs, ids = self.block_size, self.block_ids
        return [ids[p // bs] * bs + p % bs for p in range(start, end)]
