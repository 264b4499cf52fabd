"""Faults around the router and cache moves, against real paged-executor servers: answers
lost on the way back, a release racing a drain, a part of a split batch failing on the
client side, and routers that would name caches alike. No cache may end up on neither
executor, come back after its release, or be shared by two owners."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from client import (
    AsyncExecutorClient,
    DeadlineExceededError,
    DecodeInput,
    ExecutorClient,
    InvalidArgumentError,
    KvCacheHandle,
    LogitsPolicy,
    PrefillInput,
    ResourceExhaustedError,
    UnavailableError,
)
from client.drain import drain_replica
from client.errors import may_have_taken_effect
from client.router import AsyncExecutorRouter, PartialBatchError
from client.transfer import move_cache, quietly

PROMPT = list(range(1, 40))


def held(server) -> list[tuple[str, int]]:
    with ExecutorClient(server.address, timeout=10) as c:
        return sorted((i.cache_id, i.sequence_length) for i in c.list_caches())


class ReleaseAnswerLost(AsyncExecutorClient):
    """A source whose conditional releases happen, but whose first `lose` answers are lost."""

    def __init__(self, *args, error: type = UnavailableError, lose: int = 1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.error, self.lose, self.asked = error, lose, 0

    async def release_cache(self, cache, *, expected_length=None, **kwargs):
        result = await super().release_cache(cache, expected_length=expected_length, **kwargs)
        if expected_length is not None:
            self.asked += 1
            if self.asked <= self.lose:
                raise self.error("the connection dropped after the server answered (injected)")
        return result


@pytest.mark.parametrize("error", [UnavailableError, DeadlineExceededError])
def test_a_move_whose_release_answer_is_lost_keeps_the_cache_on_the_target(make_server, error):
    """The source released, its answer was lost: the move asks again, learns the cache is
    gone there, and keeps the copy (it used to drop it: the cache was on neither)."""
    source_server, target_server = make_server(), make_server()

    async def run():
        source = ReleaseAnswerLost(source_server.address, timeout=30, error=error)
        target = AsyncExecutorClient(target_server.address, timeout=30)
        await source.prefill(PrefillInput(PROMPT, KvCacheHandle("c", 0)))
        moved = await move_cache(source, target, "c")
        assert (moved.source_released, source.asked) == (True, 2)
        out = await target.decode(DecodeInput(5, moved.kv_cache))  # the cache goes on there
        assert out.kv_cache.sequence_length == len(PROMPT) + 1
        await target.release_cache("c")
        await source.close()
        await target.close()

    asyncio.run(run())


def test_a_source_that_never_answers_its_release_keeps_the_copy(make_server):
    source_server, target_server = make_server(), make_server()

    async def run():
        source = ReleaseAnswerLost(source_server.address, timeout=30, lose=99)
        target = AsyncExecutorClient(target_server.address, timeout=30)
        await source.prefill(PrefillInput(PROMPT, KvCacheHandle("c", 0)))
        moved = await move_cache(source, target, "c")
        assert moved.source_released is None  # unknown: on both, maybe, never on neither
        await target.close()
        await source.close()

    asyncio.run(run())
    assert held(source_server) == [] and held(target_server) == [("c", len(PROMPT))]


@contextlib.asynccontextmanager
async def router_holding(source: AsyncExecutorClient, other_address: str, cache_id: str):
    """A router over `source` (replica 0, holding a prefilled cache `cache_id`) and another server."""
    other = AsyncExecutorClient(other_address, timeout=30)
    async with AsyncExecutorRouter([source, other], status_ttl_s=0) as router:
        router.pin(cache_id, 0)
        await router.prefill(PrefillInput(PROMPT, KvCacheHandle(cache_id, 0)))
        yield router
    await other.close()
    await source.close()


async def goes_on_at_replica_1(router: AsyncExecutorRouter, cache_id: str) -> None:
    """The moved cache is routed to replica 1 and decodes there; then it is released."""
    assert router.replica_of(cache_id) == 1
    out = await router.decode(DecodeInput(5, KvCacheHandle(cache_id, len(PROMPT))))
    assert out.kv_cache.sequence_length == len(PROMPT) + 1
    await router.release_cache(cache_id)


def test_a_drain_whose_release_answer_is_lost_routes_the_cache_to_its_new_replica(make_server):
    servers = [make_server(), make_server()]

    async def run():
        source = ReleaseAnswerLost(servers[0].address, timeout=30, error=DeadlineExceededError)
        async with router_holding(source, servers[1].address, "d") as router:
            report = await drain_replica(router, 0, shutdown=False)
            assert (report.moved, report.failed) == ({"d": 1}, {})
            await goes_on_at_replica_1(router, "d")

    asyncio.run(run())
    assert held(servers[0]) == held(servers[1]) == []


def test_a_release_racing_a_drain_is_not_undone_by_it(make_server):
    """The owner releases the cache while it moves: the drain does not bring it back on the
    target (it used to re-pin the released id there, with an orphan copy)."""
    servers = [make_server(), make_server()]

    class PausesAfterImport(AsyncExecutorClient):
        async def import_kv(self, *args, **kwargs):
            result = await super().import_kv(*args, **kwargs)
            imported.set()
            await owner_done.wait()
            return result

    imported, owner_done = asyncio.Event(), asyncio.Event()

    async def run():
        target = PausesAfterImport(servers[1].address, timeout=30)
        async with AsyncExecutorRouter([AsyncExecutorClient(servers[0].address, timeout=30), target],
                                       status_ttl_s=0) as router:
            router.pin("u", 0)
            await router.prefill(PrefillInput(PROMPT, KvCacheHandle("u", 0)))

            async def owner():
                await imported.wait()
                assert (await router.release_cache("u")).released
                owner_done.set()

            report, _ = await asyncio.gather(drain_replica(router, 0, shutdown=False), owner())
            assert report.moved == {} and router.replica_of("u") is None
            assert router.live_caches() == [0, 0]
        await router.replicas[0].close()
        await target.close()

    asyncio.run(run())
    assert held(servers[0]) == held(servers[1]) == []


def test_a_refusal_raised_by_the_clients_own_grpc_stack_keeps_the_pin(make_server):
    """RESOURCE_EXHAUSTED from the client's receive limit comes after the server committed:
    it proves nothing, so the router keeps routing the cache it created (it used to forget it)."""
    server = make_server()

    async def run():
        tight = AsyncExecutorClient(server.address, timeout=30, max_message_bytes=700)
        async with AsyncExecutorRouter([tight]) as router:
            with pytest.raises(ResourceExhaustedError) as e:
                await router.prefill(PrefillInput([1, 2, 3], logits_policy=LogitsPolicy.full()))
            assert e.value.domain is None and may_have_taken_effect(e.value)
            [(cid, _)] = held(server)
            assert router.replica_of(cid) == 0 and router.live_caches() == [1]
            await router.release_cache(cid)
        await tight.close()

    asyncio.run(run())
    assert held(server) == []


def test_a_part_failing_on_the_client_side_keeps_the_other_parts_results(make_server):
    servers = [make_server(), make_server()]

    async def run():
        async with AsyncExecutorRouter([s.address for s in servers], status_ttl_s=0) as router:
            router.pin("a", 0)
            router.pin("b", 1)
            ha, hb = [(await router.prefill(PrefillInput([1, 2, 3], KvCacheHandle(c, 0)))).kv_cache
                      for c in ("a", "b")]
            with pytest.raises(PartialBatchError) as e:  # -1 cannot be encoded: part b never leaves
                await router.batch_decode([DecodeInput(7, ha), DecodeInput(-1, hb)])
            assert e.value.results[0].kv_cache.sequence_length == 4 and e.value.results[1] is None
            assert isinstance(e.value.errors[1], InvalidArgumentError)
            assert isinstance(e.value.errors[1].__cause__, ValueError)
            assert held(servers[0]) == [("a", 4)] and held(servers[1]) == [("b", 3)]
            with pytest.raises(ValueError):  # every part failed: nothing to keep, the error as it was
                await router.batch_decode([DecodeInput(-1, e.value.results[0].kv_cache), DecodeInput(-1, hb)])
            for c in ("a", "b"):
                await router.release_cache(c)

    asyncio.run(run())


def test_routers_given_one_id_prefix_still_name_caches_apart(make_server):
    server = make_server()

    async def run():
        async with AsyncExecutorRouter([server.address], id_prefix="svc-") as one, \
                AsyncExecutorRouter([server.address], id_prefix="svc-") as other:
            ids = [one.new_cache_id(), other.new_cache_id()]
            assert ids[0] != ids[1] and all(i.startswith("svc-") for i in ids)
            a = await one.prefill(PrefillInput([1, 2, 3]))
            b = await other.prefill(PrefillInput([1, 2, 3]))  # the same prompt: it was a replay of a's
            assert a.kv_cache.cache_id != b.kv_cache.cache_id
            await other.release_cache(b.kv_cache)
            assert (await one.decode(DecodeInput(4, a.kv_cache))).kv_cache.sequence_length == 4
            await one.release_cache(a.kv_cache.cache_id)

    asyncio.run(run())
    with pytest.raises(ValueError, match="id_prefix"):
        AsyncExecutorRouter([server.address], id_prefix="no spaces/")


def test_a_move_cut_off_mid_import_does_not_release_a_cache_the_target_had(make_server):
    """The target already holds a cache under the id (its own kv-N, say) and the import breaks
    off before it could say ALREADY_EXISTS: the clean-up drops only a copy of the moved length."""
    source_server, target_server = make_server(), make_server()

    async def run():
        source = AsyncExecutorClient(source_server.address, timeout=30)
        target = AsyncExecutorClient(target_server.address, timeout=30)
        await source.prefill(PrefillInput(PROMPT, KvCacheHandle("c", 0)))
        await target.prefill(PrefillInput([7, 8, 9], KvCacheHandle("c", 0)))  # another's "c"

        async def cut_off(export, cache_id=None, **kwargs):
            await anext(aiter(export))  # the description went out, then the connection broke
            raise UnavailableError("the connection broke (injected)")

        target.import_kv = cut_off
        with pytest.raises(UnavailableError):
            await move_cache(source, target, "c")
        await source.close()
        await target.close()

    asyncio.run(run())
    assert held(source_server) == [("c", len(PROMPT))] and held(target_server) == [("c", 3)]


class PausesAfterRelease(AsyncExecutorClient):
    """A source whose conditional release reaches the server, and whose answer then takes a
    while to come back: a cancellation lands in between."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.releasing = asyncio.Event()

    async def release_cache(self, cache, *, expected_length=None, **kwargs):
        result = await super().release_cache(cache, expected_length=expected_length, **kwargs)
        if expected_length is not None:
            self.releasing.set()
            await asyncio.sleep(0.3)
        return result


