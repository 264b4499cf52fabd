"""ModelExecutor: the executor interface, mirroring ferrum's `ModelExecutor` trait.

Required: info, capabilities, status, prefill, decode. Everything else has the trait's
default: batch_prefill, batch_decode and forward_verify fall back to one call per item;
unified_decode, forward and truncate_kv raise Unsupported (ferrum's truncate_kv default
silently does nothing, which corrupts a speculative decoder's cache, so ours refuses).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING

from executors.descriptions import (
    CacheMetrics,
    ExecutorCapabilities,
    ExecutorStatus,
    LoraAdapterInfo,
    LoraMetrics,
    LoraSource,
    ModelInfo,
)
from executors.errors import InvalidParameter, Unsupported
from executors.types import (
    DecodeInput,
    DecodeOutput,
    DType,
    ForwardKind,
    HostTensor,
    KvCacheHandle,
    LogitsPolicy,
    PrefillInput,
    PrefillOutput,
    ReleaseResult,
    TruncateResult,
    UnifiedBatchItem,
    UnifiedItemResult,
    VerifyOutput,
)

if TYPE_CHECKING:
    from executors.kv_transfer import KvExport, KvImport
    from executors.transfer_types import CacheInfo, KvExportDescription


class ModelExecutor(abc.ABC):
    """An LLM executor whose KV caches live inside it, addressed by cache id."""

    name = "executor"

    # -- required -------------------------------------------------------------------------
    @abc.abstractmethod
    def info(self) -> ModelInfo: ...

    @abc.abstractmethod
    def capabilities(self) -> ExecutorCapabilities: ...

    @abc.abstractmethod
    def status(self) -> ExecutorStatus: ...

    @abc.abstractmethod
    async def prefill(self, inp: PrefillInput) -> PrefillOutput: ...

    @abc.abstractmethod
    async def decode(self, inp: DecodeInput) -> DecodeOutput: ...

    # -- provided, with the trait's defaults ----------------------------------------------
    def supports_native_unified_decode(self) -> bool:
        return False

    def kv_capacity(self) -> int | None:
        return None

    async def batch_prefill(self, inputs: Sequence[PrefillInput]) -> list[PrefillOutput]:
        return [await self.prefill(i) for i in inputs]

    async def batch_decode(self, inputs: Sequence[DecodeInput]) -> list[DecodeOutput]:
        return [await self.decode(i) for i in inputs]

    async def unified_decode(self, items: Sequence[UnifiedBatchItem]) -> list[UnifiedItemResult]:
        raise Unsupported(f"{self.name} executor does not implement unified_decode")

    async def forward(self, input_ids: Sequence[int], kind: ForwardKind, dtype: DType) -> HostTensor:
        raise Unsupported(f"{self.name} executor does not implement forward")

    async def forward_verify(
        self, kv_cache: KvCacheHandle, tokens: Sequence[int], policy: LogitsPolicy
    ) -> VerifyOutput:
        """One decode per token (ferrum's default); executors override with one forward."""
        if not tokens:
            raise InvalidParameter("tokens must hold at least one token", field="tokens")
        outputs, handle = [], kv_cache
        for tok in tokens:
            out = await self.decode(DecodeInput(token_id=tok, kv_cache=handle, logits_policy=policy))
            outputs.append(out.logits)
            handle = out.kv_cache
        return VerifyOutput(outputs=outputs, kv_cache=handle)

    async def truncate_kv(self, cache_id: str, new_length: int) -> TruncateResult:
        raise Unsupported(f"{self.name} executor does not implement truncate_kv")

    async def release_cache(self, cache_id: str, expected_length: int | None = None) -> ReleaseResult:
        return ReleaseResult(released=False, freed_blocks=0)

    # -- moving caches between executors (kv_transfer.py) --------------------------------
    async def export_kv(self, cache_id: str, start: int | None = None, end: int | None = None,
                        max_chunk_bytes: int = 0) -> KvExport:
        """A snapshot of positions [start, end) of a cache: its description, then chunks."""
        raise Unsupported(f"the {self.name} executor cannot export KV caches")

    async def import_kv(self, description: KvExportDescription, cache_id: str | None) -> KvImport:
        """Begin importing an exported cache; write its chunks, then finish (or abort)."""
        raise Unsupported(f"the {self.name} executor cannot import KV caches")

    async def list_caches(self, cache_ids: Sequence[str] = ()) -> list[CacheInfo]:
        raise Unsupported(f"the {self.name} executor cannot list its caches")

    def cache_metrics(self) -> CacheMetrics | None:
        return None

    def lora_metrics(self) -> LoraMetrics | None:
        return None

    async def load_lora_adapter(self, name: str, source: LoraSource) -> LoraAdapterInfo:
        raise Unsupported(f"the {self.name} executor has no LoRA support")

    async def unload_lora_adapter(self, name: str) -> LoraAdapterInfo:
        raise Unsupported(f"the {self.name} executor has no LoRA support")

    def list_lora_adapters(self) -> list[LoraAdapterInfo]:
        raise Unsupported(f"the {self.name} executor has no LoRA support")

    async def warmup(self) -> None:
        return None

    async def shutdown(self) -> int:
        """Stop the executor; returns the number of caches released."""
        return 0
