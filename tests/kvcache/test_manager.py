"""KvCacheManager: ids, extend / extend_many, truncate, release, stats, shared blocks."""

from __future__ import annotations

import pytest

from kvcache import (
    CacheAlreadyExists,
    CacheNotFound,
    DuplicateCache,
    InvalidCacheId,
    InvalidLength,
    KvCacheError,
    KvCacheExhausted,
    KvCacheManager,
    KvPoolStats,
)
from kvcache.manager import RELEASED_IDS_REMEMBERED


def make(num_blocks: int = 12, block_size: int = 4) -> KvCacheManager:
    return KvCacheManager(num_blocks, block_size)


# -- construction -------------------------------------------------------------------------
@pytest.mark.parametrize("bs", [0, -4])
def test_rejects_bad_block_size(bs: int) -> None:
    with pytest.raises(ValueError):
        KvCacheManager(8, bs)


def test_rejects_empty_pool() -> None:
    with pytest.raises(ValueError):
        KvCacheManager(0, 4)


# -- create / ids -------------------------------------------------------------------------
def test_create_none_gives_fresh_unique_ids() -> None:
    m = make()
    ids = [m.create()[0] for _ in range(50)]
    assert len(set(ids)) == 50
    assert all(isinstance(i, str) and i for i in ids)
    assert len(m) == 50
    assert set(m.cache_ids()) == set(ids)
    for cid in ids:
        assert cid in m
        t = m.get(cid)
        assert t.block_ids == [] and t.num_tokens == 0 and t.block_size == 4


def test_create_returns_the_registered_table() -> None:
    m = make()
    cid, table = m.create()
    assert m.get(cid) is table
    cid2, table2 = m.create("mine")
    assert cid2 == "mine" and m.get("mine") is table2


def test_fresh_ids_skip_caller_chosen_ids_in_use() -> None:
    m = make()
    for i in range(1, 6):
        m.create(f"kv-{i}")
    m.create("kv-7")
    fresh = [m.create()[0] for _ in range(5)]
    assert not {f"kv-{i}" for i in (1, 2, 3, 4, 5, 7)} & set(fresh)
    assert len(set(fresh)) == 5
    assert len(m) == 11


def test_fresh_ids_never_collide_with_ids_created_in_between() -> None:
    m = make()
    first, _ = m.create()
    # Guess what the next few fresh ids could be and take them first.
    for i in range(1, 10):
        cid = f"kv-{i}"
        if cid not in m:
            m.create(cid)
    live = set(m.cache_ids())
    new, _ = m.create()
    assert new not in live
    assert len(m) == len(live) + 1


def test_fresh_id_is_not_an_id_in_use_after_release() -> None:
    m = make()
    a, _ = m.create()
    b, _ = m.create()
    m.release(a)
    c, _ = m.create()
    assert c not in (a, b)


def test_fresh_ids_skip_ids_a_caller_released_recently() -> None:
    """A caller's retried (idempotent) release of its own id must not reach a cache the
    server created since under that id."""
    m = make()
    m.create("kv-2")
    m.release("kv-2")
    fresh = [m.create()[0] for _ in range(3)]
    assert "kv-2" not in fresh
    assert m.release("kv-2") is None  # still the caller's released id
    assert set(m.cache_ids()) == set(fresh)
    assert m.create("kv-2")[0] == "kv-2"  # the caller may take it again


@pytest.mark.parametrize(
    "cid", ["a", "kv-3", "A.b_c:d-e", "0", "x" * 128, "seq:42.step-7", "UPPER_lower"]
)
def test_valid_caller_ids(cid: str) -> None:
    m = make()
    assert m.create(cid)[0] == cid
    assert cid in m


@pytest.mark.parametrize(
    "cid",
    [
        "",
        "x" * 129,
        "has space",
        " lead",
        "trail ",
        "a/b",
        "a\\b",
        "../etc",
        "tab\there",
        "nl\n",
        "kv-3\n",
        "é",
        "a*b",
        "a?b",
        "a,b",
        "a\x00b",
    ],
)
def test_invalid_caller_ids(cid: str) -> None:
    m = make()
    with pytest.raises(InvalidCacheId) as info:
        m.create(cid)
    assert isinstance(info.value, KvCacheError)
    assert info.value.cache_id == cid
    assert len(m) == 0
    assert cid not in m


