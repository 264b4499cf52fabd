"""The values one step of a KvCacheExecutor passes along, from request to forward to reply.

Validation (validation.py) turns each request into an ItemSpec, without reading any state;
the step (kv_step.py) resolves each spec to its cache as a StepItem, the model's
`_forward_step` runs the StepItems and returns a StepLogits, and every item comes back to
its caller as a StepResult. They live apart from the executor so that the model code and
the step plan (step_plan.py) can name them without importing the executor.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import torch

from executors.lora import LoraAdapter
from executors.types import KvCacheHandle, LogitsPolicy, LogitsResult
from kvcache import BlockTable


class Rows(enum.Enum):
    """Which positions of an item need logits."""

    NONE = 0  # a non-final prefill chunk: skip the lm_head
    LAST = 1  # prefill, decode, final chunk
    ALL = 2  # forward_verify


@dataclass(slots=True)
class ItemSpec:
    """A validated request for one cache, before any state is touched."""

    where: str  # field path used in error messages: "input", "inputs[2]", "batch.items[0]"
    cache_id: str | None  # None: a new cache with a server-chosen id
    expected_length: int  # the cache's length as the caller believes it
    may_create: bool  # an id not in use may be created (expected_length is 0)
    tokens: list[int]
    rows: Rows
    policy: LogitsPolicy
    is_decode: bool
    adapter: str | None = None  # the LoRA adapter named in the request's metadata
    # tokens is empty until the worker puts the cache's last sampled token there (kv_step.feed)
    feed: bool = False
    # The row of the step in flight whose sampled token this fed item takes on the device, until
    # that step is settled and the host learns it (step_overlap.py); tokens is [0] meanwhile.
    fed_row: int | None = None


@dataclass(frozen=True, slots=True)
class StepResult:
    cache_id: str
    outputs: list[LogitsResult] | None  # one per logits row; None for Rows.NONE
    kv_cache: KvCacheHandle
    created: bool = False  # this step created the cache
    serial: int = 0  # the creation's serial (CacheRegistry), when created


class StepLogits(NamedTuple):
    """The logits of one forward: policies then run over all of its rows at once."""

    logits: torch.Tensor | None  # [rows, vocab], float32: every row some item needs
    spans: list[tuple[int, int] | None]  # per item: (first row, rows) in logits; None for Rows.NONE
    argmax: torch.Tensor | None = None  # logits.argmax_pairs(logits), where the step computed it (decode graphs)


@dataclass(slots=True)
class StepItem:
    """One cache's share of a forward: tokens at positions start..start+len-1."""

    cache_id: str
    table: BlockTable
    tokens: list[int]
    start: int
    rows: Rows
    reused: int | None = None  # prompt tokens taken from the prefix cache; None: no lookup
    adapter: LoraAdapter | None = None  # the cache's LoRA adapter
    fed_row: int | None = None  # ItemSpec.fed_row: the token comes from the step in flight, on the device
