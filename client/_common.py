"""Settings shared by the async and blocking clients, so only their call plumbing differs."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import grpc
from grpc_health.v1 import health_pb2

from .errors import DeadlineExceededError
from .limits import DEFAULT_MAX_MESSAGE_BYTES, HEALTH_SERVICE_NAME, channel_options
from .security import bearer_metadata


class _Default(enum.Enum):
    """Sentinel type: `timeout=None` must stay free to mean "no deadline"."""

    TIMEOUT = enum.auto()


USE_DEFAULT = _Default.TIMEOUT
Timeout: TypeAlias = float | None | _Default

# Health-check failures that mean "not up yet", worth polling through.
RETRYABLE_HEALTH_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.NOT_FOUND}
)
SERVING = health_pb2.HealthCheckResponse.SERVING
# Longest single Check attempt while polling, so one hung attempt cannot eat the budget.
HEALTH_ATTEMPT_S = 1.0


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Constructor arguments of either client, validated once."""

    target: str
    timeout: float | None
    credentials: grpc.ChannelCredentials | None
    call_metadata: tuple[tuple[str, str], ...]
    options: tuple[tuple[str, Any], ...]
    # The stepping calls' handles come back without block ids (HANDLE_DETAIL_COMPACT) unless a
    # call says otherwise: what a scheduler that reads only ids and lengths wants.
    compact_handles: bool = False

    @classmethod
    def build(
        cls,
        target: str,
        timeout: float | None,
        credentials: grpc.ChannelCredentials | None,
        call_metadata: Sequence[tuple[str, str]] | None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        options: Sequence[tuple[str, Any]] = (),
        token: str | None = None,
        compact_handles: bool = False,
    ) -> ClientConfig:
        """`token`: a bearer token, sent as `authorization: Bearer <token>` with every call."""
        if token is not None:
            call_metadata = (*(call_metadata or ()), bearer_metadata(token))
        if not target:
            raise ValueError("target must be 'host:port', 'unix:///path' or 'unix:path'")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be positive or None, got {timeout}")
        return cls(
            target=target,
            timeout=timeout,
            credentials=credentials,
            call_metadata=tuple((str(k), str(v)) for k, v in (call_metadata or ())),
            options=tuple(channel_options(max_message_bytes, options)),
            compact_handles=bool(compact_handles),
        )

    def deadline(self, timeout: Timeout) -> float | None:
        """The per-call timeout: the call's own, else the client's default."""
        return self.timeout if timeout is USE_DEFAULT else timeout  # type: ignore[return-value]

    def compact(self, override: bool | None) -> bool:
        """Whether a stepping call asks for compact handles: the call's own choice, else the client's."""
        return self.compact_handles if override is None else override

    @property
    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        return self.call_metadata or None


def health_request(service: str = HEALTH_SERVICE_NAME) -> health_pb2.HealthCheckRequest:
    return health_pb2.HealthCheckRequest(service=service)


def not_ready_error(target: str, timeout: float, last: str) -> DeadlineExceededError:
    """Raised by wait_ready: a deadline error, so callers handle it like any timeout."""
    return DeadlineExceededError(
        f"{target} not SERVING after {timeout:g}s (last: {last})",
        reason="NOT_READY",
        metadata={"last_status": last},
    )
