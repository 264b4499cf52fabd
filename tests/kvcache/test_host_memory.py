"""kvcache.host_memory: large CPU tensors on transparent huge pages, small ones and other
devices as torch.zeros."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch

from kvcache import host_memory
from kvcache.kv_pool import PagedKvPool

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_kib_at(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head[1], 16) <= address < int(head[2], 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("claim", [True, False])
def test_large_tensors_are_zeros_on_a_huge_page_boundary(claim):
    t = host_memory.zeros(3, 1 << 20, dtype=torch.float32, claim=claim)
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float32 and t.is_contiguous()
    assert not t.any()
    if host_memory.huge_pages_supported():
        assert t.data_ptr() % host_memory.HUGE_PAGE == 0
    t[2, -1] = 7.0
    assert t.sum().item() == 7.0


def test_views_keep_the_mapping_alive():
    t = host_memory.zeros(4 << 20, dtype=torch.bfloat16)
    view = t[-1024:]
    view.fill_(2)
    del t
    gc.collect()
    assert view.float().sum().item() == 2048.0


def test_small_tensors_and_other_devices_are_plain_zeros():
    small = host_memory.zeros(4, 8, dtype=torch.float64)
    assert small.shape == (4, 8) and small.dtype == torch.float64 and not small.any()
    meta = host_memory.zeros(1 << 22, device="meta")
    assert meta.device.type == "meta" and meta.shape == (1 << 22,)


@pytest.mark.skipif(not host_memory.huge_pages_supported() or not THP.exists()
                    or "[never]" in THP.read_text(), reason="no transparent huge pages on this host")
def test_claimed_memory_is_backed_by_huge_pages():
    t = host_memory.zeros(8 << 20, dtype=torch.uint8)
    assert huge_kib_at(t.data_ptr()) >= 2048


def test_the_kv_pool_is_claimed_zeros_on_huge_page_memory():
    pool = PagedKvPool(num_layers=2, num_blocks=64, block_size=16, num_kv_heads=4, head_dim=64)
    assert pool.total_bytes >= host_memory.HUGE_PAGE
    k, v = pool.flat(1)
    assert not k.any() and not v.any()
    if host_memory.huge_pages_supported():
        assert pool.key[0].data_ptr() % host_memory.HUGE_PAGE == 0
