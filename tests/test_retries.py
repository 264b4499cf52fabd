"""A retry never undoes its own success, and server-chosen ids never collide with callers' ids.

1. A call cut off by its deadline goes on running on the executor's worker; when it ends,
   the caches it created are released, since its caller never learned of them. A retry of
   the same call, sent at once, gets those same caches by replay. The clean-up must then
   leave them alone, whichever of the two the worker runs first: a Decode on what the
   retry returned must work. Each RPC that creates caches is cut off here while its
   forward runs (the executor's forward is slowed by a switch), with many named caches.
2. When a batch mixes items without a cache id (the server chooses one) and items that name
   new caches, the server's choice never equals a name given in the same call.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from client import (
    DeadlineExceededError,
    DecodeInput,
    ExecutorClient,
    KvCacheHandle,
    PrefillInput,
    UnifiedBatchItem,
)
from executors.paged import PagedAttentionExecutor, PagedExecutorConfig
from tests.conftest import wait_until

CUT_AFTER_S = 0.3  # the first attempt's deadline
FORWARD_S = 1.0  # how long a slowed forward runs: the first attempt is cut off inside it
# An import has more to do before the step that is slowed (its stream, its checksums, its
# writes), so its deadline and its slowed step are longer: a busy machine still reaches the
# slowed step well before the deadline.
IMPORT_CUT_AFTER_S = 1.0
IMPORT_COMMIT_S = 3.0
NAMED = 40  # caches one BatchPrefill, UnifiedDecode or StepSession step creates


class Switchable(PagedAttentionExecutor):
    """The paged executor whose forward sleeps while `slow` is set; `slowed_ended` is set once
    such a forward has returned."""

    def __init__(self) -> None:
        super().__init__(PagedExecutorConfig(block_size=4, num_blocks=1024, max_batch_size=64))
        self.slow = threading.Event()
        self.slowed_ended = threading.Event()

    def _forward_step(self, items):
        if not self.slow.is_set():
            return super()._forward_step(items)
        time.sleep(FORWARD_S)
        try:
            return super()._forward_step(items)
        finally:
            self.slowed_ended.set()


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(3, 9))).tolist() for _ in range(n)]


def create(c: ExecutorClient, rpc: str, ids: list[str | None], timeout: float) -> list[KvCacheHandle]:
    """One call of `rpc` creating a cache per id (None: the server names it); the handles."""
    seqs = prompts(len(ids), seed=len(ids))
    if rpc == "Prefill":
        assert len(ids) == 1
        handle = None if ids[0] is None else KvCacheHandle(ids[0], 0)
        return [c.prefill(PrefillInput(seqs[0], kv_cache=handle), timeout=timeout).kv_cache]
    if rpc == "BatchPrefill":
        return [o.kv_cache for o in c.batch_prefill(
            [PrefillInput(p, kv_cache=None if i is None else KvCacheHandle(i, 0)) for i, p in zip(ids, seqs)],
            timeout=timeout)]
    items = [UnifiedBatchItem(i or "", p, 0, True) for i, p in zip(ids, seqs)]
    if rpc == "UnifiedDecode":
        return [r.kv_cache for r in c.unified_decode(items, timeout=timeout)]
    with c.step_session(timeout=timeout) as session:  # StepSession: the whole stream has the deadline
        return [r.kv_cache for r in session.step(items)]


def live(c: ExecutorClient) -> int:
    return c.status().kv_pool.active_caches


RPCS = ["Prefill", "BatchPrefill", "UnifiedDecode", "StepSession"]


@pytest.fixture
def served(make_server):
    executor = Switchable()
    running = make_server(instance=executor, max_batch_size=64)
    with ExecutorClient(running.address, timeout=30) as c:
        yield executor, c


@pytest.mark.parametrize("rpc", RPCS)
@pytest.mark.parametrize("retry", ["while the cut-off call still runs", "after its clean-up ran"])
def test_a_retried_call_keeps_what_it_got(served, rpc, retry):
    executor, c = served
    ids = ["solo"] if rpc == "Prefill" else [f"{rpc}-{i}" for i in range(NAMED)]
    executor.slow.set()
    with pytest.raises(DeadlineExceededError):
        create(c, rpc, ids, timeout=CUT_AFTER_S)
    if retry == "after its clean-up ran":
        # The first attempt finished, and its clean-up, queued behind it, released what it made.
        assert executor.slowed_ended.wait(30)
        wait_until(lambda: live(c) == 0, timeout=30)
    executor.slow.clear()
    handles = create(c, rpc, ids, timeout=30)  # the retry, identical
    assert [h.cache_id for h in handles] == ids
    # A Decode on every cache the retry returned: a clean-up that released them would make
    # these NOT_FOUND (CACHE_RELEASED). The worker runs calls in order, so this comes after it.
    steps = c.batch_decode([DecodeInput(7, h) for h in handles])
    assert all(s.kv_cache.sequence_length == h.sequence_length + 1 for s, h in zip(steps, handles))
    assert live(c) == len(ids)
    for s in steps:
        c.release_cache(s.kv_cache)
    assert c.status().kv_pool.free_blocks == c.status().kv_pool.total_blocks


@pytest.mark.parametrize("rpc", RPCS)
def test_a_cut_off_call_with_server_chosen_ids_leaves_nothing_behind(served, rpc):
    """Without names a retry cannot get the same caches: the first attempt's are released."""
    executor, c = served
    ids = [None] if rpc == "Prefill" else [None] * NAMED
    executor.slow.set()
    with pytest.raises(DeadlineExceededError):
        create(c, rpc, ids, timeout=CUT_AFTER_S)
    executor.slow.clear()
    handles = create(c, rpc, ids, timeout=30)
    time.sleep(FORWARD_S)  # the first attempt's clean-up has run by now (the retry ran after it)
    c.batch_decode([DecodeInput(7, h) for h in handles])
    assert live(c) == len(ids)
    for h in handles:
        c.release_cache(h.cache_id)
    assert live(c) == 0 and c.status().kv_pool.free_blocks == c.status().kv_pool.total_blocks


