/* The matvec kernels' block: eight weight rows against a few activation rows (matvec.c,
 * decode_step.c). Eight sequential streams the hardware prefetcher follows, one FMA
 * accumulator per weight row, the eight sums reduced together and stored as one vector. */
#ifndef MODELEXEC_MATVEC_H
#define MODELEXEC_MATVEC_H

#include "simd.h"

#define BLOCK 8

/* Dot products of x (k floats) with `rows` (<= 8) consecutive weight rows. */
static inline __m256 dot_block(const float *w, int64_t ldw, int rows, const float *x, int64_t k) {
    __m256 acc[BLOCK];
    for (int r = 0; r < BLOCK; r++) acc[r] = _mm256_setzero_ps();
    const int64_t full = k & ~(int64_t)7;
    if (rows == BLOCK) {
        for (int64_t i = 0; i < full; i += 8) {
            __m256 xv = _mm256_loadu_ps(x + i);
            for (int r = 0; r < BLOCK; r++) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w + r * ldw + i), xv, acc[r]);
        }
    } else {
        for (int64_t i = 0; i < full; i += 8) {
            __m256 xv = _mm256_loadu_ps(x + i);
            for (int r = 0; r < rows; r++) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w + r * ldw + i), xv, acc[r]);
        }
    }
    if (full < k) {
        __m256i mask = tail_mask(k - full);
        __m256 xv = _mm256_maskload_ps(x + full, mask);
        for (int r = 0; r < rows; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_maskload_ps(w + r * ldw + full, mask), xv, acc[r]);
    }
    return reduce8(acc);
}

static inline void store_rows(float *y, int rows, __m256 v) {
    if (rows == BLOCK) _mm256_storeu_ps(y, v);
    else _mm256_maskstore_ps(y, tail_mask(rows), v);
}

static inline __m256 load_rows(const float *p, int rows) {
    return rows == BLOCK ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, tail_mask(rows));
}

/* Block `blk` of y[b, :n] = x[b, :k] @ w[:n, :k]^T (+ bias) (+ residual) for b < m: output
 * columns 8 blk .. 8 blk + 7. residual may be y itself (each element read, then written). */
static inline void linear_block(const float *x, int64_t m, int64_t ldx, const float *w, int64_t n, int64_t k,
                                int64_t ldw, const float *bias, const float *residual, int64_t ldr, float *y,
                                int64_t ldy, int64_t blk) {
    const int64_t row0 = blk * BLOCK;
    const int rows = (int)(n - row0 < BLOCK ? n - row0 : BLOCK);
    const __m256 b = bias ? load_rows(bias + row0, rows) : _mm256_setzero_ps();
    for (int64_t s = 0; s < m; s++) {
        __m256 v = _mm256_add_ps(dot_block(w + row0 * ldw, ldw, rows, x + s * ldx, k), b);
        if (residual) v = _mm256_add_ps(v, load_rows(residual + s * ldr + row0, rows));
        store_rows(y + s * ldy + row0, rows, v);
    }
}

#endif
