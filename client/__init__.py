"""Python client of the modelexec.v1 executor service (no torch: grpc, protobuf, NumPy).

    from . import ExecutorClient, PrefillInput, LogitsPolicy
    with ExecutorClient("localhost:50051") as ex:
        out = ex.prefill(PrefillInput([1, 2, 3], logits_policy=LogitsPolicy.argmax()))

`client.aio.AsyncExecutorClient` is the asyncio twin; failures raise the typed
exceptions of `client.errors`.
"""

from .aio import AsyncExecutorClient
from .blocking import ExecutorClient
from .errors import (
    AbortedError,
    AlreadyExistsError,
    CallCancelledError,
    DataLossError,
    DeadlineExceededError,
    ExecutorError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    OutOfRangeError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
    UnknownError,
    from_rpc_error,
)
from .limits import DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_TIMEOUT_S, HEALTH_SERVICE_NAME
from .process_memory import keep_freed_memory
from .security import bearer_metadata, tls_credentials
from .types import (
    CallTiming,
    DecodeInput,
    DecodeOutput,
    ForwardOutput,
    ForwardVerifyOutput,
    ImportResult,
    KvCacheHandle,
    LogitsAdjustments,
    LogitsOutput,
    LogitsPolicy,
    Penalties,
    PrefillInput,
    PrefillOutput,
    ReleaseResult,
    TruncateResult,
    UnifiedBatch,
    UnifiedBatchItem,
    UnifiedItemResult,
)

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_TIMEOUT_S",
    "HEALTH_SERVICE_NAME",
    "AbortedError",
    "AlreadyExistsError",
    "AsyncExecutorClient",
    "CallCancelledError",
    "CallTiming",
    "DataLossError",
    "DeadlineExceededError",
    "DecodeInput",
    "DecodeOutput",
    "ExecutorClient",
    "ExecutorError",
    "FailedPreconditionError",
    "ForwardOutput",
    "ForwardVerifyOutput",
    "ImportResult",
    "InternalError",
    "InvalidArgumentError",
    "KvCacheHandle",
    "LogitsAdjustments",
    "LogitsOutput",
    "LogitsPolicy",
    "NotFoundError",
    "OutOfRangeError",
    "Penalties",
    "PermissionDeniedError",
    "PrefillInput",
    "PrefillOutput",
    "ReleaseResult",
    "ResourceExhaustedError",
    "TruncateResult",
    "UnauthenticatedError",
    "UnavailableError",
    "UnifiedBatch",
    "UnifiedBatchItem",
    "UnifiedItemResult",
    "UnimplementedError",
    "UnknownError",
    "bearer_metadata",
    "from_rpc_error",
    "keep_freed_memory",
    "tls_credentials",
]
