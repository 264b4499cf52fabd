"""Decode steps left in flight while the next one is launched (executors/step_overlap.py).

A graphed executor that overlaps steps (decode graphs run eagerly on a CPU, the Triton kernels in
the interpreter) against one that finishes each step before the next: the same tokens and
log-probabilities for a scheduler that keeps two fed steps in flight, and every other call (a
retry, a truncate, a TOP_K step, a caller that goes away) sees what it would have seen without the
overlap.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import torch

from bench.common import pipelined_decode
from executors import kv_step
from executors.llm import LlmExecutor, LlmExecutorConfig
from executors.types import LogitsKind, LogitsPolicy, PrefillInput, UnifiedBatchItem
from tests.conftest import triton_kernels_unrunnable
from tests.models.test_cpu_paths import BLOCK, VOCAB, tiny_model

pytestmark = pytest.mark.skipif(triton_kernels_unrunnable() is not None, reason=str(triton_kernels_unrunnable()))
pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ARGMAX = LogitsPolicy(kind=LogitsKind.ARGMAX)


def graphed(overlap: bool, model) -> LlmExecutor:
    cfg = LlmExecutorConfig(model_dir="/nonexistent/qwen3", block_size=BLOCK, num_blocks=40, device=DEVICE,
                            dtype="float32", max_batch_size=4, attention_backend="triton", max_sequence_length=96,
                            step_overlap=overlap)
    return LlmExecutor(cfg, model, decode_graphs=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3").to(DEVICE)


@pytest.fixture
def counted(monkeypatch):
    """How many steps settled the one in flight after launching their own forward."""
    calls = []
    original = kv_step.settled
    monkeypatch.setattr(kv_step, "settled", lambda ex, work, flight: calls.append(1) or original(ex, work, flight))
    return calls


@pytest.fixture
def busy_device(monkeypatch):
    """A step's pairs reach the host 0.3 s after its launch, as from a GPU still running it (on a
    CPU they are there at once, and an idle worker would settle each step before the next came)."""
    from executors import step_overlap

    original = step_overlap.HostPairs.__init__

    def init(self, pairs):
        original(self, pairs)
        self.due = time.monotonic() + 0.3

    monkeypatch.setattr(step_overlap.HostPairs, "__init__", init)
    monkeypatch.setattr(step_overlap.HostPairs, "ready", lambda self: time.monotonic() >= self.due)


def fed(handles, policy=ARGMAX):
    return [UnifiedBatchItem(seq_id=h.cache_id, q_tokens=[], pos_offset=h.sequence_length, is_final_chunk=True,
                             logits_policy=policy, feed_sampled_token=True) for h in handles]


def next_handles(results):
    return [r.kv_cache for r in results]


async def prefilled(ex: LlmExecutor, lengths=(5, 9, 13)):
    outs = await ex.batch_prefill([PrefillInput(input_ids=[(7 * n + i) % VOCAB for i in range(n)],
                                                logits_policy=ARGMAX) for n in lengths])
    return [o.kv_cache for o in outs], [o.logits.token_id for o in outs]


async def pipelined(ex: LlmExecutor, steps: int) -> list[list[tuple[int, float]]]:
    """Two fed steps in flight (bench.common.pipelined_decode): each step's ids and log-probabilities."""
    handles, _ = await prefilled(ex)
    _, results = await pipelined_decode(ex, handles, steps)
    return [[(r.logits.token_id, r.logits.logprob) for r in step] for step in results]


async def one_at_a_time(ex: LlmExecutor, steps: int) -> list[list[tuple[int, float]]]:
    handles, _ = await prefilled(ex)
    got = []
    for _ in range(steps):
        results = await ex.unified_decode(fed(handles))
        got.append([(r.logits.token_id, r.logits.logprob) for r in results])
        handles = next_handles(results)
    return got


def run(coro):
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def close(*executors):
    for ex in executors:
        ex.worker.close()


def test_two_fed_steps_in_flight_give_the_tokens_of_one_step_at_a_time(model, counted, busy_device):
    overlapping, plain = graphed(True, model), graphed(False, model)
    try:
        want = run(one_at_a_time(plain, 6))
        assert counted == []  # without the overlap no step is left in flight
        got = run(pipelined(overlapping, 6))
        for g, w in zip(got, want, strict=True):
            assert [t for t, _ in g] == [t for t, _ in w]
            assert [lp for _, lp in g] == pytest.approx([lp for _, lp in w], abs=1e-5)
        # Every step after the first was launched, its tokens fed on the device, before the one
        # before it settled; the last settled once the worker was idle and its pairs were in.
        assert len(counted) == 5, counted
        assert overlapping.worker.in_flight is None
        status = overlapping.status()
        assert status.state.name == "READY" and status.current_batch_size == 0
    finally:
        close(overlapping, plain)


