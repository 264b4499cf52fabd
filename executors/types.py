"""Domain types of the executor interface (ferrum's PrefillInput, DecodeOutput, ...).

Plain dataclasses with NumPy payloads, so neither the service nor tests need torch to
read them. Token ids are Python ints; tensors crossing the boundary are HostTensors. What
an executor says of itself (info, capabilities, status, metrics) is in descriptions.py.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from executors.adjustments import LogitsAdjustments
from executors.errors import InvalidParameter


class DType(enum.Enum):
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    INT32 = "int32"
    INT64 = "int64"
    UINT32 = "uint32"
    INT8 = "int8"
    UINT8 = "uint8"
    BOOL = "bool"


FLOAT_OUTPUT_DTYPES = (DType.FLOAT32, DType.BFLOAT16, DType.FLOAT16)


@dataclass(frozen=True, slots=True)
class HostTensor:
    """A tensor in host memory. BFLOAT16 data is held as its raw uint16 bits."""

    dtype: DType
    array: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)


@dataclass(frozen=True, slots=True)
class KvCacheHandle:
    """Identifies a sequence's cache and its state after a call (ferrum KvCacheHandle).

    On input only cache_id and sequence_length are read; the rest describes the cache.
    """

    cache_id: str
    sequence_length: int
    block_ids: tuple[int, ...] = ()
    block_size: int = 0
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    device: str = "cpu"


class LogitsKind(enum.Enum):
    FULL = "full"
    ARGMAX = "argmax"
    TOP_K = "top_k"
    SAMPLE = "sample"


MAX_TOP_K = 1024


@dataclass(frozen=True, slots=True)
class LogitsPolicy:
    """What an item returns for its next token; FULL float32 unless asked otherwise."""

    kind: LogitsKind = LogitsKind.FULL
    full_dtype: DType = DType.FLOAT32
    k: int = 0  # TOP_K
    temperature: float = 1.0  # SAMPLE; 0 means greedy
    top_k: int = 0  # SAMPLE; 0 keeps all
    top_p: float = 1.0  # SAMPLE
    seed: int | None = None  # SAMPLE
    min_p: float = 0.0  # SAMPLE; 0 keeps all
    top_logprobs: int = 0  # ARGMAX and SAMPLE: also the most likely ids and their log-probabilities
    adjustments: LogitsAdjustments | None = None  # ARGMAX and SAMPLE; None changes nothing

    def validate(self, vocab_size: int, where: str) -> None:
        """Raise InvalidParameter naming `where` unless the policy fits a vocabulary."""
        if self.kind is LogitsKind.FULL and self.full_dtype not in FLOAT_OUTPUT_DTYPES:
            raise InvalidParameter(
                f"{where}.full.dtype must be FLOAT32, BFLOAT16 or FLOAT16, got {self.full_dtype.name}",
                field=f"{where}.full.dtype",
            )
        if self.kind is LogitsKind.TOP_K and not 1 <= self.k <= min(vocab_size, MAX_TOP_K):
            raise InvalidParameter(
                f"{where}.top_k.k must be in [1, {min(vocab_size, MAX_TOP_K)}], got {self.k}",
                field=f"{where}.top_k.k",
            )
        if self.kind is LogitsKind.SAMPLE:
            if not (math.isfinite(self.temperature) and self.temperature >= 0):
                raise InvalidParameter(
                    f"{where}.sample.temperature must be finite and >= 0, got {self.temperature}",
                    field=f"{where}.sample.temperature",
                )
            if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
                raise InvalidParameter(
                    f"{where}.sample.top_p must be in (0, 1], got {self.top_p}",
                    field=f"{where}.sample.top_p",
                )
            if self.top_k < 0:
                raise InvalidParameter(f"{where}.sample.top_k must be >= 0", field=f"{where}.sample.top_k")
            if not 0 <= self.min_p <= 1:  # NaN fails too
                raise InvalidParameter(
                    f"{where}.sample.min_p must be in [0, 1], got {self.min_p}",
                    field=f"{where}.sample.min_p",
                )
        if self.top_logprobs and self.kind not in (LogitsKind.ARGMAX, LogitsKind.SAMPLE):
            raise InvalidParameter(f"{where}: top_logprobs goes with ARGMAX and SAMPLE; TOP_K returns its own k",
                                   field=where)
        if not 0 <= self.top_logprobs <= min(vocab_size, MAX_TOP_K):
            branch = "argmax" if self.kind is LogitsKind.ARGMAX else "sample"
            raise InvalidParameter(
                f"{where}.{branch}.top_logprobs must be in [0, {min(vocab_size, MAX_TOP_K)}], got {self.top_logprobs}",
                field=f"{where}.{branch}.top_logprobs",
            )
        if self.adjustments is not None:
            self.adjustments.validate(vocab_size, f"{where}.adjustments")
            if self.kind not in (LogitsKind.ARGMAX, LogitsKind.SAMPLE) and not self.adjustments.changes_nothing:
                raise InvalidParameter(
                    f"{where}.adjustments apply to ARGMAX and SAMPLE policies; {self.kind.name} returns the "
                    "model's own logits",
                    field=f"{where}.adjustments",
                )

    @property
    def adjusts(self) -> bool:
        """Whether the row is changed before its token is chosen."""
        return self.adjustments is not None and not self.adjustments.changes_nothing


@dataclass(frozen=True, slots=True)
class LogitsResult:
    """The next-token output for one position, in the form its policy asked for."""

    kind: LogitsKind
    logits: HostTensor | None = None  # FULL: [vocab]
    token_id: int | None = None  # ARGMAX, SAMPLE
    logprob: float | None = None  # ARGMAX, SAMPLE: under the model's softmax
    sampling_logprob: float | None = None  # SAMPLE: under the sampled distribution
    top_token_ids: tuple[int, ...] = ()  # TOP_K; ARGMAX and SAMPLE with top_logprobs
    top_logprobs: tuple[float, ...] = ()  # the same rows' log-probabilities under the model's softmax


Metadata = dict[str, Any]


@dataclass(slots=True)
class PrefillInput:
    """One sequence's prompt, or the next chunk of it (ferrum PrefillInput)."""

    input_ids: Sequence[int]
    kv_cache: KvCacheHandle | None = None
    position_ids: Sequence[int] | None = None
    attention_mask: Sequence[int] | None = None
    metadata: Metadata = field(default_factory=dict)
    logits_policy: LogitsPolicy = LogitsPolicy()


