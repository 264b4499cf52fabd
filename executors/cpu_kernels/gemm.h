/* A register-blocked tile for steps of several rows (gemm.c, decode_step.c): y = x @ w^T for
 * MR rows of x against NR rows of w, both read along k, one FMA accumulator per (row, weight
 * row) pair, 12 for a 4 x 3 tile, reduced once at the end. With the weight vectors and an x
 * vector that is 16 AVX registers; gcc keeps two weight vectors and folds the third into
 * the FMAs, 10 loads for 12 FMAs. Tiles of 3x4, 2x6 and 2x5 measured the same (60-65 % of
 * the sgemm peak at 32 rows, bench/RESULTS.md run 10), 6x2 and 8x1 slower. */
#ifndef MODELEXEC_GEMM_H
#define MODELEXEC_GEMM_H

#include "simd.h"

#define MR 4
#define NR 3

/* out[i * NR + j] = x[i] . w[j] for i < mr (<= MR), j < nr (<= NR), over k floats. */
static inline void dot_tile(const float *x, int64_t ldx, int mr, const float *w, int64_t ldw, int nr, int64_t k,
                            float *out) {
    __m256 acc[MR][NR];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();
    const int64_t full = k & ~(int64_t)7;
    if (mr == MR && nr == NR) {
        for (int64_t c = 0; c < full; c += 8) {
            const __m256 w0 = _mm256_loadu_ps(w + c), w1 = _mm256_loadu_ps(w + ldw + c),
                         w2 = _mm256_loadu_ps(w + 2 * ldw + c);
            for (int i = 0; i < MR; i++) {
                const __m256 xv = _mm256_loadu_ps(x + i * ldx + c);
                acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
                acc[i][2] = _mm256_fmadd_ps(xv, w2, acc[i][2]);
            }
        }
    } else {
        for (int64_t c = 0; c < full; c += 8)
            for (int j = 0; j < nr; j++) {
                const __m256 wv = _mm256_loadu_ps(w + j * ldw + c);
                for (int i = 0; i < mr; i++) acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * ldx + c), wv, acc[i][j]);
            }
    }
    if (full < k) {
        const __m256i mask = tail_mask(k - full);
        for (int j = 0; j < nr; j++) {
            const __m256 wv = _mm256_maskload_ps(w + j * ldw + full, mask);
            for (int i = 0; i < mr; i++)
                acc[i][j] = _mm256_fmadd_ps(_mm256_maskload_ps(x + i * ldx + full, mask), wv, acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) out[i * NR + j] = hsum(acc[i][j]);
}

/* Weight rows [3 g, 3 g + 3) of y[b, :n] = x[b, :k] @ w[:n, :k]^T (+ bias) (+ residual) for
 * every b < m; residual may be y itself (each element read, then written, by one thread). */
static inline void gemm_group(const float *x, int64_t m, int64_t ldx, const float *w, int64_t n, int64_t k,
                              int64_t ldw, const float *bias, const float *residual, int64_t ldr, float *y, int64_t ldy,
                              int64_t g) {
    const int64_t n0 = g * NR;
    const int nr = (int)(n - n0 < NR ? n - n0 : NR);
    float out[MR * NR];
    for (int64_t m0 = 0; m0 < m; m0 += MR) {
        const int mr = (int)(m - m0 < MR ? m - m0 : MR);
        dot_tile(x + m0 * ldx, ldx, mr, w + n0 * ldw, ldw, nr, k, out);
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < nr; j++) {
                float v = out[i * NR + j] + (bias ? bias[n0 + j] : 0.0f);
                if (residual) v += residual[(m0 + i) * ldr + n0 + j];
                y[(m0 + i) * ldy + n0 + j] = v;
            }
    }
}

#endif
