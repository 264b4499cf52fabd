"""KvCacheExecutor: every executor method on top of a paged KV pool and one forward hook.

Subclasses supply the model: `_forward_step` runs a list of StepItems (each a run of
tokens continuing one cache) as one forward, writing K and V through the pool, and
`_forward_sequence` runs a whole sequence without any cache. Everything else is done
once for every model, and this class is where it meets: its state (the pool, the block
manager, the per-cache states, the stats, the worker) and the public methods, each of
which validates its request and runs the work on the worker. The work itself lives in
modules of its own:

- step_items.py: Rows, ItemSpec, StepItem, StepLogits, StepResult (re-exported here);
- validation.py: request validation, with its error messages;
- kv_step.py: a step, with all-or-nothing KV growth and rollback and the logits policies;
- cache_ops.py: truncate, release, the lease reaper, an abandoned call's caches undone;
- kv_status.py: status and cache metrics; lora_calls.py: LoRA adapters;
- kv_moves.py (a base class): moving caches between executors.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Sequence

import torch

from executors import kv_status
from executors.adapters import LoraRegistry
from executors.base import ModelExecutor
from executors.cache_ops import reap_now, release_all_now, release_now, truncate_now, undo_created
from executors.cache_state import CacheRegistry
from executors.descriptions import CacheMetrics, ExecutorState, ExecutorStatus, LoraAdapterInfo, LoraMetrics, LoraSource
from executors.errors import Unavailable, Unsupported
from executors.identity import current_identity
from executors.kv_moves import KvMoves
from executors.kv_sizing import kv_bytes_per_block
from executors.kv_step import run_step
from executors.logits import to_host_tensor
from executors.lora_calls import add_adapter_now, lora_metrics, remove_adapter_now, require_loras
from executors.omp_pool import off_worker
from executors.stats import ExecutorStats
from executors.step_items import ItemSpec, Rows, StepItem, StepLogits, StepResult
from executors.step_overlap import settled_results, undo_when_settled
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
from executors.validation import (
    LORA_ADAPTER_KEY,
    check_batch,
    check_forward,
    decode_spec,
    prefill_spec,
    unified_spec,
    verify_spec,
)
from executors.worker import SerialWorker
from kvcache import KvCacheManager
from kvcache.kv_pool import PagedKvPool

# Importable from here, as they were before they moved out.
__all__ = ["LORA_ADAPTER_KEY", "ItemSpec", "KvCacheExecutor", "Rows", "StepItem", "StepLogits", "StepResult"]

log = logging.getLogger(__name__)


class KvCacheExecutor(KvMoves, ModelExecutor):
    pool_class: type[PagedKvPool] = PagedKvPool  # tensor parallelism: one that mirrors block copies

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        vocab_size: int,
        max_sequence_length: int,
        max_batch_size: int,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        prefix_caching: bool = True,
        scratch_blocks: int = 0,
        values_are_keys: bool = False,
    ) -> None:
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.max_batch_size = max_batch_size
        self.device = device
        self.kv = KvCacheManager(num_blocks, block_size, prefix_caching=prefix_caching)
        # Said before the allocation, which takes seconds for a large pool (zero-filled).
        pool_bytes = (num_blocks + scratch_blocks) * kv_bytes_per_block(num_layers, num_kv_heads, head_dim, kv_dtype,
                                                                        block_size, values_are_keys)
        log.info("allocating the KV pool: %d blocks of %d tokens (%d tokens), %.1f MiB of %s on %s", num_blocks,
                 block_size, num_blocks * block_size, pool_bytes / 2**20, str(kv_dtype).removeprefix("torch."), device)
        started = time.perf_counter()
        self.pool = self.pool_class(num_layers, num_blocks, block_size, num_kv_heads, head_dim, kv_dtype, device,
                                    scratch_blocks, values_are_keys)
        if (took := time.perf_counter() - started) > 1:
            log.info("KV pool allocated in %.1f s", took)
        self.worker = SerialWorker(self.name)
        self.caches = CacheRegistry()
        self.stats = ExecutorStats()
        self.peak_used_bytes = 0
        # What takes the ARGMAX rows of a step in one call (LlmExecutor: its model's CPU kernels).
        self.policy_kernels = None
        self.loras: LoraRegistry | None = None  # set by executors that apply LoRA adapters
        self._fingerprint = None  # KvMoves.kv_fingerprint, computed on first use
        self._fingerprint_lock = asyncio.Lock()
        self._fingerprint_task: asyncio.Future | None = None  # warm-up's digest, kept referenced
        # What the worker runs for a step whose caller went away; made once, not per step.
        self._undo_created = functools.partial(undo_created, self)
        self._undo_abandoned = functools.partial(undo_when_settled, self.worker, self._undo_created)

    # -- the model ------------------------------------------------------------------------
    @abc.abstractmethod
    def _forward_step(self, items: list[StepItem]) -> StepLogits:
        """Run the items as one forward; K and V of their tokens go into the pool.

        Returns the logits rows of every item that needs them, in one tensor, and per
        item where its rows are (one for Rows.LAST, len(tokens) for Rows.ALL, None for
        Rows.NONE).
        """

    @abc.abstractmethod
    def _forward_sequence(self, tokens: list[int], hidden: bool) -> torch.Tensor:
        """Logits ([n, vocab]) or final hidden states ([n, hidden]) without any cache."""

    @property
    def parameter_bytes(self) -> int:
        return 0

    # -- public methods -------------------------------------------------------------------
    def supports_native_unified_decode(self) -> bool:
        return True

    def kv_capacity(self) -> int | None:
        pool_tokens = self.kv.allocator.num_total * self.kv.block_size
        return pool_tokens if pool_tokens < self.max_sequence_length else None

    async def prefill(self, inp: PrefillInput) -> PrefillOutput:
        (res,) = await self._step([prefill_spec(inp, "input", self.vocab_size)])
        return PrefillOutput(logits=res.outputs[0], kv_cache=res.kv_cache)

    async def batch_prefill(self, inputs: Sequence[PrefillInput]) -> list[PrefillOutput]:
        specs = [prefill_spec(inp, f"inputs[{i}]", self.vocab_size) for i, inp in enumerate(inputs)]
        return [PrefillOutput(r.outputs[0], r.kv_cache) for r in await self._step(specs, "inputs")]

    async def decode(self, inp: DecodeInput) -> DecodeOutput:
        (res,) = await self._step([decode_spec(inp, "input", self.vocab_size)])
        return DecodeOutput(logits=res.outputs[0], kv_cache=res.kv_cache)

    async def batch_decode(self, inputs: Sequence[DecodeInput]) -> list[DecodeOutput]:
        specs = [decode_spec(inp, f"inputs[{i}]", self.vocab_size) for i, inp in enumerate(inputs)]
        return [DecodeOutput(r.outputs[0], r.kv_cache) for r in await self._step(specs, "inputs")]

    async def unified_decode(self, items: Sequence[UnifiedBatchItem]) -> list[UnifiedItemResult]:
        specs = [unified_spec(it, f"batch.items[{i}]", self.vocab_size) for i, it in enumerate(items)]
        results = await self._step(specs, "batch.items")
        return [UnifiedItemResult(r.cache_id, r.outputs[0] if r.outputs else None, r.kv_cache) for r in results]

    async def forward_verify(
        self, kv_cache: KvCacheHandle, tokens: Sequence[int], policy: LogitsPolicy
    ) -> VerifyOutput:
        (res,) = await self._step([verify_spec(kv_cache, tokens, policy, self.vocab_size)])
        return VerifyOutput(outputs=res.outputs, kv_cache=res.kv_cache)

    async def forward(self, input_ids: Sequence[int], kind: ForwardKind, dtype: DType) -> HostTensor:
        tokens = check_forward(input_ids, kind, dtype, self.vocab_size, self.max_sequence_length)
        return await self._run(self._forward_now, tokens, kind, dtype)

    async def truncate_kv(self, cache_id: str, new_length: int) -> TruncateResult:
        with self.caches.using([cache_id]):
            return await self._run(truncate_now, self, cache_id, new_length, current_identity.get())

    async def release_cache(self, cache_id: str, expected_length: int | None = None) -> ReleaseResult:
        return await self._run(release_now, self, cache_id, current_identity.get(), expected_length)

    async def reap_idle(self, ttl_s: float) -> list[str]:
        """Release caches idle for longer than ttl_s (their lease ran out); returns their ids."""
        return await self._run(reap_now, self, ttl_s)

    async def warmup(self) -> None:
        await self._run(self._warmup_now)
        # The weights' digest (seconds for a large model) in the background, off the worker: the
        # first move then finds it ready, and becoming ready does not wait for it.
        if self._fingerprint_task is None:
            self._fingerprint_task = asyncio.ensure_future(self._digest_in_background())

    async def _digest_in_background(self) -> None:
        with contextlib.suppress(Unsupported):  # an executor that cannot name its weights
            await self.kv_fingerprint()

    # -- LoRA adapters (lora_calls.py) ----------------------------------------------------
    async def load_lora_adapter(self, name: str, source: LoraSource) -> LoraAdapterInfo:
        # Reading and validating stay off the worker, so steps keep running meanwhile.
        loras = require_loras(self.loras, self.name)
        adapter = await off_worker(loras.read, name, source)
        return await self._run(add_adapter_now, loras, adapter)

    async def unload_lora_adapter(self, name: str) -> LoraAdapterInfo:
        return await self._run(remove_adapter_now, require_loras(self.loras, self.name), self.caches, name)

    def list_lora_adapters(self) -> list[LoraAdapterInfo]:
        return require_loras(self.loras, self.name).infos(self.caches.adapter_bindings())

    def lora_metrics(self) -> LoraMetrics | None:
        return lora_metrics(self.loras, self.caches)

    # -- lifecycle and reports ------------------------------------------------------------
    async def shutdown(self) -> int:
        return await self._run(self._shut_down_now)

    def _shut_down_now(self) -> int:
        # On the worker, so every call queued behind this one finds the executor shut down
        # when it starts (_unless_shut_down) instead of running after the release of all.
        self.stats.state = ExecutorState.SHUTDOWN
        return release_all_now(self)

    def close(self) -> None:
        """Stop what runs in the background once serving stopped (the server calls it from a
        thread while its loop runs): warm-up's weights digest, whose pending task kept the
        executor, its weights and its pool alive for good in a process that went on after
        the server stopped (tests, an application embedding one). The worker stays, for the
        clean-up of calls cut off by the stop and for whoever still holds the executor."""
        task = self._fingerprint_task
        if task is not None and not task.done():
            with contextlib.suppress(RuntimeError):  # its loop closed: that cancelled it already
                task.get_loop().call_soon_threadsafe(task.cancel)

    def status(self) -> ExecutorStatus:
        return kv_status.executor_status(self)

    def cache_metrics(self) -> CacheMetrics | None:
        return kv_status.cache_metrics(self)

    # -- execution (worker thread) --------------------------------------------------------
    async def _run(self, fn, *args, on_abandon=None, overlaps=False):
        if self.stats.state is ExecutorState.SHUTDOWN:
            raise Unavailable(f"{self.name} executor is shut down")
        return await self.worker.run(self._unless_shut_down, fn, *args, on_abandon=on_abandon, overlaps=overlaps)

    def _unless_shut_down(self, fn, *args):
        if self.stats.state is ExecutorState.SHUTDOWN:  # shut down while this call was queued
            raise Unavailable(f"{self.name} executor is shut down")
        return fn(*args)

    async def _step(self, specs: list[ItemSpec], where: str = "input") -> list[StepResult]:
        check_batch(specs, where, self.max_batch_size)
        with self.caches.using({s.cache_id for s in specs if s.cache_id is not None}):
            # overlaps: the step may run while the one before is in flight (it settles it itself)
            done = await self._run(run_step, self, specs, current_identity.get(), on_abandon=self._undo_abandoned,
                                   overlaps=True)
            return await settled_results(done, self.worker, self._undo_created)

    @property
    def overlaps_steps(self) -> bool:
        """Whether a decode step may be left in flight while the next one runs (step_overlap.py)."""
        return False

    def _feeds_on_device(self, items: list[StepItem]) -> bool:
        """Whether the forward of these items takes a fed token from the step in flight on the device."""
        return False

    def _handle(self, cache_id: str) -> KvCacheHandle:
        t, p = self.kv.get(cache_id), self.pool
        return KvCacheHandle(
            cache_id=cache_id,
            sequence_length=t.num_tokens,
            # Blocks the sliding windows left (FREED) are not the cache's any more: the held ones.
            block_ids=t.ids_tuple()[t.freed_blocks:],
            block_size=t.block_size,
            num_layers=p.num_layers,
            num_kv_heads=p.num_kv_heads,
            head_dim=p.head_dim,
            device=str(p.device),
        )

    def _forward_now(self, tokens: list[int], kind: ForwardKind, dtype: DType) -> HostTensor:
        out = self._forward_sequence(tokens, hidden=kind is ForwardKind.HIDDEN_STATES)
        if kind is ForwardKind.TOKEN_LOGPROBS:
            logprobs = torch.log_softmax(out[:-1].float(), dim=-1)
            picked = logprobs.gather(1, torch.tensor(tokens[1:], device=out.device).unsqueeze(1)).squeeze(1)
            return to_host_tensor(picked, DType.FLOAT32)
        return to_host_tensor(out, dtype)

    def _warmup_now(self) -> None:
        """One small prefill, decode and verify on a scratch cache, then back to an idle pool."""
        self.stats.state = ExecutorState.INITIALIZING
        cache_id, _ = self.kv.create(None)
        try:
            tokens = [t % self.vocab_size for t in range(1, min(9, self.max_sequence_length))]
            self.kv.extend(cache_id, len(tokens))
            self._forward_step([StepItem(cache_id, self.kv.get(cache_id), tokens, 0, Rows.LAST)])
            self._forward_sequence(tokens, hidden=False)
        finally:
            self.kv.release(cache_id)
            self.stats.state = ExecutorState.READY
