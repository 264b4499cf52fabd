"""Paged attention in Triton: K and V read through the block tables, never gathered.

Two kernels, both reading the layer's pool tensors ([num_blocks, block_size, KVH, D])
key by key through each sequence's block table, with an online (flash) softmax in float32:

- `paged_prefill`: a flat run of new tokens from several sequences (prompts, chunked
  prefill, verification runs), each over its cached context plus itself, offset-causal.
  One program per (query tile, query head); the tiles of every segment are listed on the
  host once per step, so prompts of any lengths share one launch.
- `paged_decode`: one new token per sequence. One program per (sequence, KV head, context
  partition) computes all the query heads that share the KV head at once (grouped-query
  attention without repeating K and V). Long contexts at small batch split over
  partitions (flash-decoding), merged exactly by log-sum-exp afterwards; the partition
  count is a launch argument, so a CUDA graph can fix it once.

The new tokens' K and V are written into the pool (by slot mapping) before a kernel runs,
so the kernels read every key from the pool. Keys past a sequence's length are masked out
of the loads themselves: stale K and V in a block's tail are never read. A sliding layer's
window bounds the key loop from below (a query at p reads keys p-W+1..p), so the blocks
before it, which may have been returned to the pool, are never read either.

Triton compiles these for CUDA tensors. A process started with TRITON_INTERPRET=1 runs
them in Triton's interpreter instead (NumPy, slow, CPU tensors welcome): that is how the
tests check them against the pure-torch attention on a machine without a GPU (the
variable must be set before triton is first imported; tests/conftest.py does). Importing
this module needs the `triton` package.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from executors.models.attention import StepContext, _sdpa

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b accumulated in float32; IEEE: exact float32 products (no TF32) for float32 models."""
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _online_softmax(s, v, m_i, l_i, acc, IEEE: tl.constexpr):
    """Fold one tile of keys into the running row max m_i, sum l_i and output acc; s holds the
    scores in log2 units, -inf where a key is masked, v the tile's values."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr,
    tile_seg_ptr, tile_qoff_ptr, seg_qstart_ptr, seg_qlen_ptr, seg_start_ptr,
    stride_qm, stride_qh, stride_om, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_t,
    scale_log2, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seg = tl.load(tile_seg_ptr + tile)
    q_off = tl.load(tile_qoff_ptr + tile)
    q_start = tl.load(seg_qstart_ptr + seg)
    q_len = tl.load(seg_qlen_ptr + seg)
    start = tl.load(seg_start_ptr + seg)  # tokens cached before the segment's first new one

    offs_m = q_off + tl.arange(0, BLOCK_M)  # query index within the segment
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qm + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # The tile's last query sees keys 0 .. start + q_off + BLOCK_M - 1 (causal), within the sequence.
    kv_end = start + tl.minimum(q_off + BLOCK_M, q_len)
    # ... and its first query keys from start + q_off - window + 1 on (the sliding window).
    kv_lo = tl.maximum(start + q_off - window + 1, 0)
    table = tables_ptr + seg.to(tl.int64) * stride_t
    for n0 in range(kv_lo, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        block = tl.load(table + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        within = offs_n % BLOCK_SIZE
        k = tl.load(k_ptr + block[None, :] * stride_kb + within[None, :] * stride_ks + kv_head * stride_kh
                    + offs_d[:, None], mask=n_mask[None, :] & d_mask[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        visible = n_mask[None, :] & (offs_n[None, :] <= (start + offs_m)[:, None]) \
            & (offs_n[None, :] > (start + offs_m)[:, None] - window)
        s = tl.where(visible, _dot(q, k, IEEE) * scale_log2, float("-inf"))
        v = tl.load(v_ptr + block[:, None] * stride_vb + within[:, None] * stride_vs + kv_head * stride_vh
                    + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc, IEEE)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_om + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_out_ptr, part_lse_ptr, tables_ptr, rows_ptr, lengths_ptr,
    stride_qm, stride_qh, stride_om, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_t,
    stride_pb, stride_ph, stride_pp, stride_lb, stride_lh,
    scale_log2, partition_tokens, window,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    row = tl.load(rows_ptr + b).to(tl.int64)
    length = tl.load(lengths_ptr + b)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + row * stride_qm + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    lo = part * partition_tokens
    hi = tl.minimum(length, lo + partition_tokens)
    lo = tl.maximum(lo, length - window)  # the sliding window (a partition before it sees no key)
    table = tables_ptr + b.to(tl.int64) * stride_t
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        block = tl.load(table + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        within = offs_n % BLOCK_SIZE
        k = tl.load(k_ptr + block[None, :] * stride_kb + within[None, :] * stride_ks + kv_head * stride_kh
                    + offs_d[:, None], mask=n_mask[None, :] & d_mask[:, None], other=0.0)
        s = tl.where(n_mask[None, :], _dot(q, k, IEEE) * scale_log2, float("-inf"))
        v = tl.load(v_ptr + block[:, None] * stride_vb + within[:, None] * stride_vs + kv_head * stride_vh
                    + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc, IEEE)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        # This partition's normalised output and its log2-sum-exp2 (-inf when it saw no key).
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_out_ptr + b * stride_pb + heads[:, None] * stride_ph + part * stride_pp + offs_d[None, :],
                 out, mask=mask)
        tl.store(part_lse_ptr + b * stride_lb + heads * stride_lh + part, lse, mask=g_mask)
    else:
        tl.store(out_ptr + row * stride_om + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask)


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1 when triton was imported)."""
    return bool(triton.knobs.runtime.interpret)


