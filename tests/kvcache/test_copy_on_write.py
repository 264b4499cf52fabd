"""Copy-on-write in a batch (kvcache/copy_on_write.py): how many copies extend_many counts
when several caches of one batch write into the same shared block, which of them writes
in place, and `unswap`, which gives a failed step's caches their shared blocks back."""

from __future__ import annotations

import pytest

from kvcache import KvCacheExhausted, KvCacheManager

BS = 4
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def two_sharers(num_blocks: int, lengths: tuple[int, int] = (7, 7)) -> KvCacheManager:
    """Caches "a" and "b" share two full, named blocks (b also held a third, given back),
    then both are cut back into the second one: it is held by them alone."""
    m = KvCacheManager(num_blocks, BS)
    m.create("a")
    m.extend("a", 8)
    m.commit("a", 0, PROMPT)
    m.create("b")
    assert m.match_prefix("b", PROMPT + [9], limit=8) == 8
    m.extend("b", 9)
    m.commit("b", 8, [9])
    m.truncate("a", lengths[0])
    m.truncate("b", lengths[1])
    return m


def tables(m: KvCacheManager) -> dict[str, tuple[list[int], int, list[int], list[bytes]]]:
    return {cid: (list(t.block_ids), t.num_tokens, list(t.tokens), list(t.block_hashes))
            for cid in m.cache_ids() for t in [m.get(cid)]}


def test_a_block_shared_only_by_the_batch_needs_one_copy_less_than_its_writers():
    m = two_sharers(num_blocks=3)
    shared = m.get("a").block_ids[1]
    assert m.allocator.num_free == 1 and m.allocator.ref_count(shared) == 2
    copies = m.extend_many([("a", 8), ("b", 8)])  # one at a time, these take one block: so must the batch
    assert len(copies) == 1 and copies[0][0] == shared
    assert m.allocator.num_free == 0
    assert sorted([m.get("a").block_ids[1], m.get("b").block_ids[1]]) == sorted([shared, copies[0][1]])
    m.check_invariants()


@pytest.mark.parametrize("other", ["a third cache", "a pin"])
def test_a_block_also_held_outside_the_batch_is_copied_for_every_writer(other):
    m = two_sharers(num_blocks=4)
    shared = m.get("a").block_ids[1]
    if other == "a pin":
        m.pin("a", 4, 7)
    else:
        m.create("c")
        assert m.match_prefix("c", PROMPT + [9], limit=8) == 8  # holds it as a full block
    assert m.allocator.ref_count(shared) == 3 and m.allocator.num_free == 2
    copies = m.extend_many([("a", 8), ("b", 8)])
    assert [src for src, _ in copies] == [shared, shared]
    assert shared not in (m.get("a").block_ids[1], m.get("b").block_ids[1])
    assert m.allocator.ref_count(shared) == 1 and m.allocator.hash_of(shared) is not None
    m.check_invariants()


def test_a_batch_with_a_copy_too_many_is_still_refused():
    m = two_sharers(num_blocks=3)
    m.create("c")
    before = tables(m)
    with pytest.raises(KvCacheExhausted) as info:
        m.extend_many([("a", 8), ("b", 8), ("c", 1)])  # one copy + one new block: 2 > 1 free
    assert (info.value.blocks_needed, info.value.blocks_free) == (2, 1)
    assert tables(m) == before
    m.check_invariants()


@pytest.mark.parametrize("order", [("a", "b"), ("b", "a")])
def test_the_writer_that_reaches_furthest_into_the_block_writes_it_in_place(order):
    """a ends at 5, b at 7: b's writes (positions 7..) leave a's (4) alone, a's (5..) would not b's."""
    m = two_sharers(num_blocks=4, lengths=(5, 7))
    shared = m.get("a").block_ids[1]
    m.extend_many([(cid, m.get(cid).num_tokens + 1) for cid in order])
    assert m.get("b").block_ids[1] == shared and m.get("a").block_ids[1] != shared
    m.check_invariants()


@pytest.mark.parametrize("pinned", [False, True])
def test_unswap_gives_every_table_its_shared_block_back(pinned):
    m = two_sharers(num_blocks=6, lengths=(5, 7))
    if pinned:
        m.pin("b", 4, 7)
    m.create("c")
    before, used = tables(m), m.stats().used_blocks
    swapped: list = []
    copies = m.extend_many([("a", 6), ("b", 8), ("c", 3)], swapped)
    assert len(copies) == len(swapped) == (2 if pinned else 1)
    m.unswap(swapped)  # as a failed step does, before cutting each cache back
    for cid, (_, length, _, _) in before.items():
        m.truncate(cid, length)
    assert tables(m) == before and m.stats().used_blocks == used
    m.check_invariants()


def test_unswap_of_nothing_changes_nothing():
    m = two_sharers(num_blocks=3)
    before = tables(m)
    m.unswap([])
    assert tables(m) == before
