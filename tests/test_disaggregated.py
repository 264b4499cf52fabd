"""Disaggregated serving (client/disaggregated.py): prefill on one server, decode on two, each
cache moved in between, against real servers through the real client."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import numpy as np
import pytest

from client import AsyncExecutorClient, ExecutorClient, PrefillInput
from client.disaggregated import DisaggregatedScheduler
from client.errors import ResourceExhaustedError
from client.latency import summarize_latency
from client.router import AsyncExecutorRouter
from client.scheduler import Scheduler
from service.config import ServeConfig
from tests.conftest import eventually, start_server

rng = np.random.default_rng(11)
# Lengths 1..45: several longer than a 16-token step budget, prefilled in chunks.
PROMPTS = [rng.integers(0, 256, size=int(n)).tolist() for n in [1, 5, 17, 33, 2, 40, 9, 12, 45, 3]]


class Recording(AsyncExecutorClient):
    """The typed client, remembering every UnifiedDecode batch."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[list] = []

    async def unified_decode(self, batch, **kwargs):
        items = list(batch)
        self.batches.append(items)
        return await super().unified_decode(items, **kwargs)


def assert_clean(*addresses: str) -> None:
    for address in addresses:
        with ExecutorClient(address) as c:
            kv = c.status().kv_pool
            assert kv.used_blocks == 0 and kv.active_caches == 0, (address, kv)
            assert c.list_caches() == [], address


async def colocated(address: str, prompts, max_tokens: int, **config):
    async with Scheduler(AsyncExecutorClient(address), **config) as sched:
        return await asyncio.gather(*(sched.generate(p, max_tokens=max_tokens) for p in prompts))


def check_latencies(completions) -> None:
    for c in completions:
        assert 0 < c.ttft_s <= c.latency_s
        assert len(c.token_times) == len(c.token_ids) and c.token_times == sorted(c.token_times)
        assert c.token_times[0] == c.first_token_at <= c.token_times[-1] <= c.finished_at
        if len(c.token_ids) > 1:
            assert 0 < c.itl_s <= c.latency_s
    summary = summarize_latency(completions)
    assert summary.ttft.count == len(completions)
    assert summary.itl.count == sum(len(c.token_ids) - 1 for c in completions)
    for p in (summary.ttft, summary.itl):
        assert 0 < p.p50 <= p.p99 and 0 < p.mean <= p.p99 * 1.0001
    assert str(summary).startswith("latency: first token mean ")


def test_disaggregated_tokens_equal_colocated_and_every_pool_ends_empty(make_server):
    prefill, *decode = (make_server() for _ in range(3))
    config = {"max_num_batched_tokens": 16, "max_num_seqs": 6}
    expected = asyncio.run(colocated(prefill.address, PROMPTS, 12, **config))
    check_latencies(expected)
    assert_clean(prefill.address)
    p_rec, d_recs = Recording(prefill.address), [Recording(d.address) for d in decode]

    async def run():
        async with DisaggregatedScheduler(p_rec, AsyncExecutorRouter(d_recs), **config) as sched:
            out = await asyncio.gather(*(sched.generate(p, max_tokens=12) for p in PROMPTS))
            assert sched.num_moving == 0
            return out, sched.stats

    out, stats = asyncio.run(run())
    assert [c.token_ids for c in out] == [c.token_ids for c in expected]
    assert all(c.finish_reason == "length" and c.error is None for c in out)
    check_latencies(out)
    assert stats.moves == len(PROMPTS) and stats.failed_moves == 0 and stats.bytes_moved > 0
    assert stats.generated_tokens == 12 * len(PROMPTS)
    # The prefill server only prefilled (chunks of at most 16 tokens, batched); the decode
    # servers only decoded, one token per item, several sequences per step, both of them.
    prefill_items = [i for b in p_rec.batches for i in b]
    assert max(len(b) for b in p_rec.batches) > 1
    assert all(sum(len(i.q_tokens) for i in b) <= 16 for b in p_rec.batches)
    assert sum(len(i.q_tokens) for i in prefill_items) == sum(len(p) for p in PROMPTS)
    for rec in d_recs:
        items = [i for b in rec.batches for i in b]
        assert items and all(len(i.q_tokens) == 1 and i.pos_offset > 0 and i.is_final_chunk for i in items)
        assert max(len(b) for b in rec.batches) > 1
    assert sum(len(b) for rec in d_recs for b in rec.batches) == 11 * len(PROMPTS)
    assert_clean(prefill.address, *(d.address for d in decode))


