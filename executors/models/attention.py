"""Attention over a flat batch of sequences, reading and writing the paged KV pool.

A step is a flat run of M tokens from several sequences ([M, hidden] through every
matmul); only attention is segmented per sequence. K and V of the new tokens are written
into the pool by slot mapping, and the pool stays the only copy of every cached position.

Two implementations compute the same thing:

- `attend_reference` (attention_reference.py): the plain computation. Each segment gathers
  its whole context slot by slot from the pool (index_select of every cached position) and
  runs SDPA on the copy.
- `attend` (the fast path): a per-step `AttentionPlan` (attention_plan.py), built once and
  used by every layer, sorts the segments by how they read the pool:
    * fresh prompts (nothing cached): causal attention on the K and V just computed, one
      call for each run of consecutive prompts of equal length (batch_prefill of equal
      prompts is one call): the CPU kernel of cpu_kernels/prefill_attention.c for float32
      with the kernels built (half SDPA's time), else SDPA;
    * decode rows whose blocks form few contiguous runs: SDPA directly on *views* of the
      pool's [num_blocks, block_size, H, D] tensors, no copy; with several runs, one SDPA
      per run and an exact log-sum-exp merge;
    * other decode rows (short or fragmented contexts): one block-level gather of all of
      them ([G, blocks, block_size, H, D], padded to the longest and masked) and one
      batched SDPA call, instead of one gather and one call per sequence;
    * chunked-prefill rows (several new tokens on a cached context): a view or block
      gather of the context and an offset-causal mask.
  Grouped-query attention with one query token folds the query heads of a KV head into
  the query-length axis ([B, kv_heads, group, D] against [B, kv_heads, L, D]), which the
  CPU flash kernel runs without repeating K and V.

Why: on CPU (2 cores) the per-step slot gather cost as much as attention itself at 1k
tokens, and per-sequence calls cost ~40 us each regardless of length; see bench/RESULTS.md.

The SDPA calls themselves are attention_sdpa.py's. A third implementation, for CUDA, is the Triton kernels of triton_attention.py
(StepContext.backend == "triton"): they read K and V through the block tables directly,
with no plan of views and gathers.

Per-layer options (`LayerAttention`, set by the decoder on the context): a sliding window
(a query at position p sees keys p-W+1..p), the score scale, Gemma 2's soft-cap of the
scores and GPT-OSS's attention sinks (a logit per head each softmax also normalises over),
which SDPA and flash do not apply: such layers take the reference computation, but for a
float32 CPU step's decode rows and whole fresh prompts, which the CPU kernels compute
(`_scored`), and for the Triton kernels, which take sinks (not caps). Every path
honours the window: the plan of a sliding layer reads only the blocks that hold keys inside
it (one plan per distinct window, built on the first layer that needs it) and masks the
keys of its first block that fell out; the reference gathers only the positions inside it.
Blocks wholly out of every layer's window may have been returned to the pool (the block
table holds FREED there), so nothing reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from executors.models import attention_sdpa
from executors.models.attention_plan import (
    AttentionPlan,
    FreshRun,
    PagedRows,
    plan_attention,
)
from executors.models.attention_reference import attend_reference
from kvcache.kv_pool import PagedKvPool

if TYPE_CHECKING:
    from executors.cpu_kernels import CpuKernels
    from executors.lora_batch import LoraBatch
    from executors.models.few_row_matmuls import FewRowMatmuls
    from executors.models.triton_attention import KernelPlan
    from executors.models.triton_glu import FusedGlu
    from executors.models.triton_prologue import QkvPrologue


@dataclass(slots=True)
class Segment:
    """One sequence's share of the flat batch."""

    q_start: int  # first row of the flat batch
    q_len: int  # rows (new tokens)
    start: int  # position of the first new token (tokens cached before it)
    context_slots: torch.Tensor | None = None  # pool slots of positions 0..start+q_len-1 (reference path)
    block_ids: Sequence[int] | None = None  # the sequence's block table (fast path); None without a cache
    # The same as an int32 array (BlockTable.ids_array) where the step plan has one: the kernels'
    # tables are copied from it (block_tables.py), not converted from the list.
    table: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """One layer's attention options."""

    window: int | None = None  # keys p-window+1..p for a query at p; None: every earlier key
    scale: float | None = None  # of q.k; None: 1/sqrt(head_dim)
    softcap: float | None = None  # Gemma 2: scores -> softcap * tanh(scores / softcap)
    # GPT-OSS: [H] float32, one logit per query head that its softmax also normalises over
    # (a key with no value); the layer's parameter, set once the weights are loaded.
    sinks: torch.Tensor | None = field(default=None, compare=False)

    @property
    def scored(self) -> bool:
        """Whether the scores need what SDPA does not compute (a cap, sinks)."""
        return self.softcap is not None or self.sinks is not None


