"""Every RPC through the real clients, health, lifecycle, the interface's defaults, the CLI."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from client import (
    AsyncExecutorClient,
    CallCancelledError,
    DecodeInput,
    ExecutorClient,
    LogitsPolicy,
    PermissionDeniedError,
    PrefillInput,
    UnavailableError,
    UnifiedBatchItem,
    UnimplementedError,
)
from executors.base import ModelExecutor
from executors.paged import PagedAttentionExecutor, PagedExecutorConfig
from generated.modelexec.v1 import executor_pb2 as pb
from tests.paged_reference import PagedModel

# Asserts wall-clock bounds or orders events by sleeping: `make test` runs it alone (tests/conftest.py).
pytestmark = pytest.mark.alone

MODEL = PagedModel()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_rpc_over_a_unix_socket_with_the_async_client(make_server, tmp_path):
    make_server(unix_socket=str(tmp_path / "executor.sock"))

    async def drive() -> None:
        async with AsyncExecutorClient(f"unix://{tmp_path / 'executor.sock'}") as c:
            await c.wait_ready(10)
            info = await c.info()
            assert (info.model_id, info.vocab_size, info.num_layers, info.head_dim) == ("paged-test-model", 256, 2, 8)
            caps = await c.capabilities()
            assert caps.supports_native_unified_decode and caps.supports_speculative_decoding
            assert pb.ATTENTION_TYPE_PAGED in caps.attention_mechanisms
            assert (caps.kv_block_size, caps.kv_total_blocks) == (4, 256)
            status = await c.status()
            assert status.state == pb.EXECUTOR_STATE_READY and status.is_ready
            assert status.kv_pool.free_blocks == status.kv_pool.total_blocks == 256

            pre = await c.prefill(PrefillInput([1, 2, 3]))
            dec = await c.decode(DecodeInput(4, pre.kv_cache, logits_policy=LogitsPolicy.argmax()))
            assert dec.logits.token_id == int(np.argmax(MODEL.last_logits([1, 2, 3, 4])))
            batch = await c.batch_prefill([PrefillInput([5, 6]), PrefillInput([7])])
            steps = await c.batch_decode([DecodeInput(8, o.kv_cache) for o in batch])
            uni = await c.unified_decode([UnifiedBatchItem(steps[0].kv_cache.cache_id, [9], 3, True)])
            fwd = await c.forward([1, 2, 3])
            assert fwd.output.shape == (3, 256)
            ver = await c.forward_verify(dec.kv_cache, [5, 6])
            assert len(ver.outputs) == 2
            cut = await c.truncate_kv(ver.kv_cache, 2)
            assert cut.kv_cache.sequence_length == 2
            metrics = await c.cache_metrics()
            assert metrics.block_size == 4 and metrics.decode_batch.calls >= 3
            assert metrics.decode_batch.bucket_calls.m2 >= 1
            assert await c.lora_metrics() is None
            await c.warmup()
            for cache_id in (cut.kv_cache.cache_id, uni[0].seq_id, steps[1].kv_cache.cache_id):
                assert (await c.release_cache(cache_id)).released
            with pytest.raises(PermissionDeniedError):
                await c.shutdown()
            after = await c.status()
            assert after.kv_pool.active_caches == 0 and after.kv_pool.free_blocks == 256
            assert after.prefill_operations >= 3 and after.decode_operations >= 4
            assert after.avg_prefill_time_ms > 0 and after.HasField("last_operation")

    asyncio.run(drive())


def test_responses_carry_the_executors_time(client):
    out = client.prefill(PrefillInput(list(range(40))))
    t = out.timing
    assert t.executor_ns > 0 and t.total_ns >= t.executor_ns + t.queue_ns
    assert client.release_cache(out.kv_cache).timing.executor_ns > 0


def test_health_is_not_serving_until_warmup(make_server):
    running = make_server(warmup_on_start=False)
    with ExecutorClient(running.address) as c:
        assert c.health().status == c.health().NOT_SERVING
        assert c.status().state == pb.EXECUTOR_STATE_INITIALIZING
        c.warmup()
        assert c.health().status == c.health().SERVING
        assert c.status().state == pb.EXECUTOR_STATE_READY


class SlowPagedExecutor(PagedAttentionExecutor):
    """Takes a second per forward, to show that the server answers meanwhile."""

    def _forward_step(self, items):
        time.sleep(1.0)
        return super()._forward_step(items)


def test_health_and_status_answer_during_a_long_forward(make_server):
    running = make_server(instance=SlowPagedExecutor(PagedExecutorConfig(block_size=4, num_blocks=64)),
                          warmup_on_start=False)

    async def drive() -> None:
        async with AsyncExecutorClient(running.address) as c:
            slow = asyncio.create_task(c.prefill(PrefillInput([1, 2, 3])))
            await asyncio.sleep(0.2)
            t0 = time.perf_counter()
            await c.health()
            status = await c.status()
            assert time.perf_counter() - t0 < 0.5, "health and status must not wait for the forward"
            assert status.state == pb.EXECUTOR_STATE_BUSY and status.current_batch_size == 1
            out = await slow
            await c.release_cache(out.kv_cache)

    asyncio.run(drive())


def test_shutdown_when_allowed_stops_the_server(make_server):
    running = make_server(allow_shutdown=True)
    with ExecutorClient(running.address) as c:
        c.prefill(PrefillInput([1, 2]))
        c.prefill(PrefillInput([3]))
        assert c.shutdown(grace_seconds=1).released_caches == 2
        with pytest.raises((UnavailableError, CallCancelledError)):  # shut down, or stopping
            c.prefill(PrefillInput([1]))
    running.call(asyncio.wait_for(running.server.wait(), 10))


class MinimalExecutor(ModelExecutor):
    """Only the trait's required methods, borrowed from the paged executor."""

    name = "minimal"

    def __init__(self) -> None:
        self.inner = PagedAttentionExecutor(PagedExecutorConfig(block_size=4, num_blocks=64))

    def info(self):
        return self.inner.info()

    def capabilities(self):
        return self.inner.capabilities()

    def status(self):
        return self.inner.status()

    async def prefill(self, inp):
        return await self.inner.prefill(inp)

    async def decode(self, inp):
        return await self.inner.decode(inp)