def next_server_id(c: ExecutorClient) -> str:
    """The id the server will choose next: one past the one it chooses now."""
    probe = c.prefill(PrefillInput([1])).kv_cache.cache_id
    c.release_cache(probe)
    prefix, number = probe.rsplit("-", 1)
    return f"{prefix}-{int(number) + 1}"


@pytest.mark.parametrize("rpc", ["BatchPrefill", "UnifiedDecode", "StepSession"])
@pytest.mark.parametrize("named_first", [False, True])
def test_server_chosen_ids_avoid_the_names_callers_give_in_the_call(client, rpc, named_first):
    upcoming = next_server_id(client)
    ids = [upcoming, None, None] if named_first else [None, upcoming, None]
    handles = create(client, rpc, ids, timeout=30)
    got = [h.cache_id for h in handles]
    assert got[ids.index(upcoming)] == upcoming
    assert len(set(got)) == 3, got  # three caches, three ids
    for h in handles:
        client.release_cache(h.cache_id)


def test_a_creation_is_unclaimed_until_another_call_completes_on_it():
    from executors.cache_state import CacheRegistry

    reg = CacheRegistry()
    serial = reg.add("c", owner=None)
    assert reg.unclaimed("c", serial)
    reg.claim("c")
    assert not reg.unclaimed("c", serial)
    reg.remove("c")
    again = reg.add("c", owner=None)  # the id released and created anew: another creation
    assert again != serial and not reg.unclaimed("c", serial) and reg.unclaimed("c", again)


class SlowImport(Switchable):
    """Also slows the last part of an import (adopting its blocks) while `slow` is set."""

    def __init__(self) -> None:
        super().__init__()
        commit = self.kv.commit

        def slow_commit(*args, **kwargs):
            if not self.slow.is_set():
                return commit(*args, **kwargs)
            time.sleep(IMPORT_COMMIT_S)
            try:
                return commit(*args, **kwargs)
            finally:
                self.slowed_ended.set()

        self.kv.commit = slow_commit


@pytest.mark.parametrize("into", ["a new cache", "the cache it extends"])
def test_a_retried_import_keeps_what_it_got(make_server, into):
    """The first ImportKv is cut off while its blocks are adopted; the identical retry is
    answered `replayed`, and the first attempt's clean-up, running after it, leaves it alone."""
    executor = SlowImport()
    running = make_server(instance=executor, max_batch_size=64)
    with ExecutorClient(running.address, timeout=30) as c:
        tokens = prompts(1, seed=3)[0] + [5, 6, 7, 8]
        c.prefill(PrefillInput(tokens, kv_cache=KvCacheHandle("src", 0)))
        if into == "a new cache":
            stream, target, start = list(c.export_kv("src")), "moved", 0
        else:
            start = 4
            c.prefill(PrefillInput(tokens[:start], kv_cache=KvCacheHandle("dst", 0)))
            stream, target = list(c.export_kv("src", start)), "dst"
        executor.slow.set()
        with pytest.raises(DeadlineExceededError):
            c.import_kv(iter(stream), target, timeout=IMPORT_CUT_AFTER_S)
        executor.slow.clear()
        retry = c.import_kv(iter(stream), target)
        assert retry.replayed and retry.kv_cache.sequence_length == len(tokens)
        assert executor.slowed_ended.wait(30)  # the cut-off attempt ended: its clean-up is queued
        time.sleep(0.5)  # and has run by now
        step = c.decode(DecodeInput(7, retry.kv_cache))
        assert step.kv_cache.sequence_length == len(tokens) + 1
        for cache in c.list_caches():
            c.release_cache(cache.cache_id)
        assert c.status().kv_pool.free_blocks == c.status().kv_pool.total_blocks


def test_a_retried_chunk_without_logits_is_replayed_whatever_policy_it_carries(paged_server):
    """A non-final chunk returns no logits, so its policy is not checked; even a NaN one
    (never equal to itself) must not stop its identical retry from being replayed."""
    import math

    import grpc

    from generated.modelexec.v1 import executor_pb2 as pb
    from generated.modelexec.v1 import executor_pb2_grpc as pb_grpc

    item = pb.UnifiedBatchItem(seq_id="chunked", q_tokens=[1, 2, 3, 4, 5], pos_offset=0, is_final_chunk=False,
                               logits_policy=pb.LogitsPolicy(sample=pb.SampleToken(temperature=math.nan)))
    request = pb.UnifiedDecodeRequest(batch=pb.UnifiedBatch(items=[item]))
    with grpc.insecure_channel(paged_server.address) as channel:
        stub = pb_grpc.ModelExecutorServiceStub(channel)
        first, retry = stub.UnifiedDecode(request), stub.UnifiedDecode(request)
        assert retry.results[0].kv_cache == first.results[0].kv_cache
        assert retry.results[0].kv_cache.block_table.sequence_length == 5
        stub.ReleaseCache(pb.ReleaseCacheRequest(cache_id="chunked"))
