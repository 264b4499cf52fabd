"""AsyncExecutorRouter over three real paged-executor servers: placement, routing, merging."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from client import (
    DecodeInput,
    ExecutorClient,
    KvCacheHandle,
    LogitsPolicy,
    NotFoundError,
    PrefillInput,
    UnifiedBatchItem,
)
from client.router import AsyncExecutorRouter, PartialBatchError, parse_targets

# Asserts wall-clock bounds or orders events by sleeping: `make test` runs it alone (tests/conftest.py).
pytestmark = pytest.mark.alone

ARGMAX = LogitsPolicy.argmax()
rng = np.random.default_rng(11)
PROMPTS = [rng.integers(0, 256, size=int(n)).tolist() for n in rng.integers(1, 30, size=9)]


@pytest.fixture
def three(make_server):
    servers = [make_server() for _ in range(3)]
    clients = [ExecutorClient(s.address, timeout=30) for s in servers]
    yield servers, clients
    for c in clients:
        c.close()


def statuses(clients):
    return [c.status() for c in clients]


async def scenario(router: AsyncExecutorRouter) -> tuple[list, dict[str, int]]:
    """A fixed mix of every routed call; returns what came back (comparable across runs) and placements."""
    record: list = []
    # 9 new sequences with server-side ids (the router names them), 3 with caller-chosen ids.
    outs = [await router.prefill(PrefillInput(p, logits_policy=ARGMAX)) for p in PROMPTS[:6]]
    outs += await router.batch_prefill([PrefillInput(p, logits_policy=LogitsPolicy.top_k(3)) for p in PROMPTS[6:]])
    for name in ("alpha", "beta", "gamma"):
        outs.append(await router.prefill(PrefillInput([1, 2, 3], KvCacheHandle(name, 0), logits_policy=ARGMAX)))
    handles = [o.kv_cache for o in outs]
    record.append([o.logits.next_token() for o in outs])
    # One decode each, then a batch decode across all replicas, full logits this time.
    handles = [(await router.decode(DecodeInput(7, h, logits_policy=ARGMAX))).kv_cache for h in handles]
    dec = await router.batch_decode([DecodeInput(i % 200, h, logits_policy=LogitsPolicy.full()) for i, h in
                                     enumerate(handles)])
    record.append(np.stack([d.logits.logits for d in dec]))
    handles = [d.kv_cache for d in dec]
    # A unified step: decodes of the old sequences, a chunk of a new caller-named one, a new unnamed one.
    items = [UnifiedBatchItem(h.cache_id, [5], h.sequence_length, True, logits_policy=ARGMAX) for h in handles]
    items.append(UnifiedBatchItem("delta", [9, 8, 7, 6], 0, False))
    items.append(UnifiedBatchItem("", [4, 4, 4], 0, True, logits_policy=ARGMAX))
    uni = await router.unified_decode(items)
    record.append([(r.logits.next_token() if r.logits else None, r.kv_cache.sequence_length) for r in uni])
    handles = [r.kv_cache for r in uni]
    # Verify three tokens on each, roll back one, release everything.
    for h in handles:
        v = await router.forward_verify(h, [1, 2, 3], ARGMAX)
        record.append([o.token_id for o in v.outputs])
        t = await router.truncate_kv(v.kv_cache, h.sequence_length + 1)
        record.append((t.kv_cache.sequence_length, t.freed_blocks >= 0))
    placements = {h.cache_id: router.replica_of(h) for h in handles}
    record.append((await router.forward([1, 2, 3], "token_logprobs")).output)
    return record, placements, handles, {i.seq_id for i in items[:-2]}


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, np.ndarray):
            np.testing.assert_allclose(x, y, atol=1e-6)
        else:
            assert x == y


def test_sequences_spread_every_call_lands_on_its_replica_and_results_equal_one_server(three, make_server):
    servers, clients = three
    before = statuses(clients)

    async def run():
        async with AsyncExecutorRouter([s.address for s in servers], status_ttl_s=0.01) as router:
            record, placements, handles, old = await scenario(router)
            live = router.live_caches()
            mid = statuses(clients)
            # Every cache is on the replica the router says, and on no other.
            for cid, r in placements.items():
                for i, c in enumerate(clients):
                    if i == r:
                        assert c.truncate_kv(cid, next(h.sequence_length for h in handles
                                                       if h.cache_id == cid)).kv_cache.cache_id == cid
                    else:
                        with pytest.raises(NotFoundError):
                            c.truncate_kv(cid, 0)
            for h in handles:
                assert (await router.release_cache(h)).released
            assert not (await router.release_cache(handles[0])).released  # idempotent, same replica
            return record, placements, old, live, mid, router.live_caches()

    record, placements, old, live, mid, live_after = asyncio.run(run())
    counts = [list(placements.values()).count(i) for i in range(3)]
    assert sorted(counts) == [4, 4, 6] or sorted(counts) == [4, 5, 5], counts  # 14 caches, spread evenly
    assert live == counts and live_after == [0, 0, 0]
    for i, (b, m) in enumerate(zip(before, mid)):
        assert m.kv_pool.active_caches == counts[i]
        # Each cache on replica i had 1 decode + 1 batch decode + 1 unified decode step (+1 verify
        # of 3 tokens); "delta" (a chunk) and the new unnamed item are prefill work.
        # Caches made before the unified step got a decode, a batch decode item, a unified
        # decode item and a verify (4 decode items); the two made by the unified step 1 (the verify).
        mine = [cid for cid, r in placements.items() if r == i]
        assert m.decode_operations - b.decode_operations == sum(4 if cid in old else 1 for cid in mine)
        assert m.prefill_operations - b.prefill_operations == len(mine)
    assert all(s.kv_pool.active_caches == 0 for s in statuses(clients))

    # The same scenario through one replica gives the same answers.
    single = make_server()

    async def run_single():
        async with AsyncExecutorRouter([single.address]) as router:
            record1, _, handles1, _ = await scenario(router)
            for h in handles1:
                await router.release_cache(h)
            return record1

    assert_same(record, asyncio.run(run_single()))


def test_each_replica_counts_only_its_own_calls(three):
    servers, clients = three

    async def run():
        async with AsyncExecutorRouter([s.address for s in servers]) as router:
            outs = [await router.prefill(PrefillInput(p, logits_policy=ARGMAX)) for p in PROMPTS[:3]]
            assert sorted(router.replica_of(o.kv_cache) for o in outs) == [0, 1, 2]
            base = statuses(clients)
            target = router.replica_of(outs[1].kv_cache)
            h = outs[1].kv_cache
            for _ in range(5):
                h = (await router.decode(DecodeInput(3, h, logits_policy=ARGMAX))).kv_cache
            after = statuses(clients)
            for i in range(3):
                delta = after[i].decode_operations - base[i].decode_operations
                assert delta == (5 if i == target else 0)
            for o in outs[:1] + outs[2:]:
                await router.release_cache(o.kv_cache)
            await router.release_cache(h)

    asyncio.run(run())


def test_caller_chosen_ids_are_pinned_at_creation_and_unknown_ids_fail_locally(three):
    servers, clients = three

    async def run():
        async with AsyncExecutorRouter([s.address for s in servers]) as router:
            assert router.pin("chosen", 2) == 2
            res = await router.unified_decode([UnifiedBatchItem("chosen", [1, 2, 3], 0, True, logits_policy=ARGMAX)])
            assert clients[2].status().kv_pool.active_caches == 1
            assert sum(c.status().kv_pool.active_caches for c in clients) == 1
            with pytest.raises(ValueError):
                router.pin("chosen", 0)  # a cache never moves
            with pytest.raises(NotFoundError) as e:
                await router.decode(DecodeInput(1, KvCacheHandle("nobody-made-this", 4)))
            assert e.value.reason == "CACHE_NOT_ROUTED"
            # Released behind the router's back: the replica's NOT_FOUND makes the router forget it.
            clients[2].release_cache("chosen")
            with pytest.raises(NotFoundError):
                await router.decode(DecodeInput(1, res[0].kv_cache))
            assert router.live_caches() == [0, 0, 0]

    asyncio.run(run())


def test_new_sequences_avoid_the_replica_with_fewest_free_blocks(three):
    servers, clients = three
    hog = clients[0].prefill(PrefillInput(list(range(250)) * 2))  # 125 of replica 0's 256 blocks

    async def run():
        async with AsyncExecutorRouter([s.address for s in servers], status_ttl_s=0.01) as router:
            outs = [await router.prefill(PrefillInput([1, 2])) for _ in range(2)]
            assert {router.replica_of(o.kv_cache) for o in outs} == {1, 2}
            assert router.free_blocks()[0] < router.free_blocks()[1]
            for o in outs:
                await router.release_cache(o.kv_cache)

    asyncio.run(run())
    clients[0].release_cache(hog.kv_cache)


def test_a_batch_split_over_replicas_reports_which_part_failed(three):
    servers, clients = three

    async def run():
        async with AsyncExecutorRouter([s.address for s in servers]) as router:
            outs = [await router.prefill(PrefillInput(p, logits_policy=ARGMAX)) for p in PROMPTS[:3]]
            handles = [o.kv_cache for o in outs]
            stale = KvCacheHandle(handles[2].cache_id, handles[2].sequence_length + 5)
            with pytest.raises(PartialBatchError) as e:
                await router.batch_decode([DecodeInput(1, handles[0]), DecodeInput(1, handles[1]),
                                           DecodeInput(1, stale)])
            err = e.value
            assert list(err.errors) == [router.replica_of(stale)]
            assert err.metadata["field"].startswith("inputs[2]")  # renumbered to the whole batch
            assert err.results[0] is not None and err.results[1] is not None and err.results[2] is None
            for h in [err.results[0].kv_cache, err.results[1].kv_cache, handles[2]]:
                await router.release_cache(h)
            assert router.live_caches() == [0, 0, 0]

    asyncio.run(run())
    assert all(s.kv_pool.active_caches == 0 for s in statuses(clients))


def test_parse_targets():
    assert parse_targets("a:1, b:2,,") == ["a:1", "b:2"]
    with pytest.raises(ValueError):
        parse_targets(" , ")


def test_router_scheduler_and_speculative_do_not_import_torch():
    import subprocess
    import sys
    from pathlib import Path

    code = ("import client.router, client.scheduler, client.speculative, sys; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr


def test_a_cancelled_call_keeps_the_pin_of_a_cache_it_may_have_created(three):
    """Cancelled after its request went out, a prefill may have created its cache (here it
    has): the router keeps it where it was placed, so a release or a retry reaches it."""
    servers, clients = three

    async def run():
        async with AsyncExecutorRouter([s.address for s in servers]) as router:
            answered: asyncio.Queue[int] = asyncio.Queue()

            def held_back(r: int, real):
                async def prefill(item, **kwargs):  # the server answered; the reply is late
                    out = await real(item, **kwargs)
                    answered.put_nowait(r)
                    await asyncio.sleep(30)
                    return out
                return prefill

            for r, replica in enumerate(router.replicas):
                replica.prefill = held_back(r, replica.prefill)
            call = asyncio.create_task(router.prefill(PrefillInput([1, 2, 3], KvCacheHandle("mine", 0))))
            where = await asyncio.wait_for(answered.get(), 30)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            assert clients[where].status().kv_pool.active_caches == 1
            assert router.replica_of("mine") == where  # was None: the pin went with the cancellation
            await router.release_cache("mine")
            assert sum(c.status().kv_pool.active_caches for c in clients) == 0

    asyncio.run(run())


def test_once_a_move_holds_a_cache_no_new_call_for_it_reaches_a_replica(three):
    """hold_calls returns once the cache's calls under way are done; after that, none may
    reach a replica until release_calls. A batch split over replicas counts its parts in
    flight before they start; a unified step refreshes the replicas' load before it waits
    for moves, never between that wait and its routing."""
    servers, _ = three

    async def run():
        # Load refreshed before every call that places a cache (a ttl of 0 would never refresh).
        async with AsyncExecutorRouter([s.address for s in servers], status_ttl_s=1e-9) as router:
            router.pin("B0", 0)
            router.pin("B1", 1)
            handles = [(await router.prefill(PrefillInput([3, 4], KvCacheHandle(c, 0), logits_policy=ARGMAX))).kv_cache
                       for c in ("B0", "B1")]
            batch = asyncio.create_task(router.batch_decode([DecodeInput(5, h, logits_policy=ARGMAX) for h in handles]))
            await asyncio.sleep(0)  # the batch is routed, its parts not started yet
            await router.hold_calls("B0")
            assert batch.done(), "the move stopped waiting before a call admitted ahead of it ended"
            router.release_calls("B0", None)
            stepped = await batch

            sent_while_held = []
            for replica in router.replicas:
                def spy(*args, _real=replica.unified_decode, **kwargs):
                    sent_while_held.append("B1" in router._held)
                    return _real(*args, **kwargs)
                replica.unified_decode = spy
            real_status = router.replicas[2].status

            async def slow_status(*args, **kwargs):
                await asyncio.sleep(0.2)
                return await real_status(*args, **kwargs)

            router.replicas[2].status = slow_status  # the unified step's refresh takes a while
            unified = asyncio.create_task(router.unified_decode([
                UnifiedBatchItem("B1", [6], stepped[1].kv_cache.sequence_length, True, logits_policy=ARGMAX),
                UnifiedBatchItem("", [1, 2], 0, True, logits_policy=ARGMAX)]))
            await asyncio.sleep(0.05)  # inside the refresh
            await router.hold_calls("B1")
            await asyncio.sleep(0.3)  # the refresh is over: the step must still wait for the move
            router.release_calls("B1", None)
            await unified
            return sent_while_held

    sent = asyncio.run(run())
    assert sent and not any(sent), sent