PLAIN = LayerAttention()


@dataclass(slots=True)
class StepContext:
    """What attention needs besides q, k and v; passed explicitly down the model."""

    segments: list[Segment]
    pool: PagedKvPool | None = None  # None: attend within the batch, store nothing
    slot_mapping: torch.Tensor | None = None  # [M] pool slot of every new token
    reference: bool = False  # run the plain reference computation instead of the fast path
    plan: AttentionPlan | None = None  # built once per step by the fast path
    zero_slots: torch.Tensor | None = None  # stale slots to clear (tails of newly entered blocks)
    lora: LoraBatch | None = None  # which rows use which LoRA adapter (applied by the decoder)
    # "sdpa": the planned torch attention below; "triton": the paged kernels of
    # triton_attention.py (CUDA, or Triton's interpreter in tests), whose plan is kernel_plan.
    backend: str = "sdpa"
    kernel_plan: KernelPlan | None = None
    layers: tuple[LayerAttention, ...] = ()  # per layer (set by the decoder); empty: all PLAIN
    window_plans: dict[int, AttentionPlan] = field(default_factory=dict)  # sliding layers' plans
    # float32 on a CPU: decode rows attend through the paged kernel (executors/cpu_kernels).
    cpu: CpuKernels | None = None
    # The triton path's fused kernels, where the executor's start-up checks passed: a layer's
    # q/k norm, rotation and K/V store as one (triton_prologue.QkvPrologue), and the gated
    # MLP's activation-and-multiply as one (triton_glu.FusedGlu).
    prologue: QkvPrologue | None = None
    glu: FusedGlu | None = None
    # A decode graph's step: each few-row matmul shape through the faster of torch's and the
    # Triton one (few_row_matmuls.py), where the executor turned them on.
    matmuls: FewRowMatmuls | None = None

    def layer(self, i: int) -> LayerAttention:
        return self.layers[i] if self.layers else PLAIN


