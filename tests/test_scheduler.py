"""The continuous-batching scheduler (client/scheduler.py) against real paged-executor servers."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import numpy as np
import pytest

from client import AsyncExecutorClient, DecodeInput, ExecutorClient, LogitsPolicy, Penalties, PrefillInput
from client.errors import OutOfRangeError, ResourceExhaustedError
from client.router import AsyncExecutorRouter
from client.scheduler import Scheduler
from tests.conftest import eventually
from tests.paged_reference import PagedModel
from tests.test_logits_adjustments import penalized_greedy

ARGMAX = LogitsPolicy.argmax()
rng = np.random.default_rng(3)
# Lengths 1..70: several are longer than a 16-token step budget and must be prefilled in chunks.
PROMPTS = [rng.integers(0, 256, size=int(n)).tolist() for n in [1, 5, 17, 33, 70, 2, 40, 9, 64, 3, 25, 12]]


class Recording(AsyncExecutorClient):
    """The typed client, remembering every UnifiedDecode batch and any other stepping call."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[list] = []
        self.other_steps = 0

    async def unified_decode(self, batch, **kwargs):
        items = list(batch)
        self.batches.append(items)
        return await super().unified_decode(items, **kwargs)

    async def prefill(self, *a, **k):
        self.other_steps += 1
        return await super().prefill(*a, **k)

    async def decode(self, *a, **k):
        self.other_steps += 1
        return await super().decode(*a, **k)


def plain(client: ExecutorClient, prompt: list[int], n: int, policy: LogitsPolicy = ARGMAX,
          stop: set[int] = frozenset()) -> list[int]:
    """Reference: prefill then one decode per token, through the plain client."""
    out = client.prefill(PrefillInput(prompt, logits_policy=policy))
    tokens: list[int] = []
    try:
        while True:
            t = out.logits.next_token()
            if t in stop:
                return tokens
            tokens.append(t)
            if len(tokens) == n:
                return tokens
            out = client.decode(DecodeInput(t, out.kv_cache, logits_policy=policy))
    finally:
        client.release_cache(out.kv_cache)


def pool_is_clean(client: ExecutorClient) -> None:
    kv = client.status().kv_pool
    assert kv.active_caches == 0 and kv.free_blocks == kv.total_blocks, kv


def test_continuous_batching_equals_plain_greedy_and_each_step_is_one_mixed_unified_call(make_server):
    server = make_server()
    with ExecutorClient(server.address) as c:
        expected = [plain(c, p, 12) for p in PROMPTS]
    rec = Recording(server.address)

    async def run():
        async with Scheduler(rec, max_num_batched_tokens=16, max_num_seqs=6) as sched:
            streams = [sched.submit(p, max_tokens=12) for p in PROMPTS]

            async def collect(s):
                return [t async for t in s]

            got = await asyncio.gather(*(collect(s) for s in streams))
            return got, [await s.result() for s in streams], sched.stats

    got, completions, stats = asyncio.run(run())
    assert got == expected
    assert all(c.token_ids == e and c.finish_reason == "length" for c, e in zip(completions, expected))
    assert rec.other_steps == 0 and len(rec.batches) == stats.steps
    # Budgets hold, chunks continue their cache and only the last one is final, no full logits.
    chunks: dict[str, list] = {}
    mixed = 0
    for batch in rec.batches:
        assert len(batch) <= 6 and sum(len(i.q_tokens) for i in batch) <= 16
        kinds = {("decode" if i.pos_offset > 0 and len(i.q_tokens) == 1 and i.is_final_chunk else "prefill")
                 for i in batch}
        mixed += kinds == {"decode", "prefill"}
        for i in batch:
            assert i.logits_policy is None if not i.is_final_chunk else i.logits_policy.kind == "argmax"
            chunks.setdefault(i.seq_id, []).append(i)
    assert mixed > 0, "no step mixed decodes with prefill chunks"
    for seq_items in chunks.values():
        pos = 0
        for i in seq_items:
            assert i.pos_offset == pos
            pos += len(i.q_tokens)
        prompt_len = next(len(p) for p in PROMPTS if sum(len(i.q_tokens) for i in seq_items) == len(p) + 11)
        finals = [i.is_final_chunk for i in seq_items]
        n_prefill = next(k for k, i in enumerate(seq_items) if i.is_final_chunk) + 1
        assert sum(len(i.q_tokens) for i in seq_items[:n_prefill]) == prompt_len
        assert all(finals[n_prefill:]) and not any(finals[:n_prefill - 1])
    assert any(len(v) > 12 for v in chunks.values()), "no prompt was chunked"
    with ExecutorClient(server.address) as c:
        pool_is_clean(c)


