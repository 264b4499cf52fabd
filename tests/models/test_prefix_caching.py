"""Prefix caching end to end: a real server on a tiny random Qwen3, checked against transformers.

Reused K and V must give the logits a prompt gets without any reuse; sharers must never see
each other's writes (copy-on-write through TruncateKv); GetCacheMetrics must count what
happened. The weight-free paged executor gets the same checks against its NumPy re-computation.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from client import DecodeInput, ExecutorClient, LogitsPolicy, PrefillInput, UnifiedBatchItem
from executors.llm import LlmExecutor, LlmExecutorConfig
from service.config import ServeConfig
from tests.conftest import start_server
from tests.models.tiny_models import VOCAB, build

TOL = 1e-4
BS = 4
rng = np.random.default_rng(11)


def prompt(n: int) -> list[int]:
    return rng.integers(0, VOCAB, size=n).tolist()


def close(actual, expected) -> None:
    np.testing.assert_allclose(actual, expected, atol=TOL, rtol=0)


class Served:
    def __init__(self, root, prefix_caching: bool = True, num_blocks: int = 256) -> None:
        self.oracle = build("qwen3", root)
        self.executor = LlmExecutor(LlmExecutorConfig(model_dir=str(root), block_size=BS, num_blocks=num_blocks,
                                                      prefix_caching=prefix_caching))
        self.computed_rows: list[int] = []  # rows of each forward: what was not reused
        inner = self.executor.model.hidden_states

        def counting(ids, *args, **kwargs):
            self.computed_rows.append(int(ids.shape[0]))
            return inner(ids, *args, **kwargs)

        self.executor.model.hidden_states = counting
        self.running = start_server(ServeConfig(port=0, executor="llm", model=str(root)), self.executor)
        self.client = ExecutorClient(self.running.address, timeout=60)
        self.computed_rows.clear()  # the start-up warm-up

    @torch.no_grad()
    def logits(self, tokens: list[int]) -> np.ndarray:
        return self.oracle(torch.tensor([tokens])).logits[0].float().numpy()

    def close(self) -> None:
        self.client.close()
        self.running.stop()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = Served(tmp_path_factory.mktemp("qwen3"))
    yield s
    s.close()



def metrics(c: ExecutorClient):
    m = c.cache_metrics()
    return m.hits, m.misses, m.saved_prefill_tokens


def test_prefill_with_a_cached_prefix_equals_prefill_without(served):
    c = served.client
    system, question = prompt(22), prompt(5)
    full = system + question
    ref = served.logits(full + [7, 8])
    first = c.prefill(PrefillInput(system + prompt(3)))
    hits, misses, saved = metrics(c)
    served.computed_rows.clear()
    second = c.prefill(PrefillInput(full))
    assert served.computed_rows == [len(full) - 20], "the 5 full blocks of the shared system prompt are reused"
    assert metrics(c) == (hits + 1, misses, saved + 20)
    close(second.logits.logits, ref[len(full) - 1])
    # Decoding continues from the reused blocks as from computed ones.
    h = second.kv_cache
    for i, t in enumerate([7, 8]):
        step = c.decode(DecodeInput(t, h))
        close(step.logits.logits, ref[len(full) + i])
        h = step.kv_cache
    c.release_cache(h)
    c.release_cache(first.kv_cache)


def test_released_prompts_stay_cached_and_the_last_token_is_always_computed(served):
    c = served.client
    tokens = prompt(16)  # exactly four blocks
    ref = served.logits(tokens)
    c.release_cache(c.prefill(PrefillInput(tokens)).kv_cache)
    assert c.status().kv_pool.cached_blocks >= 4
    served.computed_rows.clear()
    again = c.prefill(PrefillInput(tokens))
    assert served.computed_rows == [4], "three blocks reused; the last block is recomputed for its logits"
    close(again.logits.logits, ref[-1])
    c.release_cache(again.kv_cache)


def test_shared_blocks_survive_the_release_of_one_sharer(served):
    c = served.client
    common = prompt(12)
    a_tokens, b_tokens = common + prompt(3), common + prompt(4)
    a = c.prefill(PrefillInput(a_tokens)).kv_cache
    b = c.prefill(PrefillInput(b_tokens)).kv_cache
    assert list(b.block_ids[:3]) == list(a.block_ids[:3])
    c.release_cache(a)
    step = c.decode(DecodeInput(9, b))
    close(step.logits.logits, served.logits(b_tokens + [9])[-1])
    c.release_cache(step.kv_cache)


def test_copy_on_write_leaves_the_other_sequence_untouched(served):
    c = served.client
    tokens = prompt(13)
    a = c.prefill(PrefillInput(tokens)).kv_cache
    b = c.prefill(PrefillInput(tokens + [1])).kv_cache  # shares a's three full blocks
    shared = a.block_ids[2]
    assert b.block_ids[2] == shared
    # Roll b back into the shared third block and write a different token there.
    b = c.truncate_kv(b, 10).kv_cache
    other = (tokens[10] + 1) % VOCAB
    step = c.decode(DecodeInput(other, b))
    assert step.kv_cache.block_ids[2] != shared, "b got its own copy of the block"
    close(step.logits.logits, served.logits(tokens[:10] + [other])[-1])
    # a still reads its own tokens from the untouched block.
    a_step = c.decode(DecodeInput(5, a))
    assert a_step.kv_cache.block_ids[2] == shared
    close(a_step.logits.logits, served.logits(tokens + [5])[-1])
    c.release_cache(a_step.kv_cache)
    c.release_cache(step.kv_cache)


def test_batch_prefill_and_chunked_unified_prefill_reuse_too(served):
    c = served.client
    system = prompt(24)
    seed = c.prefill(PrefillInput(system + [3])).kv_cache
    tails = [prompt(2), prompt(6)]
    served.computed_rows.clear()
    outs = c.batch_prefill([PrefillInput(system + t) for t in tails])
    assert served.computed_rows == [sum(len(t) for t in tails)]  # both reuse the 24 system tokens
    for t, o in zip(tails, outs):
        close(o.logits.logits, served.logits(system + t)[-1])
    # A chunked prefill looks the cache up again at each block-aligned chunk.
    served.computed_rows.clear()
    first = c.unified_decode([UnifiedBatchItem("", system[:12], 0, False)])[0]
    rest = c.unified_decode([UnifiedBatchItem(first.seq_id, system[12:] + [3, 4], 12, True,
                                              logits_policy=LogitsPolicy.full())])[0]
    assert served.computed_rows == [4, 2]  # 8 of the first chunk and all 12 system tokens of the second reused
    close(rest.logits.logits, served.logits(system + [3, 4])[-1])
    for h in [seed, rest.seq_id, *(o.kv_cache for o in outs)]:
        c.release_cache(h)


def test_cache_metrics_report_entries_bytes_and_the_decode_histogram(served):
    c = served.client
    m = c.cache_metrics()
    assert m.enabled and m.block_size == BS and m.position == "real-kv-reuse"
    assert m.entries > 0
    status = c.status()
    per_block = served.executor.pool.bytes_per_block
    assert m.bytes == m.entries * per_block
    assert status.kv_pool.cached_blocks <= m.entries
    assert m.decode_batch.calls > 0 and m.decode_batch.bucket_calls.m1 > 0
    assert c.capabilities().supports_prefix_caching


def test_a_full_pool_evicts_cached_prefixes_least_recently_used_first(tmp_path):
    s = Served(tmp_path, num_blocks=12)
    try:
        c = s.client
        old, new = prompt(17), prompt(17)  # four full blocks each
        c.release_cache(c.prefill(PrefillInput(old)).kv_cache)
        c.release_cache(c.prefill(PrefillInput(new)).kv_cache)
        assert c.cache_metrics().evictions == 0
        # All 12 blocks are free, 8 of them cached (old's four full blocks, then new's).
        # Seven blocks take the 4 plain ones, then evict old's, least recently used
        # first: its tail blocks before its head.
        big = c.prefill(PrefillInput(prompt(28))).kv_cache
        m = c.cache_metrics()
        assert m.evictions == 3 and m.entries == 8 - 3 + 7
        c.release_cache(big)
        s.computed_rows.clear()
        c.release_cache(c.prefill(PrefillInput(new + [1])).kv_cache)
        assert s.computed_rows == [2], "the more recently used prompt is still cached"
        close_rows = s.computed_rows[:]
        c.release_cache(c.prefill(PrefillInput(old + [1])).kv_cache)
        # old's head block was the least recently used when new's fifth block was taken.
        assert s.computed_rows[len(close_rows):] == [18], "the older prompt was evicted"
    finally:
        s.close()


def test_prefix_caching_off(tmp_path):
    s = Served(tmp_path, prefix_caching=False)
    try:
        c = s.client
        tokens = prompt(20)
        for _ in range(2):
            c.release_cache(c.prefill(PrefillInput(tokens)).kv_cache)
        assert s.computed_rows == [20, 20]
        m = c.cache_metrics()
        assert (m.enabled, m.hits, m.misses, m.entries) == (False, 0, 0, 0)
        assert not c.capabilities().supports_prefix_caching
    finally:
        s.close()


def test_paged_executor_reuse_matches_the_numpy_recomputation(paged_server):
    from tests.paged_reference import PagedModel

    with ExecutorClient(paged_server.address) as c:
        tokens = [int(t) for t in rng.integers(0, 256, size=40)]
        a = c.prefill(PrefillInput(tokens)).kv_cache
        before = c.cache_metrics()
        b = c.prefill(PrefillInput(tokens[:37] + [7]))
        after = c.cache_metrics()
        assert after.saved_prefill_tokens - before.saved_prefill_tokens == 36  # nine whole blocks of four
        close(b.logits.logits, PagedModel().logits(tokens[:37] + [7])[-1])
        c.release_cache(a)
        c.release_cache(b.kv_cache)
