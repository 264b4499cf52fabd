"""Prefix reuse for KvCacheManager: naming filled blocks by their chain hash (`commit`),
taking cached blocks into a new prefill's table (`match_prefix`), and its counters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvcache.block_allocator import CachedBlock
from kvcache.block_table import FREED
from kvcache.prefix_hash import block_hash, root_hash


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    enabled: bool
    lookups: int  # prefills that could have reused at least one full block
    hits: int  # lookups that reused at least one
    saved_tokens: int  # prompt tokens whose K and V were reused instead of computed
    entries: int  # blocks carrying a hash, held or free
    evictions: int  # cached blocks whose memory was taken for new tokens

    @property
    def misses(self) -> int:
        return self.lookups - self.hits


class PrefixCacheMixin:
    """Mixed into KvCacheManager (its allocator, block_size, prefix_caching, get and tables)."""

    def match_prefix(self, cache_id: str, tokens: Sequence[int], limit: int) -> int | None:
        """Append cached blocks that hold the leading tokens of `tokens`, which continue the
        cache; returns how many tokens they cover (whole blocks, at most `limit`), or None
        when no lookup is possible (prefix caching off, the cache ends mid-block or its
        tokens are not all committed, or `limit` is under one block).
        """
        table = self.get(cache_id)
        bs = self.block_size
        if (not self.prefix_caching or limit < bs or table.num_tokens % bs
                or len(table.tokens) != table.num_tokens or len(table.block_hashes) != table.num_tokens // bs):
            return None
        parent = table.block_hashes[-1] if table.block_hashes else root_hash(table.namespace)
        matched = 0
        while matched + bs <= min(limit, len(tokens)):
            chunk = tuple(int(t) for t in tokens[matched:matched + bs])
            h = block_hash(parent, chunk)
            block = self.allocator.lookup(h, CachedBlock(parent, chunk))
            if block is None:
                break
            self.allocator.share(block)
            table.block_ids.append(block)
            table.block_hashes.append(h)
            table.tokens.extend(chunk)
            table.num_tokens += bs
            parent = h
            matched += bs
        return matched

    def commit(self, cache_id: str, start: int, tokens: Sequence[int], share: bool = True) -> None:
        """Record tokens whose K and V are now written at positions start.., and hash every
        block they fill, so later prefills can reuse it; with share=False (K and V this
        executor did not compute) none from the one holding `start` on ever will be."""
        table = self.get(cache_id)
        if not share:
            first = start // self.block_size
            table.unshared_from = first if table.unshared_from is None else min(table.unshared_from, first)
        if len(table.tokens) != start or start + len(tokens) > table.num_tokens:
            return  # earlier tokens unknown: this cache's blocks cannot be named
        table.tokens.extend(int(t) for t in tokens)
        if not self.prefix_caching:
            return
        bs = self.block_size
        while len(table.block_hashes) < len(table.tokens) // bs:
            i = len(table.block_hashes)
            parent = table.block_hashes[-1] if i else root_hash(table.namespace)
            chunk = tuple(table.tokens[i * bs:(i + 1) * bs])
            h = block_hash(parent, chunk)
            table.block_hashes.append(h)
            # False when an equal block is cached already (two caches computed the same
            # prefix at once): this one stays private and nameless.
            if table.block_ids[i] != FREED and (table.unshared_from is None or i < table.unshared_from):
                self.allocator.set_hash(table.block_ids[i], h, CachedBlock(parent, chunk))

    def record_lookup(self, matched_tokens: int) -> None:
        """Count a prefill that looked up the prefix cache, once it has run."""
        self.prefix_lookups += 1
        self.prefix_hits += matched_tokens > 0
        self.prefix_saved_tokens += matched_tokens

    def clear_prefix_cache(self) -> int:
        """Forget every cached prefix (blocks and live caches keep their K and V); returns
        how many blocks carried a hash."""
        for table in self._tables.values():
            table.block_hashes.clear()
            table.tokens.clear()  # nothing of them can be named any more
        return self.allocator.drop_all_hashes()

    def prefix_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            enabled=self.prefix_caching,
            lookups=self.prefix_lookups,
            hits=self.prefix_hits,
            saved_tokens=self.prefix_saved_tokens,
            entries=self.allocator.num_cached,
            evictions=self.allocator.evictions,
        )
