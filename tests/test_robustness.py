"""Retries, stale handles, orphans, leases, ownership and device OOM, through real servers."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from client import (
    AsyncExecutorClient,
    DeadlineExceededError,
    DecodeInput,
    ExecutorClient,
    FailedPreconditionError,
    KvCacheHandle,
    LogitsPolicy,
    NotFoundError,
    PrefillInput,
    ResourceExhaustedError,
    UnifiedBatchItem,
)
from executors.errors import PermissionDenied
from executors.identity import current_identity
from executors.paged import PagedAttentionExecutor, PagedExecutorConfig
from executors.types import DecodeInput as DomainDecode
from executors.types import LogitsPolicy as DomainPolicy
from executors.types import PrefillInput as DomainPrefill
from tests.conftest import wait_until

# Asserts wall-clock bounds or orders events by sleeping: `make test` runs it alone (tests/conftest.py).
pytestmark = pytest.mark.alone

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pool_is_free(c: ExecutorClient) -> bool:
    kv = c.status().kv_pool
    return kv.active_caches == 0 and kv.free_blocks == kv.total_blocks


# -- retries ---------------------------------------------------------------------------------
def test_a_retried_decode_returns_the_same_result_and_appends_once(client):
    pre = client.prefill(PrefillInput([1, 2, 3]))
    step = DecodeInput(7, pre.kv_cache, logits_policy=LogitsPolicy.sample(0.9, seed=None))
    first = client.decode(step)
    again = client.decode(step)  # as if the first answer was lost on the way back
    assert again.kv_cache.sequence_length == first.kv_cache.sequence_length == 4
    assert again.logits.token_id == first.logits.token_id  # even an unseeded sample is replayed
    nxt = client.decode(DecodeInput(8, first.kv_cache))
    assert nxt.kv_cache.sequence_length == 5
    # Not a retry: another token at the same position, or another policy, is a stale handle.
    with pytest.raises(FailedPreconditionError):
        client.decode(DecodeInput(9, first.kv_cache))
    with pytest.raises(FailedPreconditionError):
        client.decode(DecodeInput(8, first.kv_cache, logits_policy=LogitsPolicy.argmax()))
    client.release_cache(nxt.kv_cache)


def test_a_retried_unified_step_and_named_prefill_are_replayed(client):
    named = client.prefill(PrefillInput([4, 5, 6], kv_cache=KvCacheHandle("retry-me", 0)))
    again = client.prefill(PrefillInput([4, 5, 6], kv_cache=KvCacheHandle("retry-me", 0)))
    np.testing.assert_array_equal(named.logits.logits, again.logits.logits)
    assert again.kv_cache.sequence_length == 3
    items = [UnifiedBatchItem("retry-me", [7], 3, True), UnifiedBatchItem("fresh-one", [1, 2], 0, True)]
    first = client.unified_decode(items)
    second = client.unified_decode(items)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a.logits.logits, b.logits.logits)
        assert a.kv_cache == b.kv_cache
    assert client.status().kv_pool.active_caches == 2
    for r in first:
        client.release_cache(r.seq_id)


def test_truncate_ends_the_replay_of_the_undone_step(client):
    pre = client.prefill(PrefillInput([1, 2, 3]))
    step = DecodeInput(4, pre.kv_cache)
    client.decode(step)
    client.truncate_kv(pre.kv_cache, 3)
    redo = client.decode(step)  # the cache is at 3 again: this is a new step, computed afresh
    assert redo.kv_cache.sequence_length == 4
    client.truncate_kv(pre.kv_cache, 2)
    with pytest.raises(FailedPreconditionError):
        client.decode(step)
    client.release_cache(pre.kv_cache)


# -- orphans ---------------------------------------------------------------------------------
class SlowPaged(PagedAttentionExecutor):
    def _forward_step(self, items):
        time.sleep(0.6)
        return super()._forward_step(items)


def slow_server(make_server, **overrides):
    return make_server(instance=SlowPaged(PagedExecutorConfig(block_size=4, num_blocks=64)), **overrides)


def test_a_deadline_exceeded_mid_prefill_leaves_nothing_allocated(make_server):
    running = slow_server(make_server)
    with ExecutorClient(running.address) as c:
        with pytest.raises(DeadlineExceededError):
            c.prefill(PrefillInput(list(range(20))), timeout=0.2)
        with pytest.raises(DeadlineExceededError):
            c.batch_prefill([PrefillInput([1, 2]), PrefillInput([3], kv_cache=KvCacheHandle("named", 0))],
                            timeout=0.2)
        wait_until(lambda: pool_is_free(c))


def test_a_cancelled_call_leaves_nothing_allocated(make_server):
    running = slow_server(make_server)

    async def drive() -> None:
        async with AsyncExecutorClient(running.address) as c:
            task = asyncio.create_task(c.prefill(PrefillInput(list(range(30)))))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(drive())
    with ExecutorClient(running.address) as c:
        wait_until(lambda: pool_is_free(c))


def test_idle_caches_are_reclaimed_when_their_lease_runs_out(make_server):
    running = make_server(cache_ttl_seconds=0.5)
    with ExecutorClient(running.address) as c:
        assert c.capabilities().limits.cache_ttl_seconds == 0.5
        idle = c.prefill(PrefillInput([1, 2, 3])).kv_cache
        busy = c.prefill(PrefillInput([4, 5])).kv_cache
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:  # keep one cache in use
            busy = c.decode(DecodeInput(6, busy)).kv_cache
            time.sleep(0.1)
        with pytest.raises(NotFoundError) as info:
            c.decode(DecodeInput(1, idle))
        assert info.value.reason == "CACHE_RELEASED"
        status = c.status().kv_pool
        assert status.active_caches == 1 and status.leases_expired == 1
        c.release_cache(busy)


class SlowOnMarker(PagedAttentionExecutor):
    """A step with an item starting at token SLOW_MARKER takes 1.2 s; the others are instant."""

    def _forward_step(self, items):
        if any(it.tokens and it.tokens[0] == SLOW_MARKER for it in items):
            time.sleep(1.2)
        return super()._forward_step(items)


SLOW_MARKER = 250


def test_a_lease_runs_from_a_calls_end_and_not_while_it_waits(make_server):
    """A 0.5 s lease: a cache whose prefill took 1.2 s is not reaped before its owner's next
    call (it was: the lease ran from the step's start), nor one whose decode arrived in time
    but waited behind another caller's 1.2 s step (it was: reaped while the call queued)."""
    running = make_server(instance=SlowOnMarker(PagedExecutorConfig(block_size=4, num_blocks=64)),
                          cache_ttl_seconds=0.5)

    async def drive():
        async with AsyncExecutorClient(running.address, timeout=30) as c:
            slow = (await c.prefill(PrefillInput([SLOW_MARKER, 1, 2]))).kv_cache
            slow = (await c.decode(DecodeInput(3, slow))).kv_cache  # right after: still leased
            await c.release_cache(slow)
            waiting = (await c.prefill(PrefillInput([4, 5]))).kv_cache
            other = asyncio.create_task(c.prefill(PrefillInput([SLOW_MARKER, 7])))
            await asyncio.sleep(0.2)  # the slow step is running: this decode queues behind it
            waiting = (await c.decode(DecodeInput(6, waiting))).kv_cache
            other = (await other).kv_cache
            for h in (waiting, other):
                await c.release_cache(h)
            return (await c.status()).kv_pool

    pool = asyncio.run(drive())
    assert pool.leases_expired == 0 and pool.active_caches == 0


def test_a_cache_an_import_extends_is_not_reaped_while_the_stream_runs(make_server):
    running = make_server(cache_ttl_seconds=0.3)
    with ExecutorClient(running.address) as c:
        source = c.prefill(PrefillInput(list(range(1, 13)))).kv_cache
        c.prefill(PrefillInput(list(range(1, 9)), KvCacheHandle("target", 0)))
        messages = list(c.export_kv(source, start=8))
        c.release_cache(source)

        def slow_stream():
            for message in messages:
                yield message
                time.sleep(0.5)  # longer than the lease, between each message

        assert c.import_kv(slow_stream(), "target").kv_cache.sequence_length == 12
        c.release_cache("target")
        assert c.status().kv_pool.leases_expired == 0


CLIENT_SCRIPT = textwrap.dedent("""
    import sys
    from client import ExecutorClient, PrefillInput, DecodeInput
    with ExecutorClient(sys.argv[1]) as c:
        handles = [c.prefill(PrefillInput(list(range(1, 40)))).kv_cache for _ in range(3)]
        print("ready", flush=True)
        while True:
            handles = [c.decode(DecodeInput(5, h)).kv_cache for h in handles]
""")


def test_a_client_killed_mid_stream_has_its_caches_reclaimed(make_server):
    running = make_server(cache_ttl_seconds=1.0)
    proc = subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT, running.address], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        with ExecutorClient(running.address) as c:
            assert c.status().kv_pool.active_caches == 3
            wait_until(lambda: pool_is_free(c), timeout=10)
            assert c.status().kv_pool.leases_expired == 3
    finally:
        if proc.poll() is None:
            proc.kill()