def test_a_full_decode_pool_sends_the_move_elsewhere_or_later_and_errors_stay_per_request(make_server):
    """Decode server 0 looks emptiest but is full (blocks taken behind the scheduler's back):
    its imports are refused and the caches go to server 1, which holds only two sequences
    at a time, so moves also wait for decodes to finish. A prompt no decode pool could hold
    fails alone."""
    prefill = make_server()
    full, small = make_server(num_blocks=40), make_server(num_blocks=24)
    prompts = PROMPTS[2:6]  # 17, 33, 2, 40 tokens: 7, 11, 3, 12 blocks of 4 with 8 new tokens
    expected = asyncio.run(colocated(prefill.address, prompts, 8))
    hog_client = ExecutorClient(full.address)

    async def run():
        router = AsyncExecutorRouter([full.address, small.address])
        async with router, DisaggregatedScheduler(AsyncExecutorClient(prefill.address), router,
                                                  status_refresh_s=3600) as sched:
            hog = hog_client.prefill(PrefillInput(list(range(150))))  # 38 of 40 blocks
            too_long = sched.submit(list(range(200)), max_tokens=4)  # 50 blocks: more than either pool
            out = await asyncio.gather(*(sched.generate(p, max_tokens=8) for p in prompts))
            with pytest.raises(ResourceExhaustedError):
                async for _ in too_long:
                    pass
            failed = await too_long.result()
            hog_client.release_cache(hog.kv_cache)
            return out, failed, sched.stats

    try:
        out, failed, stats = asyncio.run(run())
    finally:
        hog_client.close()
    assert [c.token_ids for c in out] == [c.token_ids for c in expected]
    assert failed.finish_reason == "error" and len(failed.token_ids) == 1 and "KV blocks" in str(failed.error)
    assert stats.move_refusals >= 1 and stats.moves == len(prompts) and stats.failed_moves == 1
    assert_clean(prefill.address, full.address, small.address)


@pytest.mark.parametrize("decode_servers", [1, 2])
def test_requests_sharing_a_request_id_keep_caches_of_their_own(make_server, decode_servers):
    """The request id is the caller's label: a second live "dup" used to be imported under
    the first one's cache id, and its clean-up released the first one's cache (one decode
    server), or its adoption failed and it never ended (two)."""
    prefill, *decode = (make_server() for _ in range(1 + decode_servers))
    prompts = PROMPTS[3:5]
    expected = asyncio.run(colocated(prefill.address, prompts, 24, max_num_batched_tokens=16))

    async def run():
        router = AsyncExecutorRouter([d.address for d in decode], status_ttl_s=0)
        async with router, DisaggregatedScheduler(AsyncExecutorClient(prefill.address), router,
                                                  max_num_batched_tokens=16) as sched:
            first = sched.submit(prompts[0], max_tokens=24, ignore_eos=True, request_id="dup")
            await eventually(lambda: sched.stats.moves >= 1)  # the first one decodes when the second arrives
            second = sched.submit(prompts[1], max_tokens=24, ignore_eos=True, request_id="dup")
            return await asyncio.wait_for(asyncio.gather(first.result(), second.result()), 60), sched.stats

    out, stats = asyncio.run(run())
    assert [(c.finish_reason, c.error, c.preemptions) for c in out] == [("length", None, 0)] * 2
    assert [c.token_ids for c in out] == [c.token_ids for c in expected]
    assert stats.moves == 2 and stats.failed_moves == 0
    assert_clean(prefill.address, *(d.address for d in decode))


def test_cancel_and_close_with_requests_prefilling_moving_and_decoding_release_everything(make_server):
    prefill, *decode = (make_server() for _ in range(3))

    async def run():
        router = AsyncExecutorRouter([d.address for d in decode])
        async with router, DisaggregatedScheduler(AsyncExecutorClient(prefill.address), router,
                                                  max_num_batched_tokens=16) as sched:
            first = sched.submit(PROMPTS[3], max_tokens=400)
            got = []
            async with first:  # leaving it cancels the request, by then decoding on a decode server
                async for t in first:
                    got.append(t)
                    if len(got) == 3:
                        break
            assert (await first.result()).finish_reason == "cancelled"
            streams = [sched.submit(p, max_tokens=400) for p in PROMPTS]
            await eventually(lambda: sched.stats.moves >= 4, poll=0.001)
        return [await s.result() for s in streams], sched.stats  # close() ended every one of them

    out, stats = asyncio.run(run())
    assert all(c.finish_reason == "cancelled" for c in out) and stats.failed_moves == 0
    assert_clean(prefill.address, *(d.address for d in decode))


