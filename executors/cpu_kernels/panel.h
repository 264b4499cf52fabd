/* float32 matmuls over weights stored in panels (panel.c, decode_step.c).
 *
 * A weight [n, k] (y = x @ w^T) is stored as ceil(n / 16) panels of [k, 16]: panel j holds
 * output columns 16 j .. 16 j + 15, k-major, zero-padded past n. A tile of MR rows of x
 * against one panel keeps its 6 x 16 outputs in 12 AVX accumulators and walks k once: per
 * k, two aligned 32-byte loads of the panel, six broadcasts of x and twelve FMAs, with no
 * horizontal sums. The panel streams sequentially from memory (one row of x: at the rate
 * the weights stream, 8 % faster than dot products over the row-major weight here), and
 * from the L2 for every further tile of rows (32 rows: 150-180 GFLOP/s, 128 rows and more:
 * 180-195, against 191 for MKL's best square sgemm; bench/RESULTS.md run 11).
 */
#ifndef MODELEXEC_PANEL_H
#define MODELEXEC_PANEL_H

#include "simd.h"

#define PANEL 16   /* output columns of a panel */
#define TILE_ROWS 6  /* rows of x a tile takes */
#define CHUNK_ROWS 256  /* rows of x the threads share out panel by panel before the next rows */

/* The epilogue's masks: valid columns of a panel's two halves. */
static inline void panel_masks(int cols, __m256i *lo, __m256i *hi) {
    *lo = tail_mask(cols < 8 ? cols : 8);
    *hi = tail_mask(cols > 8 ? cols - 8 : 0);
}

/* y[i, :cols] = x[i] @ panel (+ bias) (+ residual[i]) for i < mr, mr <= TILE_ROWS known where
 * this inlines. residual may be y (each element read, then written, by this thread). */
static inline __attribute__((always_inline)) void panel_tile(const float *x, int64_t ldx, const int mr,
                                                             const float *panel, int64_t k, int cols,
                                                             const float *bias, const float *residual,
                                                             int64_t ldr, float *y, int64_t ldy) {
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0, a4 = a0,
           b4 = a0, a5 = a0, b5 = a0;
    const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx, *x4 = x + 4 * ldx, *x5 = x + 5 * ldx;
#define ME_ROW(i)                                                                \
    if (mr > i) {                                                                \
        const __m256 s = _mm256_broadcast_ss(x##i + c);                          \
        a##i = _mm256_fmadd_ps(s, w0, a##i);                                     \
        b##i = _mm256_fmadd_ps(s, w1, b##i);                                     \
    }
    for (int64_t c = 0; c < k; c++) {
        const __m256 w0 = _mm256_loadu_ps(panel + c * PANEL), w1 = _mm256_loadu_ps(panel + c * PANEL + 8);
        ME_ROW(0) ME_ROW(1) ME_ROW(2) ME_ROW(3) ME_ROW(4) ME_ROW(5)
    }
#undef ME_ROW
    __m256i lo, hi;
    panel_masks(cols, &lo, &hi);
    const int full = cols == PANEL;
    __m256 bias0 = _mm256_setzero_ps(), bias1 = bias0;
    if (bias) {
        bias0 = full ? _mm256_loadu_ps(bias) : _mm256_maskload_ps(bias, lo);
        bias1 = full ? _mm256_loadu_ps(bias + 8) : _mm256_maskload_ps(bias + 8, hi);
    }
#define ME_OUT(i)                                                                                    \
    if (mr > i) {                                                                                    \
        __m256 v0 = _mm256_add_ps(a##i, bias0), v1 = _mm256_add_ps(b##i, bias1);                     \
        float *out = y + i * ldy;                                                                    \
        if (residual) {                                                                              \
            const float *r = residual + i * ldr;                                                     \
            v0 = _mm256_add_ps(v0, full ? _mm256_loadu_ps(r) : _mm256_maskload_ps(r, lo));           \
            v1 = _mm256_add_ps(v1, full ? _mm256_loadu_ps(r + 8) : _mm256_maskload_ps(r + 8, hi));   \
        }                                                                                            \
        if (full) {                                                                                  \
            _mm256_storeu_ps(out, v0);                                                               \
            _mm256_storeu_ps(out + 8, v1);                                                           \
        } else {                                                                                     \
            _mm256_maskstore_ps(out, lo, v0);                                                        \
            _mm256_maskstore_ps(out + 8, hi, v1);                                                    \
        }                                                                                            \
    }
    ME_OUT(0) ME_OUT(1) ME_OUT(2) ME_OUT(3) ME_OUT(4) ME_OUT(5)
#undef ME_OUT
}

/* panel_tile for any mr in 1..TILE_ROWS, each row count its own inlined copy. */
static inline void panel_tile_rows(const float *x, int64_t ldx, int64_t mr, const float *panel, int64_t k, int cols,
                                   const float *bias, const float *residual, int64_t ldr, float *y, int64_t ldy) {
    switch (mr) {
    case 6: panel_tile(x, ldx, 6, panel, k, cols, bias, residual, ldr, y, ldy); break;
    case 5: panel_tile(x, ldx, 5, panel, k, cols, bias, residual, ldr, y, ldy); break;
    case 4: panel_tile(x, ldx, 4, panel, k, cols, bias, residual, ldr, y, ldy); break;
    case 3: panel_tile(x, ldx, 3, panel, k, cols, bias, residual, ldr, y, ldy); break;
    case 2: panel_tile(x, ldx, 2, panel, k, cols, bias, residual, ldr, y, ldy); break;
    default: panel_tile(x, ldx, 1, panel, k, cols, bias, residual, ldr, y, ldy); break;
    }
}

/* Rows [m0, m1) of x against panel j of y[:, :n] = x @ w^T (+ bias) (+ residual). */
static inline void panel_rows(const float *x, int64_t m0, int64_t m1, int64_t ldx, const float *panels, int64_t n,
                              int64_t k, const float *bias, const float *residual, int64_t ldr, float *y, int64_t ldy,
                              int64_t j) {
    const float *panel = panels + j * k * PANEL;
    const int64_t col = j * PANEL;
    const int cols = (int)(n - col < PANEL ? n - col : PANEL);
    const float *b = bias ? bias + col : NULL;
    for (int64_t i = m0; i < m1; i += TILE_ROWS) {
        const float *xi = x + i * ldx, *ri = residual ? residual + i * ldr + col : NULL;
        panel_tile_rows(xi, ldx, m1 - i < TILE_ROWS ? m1 - i : TILE_ROWS, panel, k, cols, b, ri, ldr,
                        y + i * ldy + col, ldy);
    }
}

/* y[:m, :n] = x @ w^T (+ bias) (+ residual), shared out over the calling team (orphaned
 * `omp for`s: inside a parallel region they split its work; each chunk of rows ends
 * without a barrier, the caller's next barrier waits for all of them). */
static inline void panel_linear_team(const float *x, int64_t m, int64_t ldx, const float *panels, int64_t n,
                                     int64_t k, const float *bias, const float *residual, int64_t ldr, float *y,
                                     int64_t ldy) {
    const int64_t count = (n + PANEL - 1) / PANEL;
    for (int64_t m0 = 0; m0 < m; m0 += CHUNK_ROWS) {
        const int64_t m1 = m0 + CHUNK_ROWS < m ? m0 + CHUNK_ROWS : m;
        #pragma omp for schedule(static) nowait
        for (int64_t j = 0; j < count; j++) panel_rows(x, m0, m1, ldx, panels, n, k, bias, residual, ldr, y, ldy, j);
    }
}

#endif
