"""The per-step attention plan: how each segment of a step reads the paged KV pool.

Built once per step (and once per sliding window) on the first layer that needs it, used by
every layer (attention.py, whose docstring says what each path computes):

- fresh prompts (nothing cached): runs of consecutive prompts of equal length, causal over
  themselves (`FreshRun`);
- decode rows, float32 on a CPU with the kernels built: the paged kernel through the rows'
  block tables (`PagedRows`);
- other decode rows whose blocks form few contiguous runs: SDPA on views of the pool
  (`ViewRow`); short or fragmented ones: one block-level gather per group of similar
  lengths, padded and masked (`GatheredRows`);
- chunked-prefill rows (several new tokens on a cached context): a view or block gather of
  the context and an offset-causal mask (`ChunkRows`).

A sliding layer's plan reads only the blocks that hold keys inside its window.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from executors.models.block_tables import padded_block_tables, segment_table
from kvcache.kv_pool import PagedKvPool

if TYPE_CHECKING:
    from executors.models.attention import Segment, StepContext

# A decode row reads its context through pool views when its blocks form at most
# MAX_VIEW_RUNS contiguous runs and the runs average at least VIEW_MIN_TOKENS tokens
# (one SDPA call per row costs ~40 us on this CPU, about what copying ~250 tokens' K and V
# costs at fp32); otherwise it joins the batched gather. A lone decode row reads through
# views whenever its runs allow. MAX_VIEW_RUNS = 0 sends every decode row to the gather.
VIEW_MIN_TOKENS = 256
MAX_VIEW_RUNS = 8
# Batched gathers are split so that one group's gathered K and V stay cache-sized.
GATHER_GROUP_BYTES = 8 << 20
# float32 on a CPU with executors/cpu_kernels built: decode rows read the pool through the
# paged kernel instead of views and gathers (False: the torch paths above, for tests).
PAGED_KERNEL = True

# CPU flash attention that also returns each row's log-sum-exp: a decode row read as several
# view runs merges their outputs exactly with it (attention_sdpa.over_views).
flash_with_lse = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def visibility(n: int, start: int, keys: int, key_start: int, window: int | None, device) -> torch.Tensor:
    """[n, keys] bool: query i (position start+i) sees key j (position key_start+j)."""
    kpos = key_start + torch.arange(keys, device=device)[None, :]
    qpos = start + torch.arange(n, device=device)[:, None]
    visible = kpos <= qpos
    if window is not None:
        visible &= kpos > qpos - window
    return visible


@dataclass(slots=True)
class FreshRun:
    """`count` consecutive fresh segments of n tokens each, from row r0: causal over themselves
    (mask: [n, n] when a window is shorter than n, else None)."""

    r0: int
    count: int
    n: int
    mask: torch.Tensor | None = None


@dataclass(slots=True)
class ViewRow:
    """One decode row reading contiguous block runs of the pool: (first block, blocks, keys
    to skip at the run's start (out of the window), keys used)."""

    row: int
    runs: list[tuple[int, int, int, int]]


@dataclass(slots=True)
class GatheredRows:
    """Decode rows reading their blocks through one gather: [G * nb] block ids, padded, masked."""

    rows: torch.Tensor | slice
    blocks: torch.Tensor
    count: int
    nb: int
    mask: torch.Tensor | None  # [G, 1, 1, nb * block_size], True where a key is visible


@dataclass(slots=True)
class ChunkRows:
    """n new tokens at positions start.. on a cached context, read by view or block gather;
    the keys read are positions key_start..start+n-1 (key_start: a block boundary)."""

    r0: int
    n: int
    start: int
    run: tuple[int, int] | None  # (first block, blocks) when the context is one contiguous run
    blocks: torch.Tensor | None
    mask: torch.Tensor  # [n, start + n - key_start]
    key_start: int = 0


@dataclass(slots=True)
class PagedRows:
    """Decode rows for the CPU kernel: row r reads keys lo[r]..hi[r]-1 through tables[r]."""

    rows: slice | torch.Tensor
    count: int
    tables: torch.Tensor  # [count, widest table] int32
    lo: torch.Tensor  # [count] int32
    hi: torch.Tensor


@dataclass(slots=True)
class AttentionPlan:
    fresh: list[FreshRun] = field(default_factory=list)
    paged: PagedRows | None = None
    kernel_store: bool = False  # the CPU kernel stores the new K and V (every slot checked in range)
    views: list[ViewRow] = field(default_factory=list)
    gathered: list[GatheredRows] = field(default_factory=list)
    chunks: list[ChunkRows] = field(default_factory=list)
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


def first_block(first_key: int, window: int | None, bs: int) -> int:
    """The first block holding a key visible to a query at position `first_key`."""
    return 0 if window is None else max(0, first_key - window + 1) // bs


def plan_attention(ctx: StepContext, num_rows: int, window: int | None = None,
                   device: torch.device | None = None) -> AttentionPlan:
    """Decide once per step (and window) how each segment reads the pool (module docstring)."""
    plan = AttentionPlan()
    pool = ctx.pool
    decode: list[tuple[Segment, int]] = []
    for seg in ctx.segments:
        if seg.start == 0 or pool is None:
            last = plan.fresh[-1] if plan.fresh else None
            if last is not None and last.n == seg.q_len and last.r0 + last.count * last.n == seg.q_start:
                last.count += 1
            else:
                mask = None
                if window is not None and seg.q_len > window:
                    dev = device or (pool.device if pool is not None else "cpu")
                    mask = visibility(seg.q_len, 0, seg.q_len, 0, window, dev)
                plan.fresh.append(FreshRun(seg.q_start, 1, seg.q_len, mask))
            continue
        bs = pool.block_size
        length = seg.start + seg.q_len
        nb = -(-length // bs)
        if seg.q_len > 1:
            lb = first_block(seg.start, window, bs)
            dev = pool.device
            mask = visibility(seg.q_len, seg.start, length - lb * bs, lb * bs, window, dev)
            runs = runs_of(seg.block_ids[lb:], nb - lb)
            if len(runs) == 1:
                plan.chunks.append(ChunkRows(seg.q_start, seg.q_len, seg.start, runs[0], None, mask, lb * bs))
            else:
                blocks = torch.tensor(seg.block_ids[lb:nb], device=dev)
                plan.chunks.append(ChunkRows(seg.q_start, seg.q_len, seg.start, None, blocks, mask, lb * bs))
            continue
        decode.append((seg, nb))
    kernels = (PAGED_KERNEL and ctx.cpu is not None and pool is not None and pool.dtype == torch.float32
               and pool.device.type == "cpu")
    if kernels and ctx.slot_mapping is not None and ctx.slot_mapping.dtype == torch.int64 and num_rows:
        slots = pool.key[0].shape[0] * pool.block_size  # scratch blocks included
        plan.kernel_store = 0 <= int(ctx.slot_mapping.min()) and int(ctx.slot_mapping.max()) < slots
    if decode and kernels:
        plan.paged = _plan_paged(decode, window)
    elif decode:
        _plan_decode(plan, decode, pool, lone=len(decode) == 1, window=window)
    groups = len(plan.fresh) + len(plan.views) + len(plan.gathered) + len(plan.chunks) + (plan.paged is not None)
    if groups == 1:
        if plan.paged is not None:
            rows = plan.paged.rows
            plan.whole = isinstance(rows, slice) and rows.start == 0 and plan.paged.count == num_rows
        elif plan.fresh:
            plan.whole = plan.fresh[0].r0 == 0 and plan.fresh[0].count * plan.fresh[0].n == num_rows
        elif plan.gathered:
            g = plan.gathered[0]
            plan.whole = isinstance(g.rows, slice) and g.rows.start == 0 and g.count == num_rows
    return plan


def _plan_paged(decode: list[tuple[Segment, int]], window: int | None) -> PagedRows:
    tables = torch.from_numpy(padded_block_tables([segment_table(seg) for seg, _ in decode], [nb for _, nb in decode]))
    hi = [seg.start + 1 for seg, _ in decode]
    lo = [0 if window is None else max(0, h - window) for h in hi]
    rows = [seg.q_start for seg, _ in decode]
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    sel = slice(rows[0], rows[0] + len(rows)) if contiguous else torch.tensor(rows)
    return PagedRows(sel, len(rows), tables, torch.tensor(lo, dtype=torch.int32), torch.tensor(hi, dtype=torch.int32))


def _plan_decode(plan: AttentionPlan, decode: list[tuple[Segment, int]], pool: PagedKvPool, lone: bool,
                 window: int | None = None) -> None:
    bs = pool.block_size
    rest: list[tuple[Segment, int, int]] = []  # (segment, blocks to its end, first block read)
    for seg, nb in decode:
        length = seg.start + 1
        lb = first_block(seg.start, window, bs)
        skip = 0 if window is None else max(0, length - window) - lb * bs  # out-of-window keys of block lb
        runs = runs_of(seg.block_ids[lb:], nb - lb)
        r = len(runs)
        merge = flash_with_lse is not None and pool.device.type == "cpu"  # the LSE-returning op is CPU's
        max_runs = MAX_VIEW_RUNS if merge else min(MAX_VIEW_RUNS, 1)
        by_view = r <= max_runs and (lone or length - lb * bs - skip >= VIEW_MIN_TOKENS * r)
        if not by_view:
            rest.append((seg, nb, lb))  # short or fragmented: cheaper in the batched gather
            continue
        left, view_runs = length - lb * bs, []
        for first, n in runs:
            used = min(left, n * bs)
            view_runs.append((first, n, skip, used))
            left -= used
            skip = 0
        plan.views.append(ViewRow(seg.q_start, view_runs))
    if not rest:
        return
    # Group by blocks read (sorted) so that padding stays small and each group's gather
    # stays cache-sized; rows keep their order within a group.
    per_block = 2 * bs * pool.num_kv_heads * pool.head_dim * pool.dtype.itemsize
    rest.sort(key=lambda s: s[1] - s[2])
    groups: list[list[tuple[Segment, int, int]]] = [[]]
    for seg, nb, lb in rest:
        g = groups[-1]
        n = nb - lb
        if g and ((len(g) + 1) * n * per_block > GATHER_GROUP_BYTES or n > 2 * (g[0][1] - g[0][2]) + 1):
            groups.append([])
        groups[-1].append((seg, nb, lb))
    dev = pool.device
    for g in groups:
        width = max(nb - lb for _, nb, lb in g)
        rows = [seg.q_start for seg, _, _ in g]
        ids: list[int] = []
        bounds: list[tuple[int, int]] = []  # visible keys [lo, hi) of each row, in its gathered blocks
        for seg, nb, lb in g:
            ids.extend(seg.block_ids[lb:nb])
            ids.extend([seg.block_ids[nb - 1]] * (width - (nb - lb)))  # padding: the row's own last block, masked
            length = seg.start + 1
            lo = 0 if window is None else max(0, length - window)
            bounds.append((lo - lb * bs, length - lb * bs))
        mask = None
        if any(lo != 0 or hi != width * bs for lo, hi in bounds):
            keys = torch.arange(width * bs, device=dev)[None, :]
            lo, hi = torch.tensor(bounds, device=dev).unbind(1)
            mask = ((keys >= lo[:, None]) & (keys < hi[:, None])).view(len(g), 1, 1, width * bs)
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        sel = slice(rows[0], rows[0] + len(rows)) if contiguous else torch.tensor(rows, device=dev)
        plan.gathered.append(GatheredRows(sel, torch.tensor(ids, device=dev), len(g), width, mask))
