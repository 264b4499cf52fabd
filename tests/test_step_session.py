"""The StepSession stream: unified steps over one call, with UnifiedDecode's results and errors."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest

from client import (
    AsyncExecutorClient,
    CallCancelledError,
    DeadlineExceededError,
    ExecutorClient,
    FailedPreconditionError,
    InvalidArgumentError,
    LogitsPolicy,
    NotFoundError,
    UnifiedBatchItem,
)
from executors.paged import PagedAttentionExecutor, PagedExecutorConfig
from generated.modelexec.v1 import executor_pb2 as pb
from tests.paged_reference import PagedModel

# Asserts wall-clock bounds or orders events by sleeping: `make test` runs it alone (tests/conftest.py).
pytestmark = pytest.mark.alone

MODEL = PagedModel()


def test_a_session_of_steps_equals_unified_calls(client):
    prompt = [5, 17, 3, 99, 42, 7]
    with client.step_session() as session:
        first = session.step([UnifiedBatchItem("sess-a", prompt[:4], 0, False),
                              UnifiedBatchItem("sess-b", [1, 2, 3], 0, True)])
        assert first[0].logits is None and first[0].kv_cache.sequence_length == 4
        np.testing.assert_allclose(first[1].logits.logits, MODEL.last_logits([1, 2, 3]), atol=1e-5)
        second = session.step([UnifiedBatchItem("sess-a", prompt[4:], 4, True),
                               UnifiedBatchItem("sess-b", [8], 3, True, logits_policy=LogitsPolicy.argmax())])
        np.testing.assert_allclose(second[0].logits.logits, MODEL.last_logits(prompt), atol=1e-5)
        assert second[1].logits.token_id == int(np.argmax(MODEL.last_logits([1, 2, 3, 8])))
        # A failed step raises UnifiedDecode's error, and the session goes on.
        with pytest.raises(FailedPreconditionError) as info:
            session.step([UnifiedBatchItem("sess-a", [1], 3, True)])
        assert info.value.reason == "STALE_CACHE_HANDLE"
        with pytest.raises(InvalidArgumentError):
            session.step([UnifiedBatchItem("sess-a", [999], 6, True)])
        third = session.step([UnifiedBatchItem("sess-a", [1], 6, True)])
        assert third[0].kv_cache.sequence_length == 7
        assert third[0].timing.executor_ns > 0
    for cache_id in ("sess-a", "sess-b"):
        client.release_cache(cache_id)
    with pytest.raises(NotFoundError):
        client.release_cache("never-there")


def test_the_async_session_and_undecodable_steps(paged_server):
    async def drive() -> None:
        async with AsyncExecutorClient(paged_server.address) as c:
            async with c.step_session() as session:
                out = await session.step([UnifiedBatchItem("", [1, 2], 0, True)])
                results = [await session.step([UnifiedBatchItem(out[0].seq_id, [t], 2 + i, True)])
                           for i, t in enumerate([3, 4, 5])]
                assert results[-1][0].kv_cache.sequence_length == 5
            await c.release_cache(out[0].seq_id)

    asyncio.run(drive())
    # Raw bytes that are not a protobuf: that step is answered with INVALID_ARGUMENT.
    with grpc.insecure_channel(paged_server.address) as channel:
        call = channel.stream_stream("/modelexec.v1.ModelExecutorService/StepSession",
                                     response_deserializer=pb.StepSessionResponse.FromString)
        good = pb.StepSessionRequest(step_id=9, batch=pb.UnifiedBatch(
            items=[pb.UnifiedBatchItem(seq_id="raw", q_tokens=[1], is_final_chunk=True)])).SerializeToString()
        responses = list(call(iter([b"\xff\xff\xff garbage", good]), timeout=10))
    assert responses[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert responses[1].step_id == 9 and not responses[1].HasField("error")
    with ExecutorClient(paged_server.address) as c:
        c.release_cache("raw")


class SlowPaged(PagedAttentionExecutor):
    def _forward_step(self, items):
        time.sleep(0.5)
        return super()._forward_step(items)


def test_a_step_on_a_session_that_ended_raises_a_typed_error(make_server):
    """Past its deadline, or once a step was cancelled, the call is over: a step says why, as
    an ExecutorError (it was asyncio.InvalidStateError, which handlers of ExecutorError missed)."""
    running = make_server(instance=SlowPaged(PagedExecutorConfig(block_size=4, num_blocks=64)))

    async def drive() -> None:
        async with AsyncExecutorClient(running.address) as c:
            session = c.step_session(timeout=1.0)
            await session.step([UnifiedBatchItem("late", [1, 2], 0, True)])
            await asyncio.sleep(1.0)
            with pytest.raises(DeadlineExceededError):
                await session.step([UnifiedBatchItem("late", [3], 2, True)])
            await session.close()
            await c.release_cache("late")

            session = c.step_session()
            step = asyncio.create_task(session.step([UnifiedBatchItem("cut", [1, 2], 0, True)]))
            await asyncio.sleep(0.2)  # its answer is 0.3 s away
            step.cancel()
            with pytest.raises(asyncio.CancelledError):
                await step
            with pytest.raises(CallCancelledError):
                await session.step([UnifiedBatchItem("cut", [3], 2, True)])
            await session.close()
        with ExecutorClient(running.address) as c:
            c.release_cache("cut")
            assert c.status().kv_pool.active_caches == 0

    asyncio.run(drive())


def test_the_step_session_bench_runs():
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-m", "bench.step_session", "--steps", "3", "--batch", "2"],
                          cwd=repo, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "unix" in done.stdout and "tcp" in done.stdout