def test_the_interfaces_defaults(make_server):
    running = make_server(instance=MinimalExecutor())
    with ExecutorClient(running.address) as c:
        outs = c.batch_prefill([PrefillInput([1, 2, 3]), PrefillInput([4])])  # one prefill per item
        np.testing.assert_allclose(outs[0].logits.logits, MODEL.last_logits([1, 2, 3]), atol=1e-5)
        ver = c.forward_verify(outs[0].kv_cache, [5, 6, 7])  # one decode per token
        expected = MODEL.logits([1, 2, 3, 5, 6, 7])[3:]
        for row, exp in zip(ver.outputs, expected):
            np.testing.assert_allclose(row.logits, exp, atol=1e-5)
        assert ver.kv_cache.sequence_length == 6
        for call in (lambda: c.unified_decode([UnifiedBatchItem("", [1], 0, True)]),
                     lambda: c.forward([1, 2]),
                     lambda: c.truncate_kv(ver.kv_cache, 1)):
            with pytest.raises(UnimplementedError):
                call()
        assert c.cache_metrics() is None and c.lora_metrics() is None


def test_generated_code_matches_the_protos():
    done = subprocess.run([sys.executable, "-m", "generated", "--check"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_service_never_imports_transformers():
    code = ("import sys, service.server, service.__main__, executors.llm, executors.gguf_import; "
            "assert 'transformers' not in sys.modules, 'transformers is a test oracle only'")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_cli_serves_and_stops_on_sigterm(tmp_path):
    sock = tmp_path / "cli.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "service", "--executor", "paged", "--unix-socket", str(sock), "--num-blocks", "32"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with ExecutorClient(f"unix://{sock}") as c:
            c.wait_ready(60)
            assert c.capabilities().kv_total_blocks == 32
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert "serving the paged executor" in out and "stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
