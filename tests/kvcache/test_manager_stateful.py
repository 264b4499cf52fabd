"""Random create / extend / extend_many / truncate / release sequences against a model."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvcache import CacheAlreadyExists, CacheNotFound, InvalidLength, KvCacheExhausted, KvCacheManager

NUM_BLOCKS = 12
BLOCK_SIZE = 4
MAX_LEN = NUM_BLOCKS * BLOCK_SIZE + 8  # a bit past what the pool can hold
INDEX = st.integers(0, 63)  # picks a live cache by position in sorted order


def blocks(length: int) -> int:
    return -(-length // BLOCK_SIZE)


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = KvCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.model: dict[str, int] = {}  # live cache id -> length
        self.released: set[str] = set()
        self.failures = 0
        self.allocations = 0

    def used(self) -> int:
        return sum(blocks(n) for n in self.model.values())

    def pick(self, index: int) -> str:
        ids = sorted(self.model)
        return ids[index % len(ids)]

    # -- rules (those needing a live or released cache do nothing without one) --------
    @rule(named=st.booleans(), suffix=st.integers(0, 30))
    def create(self, named: bool, suffix: int) -> None:
        if named:
            cid = f"kv-{suffix}"  # collides with fresh ids on purpose
            if cid in self.model:
                with pytest.raises(CacheAlreadyExists):
                    self.m.create(cid)
                return
            got, table = self.m.create(cid)
            assert got == cid
        else:
            got, table = self.m.create()
            assert got not in self.model
        assert table.num_tokens == 0 and table.block_ids == []
        self.model[got] = 0
        self.released.discard(got)

    @rule(index=INDEX, grow=st.integers(0, MAX_LEN))
    def extend(self, index: int, grow: int) -> None:
        if not self.model:
            return
        cid = self.pick(index)
        target = min(self.model[cid] + grow, MAX_LEN)
        need = blocks(target) - blocks(self.model[cid])
        free = NUM_BLOCKS - self.used()
        if need > free:
            with pytest.raises(KvCacheExhausted) as info:
                self.m.extend(cid, target)
            assert (info.value.blocks_needed, info.value.blocks_free) == (need, free)
            self.failures += 1
        else:
            self.m.extend(cid, target)
            self.model[cid] = target
            self.allocations += need

    @rule(picks=st.lists(st.tuples(INDEX, st.integers(0, 3 * BLOCK_SIZE)), min_size=1, max_size=4))
    def extend_many(self, picks: list[tuple[int, int]]) -> None:
        if not self.model:
            return
        grow_by: dict[str, int] = {}
        for index, grow in picks:  # each cache at most once per batch
            grow_by.setdefault(self.pick(index), grow)
        targets = [(cid, self.model[cid] + grow) for cid, grow in grow_by.items()]
        need = sum(blocks(t) - blocks(self.model[cid]) for cid, t in targets)
        free = NUM_BLOCKS - self.used()
        before = {cid: (list(self.m.get(cid).block_ids), self.m.get(cid).num_tokens) for cid in self.model}
        if need > free:
            with pytest.raises(KvCacheExhausted) as info:
                self.m.extend_many(targets)
            assert (info.value.blocks_needed, info.value.blocks_free) == (need, free)
            self.failures += 1
            after = {cid: (list(self.m.get(cid).block_ids), self.m.get(cid).num_tokens) for cid in self.model}
            assert after == before
        else:
            self.m.extend_many(targets)
            self.model.update(targets)
            self.allocations += need
            for cid, _ in targets:  # existing blocks stay in place
                old = before[cid][0]
                assert self.m.get(cid).block_ids[: len(old)] == old

    @rule(index=INDEX, length=st.integers(-1, MAX_LEN + 2))
    def truncate(self, index: int, length: int) -> None:
        if not self.model:
            return
        cid = self.pick(index)
        cur = self.model[cid]
        if length > cur + 2:
            length %= cur + 3  # mostly valid lengths, sometimes one or two past the end
        if length < 0 or length > cur:
            with pytest.raises(InvalidLength):
                self.m.truncate(cid, length)
            return
        freed = self.m.truncate(cid, length)
        assert freed == blocks(cur) - blocks(length)
        self.model[cid] = length

    @rule(index=INDEX)
    def release(self, index: int) -> None:
        if not self.model:
            return
        cid = self.pick(index)
        assert self.m.release(cid) == blocks(self.model.pop(cid))
        self.released.add(cid)
        assert self.m.release(cid) is None

    @rule(index=INDEX)
    def lookup_released(self, index: int) -> None:
        if not self.released:
            return
        ids = sorted(self.released)
        cid = ids[index % len(ids)]
        with pytest.raises(CacheNotFound) as info:
            self.m.get(cid)
        assert info.value.released is True
        assert self.m.release(cid) is None

    # -- checks after every step ----------------------------------------------------------
    @invariant()
    def books_balance(self) -> None:
        self.m.check_invariants()
        a = self.m.allocator
        assert a.num_used + a.num_free == a.num_total == NUM_BLOCKS
        assert a.num_used == self.used()
        assert set(self.m.cache_ids()) == set(self.model)
        for cid, length in self.model.items():
            t = self.m.get(cid)
            assert t.num_tokens == length
            assert len(t.block_ids) == blocks(length)
            # Synced here: later changes must reach them.
            assert t.ids_array().tolist() == t.block_ids and t.ids_tuple() == tuple(t.block_ids)
        s = self.m.stats()
        assert (s.used_blocks, s.free_blocks, s.active_caches) == (self.used(), NUM_BLOCKS - self.used(), len(self.model))
        assert (s.allocation_failures, s.block_allocations) == (self.failures, self.allocations)

    def teardown(self) -> None:
        assert self.m.release_all() == len(self.model)
        a = self.m.allocator
        assert a.num_free == NUM_BLOCKS and a.num_used == 0
        assert len(self.m) == 0
        self.m.check_invariants()


ManagerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=12, deadline=None)
TestManagerMachine = ManagerMachine.TestCase
