"""Copy-on-write planning for KvCacheManager.extend_many.

A cache whose next write lands in its partly filled last block must not change what any
other holder of that block reads. When the block is held by something outside the batch
(a cache not writing into it, a cache of the batch holding it as a full block, an export
pin), every writer gets a private copy. When only the batch's writers hold it, all but one
copy it and that one writes in place, as writing them one at a time would: N writers, N-1
copies. (A prefix-cache hash is no holder: the block's writer in place drops it.)

The one that writes in place is the writer that reaches furthest into the block: the
forward writes it only at positions past that writer's length, which every other writer's
positions in the block precede. So a failed step can always give the other writers the
shared block back (`KvCacheManager.unswap`), even after the forward ran.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcache.block_allocator import BlockAllocator
from kvcache.block_table import BlockTable

# One swap extend_many made: the table, the index of the block in it, the shared block it
# held there, and the private copy that replaced it.
Swap = tuple[BlockTable, int, int, int]


def plan_writes(allocator: BlockAllocator, block_size: int,
                tables: Sequence[tuple[BlockTable, int]]) -> list[bool | None]:
    """For each (table, target length): None when the growth writes no position of the
    table's last block, True when that block must be copied first, False when it is
    written in place."""
    plan: list[bool | None] = [None] * len(tables)
    shared: dict[int, list[int]] = {}  # a shared last block -> the items writing into it
    for i, (t, length) in enumerate(tables):
        if length > t.num_tokens and t.num_tokens % block_size:
            last = t.block_ids[-1]
            plan[i] = False
            if allocator.ref_count(last) > 1:
                shared.setdefault(last, []).append(i)
    for block, writers in shared.items():
        for i in writers:
            plan[i] = True
        if allocator.ref_count(block) == len(writers):  # held by these writers alone
            plan[max(writers, key=lambda i: tables[i][0].num_tokens)] = False
    return plan