def test_a_move_cancelled_during_its_release_keeps_the_cache_it_released(make_server):
    """The release is the commit point: cancelled while its answer is on the way, the move
    waits for it and keeps the copy (it used to drop it: the cache was on neither)."""
    source_server, target_server = make_server(), make_server()

    async def run():
        source = PausesAfterRelease(source_server.address, timeout=30)
        target = AsyncExecutorClient(target_server.address, timeout=30)
        await source.prefill(PrefillInput(PROMPT, KvCacheHandle("c", 0)))
        committed = []
        task = asyncio.ensure_future(move_cache(source, target, "c", on_released=committed.append))
        await source.releasing.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert [(m.kv_cache.cache_id, m.source_released) for m in committed] == [("c", True)]
        await source.close()
        await target.close()

    asyncio.run(run())
    assert held(source_server) == [] and held(target_server) == [("c", len(PROMPT))]


def test_a_drain_cancelled_during_a_release_routes_the_moved_cache_to_its_new_replica(make_server):
    servers = [make_server(), make_server()]

    async def run():
        source = PausesAfterRelease(servers[0].address, timeout=30)
        async with router_holding(source, servers[1].address, "d") as router:
            drain = asyncio.ensure_future(drain_replica(router, 0, shutdown=False))
            await source.releasing.wait()
            drain.cancel()  # Ctrl-C on a drain
            with pytest.raises(asyncio.CancelledError):
                await drain
            await goes_on_at_replica_1(router, "d")

    asyncio.run(run())
    assert held(servers[0]) == held(servers[1]) == []