def test_a_retry_truncate_or_other_policy_meets_the_step_in_flight_settled(model, counted):
    ex = graphed(True, model)
    try:
        async def scenario():
            handles, _ = await prefilled(ex)
            a = handles[0]
            # A step in flight and its retry (the same request): the retry replays it.
            first, retry = await asyncio.gather(ex.unified_decode(fed([a])), ex.unified_decode(fed([a])))
            assert first == retry and first[0].kv_cache.sequence_length == a.sequence_length + 1
            # A step in flight, then a truncate of its cache: the truncate sees the step's length.
            step = asyncio.ensure_future(ex.unified_decode(fed([first[0].kv_cache])))
            await asyncio.sleep(0)  # queued first
            truncated = await ex.truncate_kv(a.cache_id, a.sequence_length + 1)
            assert (await step)[0].kv_cache.sequence_length == a.sequence_length + 2
            assert truncated.kv_cache.sequence_length == a.sequence_length + 1
            # A fed TOP_K step continuing an ARGMAX step in flight: not left in flight itself.
            b = handles[1]
            argmax_step = asyncio.ensure_future(ex.unified_decode(fed([b])))
            await asyncio.sleep(0)
            top_k = await ex.unified_decode(
                [UnifiedBatchItem(seq_id=b.cache_id, q_tokens=[], pos_offset=b.sequence_length + 1,
                                  is_final_chunk=True, logits_policy=LogitsPolicy(kind=LogitsKind.TOP_K, k=3),
                                  feed_sampled_token=True)])
            sampled = (await argmax_step)[0].logits.token_id
            assert top_k[0].kv_cache.sequence_length == b.sequence_length + 2
            assert len(top_k[0].logits.top_token_ids) == 3
            assert ex.caches.last_step(b.cache_id).tokens == (sampled,)  # the host learned the fed token
            return b

        b = run(scenario())
        assert counted  # the TOP_K step settled the ARGMAX one after its own launch
        # The same TOP_K answer as an executor that never overlaps, from the same cache contents.
        plain = graphed(False, model)
        try:
            async def same():
                handles, _ = await prefilled(plain)
                argmax = await plain.unified_decode(fed([handles[1]]))
                return await plain.unified_decode(fed([argmax[0].kv_cache], LogitsPolicy(kind=LogitsKind.TOP_K, k=3)))

            want = run(same())
            got = ex.caches.last_step(b.cache_id).result.outputs[0]
            assert got.top_token_ids == want[0].logits.top_token_ids
        finally:
            close(plain)
    finally:
        close(ex)


def test_a_caller_gone_while_its_step_is_in_flight_leaves_the_worker_serving(model, busy_device, counted):
    ex = graphed(True, model)
    try:
        async def scenario():
            handles, _ = await prefilled(ex)
            step = asyncio.ensure_future(ex.unified_decode(fed(handles)))
            while ex.worker.in_flight is None:  # launched, its caller waiting for it to settle
                await asyncio.sleep(0.01)
            step.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await step
            done = await ex.unified_decode(
                [UnifiedBatchItem(seq_id=h.cache_id, q_tokens=[], pos_offset=h.sequence_length + 1,
                                  is_final_chunk=True, logits_policy=ARGMAX, feed_sampled_token=True)
                 for h in handles])  # fed by the abandoned step, which ran and settled all the same
            assert [r.kv_cache.sequence_length for r in done] == [h.sequence_length + 2 for h in handles]
            assert counted == [1]
            await ex.release_cache(handles[0].cache_id)  # and the worker goes on serving

        run(scenario())
        assert ex.worker.in_flight is None and ex.kv.cache_ids() and len(ex.kv.cache_ids()) == 2
    finally:
        close(ex)


def test_a_step_whose_tokens_were_sent_is_answered_at_once(model, monkeypatch):
    """A caller that sends its tokens waits for each step: it is not left in flight (the idle
    worker's polling would only delay its answer); a fed one is."""
    left = []
    original = kv_step.in_flight
    monkeypatch.setattr(kv_step, "in_flight", lambda ex, specs, *rest: left.append(len(specs))
                        or original(ex, specs, *rest))
    ex = graphed(True, model)
    try:
        async def scenario():
            handles, tokens = await prefilled(ex)
            sent = await ex.unified_decode([UnifiedBatchItem(seq_id=h.cache_id, q_tokens=[t],
                                                             pos_offset=h.sequence_length, is_final_chunk=True,
                                                             logits_policy=ARGMAX) for h, t in zip(handles, tokens)])
            assert left == []
            await ex.unified_decode(fed(next_handles(sent)))
            assert left == [3]

        run(scenario())
    finally:
        close(ex)