@dataclass(frozen=True, slots=True)
class PrefillOutput:
    logits: LogitsResult
    kv_cache: KvCacheHandle


@dataclass(slots=True)
class DecodeInput:
    """One decode step (ferrum DecodeInput)."""

    token_id: int
    kv_cache: KvCacheHandle
    position_id: int | None = None
    metadata: Metadata = field(default_factory=dict)
    logits_policy: LogitsPolicy = LogitsPolicy()


@dataclass(frozen=True, slots=True)
class DecodeOutput:
    logits: LogitsResult
    kv_cache: KvCacheHandle


@dataclass(slots=True)
class UnifiedBatchItem:
    """A prefill chunk or decode step inside a unified batch (ferrum UnifiedBatchItem)."""

    seq_id: str
    q_tokens: Sequence[int]
    pos_offset: int
    is_final_chunk: bool
    metadata: Metadata = field(default_factory=dict)
    logits_policy: LogitsPolicy = LogitsPolicy()
    # Instead of q_tokens: the token the cache's latest step sampled (the proto's comment says when).
    feed_sampled_token: bool = False

    @property
    def token_count(self) -> int:
        return 1 if self.feed_sampled_token else len(self.q_tokens)


@dataclass(frozen=True, slots=True)
class UnifiedItemResult:
    seq_id: str
    logits: LogitsResult | None  # only for final items
    kv_cache: KvCacheHandle


class ForwardKind(enum.Enum):
    LOGITS = "logits"
    HIDDEN_STATES = "hidden_states"
    TOKEN_LOGPROBS = "token_logprobs"


@dataclass(frozen=True, slots=True)
class VerifyOutput:
    outputs: list[LogitsResult]  # one per token
    kv_cache: KvCacheHandle


@dataclass(frozen=True, slots=True)
class TruncateResult:
    kv_cache: KvCacheHandle
    freed_blocks: int


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    released: bool
    freed_blocks: int