def test_eos_from_server_or_caller_and_server_side_sampling(make_server):
    server = make_server()
    sample = LogitsPolicy.sample(0.9, top_k=20, seed=1234)
    with ExecutorClient(server.address) as c:
        full = [plain(c, p, 16) for p in PROMPTS[:4]]
        sampled = [plain(c, p, 10, sample) for p in PROMPTS[:4]]
    stop = full[1][5]

    async def run():
        async with Scheduler(AsyncExecutorClient(server.address), max_num_batched_tokens=32) as sched:
            assert sched.eos_token_ids == frozenset()  # the paged executor names none
            a = await asyncio.gather(*(sched.generate(p, max_tokens=16, stop_token_ids=[stop]) for p in PROMPTS[:4]))
            b = await asyncio.gather(*(sched.generate(p, max_tokens=10, policy=sample) for p in PROMPTS[:4]))
        return a, b

    stopped, drawn = asyncio.run(run())
    for comp, ref in zip(stopped, full):
        if stop in ref:
            assert comp.finish_reason == "stop" and comp.token_ids == ref[:ref.index(stop)]
        else:
            assert comp.finish_reason == "length" and comp.token_ids == ref
    # Seeded draws depend on seed and position only, so batching does not change them.
    assert [c.token_ids for c in drawn] == sampled
    with ExecutorClient(server.address) as c:
        pool_is_clean(c)


def test_a_small_pool_preempts_and_recomputes_with_the_same_tokens(make_server):
    server = make_server(num_blocks=24)  # 96 tokens of KV for 12 prompts of up to 70 + 20
    with ExecutorClient(server.address) as c:
        expected = [plain(c, p, 20) for p in PROMPTS]

    async def run():
        async with Scheduler(AsyncExecutorClient(server.address), max_num_batched_tokens=64) as sched:
            out = await asyncio.gather(*(sched.generate(p, max_tokens=20) for p in PROMPTS))
            return out, sched.stats

    out, stats = asyncio.run(run())
    assert [c.token_ids for c in out] == expected
    assert stats.preemptions > 0 and sum(c.preemptions for c in out) == stats.preemptions
    with ExecutorClient(server.address) as c:
        pool_is_clean(c)


def test_penalties_go_with_every_step_over_the_sequences_own_tokens(make_server):
    server = make_server(num_blocks=24)  # small enough to preempt: penalties must survive a recompute
    penalties = Penalties(repetition=1.3, presence=1.5, frequency=0.5)
    expected = [penalized_greedy(p, 20, penalties) for p in PROMPTS]
    with ExecutorClient(server.address) as c:
        unpenalized = [plain(c, p, 20) for p in PROMPTS]
    assert sum(e != u for e, u in zip(expected, unpenalized)) >= 6, "the penalties should change most generations"

    async def run():
        async with Scheduler(AsyncExecutorClient(server.address), max_num_batched_tokens=64) as sched:
            with pytest.raises(ValueError, match="argmax and sample"):
                sched.submit([1, 2], policy=LogitsPolicy.top_k(3), penalties=penalties)
            out = await asyncio.gather(*(sched.generate(p, max_tokens=20, penalties=penalties) for p in PROMPTS))
            return out, sched.stats

    out, stats = asyncio.run(run())
    assert [c.token_ids for c in out] == expected
    assert stats.preemptions > 0
    with ExecutorClient(server.address) as c:
        pool_is_clean(c)


