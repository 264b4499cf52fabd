/* float32 matrix-vector kernels for decode steps of a few rows on x86-64 with AVX2 and FMA.
 *
 * A decode step at batch 1 multiplies one row by every weight matrix once, so it runs at
 * the rate the weights stream from memory. MKL's sgemv reads a [n, k] row-major weight at
 * 12-20 GB/s on the 2-core EPYC of bench/RESULTS.md; these loops read it at ~24 GB/s from
 * memory, what torch.sum reads at (30-38 GB/s when the weight sits in the L3):
 * eight weight rows a block (eight sequential streams the hardware prefetcher follows),
 * one FMA accumulator per row, the block's eight sums reduced together and stored as one
 * vector. Threads split the blocks statically through OpenMP; the library links the same
 * libgomp torch loaded, so its parallel regions reuse torch's thread pool.
 *
 * Every function takes its thread count from the caller (torch.get_num_threads()), because
 * OpenMP's thread-count setting is per calling thread and the executor steps on a worker
 * thread of its own.
 */
#include "matvec.h"

/* y[b, :n] = x[b, :k] @ w[:n, :k]^T (+ bias[:n]) (+ residual[b, :n]) for b < m.
 * w: row stride ldw; x, residual, y: row strides ldx, ldr, ldy. bias, residual may be NULL;
 * residual may be y itself (each element is read before it is written, by one thread). */
void me_linear_f32(const float *x, int64_t m, int64_t ldx, const float *w, int64_t n, int64_t k, int64_t ldw,
                   const float *bias, const float *residual, int64_t ldr, float *y, int64_t ldy, int threads) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t blk = 0; blk < blocks; blk++)
        linear_block(x, m, ldx, w, n, k, ldw, bias, residual, ldr, y, ldy, blk);
}
