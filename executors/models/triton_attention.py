"""Paged attention in Triton: K and V read through the block tables, never gathered.

The entry point of the Triton attention backend: attention.py calls `attend`, the executor
runs `self_check` at start-up, decode_graphs.py builds its `KernelPlan`s, and the README and
tests call `compile_for`. One idea per file:

- triton_attention_kernels.py: the two @triton.jit kernels (prefill: new tokens over their
  cached context, offset-causal; decode: one token per sequence, all query heads of a KV head
  at once, optionally split over context partitions), and what they read and mask.
- triton_attention_launch.py: a step's layout on the device (`PrefillLaunch`, `DecodeLaunch`,
  the partition count) and the wrappers that launch the kernels (`paged_prefill`,
  `paged_decode`).
- triton_attention_aot.py: `compile_for`, the kernels built for a GPU that is not here.
- here: a step's `KernelPlan` (`plan_step`), `attend` (write K and V, then run the plan) and
  the start-up `self_check` against SDPA.

The public names of those modules are re-exported here, so other code imports from this
module alone. `attend` and `self_check` call the wrappers through this module's names, as
before the split (a test replaces `paged_decode` here to see a wrong kernel refused).

Triton compiles these for CUDA tensors. A process started with TRITON_INTERPRET=1 runs
them in Triton's interpreter instead (NumPy, slow, CPU tensors welcome): that is how the
tests check them against the pure-torch attention on a machine without a GPU (the
variable must be set before triton is first imported; tests/conftest.py does). Importing
this module needs the `triton` package.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executors.models.attention import LayerAttention, StepContext
from executors.models.attention_reference import sdpa
from executors.models.block_tables import segment_table
from executors.models.triton_attention_aot import compile_for
from executors.models.triton_attention_launch import (
    LOG2E,
    NO_WINDOW,
    DecodeLaunch,
    PrefillLaunch,
    decode_launch,
    decode_partitions,
    interpreted,
    paged_decode,
    paged_prefill,
    partition_length,
    prefill_launch,
)

__all__ = [
    "LOG2E", "NO_WINDOW", "DecodeLaunch", "KernelPlan", "PrefillLaunch", "attend", "compile_for", "decode_launch",
    "decode_partitions", "interpreted", "paged_decode", "paged_prefill", "partition_length", "plan_step",
    "prefill_launch", "self_check",
]


# -- a step ---------------------------------------------------------------------------------
@dataclass(slots=True)
class KernelPlan:
    """How one step's segments run: prefill-like ones through paged_prefill, decode rows
    through paged_decode. Built on the first layer (or once by a CUDA graph), used by all."""

    prefill: PrefillLaunch | None
    decode: DecodeLaunch | None


def plan_step(ctx: StepContext) -> KernelPlan:
    pool = ctx.pool
    prefill: list[tuple[int, int, int, list[int]]] = []
    rows: list[int] = []
    tables: list[list[int]] = []
    lengths: list[int] = []
    for seg in ctx.segments:
        if seg.q_len == 1 and seg.start > 0:
            rows.append(seg.q_start)
            tables.append(segment_table(seg))
            lengths.append(seg.start + 1)
        else:
            prefill.append((seg.q_start, seg.q_len, seg.start, seg.block_ids))
    bs, dev = pool.block_size, pool.device
    return KernelPlan(
        prefill_launch(prefill, bs, dev) if prefill else None,
        decode_launch(rows, tables, lengths, bs, pool.num_kv_heads, dev) if rows else None,
    )


def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """q [M, H, D], k and v [M, KVH, D] -> [M, H * D]: write k and v by slot mapping (None: the
    fused prologue of triton_prologue.py stored them), then attend over the pool. No stale-slot
    clearing: the kernels never load past a length."""
    pool = ctx.pool
    if k is not None:
        pool.write(layer, ctx.slot_mapping, k, v)
    plan = ctx.kernel_plan
    if plan is None:
        plan = ctx.kernel_plan = plan_step(ctx)
    m, heads, d = q.shape
    out = q.new_empty(m, heads, d)
    key, value = pool.key[layer], pool.value[layer]
    spec = ctx.layer(layer)
    if plan.prefill is not None:
        paged_prefill(q, key, value, out, plan.prefill, window=spec.window, scale=spec.scale, sinks=spec.sinks)
    if plan.decode is not None:
        paged_decode(q, key, value, out, plan.decode, window=spec.window, scale=spec.scale, sinks=spec.sinks)
    return out.view(m, heads * d)


# -- a start-up check -------------------------------------------------------------------------
def self_check(device: torch.device | str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
               block_size: int, sinks: bool = False) -> str | None:
    """Run both kernels at the model's head shapes on a small random pool and compare them with
    SDPA over the gathered contexts (`sinks`: with random attention sinks, against the explicit
    computation). None when they agree; otherwise what differed.

    The kernels compile per GPU and per Triton version: a start-up check turns a kernel that
    fails to build, or computes wrongly, on this machine into a refusal (or, for the auto
    backend, a fall-back to SDPA) instead of wrong logits."""
    device = torch.device(device)
    g = torch.Generator().manual_seed(0)
    num_blocks, lengths, chunk = 24, [1 + block_size // 2, 3 * block_size + 1, 5], 3

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    key, value = rand(num_blocks, block_size, kv_heads, head_dim), rand(num_blocks, block_size, kv_heads, head_dim)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for n in lengths:
        need = -(-n // block_size)
        tables.append(perm[:need])
        perm = perm[need:]
    q = rand(len(lengths) + chunk, heads, head_dim)
    spec = LayerAttention(sinks=rand(heads) * 2) if sinks else None
    logits = None if spec is None else spec.sinks
    try:
        out = torch.zeros_like(q)
        for partitions, r in ((2, slice(0, 2)), (1, slice(2, 3))):  # a split decode, and one in one partition
            paged_decode(q, key, value, out, decode_launch(list(range(len(lengths)))[r], tables[r], lengths[r],
                                                          block_size, kv_heads, device, partitions=partitions),
                         sinks=logits)
        rows = len(lengths)
        paged_prefill(q, key, value, out, prefill_launch([(rows, chunk, lengths[1] - chunk, tables[1])],
                                                         block_size, device), sinks=logits)
    except Exception as e:  # noqa: BLE001 - any failure to build or launch is the answer
        return f"the kernels failed to run: {type(e).__name__}: {e}"
    want = torch.empty(q.shape, dtype=torch.float32, device=device)
    for r, (table, n) in enumerate(zip(tables, lengths)):
        want[r:r + 1] = _sdpa_over(q[r:r + 1], key, value, table, n, n - 1, spec)
    want[rows:] = _sdpa_over(q[rows:], key, value, tables[1], lengths[1], lengths[1] - chunk, spec)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    err = (out.float() - want).abs().max().item()
    if not err <= tol:  # also catches NaN
        return f"the kernels differ from SDPA by {err:.3g} (tolerance {tol:g}) at heads {heads}/{kv_heads}, " \
               f"head_dim {head_dim}, block_size {block_size}, {dtype}"
    return None


def _sdpa_over(q, key, value, table, length, start, spec: LayerAttention | None = None) -> torch.Tensor:
    """float32 attention of q (queries at positions start..) over keys 0..length-1 gathered through
    table (with spec's sinks: the explicit computation)."""
    bs, kvh, d = key.shape[1], key.shape[2], key.shape[3]
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(length)], device=q.device)
    if spec is not None:
        spec = LayerAttention(sinks=spec.sinks.float())
    return sdpa(q.float(), key.reshape(-1, kvh, d)[slots].float(), value.reshape(-1, kvh, d)[slots].float(), start,
                spec)
