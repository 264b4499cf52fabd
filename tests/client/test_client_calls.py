"""Both clients against a tiny in-test grpc.aio server: results, typed errors, deadlines.

The server runs on its own event loop in a thread so the blocking client can call it
without stalling the loop, and the async tests can use theirs.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from client import (
    AsyncExecutorClient,
    CallCancelledError,
    DeadlineExceededError,
    DecodeInput,
    ExecutorClient,
    ExecutorError,
    KvCacheHandle,
    LogitsPolicy,
    NotFoundError,
    PrefillInput,
    ResourceExhaustedError,
    UnimplementedError,
    convert,
    from_rpc_error,
)
from client.__main__ import main as cli_main
from client.limits import HEALTH_SERVICE_NAME
from generated.modelexec.v1 import executor_pb2 as pb
from generated.modelexec.v1 import executor_pb2_grpc as pb_grpc

VOCAB = 8


def _status_with_info(code: int, message: str, reason: str, **metadata: str) -> grpc.Status:
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.ErrorInfo(reason=reason, domain="modelexec.v1", metadata=metadata))
    return rpc_status.to_status(status_pb2.Status(code=code, message=message, details=[detail]))


class FakeExecutor(pb_grpc.ModelExecutorServiceServicer):
    """A few RPCs, enough to exercise success, rich errors and deadlines."""

    async def GetInfo(self, request, context):
        token = dict(context.invocation_metadata()).get("x-token", "")
        return pb.GetInfoResponse(
            info=pb.ModelInfo(model_id="fake", vocab_size=VOCAB),
            server_version="test",
            executor_name=f"fake:{token}",
            timing=pb.CallTiming(total_ns=5),
        )

    async def Prefill(self, request, context):
        item = request.input
        length = item.kv_cache.block_table.sequence_length + len(item.input_ids)
        row = np.arange(VOCAB, dtype=np.float32) * float(item.metadata["scale"].number_value or 1.0)
        dtype = item.logits_policy.full.dtype or pb.DATA_TYPE_FLOAT32
        return pb.PrefillResponse(
            output=pb.PrefillOutput(
                logits=pb.LogitsOutput(kind=pb.LOGITS_KIND_FULL, logits=convert.ndarray_to_tensor(row, dtype)),
                kv_cache=pb.KvCacheHandle(
                    cache_id=item.kv_cache.cache_id or "server-1",
                    block_table=pb.BlockTable(block_ids=[0, 1], sequence_length=length, block_size=4),
                    device=pb.Device(type=pb.DEVICE_TYPE_CUDA, index=0),
                ),
            ),
            timing=pb.CallTiming(queue_ns=1, executor_ns=2, total_ns=3),
        )

    async def Decode(self, request, context):
        await context.abort_with_status(
            _status_with_info(
                code_pb2.RESOURCE_EXHAUSTED,
                "kv_cache: pool has 1 free block, 3 needed",
                "KV_CACHE_EXHAUSTED",
                cache_id=request.input.kv_cache.cache_id,
                blocks_needed="3",
                blocks_free="1",
            )
        )

    async def ReleaseCache(self, request, context):
        # No ErrorInfo: reason and metadata must come out empty, not fail.
        await context.abort(grpc.StatusCode.NOT_FOUND, f"cache_id: {request.cache_id} not found")

    async def GetStatus(self, request, context):
        await asyncio.sleep(5)
        return pb.GetStatusResponse()

    async def GetCacheMetrics(self, request, context):
        return pb.GetCacheMetricsResponse(timing=pb.CallTiming(total_ns=1))


@dataclass
class Server:
    tcp: str
    unix: str


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    loop = asyncio.new_event_loop()
    sock_dir = tempfile.mkdtemp(prefix="mx", dir="/tmp")  # short: unix paths max ~107 chars
    unix_target = f"unix://{sock_dir}/s.sock"

    async def start() -> tuple[grpc.aio.Server, int]:
        srv = grpc.aio.server()
        pb_grpc.add_ModelExecutorServiceServicer_to_server(FakeExecutor(), srv)
        health_servicer = health.aio.HealthServicer()
        await health_servicer.set(HEALTH_SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, srv)
        port = srv.add_insecure_port("127.0.0.1:0")
        srv.add_insecure_port(unix_target)
        await srv.start()
        return srv, port

    srv, port = loop.run_until_complete(start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield Server(tcp=f"127.0.0.1:{port}", unix=unix_target)
    finally:
        asyncio.run_coroutine_threadsafe(srv.stop(0), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
        shutil.rmtree(sock_dir, ignore_errors=True)


def _check_exhausted(err: ResourceExhaustedError) -> None:
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.reason == "KV_CACHE_EXHAUSTED" and err.domain == "modelexec.v1"
    assert err.details_message == "kv_cache: pool has 1 free block, 3 needed"
    assert err.metadata == {"cache_id": "c1", "blocks_needed": "3", "blocks_free": "1"}
    assert (err.blocks_needed, err.blocks_free) == (3, 1)
    assert isinstance(err.__cause__, grpc.RpcError)
    assert "KV_CACHE_EXHAUSTED" in str(err)


_DECODE = DecodeInput(token_id=1, kv_cache=KvCacheHandle("c1", 4))


# -- blocking client --------------------------------------------------------------------


def test_blocking_success_paths(server: Server) -> None:
    with ExecutorClient(server.tcp, call_metadata=[("x-token", "abc")]) as ex:
        ex.wait_ready(5)
        assert ex.info().model_id == "fake"
        assert ex.server_info().executor_name == "fake:abc"
        out = ex.prefill(PrefillInput([1, 2, 3], metadata={"scale": 0.5}, logits_policy=LogitsPolicy.full("bfloat16")))
        np.testing.assert_array_equal(out.logits.logits, np.arange(VOCAB, dtype=np.float32) * 0.5)
        assert out.logits.next_token() == VOCAB - 1
        assert out.kv_cache == KvCacheHandle("server-1", 3, (0, 1), 4, device="cuda:0")
        assert out.timing.total_ns == 3
        assert ex.cache_metrics() is None
        assert ex.health().status == health_pb2.HealthCheckResponse.SERVING


def test_blocking_unix_target(server: Server) -> None:
    with ExecutorClient(server.unix) as ex:
        assert ex.info().vocab_size == VOCAB
    with ExecutorClient("unix:" + server.unix.removeprefix("unix://")) as ex:
        assert ex.info().vocab_size == VOCAB


def test_blocking_resource_exhausted(server: Server) -> None:
    with ExecutorClient(server.tcp) as ex, pytest.raises(ResourceExhaustedError) as info:
        ex.decode(_DECODE)
    _check_exhausted(info.value)


def test_blocking_not_found_without_error_info(server: Server) -> None:
    with ExecutorClient(server.tcp) as ex, pytest.raises(NotFoundError) as info:
        ex.release_cache(KvCacheHandle("gone", 0))
    err = info.value
    assert err.reason is None and err.metadata == {} and "gone" in err.details_message


def test_blocking_unimplemented_and_deadline(server: Server) -> None:
    with ExecutorClient(server.tcp, timeout=5) as ex:
        with pytest.raises(UnimplementedError):
            ex.warmup()
        with pytest.raises(DeadlineExceededError):
            ex.status(timeout=0.2)


def test_blocking_default_timeout(server: Server) -> None:
    with ExecutorClient(server.tcp, timeout=0.2) as ex, pytest.raises(DeadlineExceededError):
        ex.status()


def test_wait_ready_times_out_when_nothing_listens() -> None:
    with ExecutorClient("127.0.0.1:1") as ex, pytest.raises(DeadlineExceededError, match="not SERVING"):
        ex.wait_ready(0.3)


def test_cli_info_and_errors(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["--target", server.tcp, "info"]) == 0
    assert '"model_id": "fake"' in capsys.readouterr().out
    assert cli_main(["--target", server.tcp, "cache-metrics"]) == 0
    assert capsys.readouterr().out.strip() == "null"
    assert cli_main(["--target", server.tcp, "health"]) == 0
    assert "SERVING" in capsys.readouterr().out
    assert cli_main(["--target", server.tcp, "capabilities"]) == 1
    assert "UNIMPLEMENTED" in capsys.readouterr().err


# -- async client -----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_async_success_paths(server: Server) -> None:
    async with AsyncExecutorClient(server.tcp, call_metadata=[("x-token", "xyz")]) as ex:
        await ex.wait_ready(5)
        assert (await ex.server_info()).executor_name == "fake:xyz"
        out = await ex.prefill(
            PrefillInput([4, 5], kv_cache=KvCacheHandle("mine", 0), logits_policy=LogitsPolicy.full("float16"))
        )
        assert out.logits.logits.dtype == np.float16 and out.kv_cache.cache_id == "mine"
        assert out.kv_cache.sequence_length == 2
        assert await ex.cache_metrics() is None


@pytest.mark.asyncio
async def test_async_resource_exhausted(server: Server) -> None:
    async with AsyncExecutorClient(server.unix) as ex:
        with pytest.raises(ResourceExhaustedError) as info:
            await ex.decode(_DECODE)
    _check_exhausted(info.value)


@pytest.mark.asyncio
async def test_async_deadline_and_not_found(server: Server) -> None:
    async with AsyncExecutorClient(server.tcp) as ex:
        with pytest.raises(DeadlineExceededError) as info:
            await ex.status(timeout=0.2)
        assert isinstance(info.value.__cause__, grpc.aio.AioRpcError)
        with pytest.raises(NotFoundError):
            await ex.release_cache("gone")


@pytest.mark.asyncio
async def test_async_wait_ready_times_out() -> None:
    async with AsyncExecutorClient("127.0.0.1:1") as ex:
        with pytest.raises(DeadlineExceededError):
            await ex.wait_ready(0.3)


# -- error parsing without a server -----------------------------------------------------


def test_from_rpc_error_on_aio_error_object() -> None:
    status = _status_with_info(code_pb2.CANCELLED, "stop", "CLIENT_GONE", field="x")
    err = grpc.aio.AioRpcError(
        grpc.StatusCode.CANCELLED,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*status.trailing_metadata),
        details="stop",
    )
    typed = from_rpc_error(err)
    assert isinstance(typed, CallCancelledError) and isinstance(typed, ExecutorError)
    assert typed.reason == "CLIENT_GONE" and typed.metadata == {"field": "x"}


def test_executor_error_pickles() -> None:
    import pickle

    err = ResourceExhaustedError("m", reason="KV_CACHE_EXHAUSTED", metadata={"blocks_free": "2"})
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is ResourceExhaustedError and back.blocks_free == 2 and back.reason == err.reason


def test_an_errors_text_names_its_code_once() -> None:
    exhausted = ResourceExhaustedError("pool has 1 free block, 3 needed", reason="KV_CACHE_EXHAUSTED")
    assert str(exhausted) == "RESOURCE_EXHAUSTED: pool has 1 free block, 3 needed [KV_CACHE_EXHAUSTED]"
    generic = ResourceExhaustedError("too many calls", reason="RESOURCE_EXHAUSTED")  # no finer reason
    assert str(generic) == "RESOURCE_EXHAUSTED: too many calls"
