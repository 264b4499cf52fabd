"""One place that turns exceptions into gRPC statuses, applied by one interceptor.

Handlers carry no try/except: an executor or KV cache error becomes its precise status
code with a message naming the field, plus a google.rpc.ErrorInfo detail (domain
"modelexec.v1") that programs can read. Only genuine server faults become INTERNAL.
Requests whose bytes are not a valid protobuf get INVALID_ARGUMENT, not gRPC's INTERNAL.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import torch
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

import kvcache
from executors import errors as ex
from service.handlers import WrappedHandlers

log = logging.getLogger(__name__)
DOMAIN = "modelexec.v1"
SERVICE_PREFIX = "/modelexec.v1.ModelExecutorService/"

EXECUTOR_CODES: dict[type[ex.ExecutorError], grpc.StatusCode] = {
    ex.InvalidParameter: grpc.StatusCode.INVALID_ARGUMENT,
    ex.OutOfRange: grpc.StatusCode.OUT_OF_RANGE,
    ex.NotFound: grpc.StatusCode.NOT_FOUND,
    ex.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    ex.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    ex.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ex.Unsupported: grpc.StatusCode.UNIMPLEMENTED,
    ex.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    ex.Unavailable: grpc.StatusCode.UNAVAILABLE,
    ex.DataLoss: grpc.StatusCode.DATA_LOSS,
}


class StatusError(Exception):
    """An error already resolved to a status: code, message, ErrorInfo reason and metadata."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: str, **metadata: object) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
        self.metadata = {k: str(v) for k, v in metadata.items() if v is not None}


def to_status_error(exc: BaseException) -> StatusError:
    """Map any exception to the status the caller should see."""
    if isinstance(exc, StatusError):
        return exc
    if isinstance(exc, ex.ExecutorError):
        code = next(c for cls, c in EXECUTOR_CODES.items() if isinstance(exc, cls))
        return StatusError(code, exc.message, exc.reason, field=exc.field, **exc.details)
    if isinstance(exc, kvcache.KvCacheExhausted):
        return StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), "KV_CACHE_EXHAUSTED",
                           blocks_needed=exc.blocks_needed, blocks_free=exc.blocks_free,
                           total_blocks=exc.total_blocks)
    if isinstance(exc, kvcache.CacheNotFound):
        return StatusError(grpc.StatusCode.NOT_FOUND, str(exc),
                           "CACHE_RELEASED" if exc.released else "CACHE_NOT_FOUND", cache_id=exc.cache_id)
    if isinstance(exc, kvcache.CacheAlreadyExists):
        return StatusError(grpc.StatusCode.ALREADY_EXISTS, str(exc), "CACHE_ALREADY_EXISTS", cache_id=exc.cache_id)
    if isinstance(exc, kvcache.DuplicateCache):
        return StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), "DUPLICATE_CACHE", cache_id=exc.cache_id)
    if isinstance(exc, kvcache.InvalidCacheId):
        return StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), "INVALID_CACHE_ID", field="cache_id")
    if isinstance(exc, kvcache.InvalidLength):
        return StatusError(grpc.StatusCode.OUT_OF_RANGE, str(exc), "LENGTH_OUT_OF_RANGE",
                           field="new_length", cache_id=exc.cache_id, cache_length=exc.current)
    if isinstance(exc, torch.OutOfMemoryError):
        return StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"device out of memory: {exc}", "DEVICE_OUT_OF_MEMORY")
    log.exception("internal error", exc_info=exc)
    return StatusError(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}", "INTERNAL")


def rich_status(err: StatusError) -> grpc.Status:
    info = error_details_pb2.ErrorInfo(reason=err.reason, domain=DOMAIN, metadata=err.metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    return rpc_status.to_status(
        status_pb2.Status(code=getattr(code_pb2, err.code.name), message=err.message, details=[detail])
    )


class _Undecodable:
    """Stands in for a request whose bytes did not parse, so the handler can refuse it."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _lenient(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as e:
            return _Undecodable(e)

    return deserialize


def _malformed(request: _Undecodable) -> StatusError:
    return StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                       f"request is not a valid protobuf message: {request.error}", "MALFORMED_REQUEST")


def _refusing_undecodable(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """Health and reflection: bytes that are not a protobuf get INVALID_ARGUMENT there too,
    not gRPC's UNKNOWN. Only the parsing is guarded; their handlers are otherwise untouched."""

    async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await context.abort_with_status(rich_status(_malformed(request)))
        return request

    lenient = _lenient(handler.request_deserializer)
    inner: Any = handler.unary_unary or handler.unary_stream or handler.stream_stream
    if handler.unary_unary is not None or (handler.unary_stream is not None and not inspect.isasyncgenfunction(inner)):
        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await inner(await checked(request, context), context)

        make = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.unary_stream_rpc_method_handler
        return make(unary, request_deserializer=lenient, response_serializer=handler.response_serializer)
    if handler.stream_stream is not None and inspect.isasyncgenfunction(inner):
        async def streams(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            async def parsed() -> Any:
                async for request in requests:
                    yield await checked(request, context)

            async for response in inner(parsed(), context):
                yield response

        return grpc.stream_stream_rpc_method_handler(
            streams, request_deserializer=lenient, response_serializer=handler.response_serializer)
    return handler


def _guarded_stream(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler that streams responses (StepSession answers failed steps itself; ExportKv
    does not): anything escaping it ends the stream with the mapped status. Undecodable
    request messages of a request stream reach the handler as _Undecodable; a single
    undecodable request is refused here."""
    inner = handler.stream_stream or handler.unary_stream
    single = handler.stream_stream is None

    async def guarded(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            if single and isinstance(requests, _Undecodable):
                raise _malformed(requests)
            async for response in inner(requests, context):
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - the same mapping as for unary calls
            await context.abort_with_status(rich_status(to_status_error(exc)))

    make = grpc.unary_stream_rpc_method_handler if single else grpc.stream_stream_rpc_method_handler
    return make(guarded, request_deserializer=_lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer)


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every handler of ModelExecutorService with the exception mapping."""

    def __init__(self) -> None:
        self.handlers = WrappedHandlers(self._wrap)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        return handler if handler is None else self.handlers.get(details.method, handler)

    @staticmethod
    def _wrap(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        if not method.startswith(SERVICE_PREFIX):
            return _refusing_undecodable(handler)
        if handler.stream_stream is not None or handler.unary_stream is not None:
            return _guarded_stream(handler)
        # A request stream's messages that do not parse reach its handler as _Undecodable.
        inner = handler.unary_unary or handler.stream_unary

        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                if isinstance(request, _Undecodable):
                    raise _malformed(request)
                return await inner(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - this is the one place that maps them all
                await context.abort_with_status(rich_status(to_status_error(exc)))

        make = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.stream_unary_rpc_method_handler
        return make(guarded, request_deserializer=_lenient(handler.request_deserializer),
                    response_serializer=handler.response_serializer)
