"""Attention over a flat batch of sequences, reading and writing the paged KV pool.

A step is a flat run of M tokens from several sequences ([M, hidden] through every
matmul); only attention is segmented per sequence. K and V of the new tokens are written
into the pool by slot mapping, and the pool stays the only copy of every cached position.

Two implementations compute the same thing:

- `attend_reference`: the plain computation. Each segment gathers its whole context slot by
  slot from the pool (index_select of every cached position) and runs SDPA on the copy.
- `attend` (the fast path): a per-step `AttentionPlan`, built once and used by every layer,
  sorts the segments by how they read the pool:
    * fresh prompts (nothing cached): causal SDPA on the K and V just computed, one call for
      each run of consecutive prompts of equal length (batch_prefill of equal prompts is
      one call);
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

A third implementation, for CUDA, is the Triton kernels of triton_attention.py
(StepContext.backend == "triton"): they read K and V through the block tables directly,
with no plan of views and gathers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvcache.kv_pool import PagedKvPool

if TYPE_CHECKING:
    from executors.lora import LoraBatch
    from executors.models.triton_attention import KernelPlan

# A decode row reads its context through pool views when its blocks form at most
# MAX_VIEW_RUNS contiguous runs and the runs average at least VIEW_MIN_TOKENS tokens
# (one SDPA call per row costs ~40 us on this CPU, about what copying ~250 tokens' K and V
# costs at fp32); otherwise it joins the batched gather. A lone decode row reads through
# views whenever its runs allow. MAX_VIEW_RUNS = 0 sends every decode row to the gather.
VIEW_MIN_TOKENS = 256
MAX_VIEW_RUNS = 8
# Batched gathers are split so that one group's gathered K and V stay cache-sized.
GATHER_GROUP_BYTES = 8 << 20

_flash_with_lse = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass(slots=True)
class Segment:
    """One sequence's share of the flat batch."""

    q_start: int  # first row of the flat batch
    q_len: int  # rows (new tokens)
    start: int  # position of the first new token (tokens cached before it)
    context_slots: torch.Tensor | None = None  # pool slots of positions 0..start+q_len-1 (reference path)
    block_ids: list[int] | None = None  # the sequence's block table (fast path); None without a cache


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


