/* A float32 tile of up to 6 rows of x against a 16-column panel [k, 16] (prefill_attention.c:
 * a prompt's keys and values laid out as panels once, then read from the L1/L2 by every tile
 * of its queries).
 *
 * The tile keeps its 6 x 16 outputs in 12 AVX accumulators and walks k once: per k, two
 * 32-byte loads of the panel, six broadcasts of x and twelve FMAs, with no horizontal sums
 * (180-195 GFLOP/s from the L2 on the 2-core EPYC of bench/RESULTS.md, run 11). The
 * weights' matmuls use weight_panel.h instead, whose streamed operand is the broadcast one.
 */
#ifndef MODELEXEC_PANEL_H
#define MODELEXEC_PANEL_H

#include "simd.h"

#define PANEL 16   /* output columns of a panel */
#define TILE_ROWS 6  /* rows of x a tile takes */

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

#endif
