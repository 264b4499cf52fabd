"""One place that turns exceptions into gRPC statuses.

Handlers carry no try/except: the wrapper every method runs in (service.handlers) maps what
escapes a ModelExecutorService handler here. An executor or KV cache error becomes its
precise status code with a message naming the field, plus a google.rpc.ErrorInfo detail
(domain "modelexec.v1") that programs can read. Only genuine server faults become INTERNAL.
Requests whose bytes are not a valid protobuf get INVALID_ARGUMENT, not gRPC's INTERNAL,
on every service (health and reflection included).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grpc
import torch
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

import kvcache
from executors import errors as ex

log = logging.getLogger(__name__)
DOMAIN = "modelexec.v1"

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
    """Stands in for a message of a request stream whose bytes did not parse, so the
    handler can refuse it (StepSession answers that step with its error and goes on)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _malformed(request: _Undecodable) -> StatusError:
    return StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                       f"request is not a valid protobuf message: {request.error}", "MALFORMED_REQUEST")


def lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """For request streams: a message that does not parse arrives as _Undecodable."""
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as e:
            return _Undecodable(e)

    return deserialize


def strict(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    """For single requests, parsed by the wrapper once the call is authenticated: a request
    that does not parse raises the INVALID_ARGUMENT StatusError."""
    if deserializer is None:
        return lambda data: data

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as e:
            raise _malformed(_Undecodable(e)) from None

    return parse


async def refusing_undecodable(requests: Any) -> Any:
    """A request stream of a service whose handler does not expect _Undecodable (reflection)."""
    async for request in requests:
        if isinstance(request, _Undecodable):
            raise _malformed(request)
        yield request
