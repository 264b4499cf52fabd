"""How many KV blocks fit: the pool sized from device memory after a warm-up forward.

A fixed block count either wastes most of a large GPU or does not fit a small one. Instead,
once the weights are loaded, one pool-less forward of a large step is run and its peak
memory measured; the pool then gets what is left of `memory_fraction` of the device's
total memory (vLLM's gpu_memory_utilization):

    blocks = (total * fraction - in use after weights and warm-up - warm-up activations
              - LoRA reserve) // bytes per block

The arithmetic (`kv_blocks_for_memory`) is a pure function; the device is reached only
through a `MemoryProbe`, so everything here runs on CPU in tests with a fake probe.
`CudaMemoryProbe` is the real one.

On CPU the pool keeps a fixed default (CPU_NUM_BLOCKS): host memory is shared with every
other process on the machine, and the CPU has no caching allocator to ask for a peak, so
"what is free" would be a guess that changes under our feet.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from kvcache.kv_pool import kv_halves

if TYPE_CHECKING:
    from executors.lora import LoraTargets
    from executors.models.decoder import DecoderLM

log = logging.getLogger(__name__)

CPU_NUM_BLOCKS = 1024  # the pool size when num_blocks is left to "auto" on CPU (see the module doc)
# The warm-up step: max_batch_size prompts of WARMUP_PROMPT_TOKENS tokens (a batch prefill at the
# batch limit) or one max-length prompt, whichever is larger, capped at WARMUP_MAX_TOKENS.
# Bigger steps are possible (a batch of long prompts, up to max_tokens_per_request), but sizing
# for that worst case would hand most of the memory to activations almost no step needs; such
# a step runs in the (1 - fraction) headroom, or fails with out-of-memory rather than corrupt
# anything. 8192 is also vLLM's default token budget per step with chunked prefill.
WARMUP_PROMPT_TOKENS = 128
WARMUP_MAX_TOKENS = 8192
# An auto pool has at most this many blocks. The allocator's bookkeeping is Python, ~50 bytes
# of host memory and some start-up time per block; real models reach a few hundred thousand
# blocks on the largest GPUs, and only tiny test models on a big GPU would ask for more.
MAX_AUTO_BLOCKS = 1 << 20
# Flat slot indices (block * block_size + offset) stay within int32, which GPU attention
# kernels commonly index with (this binds only with blocks of over 2048 tokens).
MAX_POOL_TOKENS = 2**31 - 1

GIB = 1 << 30


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       block_size: int, values_are_keys: bool = False) -> int:
    """K and V of one block over all layers, as PagedKvPool lays them out (K alone where
    the values are the keys: DeepSeek's latent rows)."""
    element = torch.empty((), dtype=dtype).element_size()
    return kv_halves(values_are_keys) * num_layers * num_kv_heads * head_dim * element * block_size


def lora_reserve_bytes(targets: LoraTargets, max_loras: int, max_rank: int, dtype: torch.dtype) -> int:
    """Device memory of max_loras adapters of rank max_rank on every projection: the most the
    LoRA registry can hold. Adapters load after the pool is built (and at run time), so their
    memory is set aside before sizing rather than found missing later."""
    element = torch.empty((), dtype=dtype).element_size()
    per_rank = targets.num_layers * sum(i + o for i, o in targets.shapes.values())  # A [r, in] + B [out, r]
    return max_loras * max_rank * per_rank * element


def kv_blocks_for_memory(*, total_bytes: int, used_bytes: int, activation_bytes: int, memory_fraction: float,
                         bytes_per_block: int, min_blocks: int = 1, max_blocks: int | None = None,
                         reserved_bytes: int = 0) -> int:
    """The number of KV blocks that fit in `memory_fraction` of the device's `total_bytes`, given
    `used_bytes` already in use (weights, CUDA context, other processes), the warm-up forward's
    peak extra `activation_bytes` and `reserved_bytes` set aside for later (LoRA adapters).

    At most `max_blocks` when given. Raises ValueError, naming every figure, when fewer than
    `min_blocks` (the blocks of one max-length sequence) would fit: a server that cannot hold
    one whole sequence is better refused at start-up than at its first long prompt.
    """
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    if bytes_per_block < 1 or min_blocks < 1:
        raise ValueError(f"bytes_per_block and min_blocks must be >= 1, got {bytes_per_block}, {min_blocks}")
    budget = int(total_bytes * memory_fraction) - used_bytes - activation_bytes - reserved_bytes
    blocks = max(budget, 0) // bytes_per_block
    if blocks < min_blocks:
        reserve = f" - LoRA reserve {_gib(reserved_bytes)}" if reserved_bytes else ""
        raise ValueError(
            f"not enough device memory for the KV pool: fraction {memory_fraction:g} of total {_gib(total_bytes)} "
            f"- weights and other use {_gib(used_bytes)} - activations {_gib(activation_bytes)}{reserve} "
            f"leaves {_gib(max(budget, 0))}, room for {blocks} blocks of {bytes_per_block} bytes per block; "
            f"one max-length sequence needs {min_blocks} blocks ({_gib(min_blocks * bytes_per_block)}). "
            f"Raise --kv-memory-fraction, lower --max-batch-size or the maximum sequence length, "
            f"or set --num-blocks explicitly")
    return blocks if max_blocks is None else min(blocks, max_blocks)


def _gib(n: int) -> str:
    """A size for people: GiB, or a smaller unit where GiB would round to nothing."""
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} bytes"


