"""Server-side decode coalescing (--coalesce-window-ms, executors/coalescer.py).

Through a real server: concurrent Decode calls run as one batched forward and each caller
gets the logits a lone Decode gives; a bad item gets its own precise error while its batch
mates succeed; a lone caller is dispatched at once, never waiting for the window. Without
gRPC: calls of different identities or for the same cache never share a batch.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from client import AsyncExecutorClient, DecodeInput, ExecutorClient, PrefillInput
from client.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from executors.coalescer import DecodeCoalescer
from executors.identity import current_identity
from executors.llm import LlmExecutor, LlmExecutorConfig
from executors.types import DecodeInput as DomainDecode
from executors.types import DecodeOutput, KvCacheHandle
from service.config import ServeConfig, parse_args
from tests.conftest import start_server
from tests.models.test_cpu_paths import VOCAB, tiny_model

# Asserts wall-clock bounds or orders events by sleeping: `make test` runs it alone (tests/conftest.py).
pytestmark = pytest.mark.alone

N = 6


class Counted:
    """A tiny-model LlmExecutor whose forwards are counted; the first `slow` of them sleep,
    so that calls arriving meanwhile find a forward in flight."""

    def __init__(self) -> None:
        self.executor = LlmExecutor(LlmExecutorConfig(model_dir="/nonexistent/tiny", block_size=4, num_blocks=256),
                                    tiny_model("llama"))
        self.forwards = 0
        self.rows: list[int] = []
        self.slow = 0
        inner = self.executor.model.hidden_states

        def counting(ids, positions, ctx):
            self.forwards += 1
            self.rows.append(int(ids.shape[0]))
            if self.slow:
                self.slow -= 1
                time.sleep(0.8)
            return inner(ids, positions, ctx)

        self.executor.model.hidden_states = counting


@pytest.fixture
def served():
    counted = Counted()
    running = start_server(ServeConfig(port=0, executor="llm", model="/nonexistent/tiny", coalesce_window_ms=50,
                                       warmup_on_start=False), counted.executor)
    counted.forwards = 0
    yield counted, running
    running.stop()


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=int(k)).tolist() for k in rng.integers(3, 20, size=n)]


def run_concurrently(address: str, inputs: list[DecodeInput]) -> list:
    """One Decode per input, all at once from one asyncio client; exceptions are returned."""
    async def go():
        async with AsyncExecutorClient(address, timeout=60) as c:
            return await asyncio.gather(*(c.decode(i) for i in inputs), return_exceptions=True)

    return asyncio.run(go())


def test_concurrent_decodes_run_as_one_forward_with_the_logits_of_lone_decodes(served):
    counted, running = served
    with ExecutorClient(running.address, timeout=60) as c:
        # The expected logits: each sequence decoded alone, then rolled back.
        handles = [c.prefill(PrefillInput(p)).kv_cache for p in prompts(N + 1, 1)]
        nxt = [int(t) for t in np.random.default_rng(2).integers(0, VOCAB, size=N + 1)]
        alone = []
        for t, h in zip(nxt, handles):
            alone.append(c.decode(DecodeInput(t, h)).logits.logits)
            c.truncate_kv(h, h.sequence_length)
        assert running.server.coalescer.coalescing.immediate == N + 1, "lone decodes do not wait"
        counted.forwards, counted.rows = 0, []
        counted.slow = 1  # the first decode holds the executor while the others arrive
        outs = run_concurrently(running.address, [DecodeInput(t, h) for t, h in zip(nxt, handles)])
        for out, want, h in zip(outs, alone, handles):
            assert not isinstance(out, Exception), out
            np.testing.assert_allclose(out.logits.logits, want, atol=1e-5, rtol=0)
            assert out.kv_cache.sequence_length == h.sequence_length + 1
        assert counted.forwards == 2 and sorted(counted.rows) == [1, N], (counted.forwards, counted.rows)
        stats = running.server.coalescer.coalescing
        assert stats.max_batch == N and stats.fallbacks == 0
        for o in outs:
            c.release_cache(o.kv_cache)


def test_a_bad_item_gets_its_own_error_and_its_batch_mates_succeed(served):
    counted, running = served
    with ExecutorClient(running.address, timeout=60) as c:
        handles = [c.prefill(PrefillInput(p)).kv_cache for p in prompts(N, 3)]
        released = c.prefill(PrefillInput([1, 2, 3])).kv_cache
        c.release_cache(released)
        good = [DecodeInput(7, h) for h in handles[1:N - 1]]
        stale = DecodeInput(7, replace(handles[N - 1], sequence_length=handles[N - 1].sequence_length - 1))
        outside = DecodeInput(VOCAB + 5, handles[0])
        gone = DecodeInput(7, released)
        blocker = c.prefill(PrefillInput([4, 5])).kv_cache
        counted.slow = 1
        outs = run_concurrently(running.address, [DecodeInput(1, blocker), *good, stale, outside, gone])
        assert not isinstance(outs[0], Exception)
        for out in outs[1:len(good) + 1]:
            assert not isinstance(out, Exception), out
        err_stale, err_outside, err_gone = outs[len(good) + 1:]
        assert isinstance(err_stale, FailedPreconditionError) and err_stale.reason == "STALE_CACHE_HANDLE"
        assert isinstance(err_outside, InvalidArgumentError) and "input.token_id" in str(err_outside)
        assert isinstance(err_gone, NotFoundError) and err_gone.reason == "CACHE_RELEASED"
        assert running.server.coalescer.coalescing.fallbacks >= 1
        # The good items advanced by exactly one token; the bad ones changed nothing.
        assert [o.kv_cache.sequence_length for o in outs[1:len(good) + 1]] == [
            h.sequence_length + 1 for h in handles[1:N - 1]]
        assert c.decode(DecodeInput(7, handles[0])).kv_cache.sequence_length == handles[0].sequence_length + 1
        assert c.decode(DecodeInput(7, handles[N - 1])).kv_cache.sequence_length == handles[N - 1].sequence_length + 1


def test_a_lone_caller_is_dispatched_without_waiting():
    counted = Counted()
    running = start_server(ServeConfig(port=0, executor="llm", model="/nonexistent/tiny", coalesce_window_ms=3000,
                                       warmup_on_start=False), counted.executor)
    try:
        with ExecutorClient(running.address, timeout=60) as c:
            h = c.prefill(PrefillInput(prompts(1, 4)[0])).kv_cache
            started = time.perf_counter()
            for _ in range(10):
                h = c.decode(DecodeInput(5, h)).kv_cache
            elapsed = time.perf_counter() - started
        stats = running.server.coalescer.coalescing
        assert stats.calls == 10 and stats.immediate == 10 and stats.max_batch == 1
        assert elapsed < 3.0, f"10 lone decodes took {elapsed:.2f} s: something waited for the 3 s window"
    finally:
        running.stop()


def test_the_flag_parses_and_zero_means_off():
    assert parse_args(["--coalesce-window-ms", "2.5"]).coalesce_window_ms == 2.5
    assert parse_args([]).coalesce_window_ms == 0
    with pytest.raises(SystemExit):
        parse_args(["--coalesce-window-ms", "-1"])


# -- without gRPC ----------------------------------------------------------------------------
class FakeExecutor:
    """Records batches; decodes echo the token. Cache 'bad' fails."""

    name = "fake"

    def __init__(self) -> None:
        self.batches: list[tuple[str | None, list[str]]] = []
        self.gate = asyncio.Event()

    def _out(self, inp: DomainDecode) -> DecodeOutput:
        if inp.kv_cache.cache_id == "bad":
            raise ValueError("bad cache")
        return DecodeOutput(logits=None, kv_cache=replace(inp.kv_cache, sequence_length=inp.token_id))

    async def decode(self, inp: DomainDecode) -> DecodeOutput:
        self.batches.append((current_identity.get(), [inp.kv_cache.cache_id]))
        await self.gate.wait()
        return self._out(inp)

    async def batch_decode(self, inputs) -> list[DecodeOutput]:
        self.batches.append((current_identity.get(), [i.kv_cache.cache_id for i in inputs]))
        await self.gate.wait()
        return [self._out(i) for i in inputs]


def handle(cache_id: str) -> KvCacheHandle:
    return KvCacheHandle(cache_id=cache_id, sequence_length=1, block_ids=(0,), block_size=4, num_layers=1,
                         num_kv_heads=1, head_dim=1, device="cpu")


def test_batches_never_mix_identities_or_repeat_a_cache():
    async def go():
        ex = FakeExecutor()
        co = DecodeCoalescer(ex, window_s=0.05, max_batch=8)

        async def call(identity: str | None, cache_id: str, token: int):
            current_identity.set(identity)
            return await co.decode(DomainDecode(token_id=token, kv_cache=handle(cache_id)))

        first = asyncio.create_task(call("alice", "a0", 1))  # dispatched at once, held by the gate
        await asyncio.sleep(0.01)
        rest = [asyncio.create_task(call(who, cid, tok)) for who, cid, tok in
                [("alice", "a1", 2), ("bob", "b1", 3), ("alice", "a1", 4), ("alice", "a2", 5), ("bob", "bad", 6)]]
        await asyncio.sleep(0.01)
        ex.gate.set()
        results = await asyncio.gather(first, *rest, return_exceptions=True)
        return ex.batches, results, co.coalescing

    batches, results, stats = asyncio.run(go())
    assert batches[0] == ("alice", ["a0"])
    for identity, caches in batches:
        assert len(set(caches)) == len(caches)
    assert ("alice", ["a1", "a2"]) in batches
    assert ("bob", ["b1", "bad"]) in batches  # failed as a batch, then one by one
    assert ("bob", ["b1"]) in batches and ("bob", ["bad"]) in batches
    assert [r.kv_cache.sequence_length for r in results[:5]] == [1, 2, 3, 4, 5]
    assert isinstance(results[5], ValueError)
    assert stats.fallbacks == 1


def test_a_cancelled_caller_leaves_the_queue():
    async def go():
        ex = FakeExecutor()
        co = DecodeCoalescer(ex, window_s=0.05, max_batch=8)
        first = asyncio.create_task(co.decode(DomainDecode(token_id=1, kv_cache=handle("x"))))
        await asyncio.sleep(0.01)
        doomed = asyncio.create_task(co.decode(DomainDecode(token_id=2, kv_cache=handle("y"))))
        await asyncio.sleep(0.01)
        doomed.cancel()
        ex.gate.set()
        await first
        await asyncio.sleep(0.1)
        return ex.batches

    assert asyncio.run(go()) == [(None, ["x"])]


def test_a_call_waiting_behind_a_running_batch_does_not_spin_the_event_loop():
    """Past its window, a queued call can only go when the running batch ends; until then
    the coalescer must sleep, not re-arm a timer that fires at once on every loop turn."""
    async def go():
        ex = FakeExecutor()
        co = DecodeCoalescer(ex, window_s=0.005, max_batch=8)
        flushes = 0
        flush = co._flush

        def counted(*args, **kwargs):
            nonlocal flushes
            flushes += 1
            return flush(*args, **kwargs)

        co._flush = counted
        first = asyncio.create_task(co.decode(DomainDecode(token_id=1, kv_cache=handle("x"))))
        await asyncio.sleep(0.01)
        queued = asyncio.create_task(co.decode(DomainDecode(token_id=2, kv_cache=handle("y"))))
        await asyncio.sleep(0.3)  # far past the 5 ms window, the first batch still held by the gate
        waiting = flushes
        ex.gate.set()
        await asyncio.gather(first, queued)
        return waiting, ex.batches

    waiting, batches = asyncio.run(go())
    assert waiting <= 3, f"the coalescer flushed {waiting} times while one call waited 0.3 s"
    assert batches == [(None, ["x"]), (None, ["y"])]


def test_threads_through_blocking_clients_coalesce_too(served):
    counted, running = served
    with ExecutorClient(running.address, timeout=60) as c:
        handles = [c.prefill(PrefillInput(p)).kv_cache for p in prompts(N, 5)]
    counted.forwards = 0
    counted.slow = 1
    results: list = [None] * N

    def worker(i: int) -> None:
        with ExecutorClient(running.address, timeout=60) as cc:
            results[i] = cc.decode(DecodeInput(3, handles[i]))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(N)]
    for t in threads:
        t.start()
        time.sleep(0.02 if t is threads[0] else 0)
    for t in threads:
        t.join(60)
    assert all(r is not None for r in results)
    assert counted.forwards < N