def test_min_tokens_keeps_the_stop_ids_out_until_then(make_server):
    server = make_server()
    with ExecutorClient(server.address) as c:
        greedy = [plain(c, p, 16) for p in PROMPTS[:6]]
    stops = [g[2] for g in greedy]  # each request stops at the third token plain greedy decoding gives it
    model = PagedModel()

    def reference(prompt: list[int], stop: int) -> tuple[list[int], str]:
        tokens: list[int] = []
        while len(tokens) < 16:
            logits = model.last_logits(prompt + tokens)
            if len(tokens) < 10:
                logits[stop] = -np.inf
            token = int(np.argmax(logits))
            if token == stop:
                return tokens, "stop"
            tokens.append(token)
        return tokens, "length"

    async def run():
        async with Scheduler(AsyncExecutorClient(server.address), max_num_batched_tokens=32) as sched:
            with pytest.raises(ValueError, match="min_tokens"):
                sched.submit([1], max_tokens=4, min_tokens=5)
            return await asyncio.gather(*(sched.generate(p, max_tokens=16, min_tokens=10, stop_token_ids=[stop])
                                          for p, stop in zip(PROMPTS[:6], stops)))

    for prompt, stop, comp in zip(PROMPTS[:6], stops, asyncio.run(run())):
        assert (comp.token_ids, comp.finish_reason) == reference(prompt, stop)
        assert len(comp.token_ids) >= 10 and stop not in comp.token_ids[:10]
    with ExecutorClient(server.address) as c:
        pool_is_clean(c)


def test_top_logprobs_come_with_each_token(make_server):
    server = make_server()

    async def run():
        async with Scheduler(AsyncExecutorClient(server.address), max_num_batched_tokens=32) as sched:
            return await asyncio.gather(*(sched.generate(p, max_tokens=6, policy=LogitsPolicy.argmax(top_logprobs=3))
                                          for p in PROMPTS[:4]))

    for comp in asyncio.run(run()):
        assert len(comp.top_logprobs) == len(comp.token_ids) == 6
        for token, logprob, top in zip(comp.token_ids, comp.logprobs, comp.top_logprobs):
            assert len(top) == 3 and max(top.values()) == pytest.approx(logprob, abs=1e-6)
            assert top.get(token, logprob) == pytest.approx(logprob, abs=1e-6)  # ties may list another id
    with ExecutorClient(server.address) as c:
        pool_is_clean(c)


def test_resource_exhausted_from_another_client_is_waited_out(make_server):
    """Blocks taken behind the scheduler's back: the step is refused, nothing fails, it resumes when freed."""
    server = make_server(num_blocks=40)
    with ExecutorClient(server.address) as c:
        expected = [plain(c, p, 8) for p in PROMPTS[:4]]
        hog_client = ExecutorClient(server.address)

    async def run():
        async with Scheduler(AsyncExecutorClient(server.address), status_refresh_s=3600) as sched:
            hog = hog_client.prefill(PrefillInput(list(range(150))))  # 38 of 40 blocks, unknown to the scheduler
            task = asyncio.gather(*(sched.generate(p, max_tokens=8) for p in PROMPTS[:4]))
            await eventually(lambda: sched.stats.refused_steps > 0)
            await asyncio.sleep(0.2)
            assert not task.done()
            hog_client.release_cache(hog.kv_cache)
            return await task, sched.stats

    out, stats = asyncio.run(run())
    hog_client.close()
    assert [c.token_ids for c in out] == expected and stats.refused_steps >= 1
    with ExecutorClient(server.address) as c:
        pool_is_clean(c)


def test_limits_from_capabilities_and_requests_that_can_never_fit(make_server):
    server = make_server(num_blocks=20, max_batch_size=3, max_tokens_per_request=8)
    rec = Recording(server.address)
    with ExecutorClient(make_server().address) as c:  # a prefill here would be past the limits
        expected = [plain(c, p, 6) for p in PROMPTS[:5]]

    async def run():
        async with Scheduler(rec, max_num_batched_tokens=512, max_num_seqs=32, kv_watermark_blocks=2) as sched:
            too_long = sched.submit(list(range(76)), max_tokens=4)  # 19 blocks > 20 in the pool - 2 kept free
            past_max = sched.submit([1] * 81, max_tokens=4)  # past kv_capacity (20 blocks of 4 tokens)
            ok = await asyncio.gather(*(sched.generate(p, max_tokens=6) for p in PROMPTS[:5]))
            with pytest.raises(ResourceExhaustedError):
                async for _ in too_long:
                    pass
            with pytest.raises(OutOfRangeError):
                async for _ in past_max:
                    pass
            return ok

    ok = asyncio.run(run())
    assert [c.token_ids for c in ok] == expected
    assert all(len(b) <= 3 and sum(len(i.q_tokens) for i in b) <= 8 for b in rec.batches)
    with ExecutorClient(server.address) as c:
        pool_is_clean(c)


