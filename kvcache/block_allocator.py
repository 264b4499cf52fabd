"""BlockAllocator: a fixed pool of block ids with ref counts, free lists and block hashes."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from kvcache.errors import KvCacheExhausted


@dataclass(frozen=True, slots=True)
class CachedBlock:
    """What a hashed block holds: the hash of the block before it and its own tokens.

    A lookup compares both, so a hash collision can never hand out the wrong KV."""

    parent: bytes
    tokens: tuple[int, ...]


class BlockAllocator:
    """Hands out physical block ids 0..num_blocks-1.

    Every block is either free (ref count 0) or held (ref count >= 1), never both. Ref
    counts let several caches share prefix blocks; a block is free when its last holder
    lets go.

    A full block can carry a hash (see prefix_cache.py) that says which tokens, after which
    prefix, its K and V belong to. A freed hashed block keeps its hash and its contents and
    waits on the `cached` free list, least recently used first, so a later prompt with the
    same prefix can revive it (`share`). Allocation takes never-hashed blocks first (FIFO,
    so a block is reused as late as possible) and only then evicts the least recently used
    cached block, dropping its hash.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self._ref_counts = [0] * num_blocks
        self._free_plain: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._entries: dict[int, CachedBlock] = {}
        self.block_allocations = 0  # blocks handed out by allocate() since start
        self.allocation_failures = 0  # allocate() calls refused for lack of blocks
        self.evictions = 0  # hashed blocks whose hash was dropped to reuse their memory

    @property
    def num_total(self) -> int:
        return len(self._ref_counts)

    @property
    def num_free(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used(self) -> int:
        return self.num_total - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks carrying a hash, held or free."""
        return len(self._hash_of)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a reusable prefix."""
        return len(self._free_cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[self._checked(block_id)]

    def _checked(self, block_id: int) -> int:
        # A negative id would silently index from the end of the list.
        if not 0 <= block_id < len(self._ref_counts):
            raise ValueError(f"block id {block_id} is outside the pool [0, {len(self._ref_counts)})")
        return block_id

    # -- holding and freeing ----------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take n free blocks, each with ref count 1 and no hash; all or none."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            self.allocation_failures += 1
            raise KvCacheExhausted(n, self.num_free, self.num_total)
        blocks = []
        for _ in range(n):
            if self._free_plain:
                b = self._free_plain.popleft()
            else:
                b, _ = self._free_cached.popitem(last=False)
                self.drop_hash(b)
                self.evictions += 1
            self._ref_counts[b] = 1
            blocks.append(b)
        self.block_allocations += n
        return blocks

    def incref(self, block_id: int) -> None:
        """Add a holder to a block that is already held."""
        if self._ref_counts[self._checked(block_id)] < 1:
            raise ValueError(f"block {block_id} is free; allocate or share it instead")
        self._ref_counts[block_id] += 1

    def share(self, block_id: int) -> None:
        """Add a holder to a hashed block, reviving it from the cached free list if it was free."""
        if block_id not in self._hash_of:
            raise ValueError(f"block {block_id} carries no hash; only cached blocks are shared this way")
        if self._ref_counts[block_id] == 0:
            del self._free_cached[block_id]
        self._ref_counts[block_id] += 1

    def decref(self, block_id: int) -> bool:
        """Drop one holder; returns True when that freed the block."""
        count = self._ref_counts[self._checked(block_id)]
        if count < 1:
            raise ValueError(f"block {block_id} is already free")
        self._ref_counts[block_id] = count - 1
        if count > 1:
            return False
        if block_id in self._hash_of:
            self._free_cached[block_id] = None  # most recently used end
        else:
            self._free_plain.append(block_id)
        return True

    # -- hashes ---------------------------------------------------------------------------
    def lookup(self, block_hash: bytes, entry: CachedBlock) -> int | None:
        """The block holding exactly `entry` under `block_hash`, or None."""
        b = self._block_of.get(block_hash)
        if b is None or self._entries[b] != entry:
            return None
        return b

    def hash_of(self, block_id: int) -> bytes | None:
        return self._hash_of.get(block_id)

    def set_hash(self, block_id: int, block_hash: bytes, entry: CachedBlock) -> bool:
        """Record what a held, full block holds; False (nothing changes) when another block
        already holds that hash or this block already carries one."""
        if self._ref_counts[self._checked(block_id)] < 1:
            raise ValueError(f"block {block_id} is free; only held blocks get a hash")
        if block_hash in self._block_of or block_id in self._hash_of:
            return False
        self._hash_of[block_id] = block_hash
        self._block_of[block_hash] = block_id
        self._entries[block_id] = entry
        return True

    def drop_hash(self, block_id: int) -> None:
        """Forget what a block holds (it is about to be overwritten, or evicted)."""
        h = self._hash_of.pop(block_id, None)
        if h is None:
            return
        del self._block_of[h]
        del self._entries[block_id]
        if block_id in self._free_cached:
            del self._free_cached[block_id]
            self._free_plain.append(block_id)

    def drop_all_hashes(self) -> int:
        """Forget every cached prefix; returns how many blocks carried a hash."""
        hashed = list(self._hash_of)
        for b in hashed:
            self.drop_hash(b)
        return len(hashed)

    def check_invariants(self) -> None:
        """Raise AssertionError unless the free lists are exactly the blocks with ref count 0
        and the hash maps agree with each other."""
        plain, cached = set(self._free_plain), set(self._free_cached)
        assert len(plain) == len(self._free_plain), "a block is on the free list twice"
        assert not plain & cached, "a block is on both free lists"
        zero = {b for b, c in enumerate(self._ref_counts) if c == 0}
        assert plain | cached == zero, f"free lists {sorted(plain | cached)} != unreferenced blocks {sorted(zero)}"
        assert all(c >= 0 for c in self._ref_counts)
        assert cached <= set(self._hash_of), "a cached free block has no hash"
        assert not plain & set(self._hash_of), "a plain free block has a hash"
        assert {b: h for h, b in self._block_of.items()} == self._hash_of, "hash maps disagree"
        assert set(self._entries) == set(self._hash_of)