# -- ownership -------------------------------------------------------------------------------
def test_a_cache_belongs_to_the_identity_that_created_it():
    ex = PagedAttentionExecutor(PagedExecutorConfig(block_size=4, num_blocks=32))

    async def as_(identity, coro_fn):
        token = current_identity.set(identity)
        try:
            return await coro_fn()
        finally:
            current_identity.reset(token)

    async def scenario() -> None:
        out = await as_("alice", lambda: ex.prefill(DomainPrefill(input_ids=[1, 2, 3])))
        handle = out.kv_cache
        for attempt in (lambda: ex.decode(DomainDecode(token_id=4, kv_cache=handle)),
                        lambda: ex.truncate_kv(handle.cache_id, 1),
                        lambda: ex.release_cache(handle.cache_id),
                        lambda: ex.forward_verify(handle, [1, 2], DomainPolicy())):
            with pytest.raises(PermissionDenied):
                await as_("bob", attempt)
        step = await as_("alice", lambda: ex.decode(DomainDecode(token_id=4, kv_cache=handle)))
        assert step.kv_cache.sequence_length == 4
        assert (await as_("alice", lambda: ex.release_cache(handle.cache_id))).released

    asyncio.run(scenario())
    ex.worker.close()


# -- device out of memory --------------------------------------------------------------------
class OomOnLongPrompts(PagedAttentionExecutor):
    def _forward_step(self, items):
        if any(len(it.tokens) > 50 for it in items):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super()._forward_step(items)