# -- the reference -----------------------------------------------------------------------
def attend_reference(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """q [M, H, D], k and v [M, KVH, D] -> [M, H * D]; gathers every segment's context by slot."""
    if ctx.pool is not None:
        ctx.pool.write(layer, ctx.slot_mapping, k, v)
    out = torch.empty_like(q)
    for seg in ctx.segments:
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        if seg.start == 0 or ctx.pool is None:
            ks, vs = k[rows], v[rows]
        else:
            ks, vs = ctx.pool.read(layer, _context_slots(seg, ctx.pool))
            ks, vs = ks.to(q.dtype), vs.to(q.dtype)
        out[rows] = _sdpa(q[rows], ks, vs, seg.start)
    return out.flatten(1)


def _context_slots(seg: Segment, pool: PagedKvPool) -> torch.Tensor:
    if seg.context_slots is None:
        bs, ids = pool.block_size, seg.block_ids
        seg.context_slots = torch.tensor([ids[p // bs] * bs + p % bs for p in range(seg.start + seg.q_len)],
                                         device=pool.device)
    return seg.context_slots


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of n queries at positions start.. over L = start + n keys."""
    n, length = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    if n == 1:
        mask, causal = None, False  # a single query sees every cached key
    elif n == length:
        mask, causal = None, True
    else:
        mask = torch.arange(length, device=q.device)[None, :] <= (start + torch.arange(n, device=q.device))[:, None]
        causal = False
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


# -- the plan ----------------------------------------------------------------------------
@dataclass(slots=True)
class _Fresh:
    """`count` consecutive fresh segments of n tokens each, from row r0: causal over themselves."""

    r0: int
    count: int
    n: int


@dataclass(slots=True)
class _Views:
    """One decode row reading contiguous block runs of the pool: (first block, blocks, tokens)."""

    row: int
    runs: list[tuple[int, int, int]]


@dataclass(slots=True)
class _Gathered:
    """Decode rows reading their blocks through one gather: [G * nb] block ids, padded, masked."""

    rows: torch.Tensor | slice
    blocks: torch.Tensor
    count: int
    nb: int
    mask: torch.Tensor | None  # [G, 1, 1, nb * block_size], True where a key is visible


@dataclass(slots=True)
class _Chunk:
    """n new tokens at positions start.. on a cached context, read by view or block gather."""

    r0: int
    n: int
    start: int
    run: tuple[int, int] | None  # (first block, blocks) when the context is one contiguous run
    blocks: torch.Tensor | None
    mask: torch.Tensor  # [n, start + n]


@dataclass(slots=True)
class AttentionPlan:
    fresh: list[_Fresh] = field(default_factory=list)
    views: list[_Views] = field(default_factory=list)
    gathered: list[_Gathered] = field(default_factory=list)
    chunks: list[_Chunk] = field(default_factory=list)
    whole: bool = False  # one group covers every row in order: its output is the output


def runs_of(block_ids: list[int], nblocks: int) -> list[tuple[int, int]]:
    """The first `nblocks` ids as maximal runs of consecutive ids: [(first id, length)]."""
    runs: list[tuple[int, int]] = []
    first, length = block_ids[0], 1
    for b in block_ids[1:nblocks]:
        if b == first + length:
            length += 1
        else:
            runs.append((first, length))
            first, length = b, 1
    runs.append((first, length))
    return runs


def plan_attention(ctx: StepContext, num_rows: int) -> AttentionPlan:
    """Decide once per step how each segment reads the pool (see the module docstring)."""
    plan = AttentionPlan()
    pool = ctx.pool
    decode: list[tuple[Segment, int]] = []
    for seg in ctx.segments:
        if seg.start == 0 or pool is None:
            last = plan.fresh[-1] if plan.fresh else None
            if last is not None and last.n == seg.q_len and last.r0 + last.count * last.n == seg.q_start:
                last.count += 1
            else:
                plan.fresh.append(_Fresh(seg.q_start, 1, seg.q_len))
            continue
        bs = pool.block_size
        length = seg.start + seg.q_len
        nb = -(-length // bs)
        if seg.q_len > 1:
            runs = runs_of(seg.block_ids, nb)
            dev = pool.device
            mask = torch.arange(length, device=dev)[None, :] <= (seg.start + torch.arange(seg.q_len, device=dev))[:, None]
            if len(runs) == 1:
                plan.chunks.append(_Chunk(seg.q_start, seg.q_len, seg.start, runs[0], None, mask))
            else:
                blocks = torch.tensor(seg.block_ids[:nb], device=dev)
                plan.chunks.append(_Chunk(seg.q_start, seg.q_len, seg.start, None, blocks, mask))
            continue
        decode.append((seg, nb))
    if decode:
        _plan_decode(plan, decode, pool, lone=len(decode) == 1)
    groups = len(plan.fresh) + len(plan.views) + len(plan.gathered) + len(plan.chunks)
    if groups == 1:
        if plan.fresh:
            plan.whole = plan.fresh[0].r0 == 0 and plan.fresh[0].count * plan.fresh[0].n == num_rows
        elif plan.gathered:
            g = plan.gathered[0]
            plan.whole = isinstance(g.rows, slice) and g.rows.start == 0 and g.count == num_rows
    return plan


def _plan_decode(plan: AttentionPlan, decode: list[tuple[Segment, int]], pool: PagedKvPool, lone: bool) -> None:
    bs = pool.block_size
    rest: list[tuple[Segment, int]] = []
    for seg, nb in decode:
        length = seg.start + 1
        runs = runs_of(seg.block_ids, nb)
        r = len(runs)
        merge = _flash_with_lse is not None and pool.device.type == "cpu"  # the LSE-returning op is CPU's
        max_runs = MAX_VIEW_RUNS if merge else min(MAX_VIEW_RUNS, 1)
        by_view = r <= max_runs and (lone or length >= VIEW_MIN_TOKENS * r)
        if not by_view:
            rest.append((seg, nb))  # short or fragmented: cheaper in the batched gather
            continue
        left, view_runs = length, []
        for first, n in runs:
            used = min(left, n * bs)
            view_runs.append((first, n, used))
            left -= used
        plan.views.append(_Views(seg.q_start, view_runs))
    if not rest:
        return
    # Group by block count (sorted) so that padding stays small and each group's gather
    # stays cache-sized; rows keep their order within a group.
    per_block = 2 * bs * pool.num_kv_heads * pool.head_dim * pool.dtype.itemsize
    rest.sort(key=lambda sn: sn[1])
    groups: list[list[tuple[Segment, int]]] = [[]]
    for seg, nb in rest:
        g = groups[-1]
        if g and ((len(g) + 1) * nb * per_block > GATHER_GROUP_BYTES or nb > 2 * g[0][1] + 1):
            groups.append([])
        groups[-1].append((seg, nb))
    dev = pool.device
    for g in groups:
        nb = max(n for _, n in g)
        rows = [seg.q_start for seg, _ in g]
        ids: list[int] = []
        lengths: list[int] = []
        for seg, n in g:
            ids.extend(seg.block_ids[:n])
            ids.extend([seg.block_ids[n - 1]] * (nb - n))  # padding: the row's own last block, masked
            lengths.append(seg.start + 1)
        mask = None
        if any(n != nb * bs for n in lengths):
            mask = (torch.arange(nb * bs, device=dev)[None, :] < torch.tensor(lengths, device=dev)[:, None])
            mask = mask.view(len(g), 1, 1, nb * bs)
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        sel = slice(rows[0], rows[0] + len(rows)) if contiguous else torch.tensor(rows, device=dev)
        plan.gathered.append(_Gathered(sel, torch.tensor(ids, device=dev), len(g), nb, mask))


# -- the fast path -----------------------------------------------------------------------
def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """q [M, H, D], k and v [M, KVH, D] -> [M, H * D] (the plan is built on the first layer)."""
    if ctx.reference:
        return attend_reference(layer, q, k, v, ctx)
    pool = ctx.pool
    if ctx.backend == "triton" and pool is not None:
        from executors.models import triton_attention  # triton is needed only on this path

        return triton_attention.attend(layer, q, k, v, ctx)
    if pool is not None:
        pool.write(layer, ctx.slot_mapping, k, v)
        if ctx.zero_slots is not None:
            kf, vf = pool.flat(layer)
            kf.index_fill_(0, ctx.zero_slots, 0)
            vf.index_fill_(0, ctx.zero_slots, 0)
    m, heads, d = q.shape
    kvh = k.shape[1]
    plan = ctx.plan
    if plan is None:
        plan = ctx.plan = plan_attention(ctx, m)
    if plan.whole and plan.fresh:
        f = plan.fresh[0]
        return _fresh(q, k, v, 0, f.count, f.n).reshape(m, heads * d)
    if plan.whole and plan.gathered:
        return _gathered(q, pool, layer, plan.gathered[0]).to(q.dtype).reshape(m, heads * d)
    out = q.new_empty(m, heads, d)
    for f in plan.fresh:
        out[f.r0:f.r0 + f.count * f.n] = _fresh(q, k, v, f.r0, f.count, f.n).view(f.count * f.n, heads, d)
    if plan.views:
        kl, vl = pool.key[layer], pool.value[layer]
        bs = pool.block_size
        for vw in plan.views:
            qr = q[vw.row].view(1, kvh, heads // kvh, d).to(kl.dtype)
            out[vw.row] = _over_views(qr, kl, vl, vw.runs, bs, kvh, d).view(heads, d)
    for g in plan.gathered:
        res = _gathered(q, pool, layer, g)
        if isinstance(g.rows, slice):
            out[g.rows] = res
        else:
            out.index_copy_(0, g.rows, res.to(out.dtype))
    for c in plan.chunks:
        out[c.r0:c.r0 + c.n] = _chunk(q, pool, layer, c)
    return out.view(m, heads * d)


def _fresh(q, k, v, r0: int, count: int, n: int) -> torch.Tensor:
    """Causal attention within `count` consecutive prompts of n tokens: [count, n, H, D]."""
    end = r0 + count * n
    qh = q[r0:end].view(count, n, q.shape[1], q.shape[2]).transpose(1, 2)
    kh = k[r0:end].view(count, n, k.shape[1], k.shape[2]).transpose(1, 2)
    vh = v[r0:end].view(count, n, v.shape[1], v.shape[2]).transpose(1, 2)
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=n > 1, enable_gqa=True)
    return out.transpose(1, 2)


def _over_views(qr, kl, vl, runs, bs: int, kvh: int, d: int) -> torch.Tensor:
    """One query row ([1, KVH, group, D]) over contiguous runs of pool blocks, no copy."""
    if len(runs) == 1:
        first, n, used = runs[0]
        kr = kl[first:first + n].view(n * bs, kvh, d)[:used].transpose(0, 1).unsqueeze(0)
        vr = vl[first:first + n].view(n * bs, kvh, d)[:used].transpose(0, 1).unsqueeze(0)
        return F.scaled_dot_product_attention(qr, kr, vr)
    outs, lses = [], []
    for first, n, used in runs:
        kr = kl[first:first + n].view(n * bs, kvh, d)[:used].transpose(0, 1).unsqueeze(0)
        vr = vl[first:first + n].view(n * bs, kvh, d)[:used].transpose(0, 1).unsqueeze(0)
        o, lse = _flash_with_lse(qr, kr, vr, 0.0, False)[:2]
        outs.append(o)
        lses.append(lse)
    lse = torch.stack(lses)  # [R, 1, KVH, group], float32
    weights = torch.softmax(lse, dim=0).unsqueeze(-1)  # exp(lse_r - logsumexp_r lse_r)
    return (torch.stack(outs).float() * weights).sum(0).to(qr.dtype)


def _gathered(q, pool: PagedKvPool, layer: int, g: _Gathered) -> torch.Tensor:
    """Decode rows over one block gather: [G, H, D]."""
    bs, kvh, d = pool.block_size, pool.num_kv_heads, pool.head_dim
    heads = q.shape[1]
    kl, vl = pool.key[layer], pool.value[layer]
    nblocks = kl.shape[0]
    kg = kl.view(nblocks, -1).index_select(0, g.blocks).view(g.count, g.nb * bs, kvh, d).transpose(1, 2)
    vg = vl.view(nblocks, -1).index_select(0, g.blocks).view(g.count, g.nb * bs, kvh, d).transpose(1, 2)
    qg = (q[g.rows] if isinstance(g.rows, slice) else q.index_select(0, g.rows)).to(kg.dtype)
    out = F.scaled_dot_product_attention(qg.view(g.count, kvh, heads // kvh, d), kg, vg, attn_mask=g.mask)
    return out.reshape(g.count, heads, d)


def _chunk(q, pool: PagedKvPool, layer: int, c: _Chunk) -> torch.Tensor:
    """n new tokens over their cached context plus themselves (offset-causal): [n, H, D]."""
    bs, kvh, d = pool.block_size, pool.num_kv_heads, pool.head_dim
    length = c.start + c.n
    kl, vl = pool.key[layer], pool.value[layer]
    if c.run is not None:
        first, n = c.run
        ks = kl[first:first + n].view(n * bs, kvh, d)[:length]
        vs = vl[first:first + n].view(n * bs, kvh, d)[:length]
    else:
        nblocks = kl.shape[0]
        ks = kl.view(nblocks, -1).index_select(0, c.blocks).view(-1, kvh, d)[:length]
        vs = vl.view(nblocks, -1).index_select(0, c.blocks).view(-1, kvh, d)[:length]
    qh = q[c.r0:c.r0 + c.n].transpose(0, 1).unsqueeze(0).to(ks.dtype)
    out = F.scaled_dot_product_attention(qh, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                                         attn_mask=c.mask, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)