class MemoryProbe(Protocol):
    """What sizing needs to know about a device's memory, in bytes."""

    def total_bytes(self) -> int: ...

    def used_bytes(self) -> int:
        """In use on the device now, by anything: this process's tensors, its allocator's cache,
        the CUDA context and libraries' workspaces, other processes."""
        ...

    def allocated_bytes(self) -> int:
        """Held by this process's live tensors now."""
        ...

    def reset_peak(self) -> None: ...

    def peak_allocated_bytes(self) -> int:
        """The most allocated_bytes since reset_peak."""
        ...

    def release_cached(self) -> None:
        """Wait for queued work and give the allocator's cached, unused memory back to the device."""
        ...


class CudaMemoryProbe:
    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)

    def total_bytes(self) -> int:
        return torch.cuda.mem_get_info(self.device)[1]

    def used_bytes(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def allocated_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_allocated_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def release_cached(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


@dataclass(frozen=True, slots=True)
class MemoryFigures:
    total: int
    used: int  # in use on the device after the weights and the warm-up (its cache released)
    activations: int  # the warm-up's peak allocation above what was allocated before it


def measure(probe: MemoryProbe, warmup: Callable[[], None]) -> MemoryFigures:
    """Run `warmup` and return the device's figures around it."""
    probe.release_cached()  # loading's staging buffers are not ours to keep
    probe.reset_peak()
    before = probe.allocated_bytes()
    warmup()
    peak = probe.peak_allocated_bytes()
    probe.release_cached()
    # "In use" is read after the warm-up: its first kernels set up what lasts (cuBLAS
    # workspaces, lazily loaded modules), memory the allocator's peak does not see.
    return MemoryFigures(total=probe.total_bytes(), used=probe.used_bytes(), activations=max(peak - before, 0))


def warmup_forward(model: DecoderLM, *, max_batch_size: int, max_sequence_length: int, device: str,
                   reference: bool = False) -> int:
    """One pool-less forward of the warm-up step (see WARMUP_MAX_TOKENS) and the lm_head on
    max_batch_size rows (a full decode batch's logits); returns the tokens it ran."""
    from executors.models.attention import Segment, StepContext

    wanted = min(max(max_batch_size * WARMUP_PROMPT_TOKENS, max_sequence_length), WARMUP_MAX_TOKENS)
    length = min(max_sequence_length, wanted)  # positions stay inside the rotary tables
    count = max(wanted // length, 1)
    n = count * length
    ids = torch.zeros(n, dtype=torch.long, device=device)
    positions = torch.arange(length, device=device).repeat(count)
    ctx = StepContext([Segment(i * length, length, 0) for i in range(count)], reference=reference)
    hidden = model.hidden_states(ids, positions, ctx)
    rows = hidden[:min(max_batch_size, n)]
    if reference:
        model.logits(rows, reference=True)
    else:
        model.logits(rows)
    return n


def auto_num_blocks(model: DecoderLM, *, device: str, kv_dtype: torch.dtype, block_size: int,
                    max_batch_size: int, max_sequence_length: int, memory_fraction: float,
                    reserved_bytes: int = 0, probe: MemoryProbe | None = None, reference: bool = False) -> int:
    """The pool size for num_blocks "auto": CPU_NUM_BLOCKS on CPU without a probe, otherwise
    measured through `probe` (the CUDA probe on a CUDA device) after a warm-up forward."""
    if probe is None:
        if not device.startswith("cuda"):
            log.info("KV pool: %d blocks of %d tokens (the CPU default; --num-blocks sets it)",
                     CPU_NUM_BLOCKS, block_size)
            return CPU_NUM_BLOCKS
        probe = CudaMemoryProbe(device)
    mc = model.config
    per_block = kv_bytes_per_block(mc.num_layers, mc.num_kv_heads, mc.head_dim, kv_dtype, block_size,
                                   mc.values_are_keys)
    tokens = 0

    log.info("sizing the KV pool from %s's memory: one warm-up forward without a pool first", device)

    def warmup() -> None:
        nonlocal tokens
        tokens = warmup_forward(model, max_batch_size=max_batch_size, max_sequence_length=max_sequence_length,
                                device=device, reference=reference)

    m = measure(probe, warmup)
    cap = min(MAX_AUTO_BLOCKS, MAX_POOL_TOKENS // block_size)
    blocks = kv_blocks_for_memory(
        total_bytes=m.total, used_bytes=m.used, activation_bytes=m.activations, memory_fraction=memory_fraction,
        bytes_per_block=per_block, min_blocks=math.ceil(max_sequence_length / block_size), max_blocks=cap,
        reserved_bytes=reserved_bytes)
    log.info("KV pool: %d blocks of %d tokens (%d tokens, %s)%s, sized from device memory: fraction %g of %s "
             "- in use %s - activations %s (a %d-token warm-up forward) - LoRA reserve %s",
             blocks, block_size, blocks * block_size, _gib(blocks * per_block),
             f" (capped at {cap} blocks)" if blocks == cap else "", memory_fraction, _gib(m.total),
             _gib(m.used), _gib(m.activations), tokens, _gib(reserved_bytes))
    return blocks
