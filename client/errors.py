"""Typed exceptions for executor calls, one per gRPC status code.

Schedulers branch on failures (evict on KV_CACHE_EXHAUSTED, resync on a stale handle),
so the status code becomes the exception type and the server's google.rpc.ErrorInfo
(domain "modelexec.v1") becomes `.reason` and `.metadata`, without parsing messages.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

__all__ = [
    "ERROR_DOMAIN",
    "STATUS_DETAILS_KEY",
    "AbortedError",
    "AlreadyExistsError",
    "CallCancelledError",
    "DataLossError",
    "DeadlineExceededError",
    "ExecutorError",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "OutOfRangeError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "UnknownError",
    "error_class",
    "from_rpc_error",
    "from_status",
    "parse_status_details",
]

ERROR_DOMAIN = "modelexec.v1"
# Trailer carrying a serialized google.rpc.Status (what grpc_status.rpc_status reads).
STATUS_DETAILS_KEY = "grpc-status-details-bin"


class ExecutorError(Exception):
    """A failed executor call: its status code, message and ErrorInfo (when sent)."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(
        self,
        details_message: str = "",
        *,
        code: grpc.StatusCode | None = None,
        reason: str | None = None,
        metadata: dict[str, str] | None = None,
        domain: str | None = None,
    ) -> None:
        super().__init__(details_message)
        if code is not None:
            self.code = code
        self.details_message = details_message
        self.reason = reason
        self.metadata: dict[str, str] = dict(metadata or {})
        self.domain = domain

    def __str__(self) -> str:
        text = f"{self.code.name}: {self.details_message}"
        # A generic reason (the code's own name) would say the code twice.
        return f"{text} [{self.reason}]" if self.reason and self.reason != self.code.name else text

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only fields survive pickling (e.g. across multiprocessing boundaries).
        return (_rebuild, (type(self), self.details_message, self.code, self.reason, self.metadata, self.domain))


def _rebuild(cls: type[ExecutorError], message: str, code: grpc.StatusCode, reason: str | None,
             metadata: dict[str, str], domain: str | None) -> ExecutorError:
    return cls(message, code=code, reason=reason, metadata=metadata, domain=domain)


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


class CallCancelledError(ExecutorError):
    code = grpc.StatusCode.CANCELLED


class UnknownError(ExecutorError):
    code = grpc.StatusCode.UNKNOWN


class InvalidArgumentError(ExecutorError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceededError(ExecutorError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFoundError(ExecutorError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(ExecutorError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDeniedError(ExecutorError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhaustedError(ExecutorError):
    """Usually KV_CACHE_EXHAUSTED: the pool lacks blocks; the counts guide eviction."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    @property
    def blocks_needed(self) -> int | None:
        return _int_or_none(self.metadata.get("blocks_needed"))

    @property
    def blocks_free(self) -> int | None:
        return _int_or_none(self.metadata.get("blocks_free"))


class FailedPreconditionError(ExecutorError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class AbortedError(ExecutorError):
    code = grpc.StatusCode.ABORTED


class OutOfRangeError(ExecutorError):
    code = grpc.StatusCode.OUT_OF_RANGE


class UnimplementedError(ExecutorError):
    code = grpc.StatusCode.UNIMPLEMENTED


class InternalError(ExecutorError):
    code = grpc.StatusCode.INTERNAL


class UnavailableError(ExecutorError):
    code = grpc.StatusCode.UNAVAILABLE


class DataLossError(ExecutorError):
    code = grpc.StatusCode.DATA_LOSS


class UnauthenticatedError(ExecutorError):
    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE: dict[grpc.StatusCode, type[ExecutorError]] = {
    cls.code: cls
    for cls in (
        CallCancelledError, UnknownError, InvalidArgumentError, DeadlineExceededError, NotFoundError,
        AlreadyExistsError, PermissionDeniedError, ResourceExhaustedError, FailedPreconditionError,
        AbortedError, OutOfRangeError, UnimplementedError, InternalError, UnavailableError,
        DataLossError, UnauthenticatedError,
    )
}


# Statuses after which the executor guarantees the call changed nothing: a cache it was to
# create does not exist. After anything else (a deadline, a lost connection, a cancellation
# on the caller's side) it may have taken effect all the same. Only the executor's own
# answer (its ErrorInfo's domain) proves it: gRPC raises RESOURCE_EXHAUSTED on the client
# too, when an answer the server committed to exceeds the client's receive limit.
NOTHING_CHANGED = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAUTHENTICATED,
})


def may_have_taken_effect(error: BaseException) -> bool:
    """A call that failed with `error` after its request went out may have done its work."""
    return (not isinstance(error, ExecutorError) or error.code not in NOTHING_CHANGED
            or error.domain != ERROR_DOMAIN)


def error_class(code: grpc.StatusCode) -> type[ExecutorError]:
    """The exception class for a status code (UnknownError for OK or anything unmapped)."""
    return _BY_CODE.get(code, UnknownError)


def parse_status_details(
    trailing_metadata: Iterable[tuple[str, str | bytes]] | None,
) -> error_details_pb2.ErrorInfo | None:
    """The first ErrorInfo inside the grpc-status-details-bin trailer, if any.

    Works on a sync call's tuple and on grpc.aio.Metadata alike (both iterate as
    (key, value) pairs), which is why aio errors need no separate path. A malformed
    trailer yields None rather than masking the original error.
    """
    for key, value in trailing_metadata or ():
        if key != STATUS_DETAILS_KEY or not isinstance(value, bytes):
            continue
        try:
            status = status_pb2.Status.FromString(value)
        except DecodeError:
            return None
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                return info
        return None
    return None


def _call_or_none(err: Any, name: str) -> Any:
    method = getattr(err, name, None)
    try:
        return method() if callable(method) else None
    except Exception:  # noqa: BLE001 - a broken accessor must not hide the real error
        return None


def from_rpc_error(err: grpc.RpcError) -> ExecutorError:
    """The typed exception for a failed sync or aio call (raise it `from err`)."""
    code = _call_or_none(err, "code")
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    return from_status(code, _call_or_none(err, "details") or "", _call_or_none(err, "trailing_metadata"))


def from_status(code: grpc.StatusCode, details: str,
                trailing_metadata: Iterable[tuple[str, str | bytes]] | None) -> ExecutorError:
    """The typed exception for a call that ended with this status (its ErrorInfo read from the trailers)."""
    info = parse_status_details(trailing_metadata)
    return error_class(code)(
        details,
        code=code,
        reason=(info.reason or None) if info else None,
        metadata=dict(info.metadata) if info else None,
        domain=(info.domain or None) if info else None,
    )
