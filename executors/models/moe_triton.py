"""A grouped GEMM in Triton: rows sorted by expert, each slice times its own expert's weight.

moe.py sorts a step's (row, expert) pairs by expert, so expert e owns rows
ends[e-1]..ends[e]-1 of a [N, K] matrix; this computes out[r] = x[r] @ w[e].T for every
row in one launch, with no host sync (the slice bounds are read on the device, which a
CUDA graph can capture). It is the fallback where torch has no grouped GEMM of its own
(torch._grouped_mm) for the GPU and dtype at hand.

The grid has one program per (expert, row tile, column tile), sized for the worst case
of every row on one expert; a program whose tile starts past its expert's rows returns at
once, so an expert no row picked costs one empty program per column tile. As with
triton_attention.py, TRITON_INTERPRET=1 runs it on CPU tensors for the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_kernel(
    x_ptr, w_ptr, out_ptr, ends_ptr, K, NOUT, stride_xm, stride_we, stride_wn, stride_om, tiles_per_expert,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    expert = pid // tiles_per_expert
    tile = pid % tiles_per_expert
    end = tl.load(ends_ptr + expert)
    before = tl.load(ends_ptr + tl.maximum(expert - 1, 0))
    start = tl.where(expert > 0, before, 0)
    row0 = start + tile * BLOCK_M
    if row0 < end:
        offs_m = row0 + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < end
        n_mask = offs_n < NOUT
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            a = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None],
                        mask=n_mask[None, :] & k_mask[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
            if IEEE:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """x [N, K] (rows sorted by expert), w [E, NOUT, K], ends [E] int32 (cumulative row
    counts) -> [N, NOUT] with out[r] = x[r] @ w[e].T for the expert e owning row r."""
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("grouped_matmul needs unit stride along K")
    n, k = x.shape
    experts, nout = w.shape[0], w.shape[1]
    out = torch.empty(n, nout, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    block_m = 16 if n <= 16 * experts else 64
    block_n = 64 if x.is_cuda else 32
    block_k = 32
    tiles = triton.cdiv(n, block_m)
    _grouped_kernel[(experts * tiles, triton.cdiv(nout, block_n))](
        x, w, out, ends, k, nout, x.stride(0), w.stride(0), w.stride(1), out.stride(0), tiles,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32,
    )
    return out