def test_cancelling_a_request_frees_its_cache(make_server):
    server = make_server()

    async def run():
        async with Scheduler(AsyncExecutorClient(server.address)) as sched:
            stream = sched.submit(PROMPTS[4], max_tokens=400)
            other = sched.submit(PROMPTS[2], max_tokens=400)
            got = []
            async with stream:
                async for t in stream:
                    got.append(t)
                    if len(got) == 3:
                        break
            c = await stream.result()
            assert c.finish_reason == "cancelled" and c.token_ids[:3] == got

            async def consume():
                async for _ in other:
                    pass

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.05)
            task.cancel()  # the consumer goes away: the request goes too
            with pytest.raises(asyncio.CancelledError):
                await task
            assert (await other.result()).finish_reason == "cancelled"
            while sched.num_running:
                await asyncio.sleep(0.01)
            with ExecutorClient(server.address) as cl:
                pool_is_clean(cl)
            # Closing with work in flight cancels it and releases everything.
            left = sched.submit(PROMPTS[3], max_tokens=400)
            await asyncio.sleep(0.05)
        assert (await left.result()).finish_reason == "cancelled"

    asyncio.run(run())
    with ExecutorClient(server.address) as c:
        pool_is_clean(c)


def test_request_ids_are_the_callers_labels_shared_or_not_cache_ids(make_server):
    """Two live requests may share a request id, and one may hold characters a cache id
    refuses: each still gets its own cache (the ids were made from the request id)."""
    server = make_server()
    with ExecutorClient(server.address) as c:
        expected = [plain(c, p, 12) for p in PROMPTS[1:4]]

    async def run():
        async with Scheduler(AsyncExecutorClient(server.address)) as sched:
            return await asyncio.gather(*(sched.generate(p, max_tokens=12, ignore_eos=True, request_id=rid)
                                          for p, rid in zip(PROMPTS[1:4], ["dup", "dup", "user 7/chat #3"])))

    out = asyncio.run(run())
    assert [c.token_ids for c in out] == expected and [c.request_id for c in out] == ["dup", "dup", "user 7/chat #3"]
    with ExecutorClient(server.address) as c:
        pool_is_clean(c)


def test_over_three_replicas_sequences_spread_and_tokens_equal_one_server(make_server):
    servers = [make_server() for _ in range(3)]
    with ExecutorClient(servers[0].address) as c:
        expected = [plain(c, p, 10) for p in PROMPTS]
    before = [ExecutorClient(s.address).status().prefill_operations for s in servers]

    async def run():
        router = AsyncExecutorRouter([s.address for s in servers])
        async with router, Scheduler(router, max_num_batched_tokens=32, max_num_seqs=4) as sched:
            return await asyncio.gather(*(sched.generate(p, max_tokens=10) for p in PROMPTS))

    out = asyncio.run(run())
    assert [c.token_ids for c in out] == expected
    for s, b in zip(servers, before):
        with ExecutorClient(s.address) as c:
            assert c.status().prefill_operations > b  # every replica took sequences
            pool_is_clean(c)


