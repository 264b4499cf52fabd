"""Draining a replica: its caches move to the others and it shuts down, without losing a
sequence, whether a scheduler is running over a router (client.drain.drain_replica) or
an operator runs `python -m client drain`."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import numpy as np
import pytest

from client import DecodeInput, ExecutorClient, KvCacheHandle, LogitsPolicy, PrefillInput, UnavailableError
from client.drain import drain_replica
from client.router import AsyncExecutorRouter
from client.scheduler import Scheduler
from tests.conftest import eventually
from tests.test_scheduler import plain, pool_is_clean

PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(5 + 3 * i)] for i in range(6)]
FULL = LogitsPolicy.full()


def wait_down(address: str) -> None:
    with ExecutorClient(address, timeout=2) as c:
        for _ in range(100):
            try:
                c.status()
            except UnavailableError:
                return
            time.sleep(0.05)
    pytest.fail(f"{address} still serves after its drain")


def test_a_drain_during_a_scheduler_run_loses_no_request(make_server):
    servers = [make_server(allow_shutdown=True), make_server()]
    with ExecutorClient(servers[1].address) as c:
        expected = [plain(c, p, 40) for p in PROMPTS]

    async def run():
        router = AsyncExecutorRouter([s.address for s in servers])
        async with router, Scheduler(router, max_num_batched_tokens=64, max_num_seqs=8) as sched:
            tasks = [asyncio.ensure_future(sched.generate(p, max_tokens=40)) for p in PROMPTS]
            await eventually(lambda: router.live_caches()[0] >= 2)  # replica 0 holds sequences mid-run
            report = await drain_replica(router, 0)
            done = await asyncio.gather(*tasks)
        return report, done, router.live_caches()

    report, done, live = asyncio.run(run())
    assert report.moved and not report.failed and report.shut_down, report
    assert set(report.moved.values()) == {1}
    assert [c.token_ids for c in done] == expected
    assert all(c.finish_reason == "length" for c in done)
    assert live == [0, 0]
    wait_down(servers[0].address)
    with ExecutorClient(servers[1].address) as c:
        pool_is_clean(c)


def test_the_drain_command_moves_every_cache_and_shuts_the_source_down(make_server):
    source, target = make_server(allow_shutdown=True), make_server()
    with ExecutorClient(source.address) as a, ExecutorClient(target.address) as b:
        handles = [a.prefill(PrefillInput(p)).kv_cache for p in PROMPTS[:3]]
        done = subprocess.run([sys.executable, "-m", "client", "--target", source.address, "drain", "--to",
                               target.address], capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        assert "3 caches moved" in done.stdout and "source shut down" in done.stdout, done.stdout
        listed = {i.cache_id: i.sequence_length for i in b.list_caches()}
        assert listed == {h.cache_id: h.sequence_length for h in handles}
        for h, p in zip(handles, PROMPTS):
            step = b.decode(DecodeInput(9, h, logits_policy=FULL))
            np.testing.assert_array_equal(step.logits.logits,
                                          b.prefill(PrefillInput(p + [9], logits_policy=FULL)).logits.logits)
        for cid in listed:
            b.release_cache(cid)
    wait_down(source.address)


def test_a_drain_with_nowhere_to_go_leaves_the_source_running(make_server):
    source, small = make_server(allow_shutdown=True), make_server(num_blocks=2)
    with ExecutorClient(source.address) as a:
        h = a.prefill(PrefillInput(list(range(1, 30)))).kv_cache
        done = subprocess.run([sys.executable, "-m", "client", "--target", source.address, "drain", "--to",
                               small.address], capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 1 and "RESOURCE_EXHAUSTED" in done.stderr, done.stderr
        assert "left running" in done.stdout
        assert [i.cache_id for i in a.list_caches()] == [h.cache_id]
        a.release_cache(h)
        pool_is_clean(a)
    with ExecutorClient(small.address) as b:
        pool_is_clean(b)


def test_a_move_whose_import_answer_is_lost_leaves_no_copy_behind(make_server):
    """The target imported the cache but its answer was lost (a deadline): the move fails and
    the cache stays where it was, without an orphan copy on the target."""
    from client import AsyncExecutorClient, DeadlineExceededError, KvCacheHandle
    from client.transfer import move_cache

    servers = [make_server(), make_server()]

    async def run():
        source, target = (AsyncExecutorClient(s.address, timeout=30) for s in servers)
        await source.prefill(PrefillInput(PROMPTS[2], KvCacheHandle("C", 0)))
        real = target.import_kv

        async def answer_lost(*args, **kwargs):
            await real(*args, **kwargs)
            raise DeadlineExceededError("the import's answer did not arrive in time")

        target.import_kv = answer_lost
        with pytest.raises(DeadlineExceededError):
            await move_cache(source, target, "C")
        held = [[c.cache_id for c in await x.list_caches()] for x in (source, target)]
        await source.release_cache("C")
        await source.close()
        await target.close()
        return held

    assert asyncio.run(run()) == [["C"], []]


def test_a_replica_that_refuses_to_shut_down_still_reports_its_moves(make_server):
    """Started without --allow-shutdown: drain_replica's caches move and the refusal is in the
    report (it was raised, and the report of what moved was lost)."""
    servers = [make_server(), make_server()]

    async def run():
        async with AsyncExecutorRouter([s.address for s in servers], status_ttl_s=0) as router:
            router.pin("r", 0)
            await router.prefill(PrefillInput(PROMPTS[1], KvCacheHandle("r", 0)))
            report = await drain_replica(router, 0)
            assert report.moved == {"r": 1} and not report.shut_down
            assert report.shutdown_error is not None and report.shutdown_error.code.name == "PERMISSION_DENIED"
            await router.release_cache("r")

    asyncio.run(run())