def test_duplicate_caller_id_raises() -> None:
    m = make()
    m.create("dup")
    m.extend("dup", 5)
    with pytest.raises(CacheAlreadyExists) as info:
        m.create("dup")
    assert info.value.cache_id == "dup"
    # The existing cache is untouched.
    assert m.get("dup").num_tokens == 5
    assert len(m) == 1


def test_caller_id_equal_to_fresh_id_in_use_raises() -> None:
    m = make()
    cid, _ = m.create()
    with pytest.raises(CacheAlreadyExists):
        m.create(cid)


def test_released_id_can_be_created_again() -> None:
    m = make()
    m.create("again")
    m.extend("again", 6)
    m.release("again")
    _, t = m.create("again")
    assert t.num_tokens == 0 and t.block_ids == []
    assert m.get("again") is t
    # It is live again, so releasing it frees and a second release is idempotent.
    assert m.release("again") == 0
    assert m.release("again") is None


# -- extend -------------------------------------------------------------------------------
def test_extend_allocates_exactly_missing_blocks() -> None:
    m = make(12, 4)
    cid, t = m.create()
    m.extend(cid, 0)
    assert (t.block_ids, t.num_tokens, m.allocator.num_used) == ([], 0, 0)
    m.extend(cid, 1)
    assert (len(t.block_ids), t.num_tokens, m.allocator.num_used) == (1, 1, 1)
    m.extend(cid, 4)
    assert (len(t.block_ids), t.num_tokens, m.allocator.num_used) == (1, 4, 1)
    first = list(t.block_ids)
    m.extend(cid, 5)
    assert (len(t.block_ids), t.num_tokens, m.allocator.num_used) == (2, 5, 2)
    assert t.block_ids[:1] == first  # existing blocks are kept, new ones appended
    m.extend(cid, 13)
    assert (len(t.block_ids), t.num_tokens, m.allocator.num_used) == (4, 13, 4)
    m.extend(cid, 13)  # same length: no change
    assert (len(t.block_ids), t.num_tokens, m.allocator.num_used) == (4, 13, 4)
    assert m.allocator.block_allocations == 4
    assert len(set(t.block_ids)) == 4
    m.check_invariants()


def test_extend_unknown_cache_raises() -> None:
    m = make()
    with pytest.raises(CacheNotFound) as info:
        m.extend("nope", 4)
    assert info.value.released is False
    assert m.allocator.num_free == 12


def test_extend_released_cache_raises_released() -> None:
    m = make()
    cid, _ = m.create()
    m.release(cid)
    with pytest.raises(CacheNotFound) as info:
        m.extend(cid, 4)
    assert info.value.released is True


def test_extend_exhausted_changes_nothing() -> None:
    m = make(4, 4)
    cid, t = m.create()
    m.extend(cid, 6)  # 2 blocks
    before = list(t.block_ids)
    with pytest.raises(KvCacheExhausted) as info:
        m.extend(cid, 17)  # needs 3 more, 2 free
    assert (info.value.blocks_needed, info.value.blocks_free, info.value.total_blocks) == (3, 2, 4)
    assert t.block_ids == before and t.num_tokens == 6
    assert m.allocator.num_free == 2
    assert m.allocator.allocation_failures == 1
    m.extend(cid, 16)  # exactly fits
    assert m.allocator.num_free == 0 and t.num_tokens == 16
    m.check_invariants()


def test_extend_many_allocates_for_each_cache() -> None:
    m = make(12, 4)
    a, ta = m.create()
    b, tb = m.create()
    c, tc = m.create()
    m.extend(c, 3)
    m.extend_many([(a, 5), (b, 8), (c, 9)])
    assert (ta.num_tokens, tb.num_tokens, tc.num_tokens) == (5, 8, 9)
    assert (len(ta.block_ids), len(tb.block_ids), len(tc.block_ids)) == (2, 2, 3)
    assert m.allocator.num_used == 7
    assert m.allocator.block_allocations == 7
    all_ids = ta.block_ids + tb.block_ids + tc.block_ids
    assert len(set(all_ids)) == 7
    m.check_invariants()


def test_extend_many_empty_is_noop() -> None:
    m = make()
    m.extend_many([])
    assert m.stats() == make().stats()