def test_schedule_cli_runs_a_prompt_file_through_the_scheduler(make_server, smollm2_dir, tmp_path):
    from service.config import ServeConfig
    from tests.conftest import start_server

    running = start_server(ServeConfig(port=0, executor="llm", model=str(smollm2_dir), num_blocks=128))
    try:
        prompts = tmp_path / "prompts.txt"
        prompts.write_text("The capital of France is\n\nWhat is 2+2?\n")
        done = subprocess.run(
            [sys.executable, "-m", "client", "schedule", "--targets", running.address, "--prompts-file",
             str(prompts), "--max-tokens", "6"],
            capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr
        assert "--- [0] The capital of France is\nParis" in done.stdout, done.stdout
        assert "--- [1] What is 2+2?" in done.stdout
        assert "throughput:" in done.stdout and "tokens/s" in done.stdout and "requests/s" in done.stdout
        assert "2/2 requests" in done.stderr  # the progress bar
        with ExecutorClient(running.address) as c:
            pool_is_clean(c)
    finally:
        running.stop()


def test_a_sequence_preempted_on_one_replica_frees_its_cache_there_when_it_moves_to_another(make_server):
    """Replica 0's pool is too small for its sequences, replica 1 has room: the preempted one
    is recomputed (on either), and its old cache is released on the replica it left."""
    small, big = make_server(num_blocks=12), make_server(num_blocks=256)
    prompts = [p[:20] for p in PROMPTS if len(p) >= 20][:4]
    with ExecutorClient(big.address) as c:
        expected = [plain(c, p, 20) for p in prompts]

    async def run():
        router = AsyncExecutorRouter([small.address, big.address])
        async with router, Scheduler(router, max_num_batched_tokens=128) as sched:
            out = await asyncio.gather(*(sched.generate(p, max_tokens=20) for p in prompts))
            return out, sched.stats

    out, stats = asyncio.run(run())
    assert [c.token_ids for c in out] == expected and stats.preemptions > 0
    for s in (small, big):
        with ExecutorClient(s.address) as c:
            pool_is_clean(c)


def test_a_cache_whose_lease_ran_out_is_recomputed_and_its_batch_mates_go_on(make_server):
    """The server reaps one running request's cache between two steps: the next step is
    refused NOT_FOUND (CACHE_RELEASED, naming the cache), and only that request is
    prefilled again, with the same tokens; the other one carries on."""
    server = make_server()
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    with ExecutorClient(server.address) as c:
        expected = [plain(c, p, 8) for p in prompts]
    executor = server.server.executor

    class ReapsOnce(Recording):
        async def unified_decode(self, batch, **kwargs):
            items = list(batch)
            if len(self.batches) == 3:  # both requests are decoding by now
                victim = next(i.seq_id for i in items if i.pos_offset > 0)
                executor.caches._states[victim].last_used -= 10_000  # its lease ran out long ago
                assert await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
                    executor.reap_idle(600), server.loop)) == [victim]
            return await super().unified_decode(items, **kwargs)

    async def run():
        async with Scheduler(ReapsOnce(server.address), max_num_batched_tokens=64, max_num_seqs=8,
                             retry_attempts=0) as sched:
            streams = [sched.submit(p, max_tokens=8) for p in prompts]
            return [await s.result() for s in streams]

    completions = asyncio.run(run())
    assert [c.finish_reason for c in completions] == ["length", "length"]
    assert [c.token_ids for c in completions] == expected
    assert sorted(c.preemptions for c in completions) == [0, 1]
    with ExecutorClient(server.address) as c:
        pool_is_clean(c)


def test_a_request_whose_logits_cannot_pass_the_message_limit_fails_alone(make_server):
    """A full row of logits (~1.1 KB here) cannot pass a 1500-byte message limit: the server
    refuses the step before it runs (RESPONSE_TOO_LARGE); that request fails with the error,
    and the argmax request stepped with it goes on with the tokens it would have had."""
    server = make_server(max_message_bytes=1500)
    with ExecutorClient(server.address) as c:
        expected = plain(c, PROMPTS[1], 6)

    async def run():
        async with Scheduler(AsyncExecutorClient(server.address), max_num_batched_tokens=64, max_num_seqs=8,
                             retry_attempts=0) as sched:
            small = sched.submit(PROMPTS[1], max_tokens=6)
            full = sched.submit(PROMPTS[0], max_tokens=6, policy=LogitsPolicy.full())
            return await small.result(), await full.result()

    small, full = asyncio.run(asyncio.wait_for(run(), 60))  # once, refused steps were planned again forever
    assert (small.finish_reason, small.token_ids) == ("length", expected)
    assert full.finish_reason == "error" and full.error.reason == "RESPONSE_TOO_LARGE"
    with ExecutorClient(server.address) as c:
        pool_is_clean(c)
