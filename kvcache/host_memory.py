"""Large host tensors on transparent huge pages: the KV pool and the CPU kernels' weights.

A decode step streams the weights and the KV it attends over from memory, and the CPU's
prefetchers stop at every 4 KiB page boundary. On 2 MiB pages the same fp32 SmolLM2-135M
weights stream at 30-33 GB/s instead of 26-28 on the 2-core EPYC of bench/RESULTS.md
(run 12): one page walk per 2 MiB instead of one per 4 KiB.

Linux backs anonymous private memory with huge pages where the process asks for it
(madvise(MADV_HUGEPAGE)) when transparent_hugepage is `madvise`, the common default; the
pages are then faulted in as 2 MiB pages, which must happen after the advice. So `zeros`
maps the memory itself, advises it, and only then writes the zeros (claiming the memory at
once, as torch.zeros does), or leaves the pages to be faulted in by their first writer
(`claim=False`: the weights, packed into it layer by layer while the loaded copy of each is
freed, so the peak stays one layer above the model). Elsewhere (not Linux, not the CPU, a
tensor under 2 MiB) it is plain torch.zeros; a kernel that refuses the advice gets 4 KiB pages.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def huge_pages_supported() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS")


def zeros(*shape: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
          claim: bool = True) -> torch.Tensor:
    """torch.zeros(shape, dtype, device), on huge pages where the host offers them; with
    claim=False their memory is taken as they are first written. The tensor keeps its
    mapping alive (a view of it too); it is freed with the last of them."""
    numel = math.prod(shape)
    size = numel * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or size < HUGE_PAGE or not huge_pages_supported():
        return torch.zeros(*shape, dtype=dtype, device=device)
    # One huge page more than asked: the tensor starts at the first 2 MiB boundary inside.
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: 4 KiB pages, still zeros
        pass
    base = torch.frombuffer(region, dtype=torch.uint8, count=1)
    offset = -base.data_ptr() % HUGE_PAGE
    tensor = torch.frombuffer(region, dtype=dtype, count=numel, offset=offset).view(*shape)
    if claim:
        tensor.zero_()  # a fresh mapping reads as zeros; writing them faults the pages in, now
    return tensor
