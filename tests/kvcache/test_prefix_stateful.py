"""Prefix reuse under random prefills, appends, truncations and releases, against a simulated pool.

The machine drives KvCacheManager the way the executor does (match_prefix, extend with
copy-on-write, write the K/V of the computed tokens, commit; on failure unswap and truncate
back) and keeps what every pool slot holds. After each step every cache must read back
exactly its own tokens through its block table, and every named block must hold the
tokens its name says: a reused block with the wrong K/V, a write that leaks into a sharer,
a rolled-back cache reading a copy never made, or a name that outlives its contents all
fail here. A three-token alphabet makes shared prefixes common.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvcache import KvCacheExhausted, KvCacheManager

NUM_BLOCKS = 16
BLOCK_SIZE = 4
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=18)
INDEX = st.integers(0, 63)
FAIL = st.sampled_from([None, "copy", "forward"])  # where a batched step fails, if it does


class PrefixMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = KvCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.slots: dict[int, tuple[str, int]] = {}  # flat slot -> (namespace, token) whose K/V it holds
        self.model: dict[str, list[int]] = {}  # live cache -> its tokens
        self.namespace: dict[str, str] = {}
        self.reused_total = 0

    def pick(self, index: int) -> str | None:
        ids = sorted(self.model)
        return ids[index % len(ids)] if ids else None

    def _step(self, cid: str, tokens: list[int], reuse: bool, created: bool) -> None:
        """One prefill or append of `tokens` to cid, as the executor's step (executors/kv_step.py run_step) runs it."""
        table = self.m.get(cid)
        start = table.num_tokens
        reused = self.m.match_prefix(cid, tokens, limit=len(tokens) - 1) if reuse else None
        skip = reused or 0
        try:
            copies = self.m.extend(cid, start + len(tokens))
        except KvCacheExhausted:
            if created:
                self.m.release(cid)
                del self.namespace[cid]
            elif table.num_tokens > start:
                self.m.truncate(cid, start)  # drop the prefix blocks it was given
            return
        self._copy(copies)  # the pool copies before the forward writes
        ns = self.namespace[cid]
        for slot, tok in zip(table.slots(start + skip, start + len(tokens)), tokens[skip:], strict=True):
            self.slots[slot] = (ns, tok)
        self.m.commit(cid, start + skip, tokens[skip:])
        if reused is not None:
            self.m.record_lookup(reused)
            self.reused_total += reused
        self.model[cid] = self.model.get(cid, []) + tokens

    @rule(tokens=TOKENS, namespace=st.sampled_from(["", "adapter-a"]))
    def prefill(self, tokens: list[int], namespace: str) -> None:
        cid, _ = self.m.create(namespace=namespace)
        self.namespace[cid] = namespace
        self._step(cid, tokens, reuse=True, created=True)

    @rule(index=INDEX, keep=st.integers(1, 24), extra=st.lists(st.integers(0, 2), max_size=5),
          rewrite=st.none() | st.tuples(st.booleans(), st.integers(1, 20), st.integers(0, 2)))
    def fork(self, index: int, keep: int, extra: list[int], rewrite: tuple[bool, int, int] | None) -> None:
        """A prompt that starts like a live cache, so it shares that cache's full blocks;
        then, maybe, one of the two rolls back into a shared block and writes there."""
        src = self.pick(index)
        if src is None or not self.model[src][:keep] + extra:
            return
        cid, _ = self.m.create(namespace=self.namespace[src])
        self.namespace[cid] = self.namespace[src]
        self._step(cid, self.model[src][:keep] + extra, reuse=True, created=True)
        if rewrite is not None and cid in self.model:
            use_source, at, token = rewrite
            target = src if use_source else cid
            self._rewrite(target, at % (len(self.model[target]) + 1), token)

    def _rewrite(self, cid: str, length: int, token: int) -> None:
        self.m.truncate(cid, length)
        del self.model[cid][length:]
        self._step(cid, [token], reuse=False, created=False)

    @rule(index=INDEX, back=st.integers(1, 2 * BLOCK_SIZE), token=st.integers(0, 2))
    def rewrite(self, index: int, back: int, token: int) -> None:
        """Roll back into a block (possibly a shared one) and write another token there."""
        cid = self.pick(index)
        if cid is not None:
            self._rewrite(cid, max(0, len(self.model[cid]) - back), token)

    @rule(index=INDEX, tokens=TOKENS, chunk=st.booleans())
    def append(self, index: int, tokens: list[int], chunk: bool) -> None:
        cid = self.pick(index)
        if cid is not None:
            # A prefill chunk looks the prefix cache up again; a decode step does not.
            self._step(cid, tokens if chunk else tokens[:1], reuse=chunk, created=False)

    @rule(picks=st.lists(st.tuples(INDEX, st.integers(0, 3 * BLOCK_SIZE), st.integers(0, 2)), min_size=1,
                         max_size=3), fail=FAIL)
    def batch(self, picks: list[tuple[int, int, int]], fail: str | None) -> None:
        """Caches cut back to absolute lengths, then written one token each as one step."""
        work: dict[str, tuple[int, int]] = {}
        for index, at, token in picks:
            cid = self.pick(index)
            if cid is not None and cid not in work:
                work[cid] = (at, token)
        self._batch(work, fail)

    @rule(index=INDEX, block=st.integers(0, 3), src_first=st.booleans(), fail=FAIL,
          cuts=st.lists(st.tuples(st.integers(1, BLOCK_SIZE - 1), st.integers(0, 2)), min_size=2, max_size=2))
    def fork_batch(self, index: int, block: int, src_first: bool, fail: str | None,
                   cuts: list[tuple[int, int]]) -> None:
        """A copy of a live cache (sharing its full blocks), then both cut back into the same
        shared block and written as one step: a block that only the step's writers hold is
        copied for all but one of them."""
        long = [c for c in sorted(self.model) if len(self.model[c]) > BLOCK_SIZE]
        if not long:
            return
        src = long[index % len(long)]
        cid, _ = self.m.create(namespace=self.namespace[src])
        self.namespace[cid] = self.namespace[src]
        self._step(cid, list(self.model[src]), reuse=True, created=True)
        if cid not in self.model:
            return
        i = min(block, (len(self.model[src]) - 1) // BLOCK_SIZE - 1)  # a block the copy took from the cache
        shared = self.m.get(cid).block_ids[i]
        # src, or whichever cache held the block the copy took (an equal block cached first)
        other = next((c for c in sorted(self.model, key=lambda c: c != src)
                      if c != cid and self.m.get(c).block_ids[i:i + 1] == [shared]), None)
        if other is not None:
            order = [other, cid] if src_first else [cid, other]
            self._batch({c: (i * BLOCK_SIZE + offset, token) for c, (offset, token) in zip(order, cuts)}, fail)

    def _batch(self, work: dict[str, tuple[int, int]], fail: str | None) -> None:
        """Each cache cut to a length (at most its own) and written one token, as one step,
        which may fail in its copy or after its forward wrote: then rolled back as run_step
        does (unswap, then each cache cut back to its length before the step)."""
        for cid, (at, _) in work.items():
            length = min(at, len(self.model[cid]))
            self.m.truncate(cid, length)
            del self.model[cid][length:]
        swapped: list = []
        try:
            copies = self.m.extend_many([(cid, len(self.model[cid]) + 1) for cid in work], swapped)
        except KvCacheExhausted:
            return
        if fail != "copy":
            self._copy(copies)
            for cid, (_, token) in work.items():
                (slot,) = self.m.get(cid).slots(len(self.model[cid]), len(self.model[cid]) + 1)
                self.slots[slot] = (self.namespace[cid], token)
        if fail is not None:
            self.m.unswap(swapped)
            for cid in work:
                self.m.truncate(cid, len(self.model[cid]))
            return
        for cid, (_, token) in work.items():
            self.m.commit(cid, len(self.model[cid]), [token])
            self.model[cid].append(token)

    def _copy(self, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:
            for off in range(BLOCK_SIZE):
                if src * BLOCK_SIZE + off in self.slots:
                    self.slots[dst * BLOCK_SIZE + off] = self.slots[src * BLOCK_SIZE + off]

    @rule(index=INDEX, cut=st.integers(0, 20))
    def truncate(self, index: int, cut: int) -> None:
        cid = self.pick(index)
        if cid is not None:
            length = max(0, len(self.model[cid]) - cut)
            self.m.truncate(cid, length)
            del self.model[cid][length:]

    @rule(index=INDEX)
    def release(self, index: int) -> None:
        cid = self.pick(index)
        if cid is not None:
            self.m.release(cid)
            del self.model[cid], self.namespace[cid]

    @invariant()
    def every_cache_reads_its_own_tokens(self) -> None:
        self.m.check_invariants()
        assert set(self.m.cache_ids()) == set(self.model)
        for cid, tokens in self.model.items():
            table = self.m.get(cid)
            assert table.num_tokens == len(tokens) and table.tokens == tokens
            # Synced here: later changes must reach them.
            assert table.ids_array().tolist() == table.block_ids and table.ids_tuple() == tuple(table.block_ids)
            ns = self.namespace[cid]
            assert [self.slots[s] for s in table.slots(0, len(tokens))] == [(ns, t) for t in tokens], cid

    @invariant()
    def every_named_block_holds_what_its_name_says(self) -> None:
        a = self.m.allocator
        for block, entry in a._entries.items():
            held = [self.slots.get(block * BLOCK_SIZE + off) for off in range(BLOCK_SIZE)]
            assert [tok for _, tok in held] == list(entry.tokens), block
        assert self.m.prefix_stats().saved_tokens == self.reused_total
        assert a.num_used == len({b for cid in self.model for b in self.m.get(cid).block_ids})

    def teardown(self) -> None:
        self.m.release_all()
        assert self.m.allocator.num_free == NUM_BLOCKS
        self.m.check_invariants()


PrefixMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestPrefixMachine = PrefixMachine.TestCase