def test_extend_many_is_all_or_nothing() -> None:
    m = make(6, 4)
    a, ta = m.create()
    b, tb = m.create()
    c, tc = m.create()
    m.extend(a, 4)  # 1 block; 5 free
    snapshot = [(list(t.block_ids), t.num_tokens) for t in (ta, tb, tc)]
    # a: +1, b: +2, c: +3 = 6 > 5 free; each alone would fit.
    with pytest.raises(KvCacheExhausted) as info:
        m.extend_many([(a, 8), (b, 8), (c, 12)])
    err = info.value
    assert (err.blocks_needed, err.blocks_free, err.total_blocks) == (6, 5, 6)
    assert [(list(t.block_ids), t.num_tokens) for t in (ta, tb, tc)] == snapshot
    assert m.allocator.num_free == 5
    assert m.allocator.allocation_failures == 1  # counted once for the batch
    assert m.allocator.block_allocations == 1
    assert m.stats().allocation_failures == 1
    m.check_invariants()
    # A batch that fits goes through afterwards.
    m.extend_many([(a, 8), (b, 8), (c, 8)])
    assert m.allocator.num_free == 0
    m.check_invariants()


def test_extend_many_unknown_cache_changes_nothing() -> None:
    m = make()
    a, ta = m.create()
    with pytest.raises(CacheNotFound):
        m.extend_many([(a, 8), ("ghost", 4)])
    assert ta.block_ids == [] and ta.num_tokens == 0
    assert m.allocator.num_free == 12
    assert m.allocator.allocation_failures == 0


def test_extend_to_a_shorter_length_is_refused() -> None:
    """extend() only grows; a target below the current length raises and changes nothing."""
    m = make(12, 4)
    cid, t = m.create()
    m.extend(cid, 8)
    before = list(t.block_ids)
    with pytest.raises(InvalidLength) as info:
        m.extend(cid, 2)
    assert (info.value.cache_id, info.value.requested, info.value.current) == (cid, 2, 8)
    assert t.block_ids == before and t.num_tokens == 8
    assert m.allocator.allocation_failures == 0
    m.check_invariants()


@pytest.mark.parametrize("start", [0, 4])
def test_extend_to_a_negative_length_is_refused(start: int) -> None:
    m = make(12, 4)
    cid, t = m.create()
    m.extend(cid, start)
    with pytest.raises(InvalidLength):
        m.extend(cid, -1)
    assert t.num_tokens == start
    m.check_invariants()


def test_extend_many_with_one_backward_target_changes_nothing() -> None:
    m = make(12, 4)
    a, ta = m.create()
    b, tb = m.create()
    m.extend(b, 8)
    with pytest.raises(InvalidLength):
        m.extend_many([(a, 8), (b, 4)])
    assert ta.block_ids == [] and ta.num_tokens == 0
    assert tb.num_tokens == 8 and len(tb.block_ids) == 2
    assert m.allocator.num_used == 2
    assert m.allocator.allocation_failures == 0
    m.check_invariants()


@pytest.mark.parametrize("targets", [[8, 4], [4, 8], [4, 4]])
def test_extend_many_same_cache_twice_is_rejected(targets: list[int]) -> None:
    """A batch naming one cache twice is refused before anything moves.

    (Summing per entry would over-count the blocks needed, giving a spurious
    KvCacheExhausted, and a later smaller entry would leave blocks past the length.)
    """
    m = make(2, 4)
    a, t = m.create()
    b, tb = m.create()
    with pytest.raises(DuplicateCache) as info:
        m.extend_many([(a, targets[0]), (b, 1), (a, targets[1])])
    assert isinstance(info.value, KvCacheError)
    assert not isinstance(info.value, KvCacheExhausted)
    assert info.value.cache_id == a
    assert t.block_ids == [] and t.num_tokens == 0
    assert tb.block_ids == [] and tb.num_tokens == 0
    assert m.allocator.num_free == 2
    assert m.allocator.allocation_failures == 0
    m.check_invariants()


# -- truncate -----------------------------------------------------------------------------
def test_truncate_frees_blocks_past_new_length() -> None:
    m = make(12, 4)
    cid, t = m.create()
    m.extend(cid, 14)  # 4 blocks
    kept = list(t.block_ids[:2])
    assert m.truncate(cid, 7) == 2
    assert t.num_tokens == 7 and t.block_ids == kept
    assert m.allocator.num_used == 2
    m.check_invariants()
    assert m.truncate(cid, 5) == 0  # still needs 2 blocks
    assert t.num_tokens == 5 and len(t.block_ids) == 2
    assert m.truncate(cid, 4) == 1
    assert t.num_tokens == 4 and t.block_ids == kept[:1]
    m.check_invariants()


