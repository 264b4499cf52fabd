"""Prefix reuse in the bookkeeping: hash chains, sharing, LRU eviction, copy-on-write.

The stateful test at the end runs random prefills, decodes, truncations and releases over a
fake pool (a list of tokens per block, written the way the executor writes K and V) and
checks after every step that each live cache reads back exactly its own tokens.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvcache import KvCacheManager
from kvcache.block_allocator import BlockAllocator, CachedBlock
from kvcache.prefix_hash import block_hash, root_hash

BS = 4


def prefill(m: KvCacheManager, tokens: list[int], namespace: str = "") -> tuple[str, int]:
    """What the executor does for a new prompt: match, grow, (write), commit."""
    cid, _ = m.create(namespace=namespace)
    matched = m.match_prefix(cid, tokens, limit=len(tokens) - 1) or 0
    m.extend(cid, len(tokens))
    m.commit(cid, matched, tokens[matched:])
    return cid, matched


def test_a_second_prompt_reuses_the_full_blocks_of_the_first() -> None:
    m = KvCacheManager(16, BS)
    prompt = list(range(10, 24))  # 3 full blocks + 2 tokens
    a, matched_a = prefill(m, prompt)
    assert matched_a == 0
    b, matched_b = prefill(m, prompt + [99])
    assert matched_b == 12
    ta, tb = m.get(a), m.get(b)
    assert tb.block_ids[:3] == ta.block_ids[:3]
    assert tb.block_ids[3] != ta.block_ids[3]  # the partial block is never shared
    assert all(m.allocator.ref_count(blk) == 2 for blk in ta.block_ids[:3])
    assert tb.tokens == prompt + [99] and tb.num_tokens == 15
    m.check_invariants()


def test_the_last_prompt_token_is_always_computed() -> None:
    m = KvCacheManager(16, BS)
    prompt = list(range(8))  # exactly two blocks
    prefill(m, prompt)
    _, matched = prefill(m, prompt)
    assert matched == 4  # not 8: the last token's logits must be computed


def test_match_stops_at_the_first_differing_block() -> None:
    m = KvCacheManager(16, BS)
    prefill(m, list(range(12)) + [0])
    _, matched = prefill(m, [0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11, 0])
    assert matched == 4


def test_namespaces_never_share() -> None:
    m = KvCacheManager(16, BS)
    prompt = list(range(9))
    prefill(m, prompt, namespace="adapter-a@1")
    assert prefill(m, prompt, namespace="adapter-b@2")[1] == 0
    assert prefill(m, prompt)[1] == 0
    assert prefill(m, prompt, namespace="adapter-a@1")[1] == 8


def test_lookup_checks_tokens_and_parent_not_just_the_hash() -> None:
    a = BlockAllocator(4)
    (b,) = a.allocate(1)
    parent = root_hash("")
    h = block_hash(parent, (1, 2, 3, 4))
    assert a.set_hash(b, h, CachedBlock(parent, (1, 2, 3, 4)))
    assert a.lookup(h, CachedBlock(parent, (1, 2, 3, 4))) == b
    # As if another prefix collided on the same hash: refused.
    assert a.lookup(h, CachedBlock(parent, (1, 2, 3, 5))) is None
    assert a.lookup(h, CachedBlock(root_hash("other"), (1, 2, 3, 4))) is None
    a.check_invariants()


def test_released_blocks_keep_their_prefix_until_needed() -> None:
    m = KvCacheManager(8, BS)
    prompt = list(range(13))
    a, _ = prefill(m, prompt)
    m.release(a)
    s = m.stats()
    assert (s.used_blocks, s.free_blocks, s.cached_blocks) == (0, 8, 3)
    b, matched = prefill(m, prompt)
    assert matched == 12
    assert m.stats().cached_blocks == 0  # revived
    p = m.prefix_stats()
    assert (p.entries, p.evictions) == (3, 0)
    m.check_invariants()
    del b


def test_eviction_takes_plain_blocks_first_then_the_least_recently_used() -> None:
    m = KvCacheManager(6, BS)
    old, _ = prefill(m, [1] * 4 + [2] * 4 + [7])  # blocks hashed: 2
    new, _ = prefill(m, [3] * 4 + [4] * 4 + [7])  # blocks hashed: 2
    old_blocks, new_blocks = m.get(old).block_ids[:2], m.get(new).block_ids[:2]
    m.release(old)
    m.release(new)
    assert m.stats().cached_blocks == 4
    filler, _ = m.create()
    m.extend(filler, 2 * BS)  # two plain blocks are free: no eviction
    assert m.prefix_stats().evictions == 0
    m.extend(filler, 4 * BS)  # two more: the least recently used cached blocks go
    assert m.prefix_stats().evictions == 2
    taken = set(m.get(filler).block_ids)
    # "old" was released first, and within it the tail block before the head block.
    assert set(old_blocks) <= taken and not set(new_blocks) & taken
    m.release(filler)
    assert prefill(m, [3] * 4 + [4] * 4 + [7])[1] == 8
    assert prefill(m, [1] * 4 + [2] * 4 + [7])[1] == 0
    m.check_invariants()


def test_shared_blocks_survive_the_release_of_one_sharer() -> None:
    m = KvCacheManager(16, BS)
    prompt = list(range(9))
    a, _ = prefill(m, prompt)
    b, matched = prefill(m, prompt + [5])
    shared = m.get(a).block_ids[:2]
    assert matched == 8
    m.release(a)
    assert all(m.allocator.ref_count(blk) == 1 for blk in shared)
    assert m.get(b).block_ids[:2] == shared
    m.check_invariants()


def test_a_write_into_a_shared_block_copies_it_first() -> None:
    m = KvCacheManager(16, BS)
    prompt = list(range(9))
    a, _ = prefill(m, prompt)
    b, _ = prefill(m, prompt + [5])
    shared = m.get(a).block_ids[1]
    m.truncate(b, 6)  # into the shared second block
    free_before = m.allocator.num_free
    copies = m.extend(b, 7)
    (src, dst), = copies
    assert src == shared and dst != shared
    assert m.get(b).block_ids[1] == dst and m.get(a).block_ids[1] == shared
    assert m.allocator.ref_count(shared) == 1 and m.allocator.ref_count(dst) == 1
    assert m.allocator.num_free == free_before - 1
    assert m.allocator.hash_of(shared) is not None  # a's block still names its prefix
    m.check_invariants()


def test_a_write_into_an_unshared_cached_block_drops_its_name() -> None:
    m = KvCacheManager(16, BS)
    a, _ = prefill(m, list(range(9)))
    block = m.get(a).block_ids[1]
    m.truncate(a, 6)
    assert m.allocator.hash_of(block) is not None  # intact until written
    assert m.extend(a, 7) == []
    assert m.allocator.hash_of(block) is None
    m.commit(a, 6, [60])
    assert prefill(m, list(range(9)))[1] == 4
    m.check_invariants()


def test_a_copy_counts_against_an_all_or_nothing_batch() -> None:
    m = KvCacheManager(4, BS)
    a, _ = prefill(m, list(range(9)))  # 3 blocks
    b, _ = prefill(m, list(range(8)) + [1])  # shares 2, takes the last free block
    m.truncate(b, 6)  # frees b's third block
    assert m.allocator.num_free == 1
    other, _ = m.create()
    with pytest.raises(Exception) as info:
        m.extend_many([(b, 7), (other, 1)])  # a copy + a new block: 2 > 1 free
    assert info.value.blocks_needed == 2
    assert m.get(b).block_ids[1] == m.get(a).block_ids[1]  # nothing changed
    m.check_invariants()


def test_chunked_prefill_continues_the_chain() -> None:
    m = KvCacheManager(32, BS)
    long = list(range(30))
    prefill(m, long)
    cid, _ = m.create()
    # First chunk of 12: 8 reused (the last block recomputed), then the next chunk looks up again.
    matched = m.match_prefix(cid, long[:12], limit=11)
    assert matched == 8
    m.extend(cid, 12)
    m.commit(cid, 8, long[8:12])
    assert m.match_prefix(cid, long[12:24], limit=11) == 8
    assert m.get(cid).num_tokens == 20
    m.check_invariants()


def test_match_needs_an_aligned_cache_with_known_tokens() -> None:
    m = KvCacheManager(16, BS)
    prefill(m, list(range(12)))
    cid, _ = m.create()
    m.extend(cid, 2)
    m.commit(cid, 0, [0, 1])
    assert m.match_prefix(cid, list(range(2, 12)), limit=9) is None  # mid-block
    unknown, _ = m.create()
    m.extend(unknown, 4)  # never committed
    assert m.match_prefix(unknown, list(range(4, 12)), limit=7) is None
    assert m.match_prefix(m.create()[0], [0, 1, 2], limit=2) is None  # under one block


def test_equal_prefixes_computed_at_once_are_cached_once() -> None:
    m = KvCacheManager(16, BS)
    a, _ = m.create()
    b, _ = m.create()
    m.extend_many([(a, 5), (b, 5)])
    m.commit(a, 0, [1, 2, 3, 4, 5])
    m.commit(b, 0, [1, 2, 3, 4, 5])
    assert m.prefix_stats().entries == 1
    m.release(a)
    assert prefill(m, [1, 2, 3, 4, 9])[1] == 4
    m.check_invariants()


def test_prefix_caching_off() -> None:
    m = KvCacheManager(16, BS, prefix_caching=False)
    prompt = list(range(9))
    prefill(m, prompt)
    cid, matched = prefill(m, prompt)
    assert matched == 0 and m.match_prefix(m.create()[0], prompt, 8) is None
    p = m.prefix_stats()
    assert (p.enabled, p.entries, p.lookups) == (False, 0, 0)


def test_lookup_counters() -> None:
    m = KvCacheManager(16, BS)
    m.record_lookup(0)
    m.record_lookup(8)
    m.record_lookup(4)
    p = m.prefix_stats()
    assert (p.lookups, p.hits, p.misses, p.saved_tokens) == (3, 2, 1, 12)


def test_clear_prefix_cache() -> None:
    m = KvCacheManager(16, BS)
    a, _ = prefill(m, list(range(9)))
    m.release(a)
    assert m.clear_prefix_cache() == 2
    assert m.stats().cached_blocks == 0
    assert prefill(m, list(range(9)))[1] == 0
    m.check_invariants()


# -- random operations against a fake pool ------------------------------------------------
NUM_BLOCKS = 10
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=14)  # a tiny alphabet: many shared prefixes


class PrefixMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = KvCacheManager(NUM_BLOCKS, BS)
        self.pool: list[list[int | None]] = [[None] * BS for _ in range(NUM_BLOCKS)]
        self.model: dict[str, list[int]] = {}  # what each live cache must read back

    def _write(self, cid: str, start: int, tokens: list[int]) -> bool:
        """extend + copy + write + commit, as the executor does; False when the pool is full."""
        try:
            copies = self.m.extend(cid, start + len(tokens))
        except Exception as e:  # KvCacheExhausted: nothing changed
            assert type(e).__name__ == "KvCacheExhausted"
            return False
        for src, dst in copies:
            self.pool[dst] = list(self.pool[src])
        table = self.m.get(cid)
        for p, tok in enumerate(tokens, start):
            self.pool[table.block_ids[p // BS]][p % BS] = tok
        self.m.commit(cid, start, tokens)
        return True

    @rule(index=st.integers(0, 50), extra=TOKENS)
    def fork(self, index: int, extra: list[int]) -> None:
        """A prompt that starts with a live cache's tokens: sharing guaranteed."""
        if self.model:
            self.new_prompt(self.model[sorted(self.model)[index % len(self.model)]] + extra)

    @rule(tokens=TOKENS)
    def new_prompt(self, tokens: list[int]) -> None:
        cid, _ = self.m.create()
        matched = self.m.match_prefix(cid, tokens, limit=len(tokens) - 1) or 0
        if self._write(cid, matched, tokens[matched:]):
            self.model[cid] = list(tokens)
        else:
            self.m.release(cid)

    @rule(index=st.integers(0, 50), token=st.integers(0, 2))
    def decode(self, index: int, token: int) -> None:
        if self.model:
            cid = sorted(self.model)[index % len(self.model)]
            if self._write(cid, len(self.model[cid]), [token]):
                self.model[cid].append(token)

    @rule(index=st.integers(0, 50), cut=st.integers(0, 14))
    def truncate(self, index: int, cut: int) -> None:
        if self.model:
            cid = sorted(self.model)[index % len(self.model)]
            length = min(cut, len(self.model[cid]))
            self.m.truncate(cid, length)
            del self.model[cid][length:]

    @rule(index=st.integers(0, 50), cut=st.integers(0, 14))
    def rewrite(self, index: int, cut: int) -> None:
        """A rejected draft: roll back, then write a different token where the old one was."""
        if self.model:
            cid = sorted(self.model)[index % len(self.model)]
            tokens = list(self.model[cid])
            if tokens:
                length = cut % len(tokens)
                self.truncate(index, length)
                self.decode(index, (tokens[length] + 1) % 3)

    @rule(index=st.integers(0, 50))
    def release(self, index: int) -> None:
        if self.model:
            cid = sorted(self.model)[index % len(self.model)]
            self.m.release(cid)
            del self.model[cid]

    @invariant()
    def every_cache_reads_back_its_own_tokens(self) -> None:
        self.m.check_invariants()
        for cid, tokens in self.model.items():
            table = self.m.get(cid)
            assert table.num_tokens == len(tokens)
            got = [self.pool[table.block_ids[p // BS]][p % BS] for p in range(len(tokens))]
            assert got == tokens, cid

    @invariant()
    def cached_blocks_hold_what_their_names_say(self) -> None:
        a = self.m.allocator
        for b in range(NUM_BLOCKS):
            if a.hash_of(b) is not None:
                assert tuple(self.pool[b]) == a._entries[b].tokens


PrefixMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=25, deadline=None)
TestPrefixMachine = PrefixMachine.TestCase
