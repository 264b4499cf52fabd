"""Device faults inside a step or at the start of an import, against a real server and the
real client: the pool's copy-on-write copy raising torch.OutOfMemoryError (its
index_select allocates on the GPU), or the step failing after its forward wrote K and V.

The call fails with RESOURCE_EXHAUSTED (DEVICE_OUT_OF_MEMORY) and changes nothing: every
cache holds the blocks and tokens it held before, so the retry returns the logits of a
cache-free forward over the same tokens; an import that fails before it reads the stream
gives back the blocks it reserved.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from client import DecodeInput, ExecutorClient, KvCacheHandle, PrefillInput, ResourceExhaustedError
from executors.paged import PagedAttentionExecutor, PagedExecutorConfig

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]  # two full blocks of 4


class Faulty(PagedAttentionExecutor):
    """The paged executor, whose block copies fail while `fail_copy` is set and whose
    steps fail after their forward (K and V written) while `fail_after_forward` is."""

    def __init__(self) -> None:
        super().__init__(PagedExecutorConfig(block_size=4, num_blocks=64))
        self.fail_copy = False
        self.fail_after_forward = False
        copy = self.pool.copy_blocks

        def copy_blocks(pairs):
            if self.fail_copy and pairs:
                raise torch.OutOfMemoryError("CUDA out of memory (injected in copy_blocks)")
            return copy(pairs)

        self.pool.copy_blocks = copy_blocks

    def _forward_step(self, items):
        out = super()._forward_step(items)
        if self.fail_after_forward:
            raise torch.OutOfMemoryError("CUDA out of memory (injected after the forward)")
        return out


@pytest.fixture
def served(make_server):
    executor = Faulty()
    running = make_server(instance=executor)
    with ExecutorClient(running.address, timeout=30) as c:
        # Blocks used once and given back: a block handed out fresh holds stale K and V, not zeros.
        c.release_cache(c.prefill(PrefillInput([31] * 60)).kv_cache)
        yield executor, c


def tables(ex: Faulty) -> tuple[dict, int, int]:
    """Every cache's blocks, length and known tokens; used blocks; holds (read between calls)."""
    kv = ex.kv
    return ({cid: (list(kv.get(cid).block_ids), kv.get(cid).num_tokens, list(kv.get(cid).tokens))
             for cid in kv.cache_ids()}, kv.stats().used_blocks, kv.holds)


def expected(c: ExecutorClient, tokens: list[int]) -> np.ndarray:
    """The next-token logits after `tokens`, from a forward that uses no cache."""
    return c.forward(tokens).output[-1]


def sharers(c: ExecutorClient, a_length: int, b_length: int) -> tuple[KvCacheHandle, KvCacheHandle]:
    """Caches a and b sharing PROMPT's two blocks, cut back into the second one: held by them alone."""
    a = c.prefill(PrefillInput(PROMPT)).kv_cache
    b = c.prefill(PrefillInput(PROMPT + [9])).kv_cache
    assert b.block_ids[:2] == a.block_ids  # the prefix cache gave b both of a's blocks
    return c.truncate_kv(a, a_length).kv_cache, c.truncate_kv(b, b_length).kv_cache


def fail_once(ex: Faulty, fault: str, call):
    setattr(ex, fault, True)
    try:
        with pytest.raises(ResourceExhaustedError) as info:
            call()
    finally:
        setattr(ex, fault, False)
    assert info.value.reason == "DEVICE_OUT_OF_MEMORY"


def test_a_decode_whose_copy_on_write_fails_leaves_its_cache_as_it_was(served):
    ex, c = served
    a, b = sharers(c, 6, 9)  # a ends inside a block b still holds in full
    before = tables(ex)
    fail_once(ex, "fail_copy", lambda: c.decode(DecodeInput(11, a)))
    assert tables(ex) == before  # a holds the shared block again, not the copy never made
    retry = c.decode(DecodeInput(11, a))
    np.testing.assert_allclose(retry.logits.logits, expected(c, PROMPT[:6] + [11]), atol=1e-5)
    np.testing.assert_allclose(c.decode(DecodeInput(12, b)).logits.logits, expected(c, PROMPT + [9, 12]),
                               atol=1e-5)


@pytest.mark.parametrize("fault", ["fail_copy", "fail_after_forward"])
@pytest.mark.parametrize("shorter_first", [True, False])
def test_a_failed_batch_whose_caches_share_a_block_leaves_them_as_they_were(served, fault, shorter_first):
    """a (5 tokens) and b (7) end in a block only they hold: one of them copies it, the other
    writes it in place. Whichever fails, each retried decode reads its own K and V."""
    ex, c = served
    a, b = sharers(c, 5, 7)
    items = [DecodeInput(11, a), DecodeInput(12, b)]
    if not shorter_first:
        items.reverse()
    before = tables(ex)
    fail_once(ex, fault, lambda: c.batch_decode(items))
    assert tables(ex) == before
    got = c.batch_decode(items)  # the retry
    for item, out in zip(items, got):
        tokens = (PROMPT + [9])[:item.kv_cache.sequence_length] + [item.token_id]
        np.testing.assert_allclose(out.logits.logits, expected(c, tokens), atol=1e-5)
    for out in got:
        c.release_cache(out.kv_cache)
    assert tables(ex) == ({}, 0, 0)


def test_an_import_whose_copy_fails_gives_its_reservation_back(served):
    """The import extends a cache that ends inside a block: its last block is copied into
    the reservation before any chunk is read, and that copy fails."""
    ex, c = served
    tokens = list(range(1, 11))
    c.prefill(PrefillInput(tokens, kv_cache=KvCacheHandle("src", 0)))
    c.prefill(PrefillInput(tokens[:6], kv_cache=KvCacheHandle("dst", 0)))
    stream = list(c.export_kv("src", 6))
    used = c.status().kv_pool.used_blocks
    fail_once(ex, "fail_copy", lambda: c.import_kv(iter(stream), "dst"))
    assert c.status().kv_pool.used_blocks == used
    done = c.import_kv(iter(stream), "dst")  # the retry
    assert done.kv_cache.sequence_length == 10 and not done.replayed
    np.testing.assert_allclose(c.decode(DecodeInput(11, done.kv_cache)).logits.logits,
                               expected(c, tokens + [11]), atol=1e-5)
    c.release_cache("src")
    c.release_cache("dst")
    assert tables(ex) == ({}, 0, 0)  # no reservation left behind
