"""A few-row matmul (decode at batch 1-8) in Triton, streaming the weight once at full width.

On an H100 a batch-1 decode step of the Qwen3-0.6B shape spent 0.86 ms of its 1.96 ms of
kernel time in cuBLAS matmuls of one row; the layers' 881 MB of weights took 0.75 ms of it,
~1.2 TB/s of the ~3 TB/s a copy reaches (bench/RESULTS.md, run 20). A matmul of M <= 8 rows does ~2 MFLOP per MB of weight, nothing for
the tensor cores; it is a stream over the weight. Here one program owns BLOCK_N output
columns: it walks K in BLOCK_K steps, loads its [BLOCK_N, BLOCK_K] tile of the row-major
weight (contiguous along K) once, and multiplies it into all M rows in float32, then adds
the bias and the residual (what the step's addmm folds in) and stores.

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


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, M, N, K,
                 stride_xm, stride_wn, stride_rm, stride_om,
                 HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if HAS_RES:
        acc += tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         residual: torch.Tensor | None = None, block_n: int = 16, block_k: int = 256,
         num_warps: int = 4) -> torch.Tensor:
    """residual + x @ weight.T + bias for x [M, K] (M <= MAX_ROWS), weight [N, K] row-major."""
    m, k = x.shape
    n = weight.shape[0]
    if not 0 < m <= MAX_ROWS or weight.shape[1] != k or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"gemv takes 1..{MAX_ROWS} rows of unit-stride x against a row-major weight, "
                         f"got x {tuple(x.shape)} and weight {tuple(weight.shape)}")
    out = x.new_empty(m, n)
    res = residual if residual is not None else out
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else out, res, out, m, n, k,
        x.stride(0), weight.stride(0), res.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        BLOCK_M=max(1, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
    )
    return out
