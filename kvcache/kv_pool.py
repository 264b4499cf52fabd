"""PagedKvPool: the K and V tensors that block ids index."""

from __future__ import annotations

import torch

from kvcache import host_memory


class PagedKvPool:
    """K and V for every layer, preallocated as [num_blocks, block_size, num_kv_heads, head_dim].

    One allocation backs all layers (k and v are views into it), so the pool's memory is
    claimed once at start-up and never fragments. Slots are flat indices
    block_id * block_size + offset, as BlockTable.slots() produces them.

    `scratch_blocks` extra blocks follow the num_blocks the allocator hands out: padding
    rows of a fixed-shape step (a CUDA graph's bucket) write their K and V there, where no
    sequence reads. The first is `scratch_block`.

    `values_are_keys` (DeepSeek's latent attention, whose cached rows are their own values):
    one half, `value[layer]` the very tensor `key[layer]` is, half the memory. The pool's
    interface is unchanged: writes of V are dropped (they equal K), and reads of V are K's.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        scratch_blocks: int = 0,
        values_are_keys: bool = False,
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.scratch_block = num_blocks if scratch_blocks else None
        self.values_are_keys = values_are_keys
        # On huge pages on a CPU: decode attention streams this pool (host_memory's doc).
        self._storage = host_memory.zeros(
            kv_halves(values_are_keys), num_layers, num_blocks + scratch_blocks, block_size, num_kv_heads, head_dim,
            dtype=dtype, device=device
        )
        self.key = list(self._storage[0])  # key[layer]: [num_blocks, block_size, H, D]
        self.value = self.key if values_are_keys else list(self._storage[1])

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers (of K alone where values are keys)."""
        return self._storage.shape[0] * self.num_layers * self.num_kv_heads * self.head_dim * \
            self._storage.element_size()

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def total_bytes(self) -> int:
        return self._storage.numel() * self._storage.element_size()

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer viewed as [num_blocks * block_size, H, D]."""
        h, d = self.num_kv_heads, self.head_dim
        return self.key[layer].view(-1, h, d), self.value[layer].view(-1, h, d)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([n, H, D]) at the given flat slots ([n], int64)."""
        kf, vf = self.flat(layer)
        kf.index_copy_(0, slots, k.to(self.dtype))
        if not self.values_are_keys:
            vf.index_copy_(0, slots, v.to(self.dtype))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks, every layer's K and V: (source, destination) pairs (copy-on-write)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        self._storage.index_copy_(2, dst, self._storage.index_select(2, src))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ([n, H, D]) at the given flat slots."""
        kf, vf = self.flat(layer)
        return kf.index_select(0, slots), vf.index_select(0, slots)

    def view_layers(self, layer_start: int, layer_count: int, first_slot: int,
                    count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (no copy) of K and V ([layer_count, count, H, D]) of consecutive slots."""
        return (self._layers(0, layer_start, layer_count)[:, first_slot:first_slot + count],
                self._layers(1, layer_start, layer_count)[:, first_slot:first_slot + count])

    def write_layers(self, layer_start: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([layers, n, H, D]) for layers layer_start.. at the given flat slots."""
        self._layers(0, layer_start, k.shape[0]).index_copy_(1, slots, k.to(self.dtype))
        if not self.values_are_keys:
            self._layers(1, layer_start, v.shape[0]).index_copy_(1, slots, v.to(self.dtype))

    def _layers(self, kv: int, layer_start: int, layer_count: int) -> torch.Tensor:
        half = 0 if self.values_are_keys else kv
        return self._storage[half, layer_start:layer_start + layer_count].view(
            layer_count, -1, self.num_kv_heads, self.head_dim)


def kv_halves(values_are_keys: bool) -> int:
    """The pool's halves: K and V, or K alone where the values are the keys."""
    return 1 if values_are_keys else 2