# -- the fast path -----------------------------------------------------------------------
def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """q [M, H, D], k and v [M, KVH, D] -> [M, H * D] (the plan is built on the first layer)."""
    spec = ctx.layer(layer)
    if ctx.reference:
        return attend_reference(layer, q, k, v, ctx)
    pool = ctx.pool
    if ctx.backend == "triton" and pool is not None and spec.softcap is None:  # (the kernels take sinks)
        from executors.models import triton_attention  # triton is needed only on this path

        return triton_attention.attend(layer, q, k, v, ctx)
    if spec.scored:
        return _scored(layer, q, k, v, ctx, spec)
    m, heads, d = q.shape
    kvh = k.shape[1]
    scale = spec.scale
    plan = _plan(ctx, spec, m, q.device)
    if pool is not None:
        if plan.kernel_store:
            ctx.cpu.store_kv(k, v, ctx.slot_mapping, pool.key[layer], pool.value[layer])
        else:
            pool.write(layer, ctx.slot_mapping, k, v)
        if ctx.zero_slots is not None:
            kf, vf = pool.flat(layer)
            kf.index_fill_(0, ctx.zero_slots, 0)
            vf.index_fill_(0, ctx.zero_slots, 0)
    if plan.whole and plan.fresh:
        f = plan.fresh[0]
        if _kernel_fresh(ctx, q, f):
            out = q.new_empty(m, heads, d)
            ctx.cpu.prefill_attention(q, k, v, f.count, _scale(scale, d), out)
            return out.view(m, heads * d)
        return attention_sdpa.fresh(q, k, v, 0, f, scale).reshape(m, heads * d)
    if plan.whole and plan.gathered:
        return attention_sdpa.gathered(q, pool, layer, plan.gathered[0], scale).to(q.dtype).reshape(m, heads * d)
    if plan.whole and plan.paged is not None:
        out = q.new_empty(m, heads * d)
        _paged(ctx.cpu, q, pool, layer, plan.paged, scale, out)
        return out
    out = q.new_empty(m, heads, d)
    if plan.paged is not None:
        _paged_rows(ctx.cpu, q, pool, layer, plan.paged, scale, out)
    for f in plan.fresh:
        rows = slice(f.r0, f.r0 + f.count * f.n)
        if _kernel_fresh(ctx, q, f):
            ctx.cpu.prefill_attention(q[rows], k[rows], v[rows], f.count, _scale(scale, d), out[rows])
        else:
            out[rows] = attention_sdpa.fresh(q, k, v, f.r0, f, scale).view(f.count * f.n, heads, d)
    if plan.views:
        kl, vl = pool.key[layer], pool.value[layer]
        bs = pool.block_size
        for vw in plan.views:
            qr = q[vw.row].view(1, kvh, heads // kvh, d).to(kl.dtype)
            out[vw.row] = attention_sdpa.over_views(qr, kl, vl, vw.runs, bs, kvh, d, scale).view(heads, d)
    for g in plan.gathered:
        res = attention_sdpa.gathered(q, pool, layer, g, scale)
        if isinstance(g.rows, slice):
            out[g.rows] = res
        else:
            out.index_copy_(0, g.rows, res.to(out.dtype))
    for c in plan.chunks:
        out[c.r0:c.r0 + c.n] = attention_sdpa.chunk(q, pool, layer, c, scale)
    return out.view(m, heads * d)


def _plan(ctx: StepContext, spec: LayerAttention, m: int, device) -> AttentionPlan:
    """The step's plan for the layer's window (built on the first layer that needs it)."""
    if spec.window is None:
        if ctx.plan is None:
            ctx.plan = plan_attention(ctx, m)
        return ctx.plan
    plan = ctx.window_plans.get(spec.window)
    if plan is None:
        plan = ctx.window_plans[spec.window] = plan_attention(ctx, m, spec.window, device)
    return plan


def _scored(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext,
            spec: LayerAttention) -> torch.Tensor:
    """Gemma 2's soft-capped scores and GPT-OSS's sinks, which SDPA and flash do not compute:
    on a float32 CPU step, the decode rows through the CPU decode kernel and the whole fresh
    prompts through the prefill kernel, which do; every other row (chunks, prompts a window
    masks), and every row elsewhere, through the reference."""
    plan = _plan(ctx, spec, q.shape[0], q.device) if ctx.cpu is not None and q.dtype == torch.float32 else None
    fresh = [f for f in plan.fresh if _kernel_fresh(ctx, q, f)] if plan is not None else []
    if plan is None or (plan.paged is None and not fresh):
        return attend_reference(layer, q, k, v, ctx)
    p = plan.paged
    skip = {f.r0 + i * f.n for f in fresh for i in range(f.count)}
    if p is not None:
        skip.update(range(p.rows.start, p.rows.stop) if isinstance(p.rows, slice) else p.rows.tolist())
    out = attend_reference(layer, q, k, v, ctx, frozenset(skip))  # stores every row's K and V
    m, heads, d = q.shape
    rows = out.view(m, heads, d)
    if p is not None:
        _paged_rows(ctx.cpu, q, ctx.pool, layer, p, spec.scale, rows, spec)
    for f in fresh:
        span = slice(f.r0, f.r0 + f.count * f.n)
        ctx.cpu.prefill_attention(q[span], k[span], v[span], f.count, _scale(spec.scale, d), rows[span], spec.softcap,
                                  spec.sinks)
    return out


def _paged(cpu: CpuKernels, q: torch.Tensor, pool: PagedKvPool, layer: int, p: PagedRows, scale: float | None,
           out: torch.Tensor, spec: LayerAttention = PLAIN) -> None:
    """Decode rows through the CPU kernel, reading the pool in place: out [count, H * D]."""
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    cpu.decode_attention(q, pool.key[layer], pool.value[layer], p.tables, p.lo, p.hi,
                         _scale(scale, q.shape[2]), out, spec.softcap, spec.sinks)


def _paged_rows(cpu: CpuKernels, q: torch.Tensor, pool: PagedKvPool, layer: int, p: PagedRows, scale: float | None,
                out: torch.Tensor, spec: LayerAttention = PLAIN) -> None:
    """The decode rows of a mixed step through the CPU kernel, into their rows of out [M, H, D]."""
    heads, d = q.shape[1:]
    res = q.new_empty(p.count, heads * d)
    _paged(cpu, q[p.rows] if isinstance(p.rows, slice) else q.index_select(0, p.rows), pool, layer, p, scale, res,
           spec)
    if isinstance(p.rows, slice):
        out[p.rows] = res.view(p.count, heads, d)
    else:
        out.index_copy_(0, p.rows, res.view(p.count, heads, d))


def _kernel_fresh(ctx: StepContext, q: torch.Tensor, f: FreshRun) -> bool:
    """Whether the CPU kernel runs these fresh prompts' attention: float32, causal over the
    whole prompt (no window's mask), and more than one token (a single token is its own
    value). 2x SDPA's speed (cpu_kernels/prefill_attention.c)."""
    return ctx.cpu is not None and f.mask is None and f.n > 1 and q.dtype == torch.float32


def _scale(scale: float | None, d: int) -> float:
    """The score scale a kernel is given: the layer's, else SDPA's default."""
    return d ** -0.5 if scale is None else scale
