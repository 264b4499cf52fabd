/* float32 matmuls for steps of a few rows to a few dozen (batched decode) on x86-64 with
 * AVX2 and FMA: register-blocked tiles (gemm.h) over the row-major weights as they are, no
 * packed copy. Threads split the weight rows statically, each group of three read once
 * from memory while every row of x (L2-resident at these sizes) passes over it. */
#include "gemm.h"

/* y[b, :n] = x[b, :k] @ w[:n, :k]^T (+ bias[:n]) (+ residual[b, :n]) for b < m; strides as
 * me_linear_f32's (matvec.c). */
void me_gemm_f32(const float *x, int64_t m, int64_t ldx, const float *w, int64_t n, int64_t k, int64_t ldw,
                 const float *bias, const float *residual, int64_t ldr, float *y, int64_t ldy, int threads) {
    const int64_t groups = (n + NR - 1) / NR;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t g = 0; g < groups; g++) gemm_group(x, m, ldx, w, n, k, ldw, bias, residual, ldr, y, ldy, g);
}
