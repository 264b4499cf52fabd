"""The scheduler's value types (client/scheduler.py): its configuration, a finished request's
Completion, the running counters, and its view of one replica's capacity.

Plain data with no behaviour beyond derived properties, kept apart so that the modules of
the scheduler (planning, stepping, batch runs) and its users share them without importing
the Scheduler itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import ExecutorError

__all__ = ["Completion", "SchedulerConfig", "SchedulerStats"]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Per-replica step budget and behaviour; the executor's own limits cap the budgets."""

    max_num_seqs: int = 32  # sequences in one step (capped by limits.max_batch_size)
    max_num_batched_tokens: int = 512  # tokens in one step (capped by limits.max_tokens_per_request)
    max_prefill_chunk: int | None = None  # longest prefill chunk; None: the step's token budget
    kv_watermark_blocks: int = 0  # blocks kept free when admitting new requests
    status_refresh_s: float = 1.0  # GetStatus at most this often (and after a refused step)
    eos_token_ids: tuple[int, ...] | None = None  # None: GetInfo metadata "eos_token_ids"
    retry_attempts: int = 3  # retries of a step that failed transiently
    retry_backoff_s: float = 0.05  # first retry delay; doubles each time
    max_stall_s: float = 30.0  # a request that cannot get KV blocks for this long fails

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_prefill_chunk is not None and self.max_prefill_chunk < 1:
            raise ValueError("max_prefill_chunk must be >= 1")


@dataclass(slots=True)
class Completion:
    """A finished request. finish_reason: "stop" (an end-of-sequence id, not included in
    token_ids), "length" (max_tokens or the model's limit), "cancelled" or "error"."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)  # only for a full-logits policy
    # Per token, for a policy with top_logprobs: the most likely ids -> their log-probabilities.
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    error: ExecutorError | None = None
    preemptions: int = 0
    submitted_at: float = 0.0
    first_token_at: float | None = None
    finished_at: float | None = None
    token_times: list[float] = field(default_factory=list)  # time.monotonic() as each token came

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    @property
    def itl_s(self) -> float | None:
        """Inter-token latency: the mean gap between successive tokens (None below two)."""
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    @property
    def latency_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.submitted_at


@dataclass(slots=True)
class SchedulerStats:
    steps: int = 0  # UnifiedDecode calls
    prefill_tokens: int = 0
    decode_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    refused_steps: int = 0  # RESOURCE_EXHAUSTED answers
    retries: int = 0
    max_items_per_step: int = 0
    finished: int = 0


@dataclass(slots=True)
class _Replica:
    index: int
    block_size: int
    total_blocks: int
    max_seq_len: int
    max_items: int
    max_tokens: int
    free_blocks: int
    stale: bool = False

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)