def test_truncate_to_same_length_frees_nothing() -> None:
    m = make()
    cid, t = m.create()
    m.extend(cid, 9)
    before = list(t.block_ids)
    assert m.truncate(cid, 9) == 0
    assert t.block_ids == before and t.num_tokens == 9
    m.check_invariants()


@pytest.mark.parametrize("bad", [10, 100, -1])
def test_truncate_out_of_range_raises(bad: int) -> None:
    m = make()
    cid, t = m.create()
    m.extend(cid, 9)
    with pytest.raises(InvalidLength) as info:
        m.truncate(cid, bad)
    assert (info.value.cache_id, info.value.requested, info.value.current) == (cid, bad, 9)
    assert t.num_tokens == 9 and len(t.block_ids) == 3
    m.check_invariants()


def test_truncate_to_zero_keeps_cache_registered() -> None:
    m = make()
    cid, t = m.create()
    m.extend(cid, 9)
    assert m.truncate(cid, 0) == 3
    assert cid in m
    assert m.get(cid) is t
    assert t.block_ids == [] and t.num_tokens == 0
    assert m.allocator.num_free == 12
    m.check_invariants()
    m.extend(cid, 2)  # usable again
    assert len(t.block_ids) == 1
    assert m.release(cid) == 1


def test_truncate_unknown_raises() -> None:
    m = make()
    with pytest.raises(CacheNotFound):
        m.truncate("nope", 0)


def test_truncated_blocks_are_reused_tail_first() -> None:
    m = make(4, 1)
    cid, t = m.create()
    m.extend(cid, 4)
    assert t.block_ids == [0, 1, 2, 3]
    m.truncate(cid, 1)
    # Blocks 3, 2, 1 went back tail first; the FIFO hands them out in that order.
    assert m.allocator.allocate(3) == [3, 2, 1]


# -- release ------------------------------------------------------------------------------
def test_release_returns_blocks_freed_and_is_idempotent() -> None:
    m = make()
    cid, _ = m.create()
    m.extend(cid, 10)
    assert m.release(cid) == 3
    assert cid not in m
    assert len(m) == 0
    assert m.allocator.num_free == 12
    assert m.release(cid) is None
    assert m.release(cid) is None
    assert m.allocator.num_free == 12
    m.check_invariants()


def test_release_empty_cache_returns_zero() -> None:
    m = make()
    cid, _ = m.create()
    assert m.release(cid) == 0


def test_release_unknown_raises_not_released() -> None:
    m = make()
    with pytest.raises(CacheNotFound) as info:
        m.release("never-seen")
    assert info.value.released is False
    assert info.value.cache_id == "never-seen"


def test_get_released_says_released() -> None:
    m = make()
    cid, _ = m.create("gone")
    m.release(cid)
    with pytest.raises(CacheNotFound) as info:
        m.get(cid)
    assert info.value.released is True
    assert "released" in str(info.value)
    with pytest.raises(CacheNotFound) as info:
        m.get("other")
    assert info.value.released is False


def test_released_ids_are_remembered_up_to_a_bound() -> None:
    m = KvCacheManager(1, 1)
    first, _ = m.create()
    m.release(first)
    for _ in range(RELEASED_IDS_REMEMBERED):
        cid, _ = m.create()
        m.release(cid)
    # The oldest one has been forgotten; the newest is still known.
    with pytest.raises(CacheNotFound) as info:
        m.get(first)
    assert info.value.released is False
    assert m.release(cid) is None


def test_release_all() -> None:
    m = make(12, 4)
    ids = [m.create()[0] for _ in range(3)]
    m.extend_many([(ids[0], 4), (ids[1], 9), (ids[2], 0)])
    assert m.release_all() == 3
    assert len(m) == 0
    assert m.allocator.num_free == 12
    for cid in ids:
        assert m.release(cid) is None
    assert m.release_all() == 0
    m.check_invariants()


# -- stats --------------------------------------------------------------------------------
def test_stats_fresh() -> None:
    assert make(12, 4).stats() == KvPoolStats(
        total_blocks=12,
        used_blocks=0,
        free_blocks=12,
        block_size=4,
        active_caches=0,
        block_allocations=0,
        allocation_failures=0,
        cached_blocks=0,
    )


