"""Typed executor errors, in the spirit of ferrum's FerrumError.

Each class names one kind of failure; the service maps the class to a gRPC status code.
`field` names the request field at fault, when there is one, so callers are told exactly
what to fix.
"""

from __future__ import annotations


class ExecutorError(Exception):
    """Base of every error an executor raises on purpose."""

    reason = "EXECUTOR_ERROR"

    def __init__(self, message: str, *, field: str | None = None, reason: str | None = None,
                 **details: object) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        if reason is not None:
            self.reason = reason  # a more specific ErrorInfo reason than the class's
        self.details = {k: str(v) for k, v in details.items()}


class InvalidParameter(ExecutorError):
    """The request is malformed, whatever the executor's state (ferrum InvalidParameter)."""

    reason = "INVALID_ARGUMENT"


class OutOfRange(ExecutorError):
    """A length or position past what the model or cache allows."""

    reason = "OUT_OF_RANGE"


class NotFound(ExecutorError):
    """A named thing (a cache) does not exist."""

    reason = "NOT_FOUND"


class AlreadyExists(ExecutorError):
    """A name (a LoRA adapter's) is already taken."""

    reason = "ALREADY_EXISTS"


class FailedPrecondition(ExecutorError):
    """The request does not fit the current state (a stale handle, a wrong position)."""

    reason = "FAILED_PRECONDITION"


class ResourceExhausted(ExecutorError):
    """Out of KV blocks or device memory; retrying later may succeed."""

    reason = "RESOURCE_EXHAUSTED"


class Unsupported(ExecutorError):
    """This executor does not implement the method (ferrum Unsupported)."""

    reason = "UNIMPLEMENTED"


class PermissionDenied(ExecutorError):
    """The caller may not do this."""

    reason = "PERMISSION_DENIED"


class Unavailable(ExecutorError):
    """The executor is shut down or not ready."""

    reason = "UNAVAILABLE"


class DataLoss(ExecutorError):
    """Data sent to the executor arrived damaged or incomplete (a bad checksum, a short stream)."""

    reason = "DATA_LOSS"