def _check_pool(key: torch.Tensor, value: torch.Tensor, q: torch.Tensor) -> None:
    # The kernels address the head dimension with unit stride.
    if key.stride(-1) != 1 or value.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("paged attention needs unit stride along the head dimension")


# -- prefill --------------------------------------------------------------------------------
@dataclass(slots=True)
class PrefillLaunch:
    """One step's prefill segments laid out for `paged_prefill` (built once, used by every layer)."""

    tables: torch.Tensor  # [S, max blocks] int32: the segments' block tables, padded
    tile_seg: torch.Tensor  # [T] int32: segment of each query tile
    tile_qoff: torch.Tensor  # [T] int32: first query of the tile within its segment
    seg_qstart: torch.Tensor  # [S] int32: first row of the segment in the flat batch
    seg_qlen: torch.Tensor  # [S] int32: new tokens
    seg_start: torch.Tensor  # [S] int32: tokens cached before them
    block_m: int


def prefill_launch(segments: list[tuple[int, int, int, list[int]]], block_size: int,
                   device: torch.device, block_m: int | None = None) -> PrefillLaunch:
    """`segments`: (first row, new tokens, cached tokens, block ids) for each sequence."""
    if block_m is None:
        block_m = 64 if device.type == "cuda" else 16
    width = max(-(-(start + n) // block_size) for _, n, start, _ in segments)
    tables, tile_seg, tile_qoff = [], [], []
    for s, (_, n, start, ids) in enumerate(segments):
        need = -(-(start + n) // block_size)
        tables.append(list(ids[:need]) + [0] * (width - need))
        for off in range(0, n, block_m):
            tile_seg.append(s)
            tile_qoff.append(off)

    def i32(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    tables = [[max(b, 0) for b in t] for t in tables]  # FREED blocks: never loaded (window), any id will do
    return PrefillLaunch(i32(tables), i32(tile_seg), i32(tile_qoff), i32([s[0] for s in segments]),
                         i32([s[1] for s in segments]), i32([s[2] for s in segments]), block_m)


def _window_arg(window: int | None) -> int:
    return NO_WINDOW if window is None else window


# A window no sequence reaches (int32): the kernels' one code path for global layers too.
NO_WINDOW = 1 << 30


def _scale_log2(d: int, scale: float | None) -> float:
    return LOG2E * (scale if scale is not None else 1 / math.sqrt(d))


def paged_prefill(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                  launch: PrefillLaunch, block_n: int | None = None, window: int | None = None,
                  scale: float | None = None) -> None:
    """Attention of the segments' rows of q ([M, H, D]) over their paged contexts, into out's rows;
    `window`: a sliding layer's, `scale`: of q.k (None: 1/sqrt(D))."""
    _check_pool(key, value, q)
    heads, d = q.shape[1], q.shape[2]
    kv_heads, block_size = key.shape[2], key.shape[1]
    block_n = block_n or (64 if q.is_cuda else 16)
    grid = (launch.tile_seg.shape[0], heads)
    _prefill_kernel[grid](
        q, key, value, out, launch.tables,
        launch.tile_seg, launch.tile_qoff, launch.seg_qstart, launch.seg_qlen, launch.seg_start,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
        launch.tables.stride(0),
        _scale_log2(d, scale), _window_arg(window),
        GROUP=heads // kv_heads, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_SIZE=block_size,
        BLOCK_M=launch.block_m, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
    )


# -- decode ---------------------------------------------------------------------------------
@dataclass(slots=True)
class DecodeLaunch:
    """One step's decode rows laid out for `paged_decode`."""

    rows: torch.Tensor  # [B] int32: the rows of the flat batch
    tables: torch.Tensor  # [B, max blocks] int32
    lengths: torch.Tensor  # [B] int32: keys each row sees (its cached tokens plus itself)
    partitions: int  # context partitions per row (1: no split)
    partition_tokens: int


def decode_partitions(batch: int, kv_heads: int, max_length: int, device: torch.device,
                      min_partition_tokens: int = 512) -> int:
    """How many context partitions keep the GPU busy: split only while (rows x KV heads)
    programs are too few to fill it, and never into partitions shorter than min_partition_tokens."""
    if device.type != "cuda":
        return max(1, -(-max_length // min_partition_tokens))
    programs = batch * kv_heads
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= target:
        return 1
    return max(1, min(-(-target // programs), -(-max_length // min_partition_tokens)))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def partition_length(max_length: int, partitions: int) -> int:
    """Keys per partition when contexts up to max_length split into `partitions` (a multiple of 16)."""
    return _round_up(-(-max_length // partitions), 16)


def decode_launch(rows: list[int], tables: list[list[int]], lengths: list[int], block_size: int,
                  kv_heads: int, device: torch.device, partitions: int | None = None) -> DecodeLaunch:
    """`partitions`: None picks them with decode_partitions."""
    width = max(-(-n // block_size) for n in lengths)
    padded = [[max(b, 0) for b in t[:-(-n // block_size)]] + [0] * (width - -(-n // block_size))
              for t, n in zip(tables, lengths)]  # FREED blocks: never loaded (window), any id will do
    if partitions is None:
        partitions = decode_partitions(len(rows), kv_heads, max(lengths), device)

    def i32(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    return DecodeLaunch(i32(rows), i32(padded), i32(lengths), partitions, partition_length(max(lengths), partitions))


def paged_decode(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                 launch: DecodeLaunch, block_n: int | None = None, window: int | None = None,
                 scale: float | None = None) -> None:
    """One query token per row of launch.rows (q and out [M, H, D]) over its paged context."""
    _check_pool(key, value, q)
    heads, d = q.shape[1], q.shape[2]
    kv_heads, block_size = key.shape[2], key.shape[1]
    group = heads // kv_heads
    batch, parts = launch.rows.shape[0], launch.partitions
    block_n = block_n or (64 if q.is_cuda else 16)
    split = parts > 1
    if split:
        part_out = torch.empty(batch, heads, parts, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, heads, parts, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    _decode_kernel[(batch, kv_heads, parts)](
        q, key, value, out, part_out, part_lse, launch.tables, launch.rows, launch.lengths,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
        launch.tables.stride(0),
        part_out.stride(0) if split else 0, part_out.stride(1) if split else 0,
        part_out.stride(2) if split else 0, part_lse.stride(0) if split else 0, part_lse.stride(1) if split else 0,
        _scale_log2(d, scale), launch.partition_tokens, _window_arg(window),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_SIZE=block_size, BLOCK_N=block_n,
        SPLIT=split, IEEE=q.dtype == torch.float32,
    )
    if split:
        # Exact merge: each partition's weight is 2^(lse_p - log2-sum-exp2 over partitions).
        weights = torch.softmax(part_lse * math.log(2.0), dim=-1).unsqueeze(-1)
        merged = (part_out * weights).sum(2).to(out.dtype)
        out.index_copy_(0, launch.rows.long(), merged)


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
            tables.append(seg.block_ids)
            lengths.append(seg.start + 1)
        else:
            prefill.append((seg.q_start, seg.q_len, seg.start, seg.block_ids))
    bs, dev = pool.block_size, pool.device
    return KernelPlan(
        prefill_launch(prefill, bs, dev) if prefill else None,
        decode_launch(rows, tables, lengths, bs, pool.num_kv_heads, dev) if rows else None,
    )


def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """q [M, H, D], k and v [M, KVH, D] -> [M, H * D]: write k and v by slot mapping, then
    attend over the pool. No stale-slot clearing: the kernels never load past a length."""
    pool = ctx.pool
    pool.write(layer, ctx.slot_mapping, k, v)
    plan = ctx.kernel_plan
    if plan is None:
        plan = ctx.kernel_plan = plan_step(ctx)
    m, heads, d = q.shape
    out = q.new_empty(m, heads, d)
    key, value = pool.key[layer], pool.value[layer]
    spec = ctx.layer(layer)
    if plan.prefill is not None:
        paged_prefill(q, key, value, out, plan.prefill, window=spec.window, scale=spec.scale)
    if plan.decode is not None:
        paged_decode(q, key, value, out, plan.decode, window=spec.window, scale=spec.scale)
    return out.view(m, heads * d)


# -- a start-up check -------------------------------------------------------------------------
def self_check(device: torch.device | str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
               block_size: int) -> str | None:
    """Run both kernels at the model's head shapes on a small random pool and compare them with
    SDPA over the gathered contexts. None when they agree; otherwise what differed.

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
    try:
        out = torch.zeros_like(q)
        paged_decode(q, key, value, out, decode_launch(list(range(len(lengths))), tables, lengths, block_size,
                                                      kv_heads, device, partitions=2))
        rows = len(lengths)
        paged_prefill(q, key, value, out, prefill_launch([(rows, chunk, lengths[1] - chunk, tables[1])],
                                                         block_size, device))
    except Exception as e:  # noqa: BLE001 - any failure to build or launch is the answer
        return f"the kernels failed to run: {type(e).__name__}: {e}"
    want = torch.empty(q.shape, dtype=torch.float32, device=device)
    for r, (table, n) in enumerate(zip(tables, lengths)):
        want[r:r + 1] = _sdpa_over(q[r:r + 1], key, value, table, n, n - 1)
    want[rows:] = _sdpa_over(q[rows:], key, value, tables[1], lengths[1], lengths[1] - chunk)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    err = (out.float() - want).abs().max().item()
    if not err <= tol:  # also catches NaN
        return f"the kernels differ from SDPA by {err:.3g} (tolerance {tol:g}) at heads {heads}/{kv_heads}, " \
               f"head_dim {head_dim}, block_size {block_size}, {dtype}"
    return None


def _sdpa_over(q, key, value, table, length, start) -> torch.Tensor:
    """float32 SDPA of q (queries at positions start..) over keys 0..length-1 gathered through table."""
    bs, kvh, d = key.shape[1], key.shape[2], key.shape[3]
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(length)], device=q.device)
    return _sdpa(q.float(), key.reshape(-1, kvh, d)[slots].float(), value.reshape(-1, kvh, d)[slots].float(), start)


# -- ahead-of-time compilation --------------------------------------------------------------
def compile_for(capability: int, dtype: str = "bf16", head_dim: int = 128, group: int = 2,
                block_size: int = 16) -> dict[str, int]:
    """Compile both kernels (decode with and without partitions, prefill) for a CUDA compute
    capability (90: H100) without a GPU, as Triton would at the first launch on one; returns
    each variant's shared memory in bytes. A kernel that cannot be built for that GPU raises.

    The interpreter checks what the kernels compute; this checks that they build for real
    hardware (tl.dot shapes, types, shared memory). Needs triton imported without
    TRITON_INTERPRET (the tests run it in a subprocess)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if interpreted():
        raise RuntimeError("compile_for needs triton imported without TRITON_INTERPRET=1")
    target = GPUTarget("cuda", capability, 32)
    block_d = max(16, triton.next_power_of_2(head_dim))

    def signature(kernel, pointers: dict[str, str], constants: dict) -> dict[str, str]:
        return {name: "constexpr" if name in constants else pointers.get(name, "fp32" if name == "scale_log2" else "i32")
                for name in kernel.arg_names}

    io = {name: f"*{dtype}" for name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    shared = {}
    for split in (False, True):
        constants = dict(GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
                         BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_N=64, SPLIT=split, IEEE=dtype == "fp32")
        pointers = {**io, "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "tables_ptr": "*i32", "rows_ptr": "*i32",
                    "lengths_ptr": "*i64"}
        compiled = triton.compile(ASTSource(_decode_kernel, signature(_decode_kernel, pointers, constants), constants),
                                  target=target)
        shared[f"decode{'_split' if split else ''}"] = compiled.metadata.shared
    constants = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_M=64, BLOCK_N=64,
                     IEEE=dtype == "fp32")
    pointers = {**io, **{name: "*i32" for name in ("tables_ptr", "tile_seg_ptr", "tile_qoff_ptr", "seg_qstart_ptr",
                                                   "seg_qlen_ptr", "seg_start_ptr")}}
    compiled = triton.compile(ASTSource(_prefill_kernel, signature(_prefill_kernel, pointers, constants), constants),
                              target=target)
    shared["prefill"] = compiled.metadata.shared
    return shared
