"""Holds (kvcache/holds.py): an export's pinned snapshot and an import's reservation."""

from __future__ import annotations

import pytest

from kvcache import KvCacheExhausted, KvCacheManager
from kvcache.errors import CacheAlreadyExists, InvalidLength


def manager(blocks: int = 8, bs: int = 4) -> KvCacheManager:
    return KvCacheManager(blocks, bs)


def test_a_pin_keeps_its_blocks_through_truncate_release_and_writes():
    m = manager()
    cid, _ = m.create("a")
    m.extend(cid, 6)  # blocks 0, 1 (the second partly filled)
    m.commit(cid, 0, range(6))
    hold = m.pin(cid, 0, 6)
    assert hold.block_ids == tuple(m.get(cid).block_ids) and hold.first_block == 0
    copies = m.extend(cid, 7)  # writes into the shared partial block: copied first
    assert copies == [(hold.block_ids[1], m.get(cid).block_ids[1])]
    m.truncate(cid, 0)
    m.release(cid)
    assert m.stats().used_blocks == 2  # only the pin holds them now
    m.check_invariants()
    assert m.drop_hold(hold) == 2 and m.drop_hold(hold) == 0
    assert m.stats().used_blocks == 0 and m.holds == 0
    m.check_invariants()


def test_a_pin_of_a_range_holds_only_its_blocks():
    m = manager()
    cid, _ = m.create("a")
    m.extend(cid, 14)
    hold = m.pin(cid, 5, 9)
    assert hold.block_ids == tuple(m.get(cid).block_ids[1:3]) and hold.first_block == 1
    with pytest.raises(InvalidLength):
        m.pin(cid, 0, 15)
    m.drop_hold(hold)
    m.check_invariants()


def test_a_reservation_is_all_or_nothing_and_becomes_a_cache_only_when_adopted():
    m = manager(blocks=4)
    with pytest.raises(KvCacheExhausted) as e:
        m.reserve(0, 17)
    assert e.value.blocks_needed == 5 and m.stats().used_blocks == 0
    hold = m.reserve(0, 10)
    assert len(hold.block_ids) == 3 and "x" not in m and m.stats().used_blocks == 3
    m.check_invariants()
    cid = m.adopt(hold, "x", 10)
    assert cid == "x" and m.get("x").block_ids == list(hold.block_ids) and m.get("x").num_tokens == 10
    assert m.holds == 0 and m.drop_hold(hold) == 0  # adopted: nothing left to drop
    m.check_invariants()


def test_adopting_under_a_taken_id_fails_and_the_reservation_can_still_be_dropped():
    m = manager()
    m.create("x")
    hold = m.reserve(0, 4)
    with pytest.raises(CacheAlreadyExists):
        m.adopt(hold, "x", 4)
    assert m.drop_hold(hold) == 1
    m.check_invariants()


def test_an_extension_copies_a_partial_last_block_and_swaps_it_in_when_adopted():
    m = manager()
    cid, _ = m.create("a")
    m.extend(cid, 6)
    last = m.get(cid).block_ids[1]
    with pytest.raises(InvalidLength):
        m.reserve(5, 12, extend=cid)  # it holds 6, not 5
    hold = m.reserve(6, 12, extend=cid)
    assert hold.first_block == 1 and len(hold.block_ids) == 2 and hold.copies == ((last, hold.block_ids[0]),)
    assert m.get(cid).num_tokens == 6  # untouched until adopted
    m.adopt(hold, None, 12, extend=cid)
    t = m.get(cid)
    assert t.num_tokens == 12 and t.block_ids[1:] == list(hold.block_ids) and last not in t.block_ids
    assert m.stats().used_blocks == 3
    m.check_invariants()


def test_an_extension_at_a_block_boundary_copies_nothing():
    m = manager()
    cid, _ = m.create("a")
    m.extend(cid, 8)
    hold = m.reserve(8, 9, extend=cid)
    assert hold.copies == () and hold.first_block == 2 and len(hold.block_ids) == 1
    m.adopt(hold, None, 9, extend=cid)
    assert len(m.get(cid).block_ids) == 3
    m.check_invariants()