def test_stats_after_operations() -> None:
    m = make(12, 4)
    a, _ = m.create()
    b, _ = m.create()
    m.extend_many([(a, 9), (b, 4)])  # 3 + 1
    with pytest.raises(KvCacheExhausted):
        m.extend(b, 40)
    m.truncate(a, 4)  # frees 2
    m.extend(b, 8)  # +1
    s = m.stats()
    assert s == KvPoolStats(
        total_blocks=12,
        used_blocks=3,
        free_blocks=9,
        block_size=4,
        active_caches=2,
        block_allocations=5,
        allocation_failures=1,
        cached_blocks=0,
    )
    m.release(a)
    s = m.stats()
    assert (s.used_blocks, s.free_blocks, s.active_caches) == (2, 10, 1)
    m.release_all()
    s = m.stats()
    assert (s.used_blocks, s.free_blocks, s.active_caches, s.block_allocations) == (0, 12, 0, 5)


# -- shared blocks ------------------------------------------------------------------------
def share_prefix(m: KvCacheManager, src: str, dst: str, n_blocks: int) -> None:
    """Simulate prefix sharing: dst takes src's first n_blocks (dst must be empty)."""
    ts, td = m.get(src), m.get(dst)
    for b in ts.block_ids[:n_blocks]:
        m.allocator.incref(b)
        td.block_ids.append(b)
    td.num_tokens = n_blocks * m.block_size


def test_shared_block_freed_only_by_last_holder() -> None:
    m = make(12, 4)
    a, ta = m.create()
    b, tb = m.create()
    m.extend(a, 8)  # 2 blocks
    share_prefix(m, a, b, 1)
    shared = ta.block_ids[0]
    assert m.allocator.ref_count(shared) == 2
    m.extend(b, 6)  # b gets 1 block of its own
    assert m.allocator.num_used == 3
    m.check_invariants()

    assert m.release(a) == 1  # only a's private block is freed
    assert m.allocator.ref_count(shared) == 1
    assert m.allocator.num_used == 2
    m.check_invariants()

    assert m.release(b) == 2  # shared block and b's own block
    assert m.allocator.ref_count(shared) == 0
    assert m.allocator.num_free == 12
    m.check_invariants()


def test_truncate_over_shared_block_does_not_free_it() -> None:
    m = make(12, 4)
    a, ta = m.create()
    b, tb = m.create()
    m.extend(a, 8)
    share_prefix(m, a, b, 2)
    assert m.truncate(b, 0) == 0  # both blocks still held by a
    assert m.allocator.num_used == 2
    m.check_invariants()
    assert m.truncate(a, 4) == 1
    assert m.release(a) == 1
    assert m.allocator.num_free == 12
    m.check_invariants()


def test_release_all_with_shared_blocks() -> None:
    m = make(12, 4)
    a, _ = m.create()
    m.extend(a, 12)
    others = [m.create()[0] for _ in range(3)]
    for o in others:
        share_prefix(m, a, o, 2)
    assert m.allocator.ref_count(m.get(a).block_ids[0]) == 4
    m.check_invariants()
    assert m.release_all() == 4
    assert m.allocator.num_free == 12
    m.check_invariants()


def test_check_invariants_detects_table_block_mismatch() -> None:
    m = make()
    cid, t = m.create()
    m.extend(cid, 4)
    t.block_ids.append(t.block_ids[0])  # referenced twice, ref count 1
    t.num_tokens = 8
    with pytest.raises(AssertionError):
        m.check_invariants()


def test_server_chosen_ids_skip_the_ids_to_avoid():
    m = KvCacheManager(8, 4)
    first, _ = m.create(None)
    number = int(first.rsplit("-", 1)[1])
    taken = {f"kv-{number + 1}", f"kv-{number + 2}"}
    second, _ = m.create(None, avoid=taken)
    assert second == f"kv-{number + 3}"
    for cache_id in taken:  # the callers' names stay free for them
        assert m.create(cache_id)[0] == cache_id


# -- K and V that were not computed here ----------------------------------------------------
def test_blocks_committed_unshared_are_never_offered_nor_those_after_them() -> None:
    m = make(num_blocks=16)
    prompt = list(range(1, 17))  # four blocks of 4
    m.create("imported")
    m.extend("imported", 6)
    m.commit("imported", 0, prompt[:4])  # computed here
    m.commit("imported", 4, prompt[4:6], share=False)  # imported from position 4: block 1 on
    m.extend("imported", 16)
    m.commit("imported", 6, prompt[6:])  # computed here, but on top of the imported block
    m.check_invariants()
    m.create("other")
    assert m.match_prefix("other", prompt, limit=15) == 4  # block 0 only
    m.release("other")
    m.release("imported")
    m.create("again")
    assert m.match_prefix("again", prompt, limit=15) == 4
    m.check_invariants()