def test_a_move_cancelled_before_its_release_keeps_the_cache_on_the_source(make_server):
    source_server, target_server = make_server(), make_server()

    async def run():
        source = AsyncExecutorClient(source_server.address, timeout=30)
        target = AsyncExecutorClient(target_server.address, timeout=30)
        await source.prefill(PrefillInput(PROMPT, KvCacheHandle("c", 0)))
        reached, committed = asyncio.Event(), []

        async def hold() -> None:  # a router holding the cache's calls: the cancellation lands here
            reached.set()
            await asyncio.sleep(30)

        task = asyncio.ensure_future(move_cache(source, target, "c", before_release=hold,
                                                on_released=committed.append))
        await reached.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert committed == []
        await source.close()
        await target.close()

    asyncio.run(run())
    assert held(source_server) == [("c", len(PROMPT))] and held(target_server) == []


def test_a_clean_up_release_runs_to_its_end_through_repeated_cancellations():
    """A scheduler's close() and then asyncio.run's own shutdown cancel the same task twice:
    the second cancellation used to cut the release short (and leak the cache)."""
    async def run():
        answered, finished = asyncio.Event(), asyncio.Event()

        async def release() -> None:
            await answered.wait()
            finished.set()

        task = asyncio.ensure_future(quietly(release()))
        for _ in range(3):
            await asyncio.sleep(0.01)
            task.cancel()
        await asyncio.sleep(0.01)
        answered.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished.is_set()

    asyncio.run(run())
