"""Plain domain types for the hot path: NumPy in and out, no protobuf in user code.

Schedulers juggle thousands of handles and outputs per second; keeping them as small
slotted dataclasses (rather than proto messages) makes them cheap, hashable where it
matters (KvCacheHandle) and independent of the wire format. Conversion lives in
`client.convert`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np

from .logits_policy import LogitsAdjustments, LogitsDType, LogitsKindName, LogitsPolicy, Penalties

__all__ = [
    "CallTiming",
    "DecodeInput",
    "DecodeOutput",
    "ForwardOutput",
    "ForwardVerifyOutput",
    "ImportResult",
    "KvCacheHandle",
    "LogitsAdjustments",
    "LogitsDType",
    "LogitsKindName",
    "LogitsOutput",
    "LogitsPolicy",
    "Metadata",
    "Penalties",
    "PrefillInput",
    "PrefillOutput",
    "ReleaseResult",
    "TokenIds",
    "TruncateResult",
    "UnifiedBatch",
    "UnifiedBatchItem",
    "UnifiedItemResult",
]

# JSON-like metadata: str, int, float, bool, None, lists and dicts of those.
Metadata: TypeAlias = Mapping[str, Any]
# Token ids as a Python sequence of ints or a 1-D integer ndarray.
TokenIds: TypeAlias = Sequence[int] | np.ndarray


@dataclass(frozen=True, slots=True)
class KvCacheHandle:
    """A sequence's KV cache inside the executor, as of the call that returned it.

    Pass it back unchanged: the executor checks `sequence_length` so a stale view
    fails with FAILED_PRECONDITION instead of producing wrong logits. `device` is
    "cpu", "cuda:0", "rocm:1", "metal:0", or "" when the server left it unset.
    `block_ids` is empty in a compact handle (`compact_handles`); `held_blocks` counts the
    blocks the cache holds either way.
    """

    cache_id: str
    sequence_length: int
    block_ids: tuple[int, ...] = ()
    block_size: int = 0
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    device: str = "cpu"
    held_blocks: int = 0  # 0: as many as block_ids lists

    def __post_init__(self) -> None:
        if not self.held_blocks and self.block_ids:
            object.__setattr__(self, "held_blocks", len(self.block_ids))


@dataclass(frozen=True, slots=True)
class CallTiming:
    """The executor's own time for a call, to separate transport cost from model cost."""

    queue_ns: int = 0
    executor_ns: int = 0
    total_ns: int = 0


@dataclass(slots=True)
class LogitsOutput:
    """Next-token output for one position, in the form its policy asked for.

    Only the fields of `kind` are set; the rest are None (top_token_ids and top_logprobs
    are set for argmax and sample too where their policy asked for top_logprobs). Full logits are float32 for
    FLOAT32 and BFLOAT16 (decoded exactly), float16 for FLOAT16, and may be read-only
    views over the response bytes (copy before writing).
    """

    kind: str
    logits: np.ndarray | None = None
    token_id: int | None = None
    logprob: float | None = None
    sampling_logprob: float | None = None
    top_token_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None

    def next_token(self) -> int:
        """The greedy/chosen next token, whatever the kind, so callers need not branch."""
        if self.kind == "full" and self.logits is not None:
            return int(np.argmax(self.logits))
        if self.kind in ("argmax", "sample") and self.token_id is not None:
            return self.token_id
        if self.kind == "top_k" and self.top_token_ids is not None and len(self.top_token_ids):
            return int(self.top_token_ids[0])
        raise ValueError(f"LogitsOutput of kind {self.kind!r} carries no token")


@dataclass(slots=True)
class PrefillInput:
    """A prompt, or the next chunk of one; kv_cache=None asks for a new cache.

    `lora_adapter` names a loaded LoRA adapter (sent as metadata "ferrum_lora_adapter");
    a cache stays bound to the adapter it was created with.
    """

    input_ids: TokenIds
    kv_cache: KvCacheHandle | None = None
    position_ids: TokenIds | None = None
    attention_mask: TokenIds | None = None
    metadata: Metadata | None = None
    logits_policy: LogitsPolicy | None = None
    lora_adapter: str | None = None


@dataclass(slots=True)
class PrefillOutput:
    """Output at the last input position, and the cache after the prefill."""

    logits: LogitsOutput
    kv_cache: KvCacheHandle
    timing: CallTiming = field(default_factory=CallTiming)


@dataclass(slots=True)
class DecodeInput:
    """One decode step: append `token_id` to `kv_cache`; `lora_adapter` as in PrefillInput."""

    token_id: int
    kv_cache: KvCacheHandle
    position_id: int | None = None
    metadata: Metadata | None = None
    logits_policy: LogitsPolicy | None = None
    lora_adapter: str | None = None


@dataclass(slots=True)
class DecodeOutput:
    """Output after the appended token, and the cache one token longer."""

    logits: LogitsOutput
    kv_cache: KvCacheHandle
    timing: CallTiming = field(default_factory=CallTiming)


@dataclass(slots=True)
class UnifiedBatchItem:
    """One sequence's share of a unified step: a prefill chunk or a decode step;
    `lora_adapter` as in PrefillInput."""

    seq_id: str
    q_tokens: TokenIds
    pos_offset: int
    is_final_chunk: bool
    metadata: Metadata | None = None
    logits_policy: LogitsPolicy | None = None
    lora_adapter: str | None = None
    # Instead of q_tokens (then empty): the token the cache's latest step sampled, so the next
    # step can be sent before that step's result is read (StepSession.send; the proto says more).
    feed_sampled_token: bool = False


@dataclass(slots=True)
class UnifiedBatch:
    """A whole unified step; each item names a distinct cache."""

    items: list[UnifiedBatchItem] = field(default_factory=list)


@dataclass(slots=True)
class UnifiedItemResult:
    """Result of one unified item; `logits` is None for non-final chunks."""

    seq_id: str
    logits: LogitsOutput | None
    kv_cache: KvCacheHandle
    timing: CallTiming = field(default_factory=CallTiming)


@dataclass(slots=True)
class ForwardVerifyOutput:
    """N+1 outputs (row i predicts the token after tokens[i]) and the extended cache."""

    outputs: list[LogitsOutput]
    kv_cache: KvCacheHandle
    timing: CallTiming = field(default_factory=CallTiming)


@dataclass(slots=True)
class TruncateResult:
    """The cache after a rollback and the blocks it returned to the pool."""

    kv_cache: KvCacheHandle
    freed_blocks: int
    timing: CallTiming = field(default_factory=CallTiming)


@dataclass(slots=True)
class ImportResult:
    """A cache created (or extended) by ImportKv; replayed=True when the call was a retry of
    an import that had completed, and wrote nothing."""

    kv_cache: KvCacheHandle
    imported_tokens: int
    replayed: bool = False
    timing: CallTiming = field(default_factory=CallTiming)


@dataclass(slots=True)
class ReleaseResult:
    """released=False means the cache had already been released (the call is idempotent)."""

    released: bool
    freed_blocks: int
    timing: CallTiming = field(default_factory=CallTiming)


@dataclass(slots=True)
class ForwardOutput:
    """A cache-free forward's tensor; kind is "logits", "hidden_states" or "token_logprobs"."""

    output: np.ndarray
    kind: str
    timing: CallTiming = field(default_factory=CallTiming)
