"""BlockTable: one sequence's logical-to-physical block map."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

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
    # block_ids as int32 (ids_array): its first _synced entries equal the list's.
    _ids: np.ndarray | None = field(default=None, repr=False, compare=False)
    _synced: int = field(default=0, repr=False, compare=False)
    # block_ids as a tuple (ids_tuple), while no entry changed and none was appended.
    _tuple: tuple[int, ...] | None = field(default=None, repr=False, compare=False)

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

    def ids_array(self) -> np.ndarray:
        """block_ids as an int32 array, for a step's kernels: a block table grows by a block every
        block_size tokens, and converting the whole list every step cost a long context's rows
        15-50 ns an id (ms a step at batch 32 and 32K tokens). Only entries appended, or marked
        `changed`, since the last call are copied. The array is the table's: read it, in the step."""
        n = len(self.block_ids)
        mirror = self._ids
        if mirror is None or mirror.shape[0] < n:
            grown = np.empty(max(16, 2 * n), np.int32)
            if mirror is not None:
                grown[:self._synced] = mirror[:self._synced]
            self._ids = mirror = grown
        if self._synced < n:
            mirror[self._synced:n] = self.block_ids[self._synced:]
            self._synced = n
        return mirror[:n]

    def ids_tuple(self) -> tuple[int, ...]:
        """block_ids as a tuple (a step's snapshot of the table, a handle's ids): made again only when
        the table grew or changed, once every block_size tokens of a decode, not on every step."""
        ids = self._tuple
        if ids is None or len(ids) != len(self.block_ids):
            ids = self._tuple = tuple(self.block_ids)
        return ids

    def changed(self, index: int) -> None:
        """Entries from `index` on were set in place or removed: ids_array copies them again, and
        ids_tuple makes its tuple again. (Entries appended need no call; everything that shortens
        the list or sets an entry makes one.)"""
        self._synced = min(self._synced, index)
        self._tuple = None

    def copies_in_step(self) -> bool:
        """Whether ids_array's synced entries and ids_tuple's tuple (where it would be returned) still
        equal the list's: an invariant the tests check."""
        ids = self._tuple
        return ((self._ids is None or self._ids[:self._synced].tolist() == self.block_ids[:self._synced])
                and (ids is None or len(ids) != len(self.block_ids) or list(ids) == self.block_ids))

    def slots(self, start: int, end: int) -> list[int]:
        """Flat slot of every position in [start, end)."""
        bs, ids = self.block_size, self.block_ids
        return [ids[p // bs] * bs + p % bs for p in range(start, end)]
