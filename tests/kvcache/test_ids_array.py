"""BlockTable.ids_array and ids_tuple: the int32 copy of a table's block ids the step's kernels
read, kept in step with the list by copying only what was appended or marked changed, and the
tuple a step's plan and its handles take, made again only when the table grew or changed. Every way the manager
changes a table in place or shortens it must mark it: a stale entry would send a row's
attention to another sequence's blocks."""

from __future__ import annotations

import numpy as np

from kvcache import BlockTable, KvCacheManager
from kvcache.block_table import FREED

BS = 4


def synced(m: KvCacheManager) -> None:
    """Each table's array equals its list (and the manager's invariants, which check the
    entries synced before, hold)."""
    m.check_invariants()
    for cid in m.cache_ids():
        t = m.get(cid)
        array = t.ids_array()
        assert array.dtype == np.int32 and array.tolist() == t.block_ids, cid
        assert t.ids_tuple() == tuple(t.block_ids), cid


def test_appends_are_copied_and_marked_entries_copied_again():
    t = BlockTable(BS, [3, 1, 4])
    assert t.ids_array().tolist() == [3, 1, 4]
    t.block_ids.extend(range(100, 140))  # past the array's first capacity: it grows
    assert t.ids_array().tolist() == [3, 1, 4, *range(100, 140)]
    t.block_ids[1] = 9
    assert t.ids_array()[1] == 1  # not marked: the array keeps what it copied
    assert not t.copies_in_step()
    t.changed(1)
    assert t.copies_in_step() and t.ids_array().tolist()[:3] == [3, 9, 4]
    del t.block_ids[2:]
    t.block_ids.append(7)  # as long as before the cut would not tell it apart: marked
    t.changed(2)
    assert t.ids_array().tolist() == [3, 9, 7]
    assert BlockTable(BS).ids_array().shape == (0,)


def test_the_tuple_is_kept_until_the_table_grows_or_changes():
    t = BlockTable(BS, [3, 1, 4])
    first = t.ids_tuple()
    assert first == (3, 1, 4) and t.ids_tuple() is first  # no copy a step
    t.block_ids.append(5)
    assert t.ids_tuple() == (3, 1, 4, 5)
    del t.block_ids[3:]
    t.block_ids.append(6)  # as long as before: only the mark tells
    t.changed(3)
    assert t.ids_tuple() == (3, 1, 4, 6) and t.copies_in_step()
    t.block_ids[0] = 7
    assert not t.copies_in_step()


def test_truncate_then_grow_back_swap_and_unswap_reach_the_array():
    m = KvCacheManager(16, BS)
    m.create("a")
    m.extend("a", 10)
    m.commit("a", 0, list(range(10)))
    synced(m)
    m.truncate("a", 3)  # back into the first block, then grown past the old length in new blocks
    m.extend("a", 10)
    synced(m)
    m.create("p")
    m.extend("p", 8)
    m.commit("p", 0, list(range(50, 58)))
    m.create("b")  # shares p's two blocks, then writes into the second: a copy swapped in
    assert m.match_prefix("b", list(range(50, 58)) + [9], limit=8) == 8
    m.truncate("b", 6)
    synced(m)
    swapped: list = []
    copies = m.extend_many([("b", 7)], swapped)
    assert copies and m.get("b").block_ids[1] == copies[0][1]
    synced(m)
    m.unswap(swapped)  # a failed step's undo: the shared block back in place
    m.truncate("b", 6)
    assert m.get("b").block_ids[1] == copies[0][0]
    synced(m)


def test_a_sliding_window_and_an_adopted_extension_reach_the_array():
    m = KvCacheManager(32, BS, prefix_caching=False)
    m.enable_sliding(window=8, reserve=0)
    m.create("w")
    m.extend("w", 6)
    synced(m)
    m.extend("w", 30)
    assert m.slide("w") > 0 and m.get("w").block_ids[0] == FREED
    synced(m)
    kept = m.get("w").ids_tuple()
    assert m.slide("w") == 0 and m.get("w").ids_tuple() is kept  # a step that moves no block: nothing made again
    m.create("x")
    m.extend("x", 6)
    synced(m)
    hold = m.reserve(6, 12, extend="x")  # a partly filled last block: the copy replaces it
    m.adopt(hold, None, 12, extend="x")
    synced(m)
