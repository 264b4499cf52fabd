"""BlockTable: capacity, block counts and the position -> flat slot mapping."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import BlockTable


def test_defaults() -> None:
    t = BlockTable(4)
    assert t.block_ids == [] and t.num_tokens == 0 and t.capacity == 0
    # Default lists are not shared between tables.
    t.block_ids.append(1)
    assert BlockTable(4).block_ids == []


@pytest.mark.parametrize(
    ("bs", "ids", "cap"), [(4, [], 0), (4, [7], 4), (4, [3, 0, 9], 12), (1, [5, 2], 2), (16, [1, 2], 32)]
)
def test_capacity(bs: int, ids: list[int], cap: int) -> None:
    assert BlockTable(bs, list(ids)).capacity == cap


@pytest.mark.parametrize(
    ("bs", "length", "blocks"),
    [(4, 0, 0), (4, 1, 1), (4, 3, 1), (4, 4, 1), (4, 5, 2), (4, 8, 2), (4, 9, 3), (1, 5, 5), (16, 17, 2)],
)
def test_blocks_for(bs: int, length: int, blocks: int) -> None:
    assert BlockTable(bs).blocks_for(length) == blocks


def test_blocks_missing() -> None:
    t = BlockTable(4, [10, 11])  # capacity 8
    assert t.blocks_missing(0) == 0
    assert t.blocks_missing(8) == 0
    assert t.blocks_missing(3) == 0  # never negative
    assert t.blocks_missing(9) == 1
    assert t.blocks_missing(16) == 2
    assert t.blocks_missing(17) == 3
    assert BlockTable(4).blocks_missing(1) == 1


def test_slot_non_contiguous() -> None:
    t = BlockTable(4, [5, 2, 9])
    expected = [20, 21, 22, 23, 8, 9, 10, 11, 36, 37, 38, 39]
    assert [t.slot(p) for p in range(12)] == expected
    assert t.slots(0, 12) == expected
    assert t.slots(3, 9) == expected[3:9]
    assert t.slots(5, 5) == []


def test_slot_past_capacity_raises() -> None:
    t = BlockTable(4, [5, 2])
    with pytest.raises(IndexError):
        t.slot(8)
    with pytest.raises(IndexError):
        t.slots(6, 9)


@settings(max_examples=200, deadline=None)
@given(
    bs=st.integers(1, 8),
    ids=st.lists(st.integers(0, 63), min_size=1, max_size=8, unique=True),
    cut=st.tuples(st.integers(0, 64), st.integers(0, 64)),
)
def test_slots_mapping_property(bs: int, ids: list[int], cut: tuple[int, int]) -> None:
    t = BlockTable(bs, ids)
    cap = t.capacity
    start, end = sorted(c % (cap + 1) for c in cut)
    slots = t.slots(start, end)
    assert slots == [ids[p // bs] * bs + p % bs for p in range(start, end)]
    assert slots == [t.slot(p) for p in range(start, end)]
    # Distinct block ids give distinct slots, each inside its own block.
    assert len(set(t.slots(0, cap))) == cap
    for p, s in zip(range(start, end), slots):
        assert s // bs == ids[p // bs] and s % bs == p % bs
