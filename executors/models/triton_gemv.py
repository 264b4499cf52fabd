"""A few-row matmul (decode at batch 1-8) in Triton, streaming the weight once at full width.

On an H100 a batch-1 decode step of the Qwen3-0.6B shape spent 0.86 ms of its 1.96 ms of
kernel time in cuBLAS matmuls of one row; the layers' 881 MB of weights took 0.75 ms of it,
~1.2 TB/s of the ~3 TB/s a copy reaches (bench/RESULTS.md, run 20). A matmul of M <= 8 rows does ~2 MFLOP per MB of weight, nothing for
the tensor cores; it is a stream over the weight. Here one program owns BLOCK_N output
columns: it walks K in BLOCK_K steps, loads its [BLOCK_N, BLOCK_K] tile of the row-major
weight (contiguous along K) once, and multiplies it into all M rows in float32, then adds
the bias and the residual (what the step's addmm folds in) and stores. With `split`, K is
divided among that many programs per column block, which store float32 partial sums that a
second kernel adds in a fixed order (then the bias and residual): more programs, more of the
weight in flight, where N alone gives too few.

few_row_matmuls.py puts it in decode graphs (`--triton-gemv`) where it beats torch's at a
shape, timed at capture; on the H100 of run 24 that was the one- and two-row o and down
projections (N = 1024), at 0.6-0.7 TB/s against cuBLAS's 0.45-0.57. `python -m
bench.gpu_gemv` times more block shapes and row counts. The interpreter checks what it computes
(tests/models/test_triton_gemv.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 8
SUM_BLOCK_N = 256  # columns per program of the split partial sums' addition


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, M, N, K, K_PER_SPLIT,
                 stride_xm, stride_wn, stride_rm, stride_om, stride_os,
                 HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, PARTIAL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (n, s) sums inputs s*K_PER_SPLIT.. of its BLOCK_N columns; PARTIAL: stores those
    float32 partial sums at out_ptr + s*stride_os for _split_sum_kernel, else the finished rows."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    k_lo = tl.program_id(1) * K_PER_SPLIT
    k_hi = tl.minimum(K, k_lo + K_PER_SPLIT)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    mask = m_mask[:, None] & n_mask[None, :]
    if PARTIAL:
        tl.store(out_ptr + tl.program_id(1) * stride_os + offs_m[:, None] * stride_om + offs_n[None, :], acc,
                 mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_RES:
            acc += tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask,
                           other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_sum_kernel(part_ptr, bias_ptr, res_ptr, out_ptr, N, SPLITS, stride_ps, stride_pm, stride_rm, stride_om,
                      HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row m's BLOCK_N columns: the splits' partial sums added in order, then bias and residual."""
    m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_s = tl.arange(0, BLOCK_S)
    n_mask = offs_n < N
    parts = tl.load(part_ptr + offs_s[:, None] * stride_ps + m * stride_pm + offs_n[None, :],
                    mask=(offs_s < SPLITS)[:, None] & n_mask[None, :], other=0.0)
    acc = tl.sum(parts, axis=0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if HAS_RES:
        acc += tl.load(res_ptr + m * stride_rm + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         residual: torch.Tensor | None = None, block_n: int = 16, block_k: int = 256,
         num_warps: int = 4, split: int = 1) -> torch.Tensor:
    """residual + x @ weight.T + bias for x [M, K] (M <= MAX_ROWS), weight [N, K] row-major.
    `split` > 1 divides K among that many programs per column block (more of the weight in
    flight where N alone gives too few programs), their float32 partial sums added by a second
    kernel in a fixed order."""
    m, k = x.shape
    n = weight.shape[0]
    if not 0 < m <= MAX_ROWS or weight.shape[1] != k or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"gemv takes 1..{MAX_ROWS} rows of unit-stride x against a row-major weight, "
                         f"got x {tuple(x.shape)} and weight {tuple(weight.shape)}")
    if split < 1:
        raise ValueError(f"split must be >= 1, got {split}")
    out = x.new_empty(m, n)
    res = residual if residual is not None else out
    b = bias if bias is not None else out
    block_m = max(1, triton.next_power_of_2(m))
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    if split == 1:
        _gemv_kernel[(triton.cdiv(n, block_n), 1)](
            x, weight, b, res, out, m, n, k, k_per_split,
            x.stride(0), weight.stride(0), res.stride(0), out.stride(0), 0,
            HAS_BIAS=bias is not None, HAS_RES=residual is not None, PARTIAL=False,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        )
        return out
    parts = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n), split)](
        x, weight, b, res, parts, m, n, k, k_per_split,
        x.stride(0), weight.stride(0), res.stride(0), parts.stride(1), parts.stride(0),
        HAS_BIAS=False, HAS_RES=False, PARTIAL=True,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
    )
    _split_sum_kernel[(m, triton.cdiv(n, SUM_BLOCK_N))](
        parts, b, res, out, n, split, parts.stride(0), parts.stride(1), res.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, BLOCK_S=max(2, triton.next_power_of_2(split)),
        BLOCK_N=SUM_BLOCK_N,
    )
    return out
