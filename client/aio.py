"""asyncio client of ModelExecutorService (grpc.aio).

The channel is opened lazily on the first call, so a client built outside a running
event loop (e.g. before `asyncio.run`) still binds to the loop that uses it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Self, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from . import convert
from ._common import (
    HEALTH_ATTEMPT_S,
    RETRYABLE_HEALTH_CODES,
    SERVING,
    USE_DEFAULT,
    ClientConfig,
    Timeout,
    health_request,
    not_ready_error,
)
from ._proto import executor_pb2 as pb
from ._proto import executor_pb2_grpc as pb_grpc
from .aio_moves import KvMoveCalls
from .errors import from_rpc_error
from .limits import DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_TIMEOUT_S, HEALTH_SERVICE_NAME
from .session import AsyncStepSession
from .types import (
    DecodeInput,
    DecodeOutput,
    ForwardOutput,
    ForwardVerifyOutput,
    KvCacheHandle,
    LogitsPolicy,
    PrefillInput,
    PrefillOutput,
    ReleaseResult,
    TokenIds,
    TruncateResult,
    UnifiedBatch,
    UnifiedBatchItem,
    UnifiedItemResult,
)

__all__ = ["AsyncExecutorClient"]

_Resp = TypeVar("_Resp")


class AsyncExecutorClient(KvMoveCalls):
    """Async client; every method raises a typed `client.errors.ExecutorError` on failure.

    `timeout` (seconds) is the default per-call deadline; each method's keyword
    `timeout` overrides it, and None there means no deadline.
    """

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        credentials: grpc.ChannelCredentials | None = None,
        call_metadata: Sequence[tuple[str, str]] | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        options: Sequence[tuple[str, Any]] = (),
        token: str | None = None,
        compact_handles: bool = False,
    ) -> None:
        self._config = ClientConfig.build(target, timeout, credentials, call_metadata, max_message_bytes, options,
                                          token=token, compact_handles=compact_handles)
        self._channel: grpc.aio.Channel | None = None
        self._stubs: tuple[pb_grpc.ModelExecutorServiceStub, health_pb2_grpc.HealthStub] | None = None

    @property
    def target(self) -> str:
        return self._config.target

    def _open(self) -> tuple[pb_grpc.ModelExecutorServiceStub, health_pb2_grpc.HealthStub]:
        if self._stubs is None:
            c = self._config
            self._channel = (
                grpc.aio.secure_channel(c.target, c.credentials, options=c.options)
                if c.credentials is not None
                else grpc.aio.insecure_channel(c.target, options=c.options)
            )
            self._stubs = (pb_grpc.ModelExecutorServiceStub(self._channel), health_pb2_grpc.HealthStub(self._channel))
        return self._stubs

    @property
    def channel(self) -> grpc.aio.Channel:
        """The underlying channel, opened on first use."""
        self._open()
        assert self._channel is not None
        return self._channel

    @property
    def stub(self) -> pb_grpc.ModelExecutorServiceStub:
        """The generated stub, for RPCs this client does not wrap."""
        return self._open()[0]

    async def close(self) -> None:
        """Close the channel; calls in flight are cancelled. The client may be reused after."""
        channel, self._channel, self._stubs = self._channel, None, None
        if channel is not None:
            await channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: Callable[..., Awaitable[_Resp]], request: Any, timeout: Timeout) -> _Resp:
        try:
            return await method(request, timeout=self._config.deadline(timeout), metadata=self._config.metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e

    # -- descriptive calls: generated messages -------------------------------------------

    async def info(self, *, timeout: Timeout = USE_DEFAULT) -> pb.ModelInfo:
        return (await self.server_info(timeout=timeout)).info

    async def server_info(self, *, timeout: Timeout = USE_DEFAULT) -> pb.GetInfoResponse:
        """ModelInfo plus server_version, executor_name and timing."""
        return await self._call(self.stub.GetInfo, pb.GetInfoRequest(), timeout)

    async def capabilities(self, *, timeout: Timeout = USE_DEFAULT) -> pb.ExecutorCapabilities:
        return (await self._call(self.stub.GetCapabilities, pb.GetCapabilitiesRequest(), timeout)).capabilities

    async def status(self, *, timeout: Timeout = USE_DEFAULT) -> pb.ExecutorStatus:
        return (await self._call(self.stub.GetStatus, pb.GetStatusRequest(), timeout)).status

    async def cache_metrics(self, *, timeout: Timeout = USE_DEFAULT) -> pb.CacheMetrics | None:
        resp = await self._call(self.stub.GetCacheMetrics, pb.GetCacheMetricsRequest(), timeout)
        return convert.cache_metrics_response(resp)

    async def lora_metrics(self, *, timeout: Timeout = USE_DEFAULT) -> pb.LoraMetrics | None:
        resp = await self._call(self.stub.GetLoraMetrics, pb.GetLoraMetricsRequest(), timeout)
        return convert.lora_metrics_response(resp)

    async def warmup(self, *, timeout: Timeout = USE_DEFAULT) -> pb.WarmupResponse:
        return await self._call(self.stub.Warmup, pb.WarmupRequest(), timeout)

    async def shutdown(self, grace_seconds: float = 0.0, *, timeout: Timeout = USE_DEFAULT) -> pb.ShutdownResponse:
        return await self._call(self.stub.Shutdown, convert.shutdown_request(grace_seconds), timeout)

    # -- LoRA adapters: generated messages -------------------------------------------------

    async def load_lora_adapter(self, name: str, path: str, *, timeout: Timeout = USE_DEFAULT) -> pb.LoraAdapterInfo:
        """Load the adapter in `path`, a directory relative to the server's --lora-dir."""
        request = convert.load_lora_adapter_request(name, path)
        return (await self._call(self.stub.LoadLoraAdapter, request, timeout)).adapter

    async def upload_lora_adapter(
        self, name: str, local_dir: str | os.PathLike[str], *, timeout: Timeout = USE_DEFAULT
    ) -> pb.LoraAdapterInfo:
        """Send a local PEFT adapter directory's two files; FileNotFoundError when one is missing."""
        # Reading a large adapter must not stall the event loop.
        request = await asyncio.to_thread(convert.upload_lora_adapter_request, name, local_dir)
        return (await self._call(self.stub.LoadLoraAdapter, request, timeout)).adapter

    async def unload_lora_adapter(self, name: str, *, timeout: Timeout = USE_DEFAULT) -> pb.LoraAdapterInfo:
        """FailedPreconditionError while caches are bound to it; release them first."""
        request = convert.unload_lora_adapter_request(name)
        return (await self._call(self.stub.UnloadLoraAdapter, request, timeout)).adapter

    async def list_lora_adapters(self, *, timeout: Timeout = USE_DEFAULT) -> list[pb.LoraAdapterInfo]:
        resp = await self._call(self.stub.ListLoraAdapters, pb.ListLoraAdaptersRequest(), timeout)
        return list(resp.adapters)

    # -- hot path: domain types ------------------------------------------------------------

    async def prefill(self, item: PrefillInput, *, timeout: Timeout = USE_DEFAULT,
                      compact_handles: bool | None = None) -> PrefillOutput:
        request = convert.prefill_request(item, self._config.compact(compact_handles))
        resp = await self._call(self.stub.Prefill, request, timeout)
        return convert.prefill_response(resp)

    async def decode(self, item: DecodeInput, *, timeout: Timeout = USE_DEFAULT,
                     compact_handles: bool | None = None) -> DecodeOutput:
        request = convert.decode_request(item, self._config.compact(compact_handles))
        resp = await self._call(self.stub.Decode, request, timeout)
        return convert.decode_response(resp)

    async def batch_prefill(
        self, items: Sequence[PrefillInput], *, timeout: Timeout = USE_DEFAULT, compact_handles: bool | None = None
    ) -> list[PrefillOutput]:
        request = convert.batch_prefill_request(items, self._config.compact(compact_handles))
        resp = await self._call(self.stub.BatchPrefill, request, timeout)
        return convert.batch_prefill_response(resp)

    async def batch_decode(self, items: Sequence[DecodeInput], *, timeout: Timeout = USE_DEFAULT,
                           compact_handles: bool | None = None) -> list[DecodeOutput]:
        request = convert.batch_decode_request(items, self._config.compact(compact_handles))
        resp = await self._call(self.stub.BatchDecode, request, timeout)
        return convert.batch_decode_response(resp)

    async def unified_decode(
        self, batch: UnifiedBatch | Sequence[UnifiedBatchItem], *, timeout: Timeout = USE_DEFAULT,
        compact_handles: bool | None = None,
    ) -> list[UnifiedItemResult]:
        request = convert.unified_decode_request(batch, self._config.compact(compact_handles))
        resp = await self._call(self.stub.UnifiedDecode, request, timeout)
        return convert.unified_decode_response(resp)

    async def forward(
        self, input_ids: TokenIds, output: str = "logits", dtype: str = "float32", *, timeout: Timeout = USE_DEFAULT
    ) -> ForwardOutput:
        resp = await self._call(self.stub.Forward, convert.forward_request(input_ids, output, dtype), timeout)
        return convert.forward_response(resp)

    async def forward_verify(
        self,
        kv_cache: KvCacheHandle,
        tokens: TokenIds,
        logits_policy: LogitsPolicy | None = None,
        *,
        timeout: Timeout = USE_DEFAULT,
        compact_handles: bool | None = None,
    ) -> ForwardVerifyOutput:
        request = convert.forward_verify_request(kv_cache, tokens, logits_policy, self._config.compact(compact_handles))
        return convert.forward_verify_response(await self._call(self.stub.ForwardVerify, request, timeout))

    async def truncate_kv(
        self, cache: KvCacheHandle | str, new_length: int, *, timeout: Timeout = USE_DEFAULT
    ) -> TruncateResult:
        resp = await self._call(self.stub.TruncateKv, convert.truncate_kv_request(cache, new_length), timeout)
        return convert.truncate_kv_response(resp)

    async def release_cache(self, cache: KvCacheHandle | str, *, expected_length: int | None = None,
                            timeout: Timeout = USE_DEFAULT) -> ReleaseResult:
        """expected_length: release only if the cache holds exactly that many tokens, else
        FailedPreconditionError (reason STALE_CACHE_HANDLE)."""
        resp = await self._call(self.stub.ReleaseCache, convert.release_cache_request(cache, expected_length), timeout)
        return convert.release_cache_response(resp)

    async def list_caches(self, cache_ids: Sequence[str] = (), *, timeout: Timeout = USE_DEFAULT) -> list[pb.CacheInfo]:
        """The caller's live caches (all, or those of cache_ids that are live)."""
        resp = await self._call(self.stub.ListCaches, pb.ListCachesRequest(cache_ids=list(cache_ids)), timeout)
        return list(resp.caches)

    # -- health ----------------------------------------------------------------------------

    async def health(
        self, service: str = HEALTH_SERVICE_NAME, *, timeout: Timeout = USE_DEFAULT
    ) -> health_pb2.HealthCheckResponse:
        """One grpc.health.v1 Check of the executor service."""
        return await self._call(self._open()[1].Check, health_request(service), timeout)

    def step_session(self, *, timeout: float | None = None, compact_handles: bool | None = None) -> AsyncStepSession:
        """Open a StepSession stream: many unified steps over one call (see client.session); every
        step's handles compact (without block ids) as `compact_handles` says, else as the client's."""
        return AsyncStepSession(self.stub, self._config.metadata, timeout, self._config.compact(compact_handles))

    async def wait_ready(self, timeout: float = DEFAULT_TIMEOUT_S, *, poll_interval: float = 0.1) -> None:
        """Poll health until SERVING (after warm-up), waiting through connection failures.

        Raises DeadlineExceededError after `timeout` seconds, or the typed error of a
        non-retryable failure (e.g. UNIMPLEMENTED when the server has no health service).
        """
        deadline = time.monotonic() + timeout
        last = "UNREACHABLE"
        health = self._open()[1]
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                resp = await health.Check(
                    health_request(), timeout=min(remaining, HEALTH_ATTEMPT_S),
                    metadata=self._config.metadata, wait_for_ready=True,
                )
                if resp.status == SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
            except grpc.RpcError as e:
                if e.code() not in RETRYABLE_HEALTH_CODES:
                    raise from_rpc_error(e) from e
                last = e.code().name
            await asyncio.sleep(max(0.0, min(poll_interval, deadline - time.monotonic())))
        raise not_ready_error(self.target, timeout, last)
