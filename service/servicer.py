"""ModelExecutorService handlers: proto to domain, one executor call, domain to proto.

No try/except here: the wrapper every method runs in (service.handlers) maps exceptions to
statuses (service.errors). Each response carries the call's timing (queue, executor, total)
in nanoseconds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import grpc

from executors.base import ModelExecutor
from executors.errors import InvalidParameter, PermissionDenied
from executors.timing import CallTimer, current_call_timer
from executors.transfer_types import DEFAULT_MAX_CHUNK_BYTES
from generated.modelexec.v1 import executor_pb2 as pb
from generated.modelexec.v1 import executor_pb2_grpc as pb_grpc
from service import convert, convert_describe, convert_results, convert_transfer
from service.config import ServeConfig
from service.errors import _malformed, _Undecodable, to_status_error
from service.read_ahead import answered_in_order
from service.response_size import ResponseBudget

SERVER_VERSION = "0.1.0"
# StepSession: steps read and queued on the executor ahead of the one being answered.
STEP_READ_AHEAD = 4


class _Call:
    """Times one RPC: started on entry, read into the response on exit."""

    def __init__(self) -> None:
        self.started = time.perf_counter_ns()
        self.timer = CallTimer()
        current_call_timer.set(self.timer)

    def timing(self) -> pb.CallTiming:
        return pb.CallTiming(
            queue_ns=self.timer.queue_ns,
            executor_ns=self.timer.executor_ns,
            total_ns=time.perf_counter_ns() - self.started,
        )

    def stamp(self, response):
        """The response, its timing filled in place (the decode path's responses are built in place)."""
        timing = response.timing
        timing.queue_ns = self.timer.queue_ns
        timing.executor_ns = self.timer.executor_ns
        timing.total_ns = time.perf_counter_ns() - self.started
        return response


class ModelExecutorServicer(pb_grpc.ModelExecutorServiceServicer):
    def __init__(
        self,
        executor: ModelExecutor,
        config: ServeConfig,
        on_warm: Callable[[], Awaitable[None]],
        on_shutdown: Callable[[float], Awaitable[None]],
    ) -> None:
        self.executor = executor
        self.config = config
        self._on_warm = on_warm
        self._on_shutdown = on_shutdown
        self.limits = pb.ServiceLimits(
            max_message_bytes=config.max_message_bytes,
            max_batch_size=min(config.max_batch_size, executor.capabilities().max_batch_size),
            max_tokens_per_request=config.max_tokens_per_request,
            max_concurrent_rpcs=config.max_concurrent_rpcs or 0,
            cache_ttl_seconds=config.cache_ttl_seconds,
        )
        info, caps = executor.info(), executor.capabilities()
        self.responses = ResponseBudget(config.max_message_bytes, info.vocab_size, info.hidden_size, caps.kv_block_size,
                                        info.max_sequence_length, executor.status().kv_pool.total_blocks)

    def _check_size(self, items: int, tokens: int, where: str) -> None:
        if items > self.limits.max_batch_size:
            raise InvalidParameter(
                f"{where} holds {items} items, more than the server's max_batch_size {self.limits.max_batch_size}",
                field=where)
        if tokens > self.limits.max_tokens_per_request:
            raise InvalidParameter(
                f"request holds {tokens} tokens, more than the server's max_tokens_per_request "
                f"{self.limits.max_tokens_per_request}", field=where)

    # -- description ----------------------------------------------------------------------
    async def GetInfo(self, request: pb.GetInfoRequest, context: grpc.aio.ServicerContext) -> pb.GetInfoResponse:
        call = _Call()
        return pb.GetInfoResponse(info=convert_describe.model_info(self.executor.info()), server_version=SERVER_VERSION,
                                  executor_name=self.executor.name, timing=call.timing())

    async def GetCapabilities(self, request, context) -> pb.GetCapabilitiesResponse:
        call = _Call()
        caps = convert_describe.capabilities(self.executor.capabilities(), self.limits)
        return pb.GetCapabilitiesResponse(capabilities=caps, timing=call.timing())

    async def GetStatus(self, request, context) -> pb.GetStatusResponse:
        call = _Call()
        return pb.GetStatusResponse(status=convert_describe.status(self.executor.status()), timing=call.timing())

    async def GetCacheMetrics(self, request, context) -> pb.GetCacheMetricsResponse:
        call = _Call()
        metrics = self.executor.cache_metrics()
        out = pb.GetCacheMetricsResponse(timing=call.timing())
        if metrics is not None:
            out.metrics.CopyFrom(convert_describe.cache_metrics(metrics))
        return out

    async def GetLoraMetrics(self, request, context) -> pb.GetLoraMetricsResponse:
        call = _Call()
        metrics = self.executor.lora_metrics()
        out = pb.GetLoraMetricsResponse(timing=call.timing())
        if metrics is not None:
            out.metrics.CopyFrom(convert_describe.lora_metrics(metrics))
        return out

    # -- prefill and decode ---------------------------------------------------------------
    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        call = _Call()
        self._check_size(1, len(request.input.input_ids), "input.input_ids")
        prefill, compact = convert.prefill_input(request.input, "input"), convert.compact_handles(request)
        self.responses.check_prefills((prefill,), "input", compact)
        out = await self.executor.prefill(prefill)
        return call.stamp(convert_results.with_output(pb.PrefillResponse(), out, compact))

    async def Decode(self, request: pb.DecodeRequest, context) -> pb.DecodeResponse:
        call = _Call()
        decode, compact = convert.decode_input(request.input, "input"), convert.compact_handles(request)
        self.responses.check_decodes((decode,), "input", compact)
        out = await self.executor.decode(decode)
        return call.stamp(convert_results.with_output(pb.DecodeResponse(), out, compact))

    async def BatchPrefill(self, request: pb.BatchPrefillRequest, context) -> pb.BatchPrefillResponse:
        call = _Call()
        self._check_size(len(request.inputs), sum(len(i.input_ids) for i in request.inputs), "inputs")
        inputs = [convert.prefill_input(m, f"inputs[{i}]") for i, m in enumerate(request.inputs)]
        compact = convert.compact_handles(request)
        self.responses.check_prefills(inputs, "inputs", compact)
        outs = await self.executor.batch_prefill(inputs)
        return call.stamp(convert_results.with_outputs(pb.BatchPrefillResponse(), outs, compact))

    async def BatchDecode(self, request: pb.BatchDecodeRequest, context) -> pb.BatchDecodeResponse:
        call = _Call()
        self._check_size(len(request.inputs), len(request.inputs), "inputs")
        inputs = [convert.decode_input(m, f"inputs[{i}]") for i, m in enumerate(request.inputs)]
        compact = convert.compact_handles(request)
        self.responses.check_decodes(inputs, "inputs", compact)
        outs = await self.executor.batch_decode(inputs)
        return call.stamp(convert_results.with_outputs(pb.BatchDecodeResponse(), outs, compact))

    async def UnifiedDecode(self, request: pb.UnifiedDecodeRequest, context) -> pb.UnifiedDecodeResponse:
        call = _Call()
        compact = convert.compact_handles(request)
        results = await self._unified(request.batch, compact)
        return call.stamp(convert_results.with_results(pb.UnifiedDecodeResponse(), results, compact))

    async def _unified(self, batch: pb.UnifiedBatch, compact: bool) -> list:
        """A unified batch checked, converted and run (UnifiedDecode, and each StepSession step)."""
        items = batch.items
        self._check_size(len(items), sum(map(convert.item_tokens, items)), "batch.items")
        unified = [convert.unified_item(m, f"batch.items[{i}]") for i, m in enumerate(items)]
        self.responses.check_unified(unified, "batch.items", compact)
        return await self.executor.unified_decode(unified)

    async def StepSession(self, requests, context):
        # Steps run in order, each as UnifiedDecode would; a failed step is answered with its
        # status and the session goes on, so one bad step does not cost the scheduler its stream.
        # Up to STEP_READ_AHEAD steps are read, checked and queued on the executor's worker (in
        # the order sent) before the oldest is answered: a scheduler that keeps steps in flight
        # (feed_sampled_token) has the next one's conversion done while the device runs this one.
        async for response in answered_in_order(requests, self._session_step, STEP_READ_AHEAD):
            yield response

    async def _session_step(self, request) -> pb.StepSessionResponse:
        call = _Call()
        try:
            if isinstance(request, _Undecodable):
                raise _malformed(request)
            compact = convert.compact_handles(request)
            results = await self._unified(request.batch, compact)
        except Exception as exc:  # noqa: BLE001 - mapped exactly as the call wrapper maps unary calls
            err = to_status_error(exc)
            return pb.StepSessionResponse(
                step_id=getattr(request, "step_id", 0), timing=call.timing(),
                error=pb.StepError(code=err.code.value[0], message=err.message, reason=err.reason,
                                   metadata=err.metadata))
        return call.stamp(convert_results.with_results(pb.StepSessionResponse(step_id=request.step_id), results,
                                                       compact))

    # -- forward and speculative decoding -------------------------------------------------
    async def Forward(self, request: pb.ForwardRequest, context) -> pb.ForwardResponse:
        call = _Call()
        self._check_size(1, len(request.input_ids), "input_ids")
        kind, dtype = convert.forward_kind(request.output), convert.forward_dtype(request.dtype)
        self.responses.check_forward(len(request.input_ids), kind, dtype, "input_ids")
        out = await self.executor.forward(request.input_ids, kind, dtype)
        return pb.ForwardResponse(output=convert_results.tensor(out), kind=convert.FORWARD_TO_PB[kind], timing=call.timing())

    async def ForwardVerify(self, request: pb.ForwardVerifyRequest, context) -> pb.ForwardVerifyResponse:
        call = _Call()
        self._check_size(1, len(request.tokens), "tokens")
        handle, policy = convert.verify_handle(request), convert.logits_policy(request.logits_policy, "logits_policy")
        compact = convert.compact_handles(request)
        self.responses.check_verify(handle, len(request.tokens), policy, "tokens", compact)
        out = await self.executor.forward_verify(handle, request.tokens, policy)
        return pb.ForwardVerifyResponse(outputs=[convert_results.logits_output(r) for r in out.outputs],
                                        kv_cache=convert_results.handle(out.kv_cache, compact), timing=call.timing())

    async def TruncateKv(self, request: pb.TruncateKvRequest, context) -> pb.TruncateKvResponse:
        call = _Call()
        out = await self.executor.truncate_kv(convert.cache_id(request.cache_id), request.new_length)
        return pb.TruncateKvResponse(kv_cache=convert_results.handle(out.kv_cache), freed_blocks=out.freed_blocks,
                                     timing=call.timing())

    async def ReleaseCache(self, request: pb.ReleaseCacheRequest, context) -> pb.ReleaseCacheResponse:
        call = _Call()
        expected = request.expected_length if request.HasField("expected_length") else None
        out = await self.executor.release_cache(convert.cache_id(request.cache_id), expected)
        return pb.ReleaseCacheResponse(released=out.released, freed_blocks=out.freed_blocks, timing=call.timing())

    # -- moving caches between executors --------------------------------------------------
    async def ExportKv(self, request: pb.ExportKvRequest, context):
        # Chunks stay under the message limit; each yield waits for flow control, so a slow
        # reader holds at most a few chunks here.
        max_chunk = min(request.max_chunk_bytes or DEFAULT_MAX_CHUNK_BYTES, self.config.max_message_bytes - 65536)
        start, end = convert_transfer.export_range(request)
        export = await self.executor.export_kv(convert.cache_id(request.cache_id), start, end, max_chunk)
        try:
            yield pb.ExportKvResponse(description=convert_transfer.description(export.description))
            async for chunk in export.chunks():
                yield convert_transfer.chunk_response(chunk)
        finally:
            export.close()

    async def ImportKv(self, requests, context) -> pb.ImportKvResponse:
        call = _Call()
        session = None
        try:
            index = 0
            async for message in requests:
                if isinstance(message, _Undecodable):
                    raise _malformed(message)
                if session is None:
                    if message.WhichOneof("item") == "start" and message.start.check_only:
                        return await self._check_import(message, requests, call)
                    session = await self.executor.import_kv(*convert_transfer.import_start(message))
                    if session.replayed is not None:  # a retry of an import that completed
                        return convert_transfer.import_response(session.replayed, call.timing())
                else:
                    await session.write(convert_transfer.import_chunk(message, index))
                index += 1
            if session is None:
                raise InvalidParameter("the ImportKv stream ended before its first message", field="start")
            result = await session.finish()
            return convert_transfer.import_response(result, call.timing())
        finally:
            if session is not None:
                session.abort()  # a no-op once the import was adopted

    async def _check_import(self, message: pb.ImportKvRequest, requests, call: _Call) -> pb.ImportKvResponse:
        # Answered once the client has half-closed: a client-streaming call answered before
        # that races the client's last write, which grpc.aio reports as a cancelled call.
        error = None
        try:
            (await self.executor.import_kv(*convert_transfer.import_start(message))).abort()
        except Exception as e:  # noqa: BLE001 - raised below, once the stream has ended
            error = e
        async for _ in requests:
            error = error or InvalidParameter("a check_only ImportKv takes its start alone, no chunks", field="chunk")
        if error is not None:
            raise error
        return pb.ImportKvResponse(timing=call.timing())

    async def ListCaches(self, request: pb.ListCachesRequest, context) -> pb.ListCachesResponse:
        call = _Call()
        infos = await self.executor.list_caches(list(request.cache_ids))
        return pb.ListCachesResponse(caches=[convert_transfer.cache_info(i) for i in infos], timing=call.timing())

    # -- LoRA adapters --------------------------------------------------------------------
    async def LoadLoraAdapter(self, request: pb.LoadLoraAdapterRequest, context) -> pb.LoadLoraAdapterResponse:
        call = _Call()
        info = await self.executor.load_lora_adapter(request.name, convert.lora_source(request))
        return pb.LoadLoraAdapterResponse(adapter=convert_describe.lora_adapter_info(info), timing=call.timing())

    async def UnloadLoraAdapter(self, request: pb.UnloadLoraAdapterRequest, context) -> pb.UnloadLoraAdapterResponse:
        call = _Call()
        info = await self.executor.unload_lora_adapter(convert.lora_name(request.name))
        return pb.UnloadLoraAdapterResponse(adapter=convert_describe.lora_adapter_info(info), timing=call.timing())

    async def ListLoraAdapters(self, request, context) -> pb.ListLoraAdaptersResponse:
        call = _Call()
        infos = self.executor.list_lora_adapters()
        return pb.ListLoraAdaptersResponse(adapters=[convert_describe.lora_adapter_info(i) for i in infos], timing=call.timing())

    # -- lifecycle ------------------------------------------------------------------------
    async def Warmup(self, request: pb.WarmupRequest, context) -> pb.WarmupResponse:
        call = _Call()
        await self.executor.warmup()
        await self._on_warm()
        return pb.WarmupResponse(timing=call.timing())

    async def Shutdown(self, request: pb.ShutdownRequest, context) -> pb.ShutdownResponse:
        call = _Call()
        if not self.config.allow_shutdown:
            raise PermissionDenied("Shutdown is disabled: start the server with --allow-shutdown to permit it")
        grace = request.grace_seconds
        if not 0 <= grace <= 3600:
            raise InvalidParameter(f"grace_seconds must be in [0, 3600], got {grace}", field="grace_seconds")
        released = await self.executor.shutdown()
        # Stop the server only once this call has completed, so its own answer is not cut off.
        loop = asyncio.get_running_loop()
        context.add_done_callback(lambda _: loop.create_task(self._on_shutdown(grace or self.config.grace_seconds)))
        return pb.ShutdownResponse(released_caches=released, timing=call.timing())
