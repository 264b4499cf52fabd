"""BlockAllocator: counts, all-or-nothing allocation, ref counts, FIFO reuse, invariants."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import BlockAllocator, KvCacheError, KvCacheExhausted

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_bookkeeping_imports_without_torch() -> None:
    code = (
        "import sys, kvcache, kvcache.block_allocator, kvcache.block_table, kvcache.manager, "
        "kvcache.errors; assert 'torch' not in sys.modules, 'kvcache bookkeeping imported torch'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("n", [1, 2, 7, 64])
def test_fresh_pool_is_all_free(n: int) -> None:
    a = BlockAllocator(n)
    assert a.num_total == n
    assert a.num_free == n
    assert a.num_used == 0
    assert a.block_allocations == 0
    assert a.allocation_failures == 0
    assert all(a.ref_count(b) == 0 for b in range(n))
    a.check_invariants()


@pytest.mark.parametrize("n", [0, -1])
def test_rejects_empty_pool(n: int) -> None:
    with pytest.raises(ValueError):
        BlockAllocator(n)


def test_allocate_hands_out_distinct_blocks_with_ref_one() -> None:
    a = BlockAllocator(8)
    blocks = a.allocate(3)
    assert len(blocks) == len(set(blocks)) == 3
    assert all(0 <= b < 8 for b in blocks)
    assert all(a.ref_count(b) == 1 for b in blocks)
    assert (a.num_free, a.num_used) == (5, 3)
    assert a.block_allocations == 3
    a.check_invariants()


def test_allocate_zero_is_a_noop() -> None:
    a = BlockAllocator(4)
    assert a.allocate(0) == []
    assert (a.num_free, a.block_allocations, a.allocation_failures) == (4, 0, 0)


def test_allocate_negative_raises() -> None:
    a = BlockAllocator(4)
    with pytest.raises(ValueError):
        a.allocate(-1)
    assert a.num_free == 4
    assert a.allocation_failures == 0


def test_allocate_whole_pool() -> None:
    a = BlockAllocator(5)
    assert sorted(a.allocate(5)) == [0, 1, 2, 3, 4]
    assert (a.num_free, a.num_used) == (0, 5)
    a.check_invariants()


def test_allocate_is_all_or_nothing() -> None:
    a = BlockAllocator(6)
    held = a.allocate(4)
    with pytest.raises(KvCacheExhausted) as info:
        a.allocate(3)
    err = info.value
    assert isinstance(err, KvCacheError)
    assert (err.blocks_needed, err.blocks_free, err.total_blocks) == (3, 2, 6)
    assert "3" in str(err) and "6" in str(err)
    # Nothing was taken.
    assert a.num_free == 2
    assert a.allocation_failures == 1
    assert a.block_allocations == 4
    assert all(a.ref_count(b) == 1 for b in held)
    a.check_invariants()
    # The two remaining blocks are still there to take.
    assert len(a.allocate(2)) == 2
    with pytest.raises(KvCacheExhausted):
        a.allocate(1)
    assert a.allocation_failures == 2
    assert a.block_allocations == 6


def test_exhausted_on_fresh_pool_reports_all_free() -> None:
    a = BlockAllocator(3)
    with pytest.raises(KvCacheExhausted) as info:
        a.allocate(4)
    assert (info.value.blocks_needed, info.value.blocks_free, info.value.total_blocks) == (4, 3, 3)


def test_block_allocations_counts_blocks_not_calls() -> None:
    a = BlockAllocator(10)
    a.allocate(2)
    a.allocate(3)
    a.allocate(0)
    assert a.block_allocations == 5
    b = a.allocate(1)[0]
    a.decref(b)
    a.allocate(1)  # reuse counts again
    assert a.block_allocations == 7


def test_decref_frees_at_zero() -> None:
    a = BlockAllocator(4)
    (b,) = a.allocate(1)
    assert a.decref(b) is True
    assert a.ref_count(b) == 0
    assert a.num_free == 4
    a.check_invariants()


def test_incref_then_decref_frees_only_at_last_holder() -> None:
    a = BlockAllocator(4)
    (b,) = a.allocate(1)
    a.incref(b)
    a.incref(b)
    assert a.ref_count(b) == 3
    assert a.num_used == 1  # sharing takes no new block
    assert a.decref(b) is False
    assert a.decref(b) is False
    assert a.num_used == 1
    a.check_invariants()
    assert a.decref(b) is True
    assert a.num_used == 0
    a.check_invariants()


def test_decref_of_free_block_raises_and_changes_nothing() -> None:
    a = BlockAllocator(4)
    with pytest.raises(ValueError):
        a.decref(2)
    (b,) = a.allocate(1)
    a.decref(b)
    with pytest.raises(ValueError):
        a.decref(b)
    assert a.num_free == 4
    assert a.ref_count(b) == 0
    a.check_invariants()


def test_incref_of_free_block_raises_and_changes_nothing() -> None:
    a = BlockAllocator(4)
    with pytest.raises(ValueError):
        a.incref(0)
    assert a.ref_count(0) == 0
    assert a.num_free == 4
    a.check_invariants()
    (b,) = a.allocate(1)
    a.decref(b)
    with pytest.raises(ValueError):
        a.incref(b)
    a.check_invariants()


@pytest.mark.parametrize("bad", [4, 100])
def test_out_of_range_block_ids_raise(bad: int) -> None:
    a = BlockAllocator(4)
    a.allocate(4)
    for op in (a.incref, a.decref):
        with pytest.raises((IndexError, ValueError)):
            op(bad)
    a.check_invariants()


def test_negative_block_id_does_not_alias_last_block() -> None:
    """A block id of -1 must be rejected, not taken as block num_blocks-1 (Python indexing).

    Otherwise decref(-1) would decrement block 3's count and put -1 on the free list.
    """
    a = BlockAllocator(4)
    a.allocate(4)
    for op in (a.decref, a.incref, a.ref_count):
        with pytest.raises((IndexError, ValueError)):
            op(-1)
    assert a.ref_count(3) == 1
    assert a.num_free == 0
    a.check_invariants()
    assert a.allocate(0) == []


def test_fresh_pool_hands_out_in_order() -> None:
    a = BlockAllocator(5)
    assert a.allocate(2) == [0, 1]
    assert a.allocate(3) == [2, 3, 4]


def test_freed_blocks_are_reused_fifo() -> None:
    a = BlockAllocator(6)
    blocks = a.allocate(4)  # [0, 1, 2, 3]; free: [4, 5]
    a.decref(blocks[2])
    a.decref(blocks[0])
    # Never-used blocks come first, then freed blocks in the order they were freed.
    assert a.allocate(4) == [4, 5, 2, 0]
    a.decref(3)
    a.decref(1)
    a.decref(5)
    assert a.allocate(3) == [3, 1, 5]
    a.check_invariants()


def test_check_invariants_detects_corruption() -> None:
    a = BlockAllocator(4)
    a.allocate(2)
    a.check_invariants()
    a._ref_counts[0] = 0  # held block lost its count but is not on the free list
    with pytest.raises(AssertionError):
        a.check_invariants()

    b = BlockAllocator(4)
    b._free_plain.append(0)  # a block twice on the free list
    with pytest.raises(AssertionError):
        b.check_invariants()


@settings(max_examples=200, deadline=None)
@given(
    num_blocks=st.integers(1, 16),
    ops=st.lists(st.tuples(st.sampled_from(["alloc", "incref", "decref"]), st.integers(0, 20)), max_size=25),
)
def test_random_ops_match_refcount_model(num_blocks: int, ops: list[tuple[str, int]]) -> None:
    a = BlockAllocator(num_blocks)
    model: dict[int, int] = {}  # held block -> ref count
    failures = allocations = 0
    for op, arg in ops:
        if op == "alloc":
            n = arg % (num_blocks + 2)
            free = num_blocks - len(model)
            if n > free:
                with pytest.raises(KvCacheExhausted):
                    a.allocate(n)
                failures += 1
            else:
                got = a.allocate(n)
                assert len(set(got)) == n and not set(got) & set(model)
                model.update({b: 1 for b in got})
                allocations += n
        elif model:
            b = sorted(model)[arg % len(model)]
            if op == "incref":
                a.incref(b)
                model[b] += 1
            else:
                freed = a.decref(b)
                model[b] -= 1
                assert freed == (model[b] == 0)
                if model[b] == 0:
                    del model[b]
        a.check_invariants()
        assert a.num_used == len(model)
        assert a.num_used + a.num_free == num_blocks
        assert all(a.ref_count(b) == c for b, c in model.items())
        assert (a.block_allocations, a.allocation_failures) == (allocations, failures)
