"""The paged-attention Triton kernels themselves (@triton.jit), and nothing that launches them.

Two kernels, both reading the layer's pool tensors ([num_blocks, block_size, KVH, D])
key by key through each sequence's block table, with an online (flash) softmax in float32:

- `_prefill_kernel` (launched by `paged_prefill`): a flat run of new tokens from several
  sequences (prompts, chunked prefill, verification runs), each over its cached context plus
  itself, offset-causal. One program per (query tile, query head); the tiles of every segment
  are listed on the host once per step, so prompts of any lengths share one launch.
- `_decode_kernel` (launched by `paged_decode`): one new token per sequence. One program per
  (sequence, KV head, context partition) computes all the query heads that share the KV head
  at once (grouped-query attention without repeating K and V). Long contexts at small batch
  split over partitions (flash-decoding), merged exactly by log-sum-exp afterwards by
  `_merge_kernel`; the partition count is a launch argument, so a CUDA graph can fix it once,
  and their length is read from device memory, so the graph's step can set it.

GPT-OSS's attention sinks (a logit per query head that each softmax also normalises over,
HAS_SINKS) join a row's running max and sum after its last key (`_with_sinks`); a split
decode's partitions leave them out and the merge adds them once.

The new tokens' K and V are written into the pool (by slot mapping) before a kernel runs,
so the kernels read every key from the pool. Keys past a sequence's length are masked out
of the loads themselves: stale K and V in a block's tail are never read. A sliding layer's
window bounds the key loop from below (a query at p reads keys p-W+1..p), so the blocks
before it, which may have been returned to the pool, are never read either.

Kept apart from the Python that lays out and launches them (triton_attention_launch.py) so
that this file is the device code alone: its source text is what Triton compiles (and hashes
for its cache), what the interpreter runs in the tests, and what triton_attention_aot.py
builds ahead of time. Importing it needs the `triton` package.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def _with_sinks(sink, m_i, l_i, acc):
    """Fold a sink logit (log2 units) into the row's final max m_i, sum l_i and output acc: a
    key with no value, so it adds to the sum only."""
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)  # 0 for a row that saw no key
    return l_i * alpha + tl.exp2(sink - m_new), acc * alpha[:, None]


@triton.jit
def _paged_slots(table, offs_n, n_mask, BLOCK_SIZE: tl.constexpr):
    """Where keys offs_n of a sequence sit in the pool: each one's block, from the sequence's
    block table (masked keys read block 0, never used), and its slot within that block."""
    block = tl.load(table + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    return block, offs_n % BLOCK_SIZE


@triton.jit
def _paged_load(ptr, block, within, kv_head, offs_d, n_mask, d_mask, stride_b, stride_s, stride_h,
                TRANSPOSED: tl.constexpr):
    """One KV head's keys or values at those slots, masked keys and dims 0: [BLOCK_D, BLOCK_N]
    transposed (keys, the right operand of q @ k), else [BLOCK_N, BLOCK_D] (values)."""
    if TRANSPOSED:
        out = tl.load(ptr + block[None, :] * stride_b + within[None, :] * stride_s + kv_head * stride_h
                      + offs_d[:, None], mask=n_mask[None, :] & d_mask[:, None], other=0.0)
    else:
        out = tl.load(ptr + block[:, None] * stride_b + within[:, None] * stride_s + kv_head * stride_h
                      + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    return out


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, sinks_ptr,
    tile_seg_ptr, tile_qoff_ptr, seg_qstart_ptr, seg_qlen_ptr, seg_start_ptr,
    stride_qm, stride_qh, stride_om, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_t,
    scale_log2, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, HAS_SINKS: tl.constexpr,
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
        block, within = _paged_slots(table, offs_n, n_mask, BLOCK_SIZE)
        k = _paged_load(k_ptr, block, within, kv_head, offs_d, n_mask, d_mask, stride_kb, stride_ks, stride_kh, True)
        visible = n_mask[None, :] & (offs_n[None, :] <= (start + offs_m)[:, None]) \
            & (offs_n[None, :] > (start + offs_m)[:, None] - window)
        s = tl.where(visible, _dot(q, k, IEEE) * scale_log2, float("-inf"))
        v = _paged_load(v_ptr, block, within, kv_head, offs_d, n_mask, d_mask, stride_vb, stride_vs, stride_vh, False)
        m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc, IEEE)
    if HAS_SINKS:
        l_i, acc = _with_sinks(tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634, m_i, l_i, acc)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_om + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_out_ptr, part_lse_ptr, tables_ptr, rows_ptr, lengths_ptr, sinks_ptr,
    stride_qm, stride_qh, stride_om, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_t,
    stride_pb, stride_ph, stride_pp, stride_lb, stride_lh,
    scale_log2, partition_tokens_ptr, window,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    # Keys per partition, read from the device: a decode graph captures the partition count
    # for its bucket but sets their length each step, for the step's longest context.
    partition_tokens = tl.load(partition_tokens_ptr).to(tl.int32)
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
        block, within = _paged_slots(table, offs_n, n_mask, BLOCK_SIZE)
        k = _paged_load(k_ptr, block, within, kv_head, offs_d, n_mask, d_mask, stride_kb, stride_ks, stride_kh, True)
        s = tl.where(n_mask[None, :], _dot(q, k, IEEE) * scale_log2, float("-inf"))
        v = _paged_load(v_ptr, block, within, kv_head, offs_d, n_mask, d_mask, stride_vb, stride_vs, stride_vh, False)
        m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc, IEEE)
    if HAS_SINKS and not SPLIT:  # (split: the merge adds them, once)
        sinks = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i, acc = _with_sinks(sinks, m_i, l_i, acc)
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


@triton.jit
def _merge_kernel(part_out_ptr, part_lse_ptr, out_ptr, rows_ptr, sinks_ptr, parts,
                  stride_pb, stride_ph, stride_pp, stride_lb, stride_lh, stride_om, stride_oh,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, HAS_SINKS: tl.constexpr):
    """The decode kernel's partitions of one (sequence, query head) merged exactly: each
    partition's output weighted by 2^(lse_p - log2-sum-exp2 over partitions, and the head's
    sink where HAS_SINKS). One launch for what took five torch ops (softmax, multiply, sum,
    cast, index_copy) a layer."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    p_mask = offs_p < parts
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(part_lse_ptr + b * stride_lb + h * stride_lh + offs_p, mask=p_mask, other=float("-inf"))
    top = tl.max(lse, axis=0)  # the row's own key is in one partition: the max is finite
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(top, sink)
        weight = tl.exp2(lse - top)
        weight = weight / (tl.sum(weight, axis=0) + tl.exp2(sink - top))
    else:
        weight = tl.exp2(lse - top)
        weight = weight / tl.sum(weight, axis=0)
    part_out = tl.load(part_out_ptr + b * stride_pb + h * stride_ph + offs_p[:, None] * stride_pp + offs_d[None, :],
                       mask=p_mask[:, None] & d_mask[None, :], other=0.0)
    merged = tl.sum(part_out * weight[:, None], axis=0)
    row = tl.load(rows_ptr + b).to(tl.int64)
    tl.store(out_ptr + row * stride_om + h * stride_oh + offs_d, merged.to(out_ptr.dtype.element_ty), mask=d_mask)