def test_device_out_of_memory_is_resource_exhausted_and_rolls_back(make_server):
    running = make_server(instance=OomOnLongPrompts(PagedExecutorConfig(block_size=4, num_blocks=64)))
    with ExecutorClient(running.address) as c:
        keep = c.prefill(PrefillInput([1, 2, 3])).kv_cache
        with pytest.raises(ResourceExhaustedError) as info:
            c.batch_prefill([PrefillInput(list(range(60))), PrefillInput([4, 5])])
        assert info.value.reason == "DEVICE_OUT_OF_MEMORY"
        with pytest.raises(ResourceExhaustedError):
            c.unified_decode([UnifiedBatchItem(keep.cache_id, list(range(60)), 3, True)])
        assert c.status().kv_pool.active_caches == 1
        assert c.decode(DecodeInput(4, keep)).kv_cache.sequence_length == 4  # its cache rolled back intact
        c.release_cache(keep.cache_id)
        assert pool_is_free(c)


def test_rpcs_beyond_the_concurrency_limit_are_refused(make_server):
    running = slow_server(make_server, max_concurrent_rpcs=2)

    async def drive() -> None:
        async with AsyncExecutorClient(running.address) as c:
            assert (await c.capabilities()).limits.max_concurrent_rpcs == 2
            calls = [asyncio.create_task(c.prefill(PrefillInput([i + 1]))) for i in range(2)]
            await asyncio.sleep(0.2)
            with pytest.raises(ResourceExhaustedError):
                await c.prefill(PrefillInput([9]))
            for out in await asyncio.gather(*calls):
                await c.release_cache(out.kv_cache)

    asyncio.run(drive())
