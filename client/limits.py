"""Transport constants shared by both clients, kept in one place so they cannot drift."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# A full fp32 logits row for a 150k vocabulary is 600 KB and Forward can return
# [seq_len, vocab] rows, so the gRPC default of 4 MiB is far too small.
DEFAULT_MAX_MESSAGE_BYTES: int = 256 * 1024 * 1024

# Per-call deadline used when a call does not pass its own timeout.
DEFAULT_TIMEOUT_S: float = 30.0

# The name the server registers with grpc.health.v1.Health.
HEALTH_SERVICE_NAME: str = "modelexec.v1.ModelExecutorService"

# Keepalive pings detect dead connections between long idle gaps of a scheduler, while
# not pinging when no call is active (servers reject clients that ping too eagerly).
KEEPALIVE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 0),
)


def channel_options(
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, extra: Sequence[tuple[str, Any]] = ()
) -> list[tuple[str, Any]]:
    """Channel options for both clients; an `extra` entry replaces a default of the same name.

    Duplicates are removed here rather than left to the C core, whose choice between two
    values of one key is not part of its documented behaviour.
    """
    if max_message_bytes <= 0:
        raise ValueError(f"max_message_bytes must be positive, got {max_message_bytes}")
    merged: dict[str, Any] = {
        "grpc.max_send_message_length": max_message_bytes,
        "grpc.max_receive_message_length": max_message_bytes,
        **dict(KEEPALIVE_OPTIONS),
    }
    merged.update(dict(extra))
    return list(merged.items())