def test_close_while_a_moves_source_release_is_answered_leaves_no_copy_anywhere(make_server):
    """close() cancels a move whose source release has happened but not yet answered: the
    move keeps its copy (the commit point), and the request's clean-up releases it."""
    from tests.test_router_faults import PausesAfterRelease

    prefill, decode = make_server(), make_server()

    async def run():
        source = PausesAfterRelease(prefill.address)
        router = AsyncExecutorRouter([decode.address])
        async with router, DisaggregatedScheduler(source, router, max_num_batched_tokens=16) as sched:
            stream = sched.submit(PROMPTS[3], max_tokens=50)
            await asyncio.wait_for(source.releasing.wait(), 30)
        return await stream.result(), sched.stats

    out, stats = asyncio.run(run())
    assert out.finish_reason == "cancelled" and stats.moves == 0
    assert_clean(prefill.address, decode.address)


def test_a_tiny_llama_in_fp32_decodes_the_same_after_its_cache_moved(tmp_path):
    from tests.models.tiny_models import VOCAB, build

    build("llama", tmp_path / "llama")
    config = ServeConfig(port=0, executor="llm", model=str(tmp_path / "llama"), block_size=4, num_blocks=128,
                         dtype="float32")
    servers = [start_server(config) for _ in range(3)]
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (3, 11, 26, 7)]
    try:
        expected = asyncio.run(colocated(servers[0].address, prompts, 10, max_num_batched_tokens=16))

        async def run():
            decode = AsyncExecutorRouter([s.address for s in servers[1:]])
            async with decode, DisaggregatedScheduler(AsyncExecutorClient(servers[0].address), decode,
                                                      max_num_batched_tokens=16) as sched:
                return await asyncio.gather(*(sched.generate(p, max_tokens=10) for p in prompts)), sched.stats

        out, stats = asyncio.run(run())
        assert [c.token_ids for c in out] == [c.token_ids for c in expected]
        assert stats.moves == len(prompts)
        check_latencies(out)
        assert_clean(*(s.address for s in servers))
    finally:
        for s in servers:
            s.stop()


def test_schedule_cli_prefill_and_decode_targets(make_server, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(256)]  # the paged executor's vocabulary
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w1 w2 w3\n\nw200 w17 w5 w9 w33 w71 w6\nw4\n")
    prefill, *decode = (make_server() for _ in range(3))

    def schedule(*targets: str) -> list[str]:
        done = subprocess.run(
            [sys.executable, "-m", "client", "schedule", *targets, "--prompts-file", str(prompts),
             "--tokenizer", str(tmp_path), "--max-tokens", "5"],
            capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        assert "3/3 requests" in done.stderr
        return done.stdout.splitlines()

    colocated_out = schedule("--targets", prefill.address)
    out = schedule("--prefill-targets", prefill.address, "--decode-targets", ",".join(d.address for d in decode))
    texts = [x for x in out if not x.startswith(" ")][:6]
    assert texts == [x for x in colocated_out if not x.startswith(" ")][:6] and texts[0] == "--- [0] w1 w2 w3"
    assert all("5 tokens, length, first token" in x and "inter-token" in x for x in out if x.startswith("    ("))
    assert any(x.startswith("3 requests (0 failed) on 1 prefill + 2 decode executors:") for x in out), out
    assert any(x.startswith("latency: first token mean") and "inter-token mean" in x for x in out), out
    assert any(x.startswith("moves: 3 caches") for x in out), out
    assert any(x.startswith("latency: first token mean") for x in colocated_out), colocated_out
    assert_clean(prefill.address, *(d.address for d in decode))
    done = subprocess.run([sys.executable, "-m", "client", "schedule", "--prefill-targets", prefill.address,
                           "--prompts-file", str(prompts), "--tokenizer", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1 and "--prefill-targets and --decode-targets go together" in done.stderr
