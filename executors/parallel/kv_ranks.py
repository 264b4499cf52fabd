"""The K and V of a tensor-parallel executor's caches, moved whole (ExportKv, ImportKv).

Each rank's pool holds its share of the KV heads (shard.py), so an export's chunk is read
from every rank and an import's is written to every rank, on the executor's worker like a
step (protocol.py's READ_KV and WRITE_KV):

- READ_KV: every rank copies K and V of the chunk's slots to the host, and rank 0 gathers
  them and puts the heads back in order. With fewer KV heads than ranks, each head is held
  by world / KVH ranks; the copy of the first of them is taken.
- WRITE_KV: rank 0 broadcasts the slots, then K and V with every head; each rank stores
  its own heads.

K and V travel as their raw bytes on the control group (gloo, host memory): any pool dtype
moves bit for bit, bfloat16 included, which not every gloo collective takes as a type. A
chunk is bounded by the export's max_chunk_bytes (1 MiB by default) or by the import's message
size, and one chunk at a time is in flight: host copies of a chunk (every rank's parts of it
on rank 0) are all the memory this takes.
"""

from __future__ import annotations

import math

import torch

from executors.parallel.comm import TpGroup
from executors.parallel.shard import ShardPlan
from kvcache.kv_pool import PagedKvPool


def local_bytes(pool: PagedKvPool, layer_start: int, layer_count: int, first_slot: int, count: int) -> torch.Tensor:
    """This rank's K and V of consecutive slots, [2, layers, count, its heads, head_dim], as host bytes."""
    k, v = pool.view_layers(layer_start, layer_count, first_slot, count)
    return torch.stack([k, v]).cpu().contiguous().view(torch.uint8).reshape(-1)


def gather_heads(group: TpGroup, plan: ShardPlan, pool: PagedKvPool, layer_start: int, layer_count: int,
                 first_slot: int, count: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every rank's part of a READ_KV (each rank calls it); on rank 0, K and V with every head
    in order ([layers, count, KV heads, head_dim], host tensors), None elsewhere."""
    mine = local_bytes(pool, layer_start, layer_count, first_slot, count)
    parts = group.gather_control(mine, "reading a cache's K and V for an export")
    if parts is None:
        return None
    shape = (2, layer_count, count, pool.num_kv_heads, pool.head_dim)
    both = torch.cat([parts[r].view(pool.dtype).view(shape) for r in plan.kv_head_owners()], dim=3)
    return both[0], both[1]


def store_heads(plan: ShardPlan, pool: PagedKvPool, layer_start: int, slots: torch.Tensor,
                whole: torch.Tensor) -> None:
    """Store this rank's heads of a WRITE_KV's K and V (whole: [2, layers, n, KV heads, head_dim])."""
    lo = plan.first_kv_head
    mine = whole[:, :, :, lo:lo + pool.num_kv_heads].to(pool.device)
    pool.write_layers(layer_start, slots.to(pool.device), mine[0], mine[1])


def write_bytes(k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rank 0's WRITE_KV payload: K and V ([layers, n, KV heads, head_dim]) as host bytes."""
    return torch.stack([k.to(dtype), v.to(dtype)]).cpu().contiguous().view(torch.uint8).reshape(-1)


def write_shape(plan: ShardPlan, layer_count: int, count: int) -> tuple[int, ...]:
    """[2, layers, n, KV heads, head_dim]: the shape of a WRITE_KV's bytes viewed in the pool dtype."""
    return 2, layer_count, count, plan.full.num_kv_heads, plan.full.head_dim


def receive_write(group: TpGroup, plan: ShardPlan, pool: PagedKvPool, h: list[int]) -> None:
    """A rank other than 0: a WRITE_KV's slots and bytes, then its heads stored."""
    layer_start, layer_count, count = h[1:4]
    shape = write_shape(plan, layer_count, count)
    slots = group.broadcast_control(torch.empty(count, dtype=torch.int64), "receiving an import's slots")
    nbytes = math.prod(shape) * pool.dtype.itemsize
    data = group.broadcast_control(torch.empty(nbytes, dtype=torch.uint8), "receiving an import's K and V")
    store_heads(plan, pool, layer_start, slots, data.view(pool.dtype).view(shape))
