/* The int8 weights' dot products (weight_q8.h has the matmul built on them): the layout's
 * constants, the dequantizing loads, and the kernels that read x in place and convert each
 * weight in registers, AVX2 (up to DOT_ROWS rows) and AVX-512 (up to 16 rows a call). Each
 * output is one FMA chain over k in order, as on the float32 paths.
 */
#ifndef MODELEXEC_WEIGHT_Q8_DOT_H
#define MODELEXEC_WEIGHT_Q8_DOT_H

#include <string.h>

#include "isa.h"
#include "weight_panel.h"

#define Q8PANEL 16  /* output columns of an int8 panel */
#define QGROUP 32   /* inputs that share a scale */

/* An int8 weight: panels [ceil(n / 16), k, 16] of bytes, scales [ceil(n / 16), ceil(k / 32), 16]. */
typedef struct {
    const int8_t *q;
    const float *scales;
} q8_weight;

static inline int64_t q8_groups(int64_t k) { return (k + QGROUP - 1) / QGROUP; }

/* Floats of scratch per thread for the dequantized tiles at inner dimension k: one int8 panel
 * as three float32 6-column panels, and two floats the last k-step's store runs past. */
static inline int64_t q8_scratch_floats(int64_t k) { return 3 * k * WPANEL + 8; }

/* Eight bytes at p as floats times scale: eight dequantized weights. */
static inline __m256 q8_load8(const int8_t *p, __m256 scale) {
    int64_t eight;
    memcpy(&eight, p, sizeof eight);
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(eight))), scale);
}

/* Lanes 0..cols-1 (cols >= 1) of an output row's eight columns into out, + bias, + residual. */
static inline void store_row8(__m256 v, int cols, const float *bias, const float *residual, float *out) {
    const __m256i mask = tail_mask(cols < 8 ? cols : 8);
    if (bias) v = _mm256_add_ps(v, cols >= 8 ? _mm256_loadu_ps(bias) : _mm256_maskload_ps(bias, mask));
    if (residual) v = _mm256_add_ps(v, cols >= 8 ? _mm256_loadu_ps(residual) : _mm256_maskload_ps(residual, mask));
    if (cols >= 8) _mm256_storeu_ps(out, v);
    else _mm256_maskstore_ps(out, mask, v);
}

/* np (1 or 2) int8 panels of w (k * 16 bytes apart) against mr (1..6) rows of x, with AVX2:
 * per k, each panel's two halves converted and each row's x broadcast against them. The
 * accumulators are named registers, c<row><half>. */
static inline __attribute__((always_inline)) void q8_dot(q8_weight w, const int np, const float *x, int64_t ldx,
                                                         const int mr, int64_t k, int cols, const float *bias,
                                                         const float *residual, int64_t ldr, float *y,
                                                         int64_t ldy, int prefetch) {
    const int64_t stride = k * Q8PANEL, groups = q8_groups(k), sstride = groups * Q8PANEL;
    const __m256 z = _mm256_setzero_ps();
    __m256 c00 = z, c01 = z, c02 = z, c03 = z, c10 = z, c11 = z, c12 = z, c13 = z, c20 = z, c21 = z, c22 = z,
           c23 = z, c30 = z, c31 = z, c32 = z, c33 = z, c40 = z, c41 = z, c42 = z, c43 = z, c50 = z, c51 = z,
           c52 = z, c53 = z;
#define Q8_ROW(i, step)                                                         \
    if (mr > i) {                                                              \
        const __m256 s = _mm256_broadcast_ss(x + i * ldx + (step));            \
        c##i##0 = _mm256_fmadd_ps(w0, s, c##i##0);                             \
        c##i##1 = _mm256_fmadd_ps(w1, s, c##i##1);                             \
        if (np > 1) {                                                          \
            c##i##2 = _mm256_fmadd_ps(w2, s, c##i##2);                         \
            c##i##3 = _mm256_fmadd_ps(w3, s, c##i##3);                         \
        }                                                                      \
    }
    for (int64_t g = 0; g < groups; g++) {
        const float *sg = w.scales + g * Q8PANEL;
        const __m256 s0 = _mm256_loadu_ps(sg), s1 = _mm256_loadu_ps(sg + 8),
                     s2 = np > 1 ? _mm256_loadu_ps(sg + sstride) : z, s3 = np > 1 ? _mm256_loadu_ps(sg + sstride + 8) : z;
        const int64_t end = (g + 1) * QGROUP < k ? (g + 1) * QGROUP : k;
        for (int64_t c = g * QGROUP; c < end; c++) {
            const int8_t *at = w.q + c * Q8PANEL;
            if (prefetch)
                for (int p = np; p < 2 * np; p++) _mm_prefetch((const char *)(at + p * stride), _MM_HINT_T0);
            const __m256 w0 = q8_load8(at, s0), w1 = q8_load8(at + 8, s1),
                         w2 = np > 1 ? q8_load8(at + stride, s2) : z, w3 = np > 1 ? q8_load8(at + stride + 8, s3) : z;
            Q8_ROW(0, c) Q8_ROW(1, c) Q8_ROW(2, c) Q8_ROW(3, c) Q8_ROW(4, c) Q8_ROW(5, c)
        }
    }
#undef Q8_ROW
    for (int h = 0; h < 2 * np; h++) {
        const int valid = cols - h * 8 < 8 ? cols - h * 8 : 8;
        if (valid <= 0) break;
        const float *b = bias ? bias + h * 8 : NULL;
#define Q8_OUT(i)                                                                                               \
    if (mr > i)                                                                                                 \
        store_row8(h == 0 ? c##i##0 : h == 1 ? c##i##1 : h == 2 ? c##i##2 : c##i##3, valid, b,                 \
                   residual ? residual + i * ldr + h * 8 : NULL, y + i * ldy + h * 8);
        Q8_OUT(0) Q8_OUT(1) Q8_OUT(2) Q8_OUT(3) Q8_OUT(4) Q8_OUT(5)
#undef Q8_OUT
    }
}

/* Sixteen bytes at p as floats times scale, with AVX-512. */
static inline ME_AVX512 __m512 q8_load16(const int8_t *p, __m512 scale) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))), scale);
}

static inline ME_AVX512 void store_row16(__m512 v, int cols, const float *bias, const float *residual, float *out) {
    const __mmask16 mask = cols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1);
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias));
    if (residual) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, residual));
    _mm512_mask_storeu_ps(out, mask, v);
}

/* q8_dot with AVX-512 for up to Q8_ROWS512 rows: np (1..3) panels, one 16-lane vector each,
 * against mr rows of x read in place, accumulators a<row>_<panel> (32 zmm registers hold
 * 3 panels x 4 rows, 2 x 8 or 1 x 16, with the weights, their scales and a broadcast). Past
 * DOT_ROWS rows this is what the AVX2 path packs and tiles for: here the weights convert in
 * registers for every 16 rows, with no scratch. */
#define Q8_ROWS512 16
#define Q8_PREFETCH_BLOCKS 2  /* steps of up to this many blocks of rows prefetch (run 22) */
static inline ME_AVX512 __attribute__((always_inline)) void q8_dot512(q8_weight w, const int np, const float *x,
                                                                      int64_t ldx, const int mr, int64_t k, int cols,
                                                                      const float *bias, const float *residual,
                                                                      int64_t ldr, float *y, int64_t ldy,
                                                                      int prefetch) {
    const int64_t stride = k * Q8PANEL, groups = q8_groups(k), sstride = groups * Q8PANEL;
    const __m512 z = _mm512_setzero_ps();
    __m512 a0_0 = z, a0_1 = z, a0_2 = z, a1_0 = z, a1_1 = z, a1_2 = z, a2_0 = z, a2_1 = z, a2_2 = z, a3_0 = z, a3_1 = z, a3_2 = z, a4_0 = z, a4_1 = z, a4_2 = z, a5_0 = z, a5_1 = z, a5_2 = z, a6_0 = z, a6_1 = z, a6_2 = z, a7_0 = z, a7_1 = z, a7_2 = z, a8_0 = z, a8_1 = z, a8_2 = z, a9_0 = z, a9_1 = z, a9_2 = z, a10_0 = z, a10_1 = z, a10_2 = z, a11_0 = z, a11_1 = z, a11_2 = z, a12_0 = z, a12_1 = z, a12_2 = z, a13_0 = z, a13_1 = z, a13_2 = z, a14_0 = z, a14_1 = z, a14_2 = z, a15_0 = z, a15_1 = z, a15_2 = z;
#define Q8_ROW(i, step)                                                         \
    if (mr > i) {                                                              \
        const __m512 s = _mm512_set1_ps(x[i * ldx + (step)]);                  \
        a##i##_0 = _mm512_fmadd_ps(w0, s, a##i##_0);                           \
        if (np > 1) a##i##_1 = _mm512_fmadd_ps(w1, s, a##i##_1);               \
        if (np > 2) a##i##_2 = _mm512_fmadd_ps(w2, s, a##i##_2);               \
    }
    for (int64_t g = 0; g < groups; g++) {
        const float *sg = w.scales + g * Q8PANEL;
        const __m512 s0 = _mm512_loadu_ps(sg), s1 = np > 1 ? _mm512_loadu_ps(sg + sstride) : z,
                     s2 = np > 2 ? _mm512_loadu_ps(sg + 2 * sstride) : z;
        const int64_t end = (g + 1) * QGROUP < k ? (g + 1) * QGROUP : k;
        for (int64_t c = g * QGROUP; c < end; c++) {
            const int8_t *at = w.q + c * Q8PANEL;
            if (prefetch)
                for (int p = np; p < 2 * np; p++) _mm_prefetch((const char *)(at + p * stride), _MM_HINT_T0);
            const __m512 w0 = q8_load16(at, s0), w1 = np > 1 ? q8_load16(at + stride, s1) : z,
                         w2 = np > 2 ? q8_load16(at + 2 * stride, s2) : z;
            Q8_ROW(0, c) Q8_ROW(1, c) Q8_ROW(2, c) Q8_ROW(3, c) Q8_ROW(4, c) Q8_ROW(5, c) Q8_ROW(6, c) Q8_ROW(7, c)
            Q8_ROW(8, c) Q8_ROW(9, c) Q8_ROW(10, c) Q8_ROW(11, c) Q8_ROW(12, c) Q8_ROW(13, c) Q8_ROW(14, c)
            Q8_ROW(15, c)
        }
    }
#undef Q8_ROW
    for (int p = 0; p < np; p++) {
        const int valid = cols - p * Q8PANEL < Q8PANEL ? cols - p * Q8PANEL : Q8PANEL;
        if (valid <= 0) break;
        const float *b = bias ? bias + p * Q8PANEL : NULL;
#define Q8_OUT(i)                                                                                         \
    if (mr > i)                                                                                           \
        store_row16(p == 0 ? a##i##_0 : p == 1 ? a##i##_1 : a##i##_2, valid, b,                          \
                    residual ? residual + i * ldr + p * Q8PANEL : NULL, y + i * ldy + p * Q8PANEL);
        Q8_OUT(0) Q8_OUT(1) Q8_OUT(2) Q8_OUT(3) Q8_OUT(4) Q8_OUT(5) Q8_OUT(6) Q8_OUT(7) Q8_OUT(8) Q8_OUT(9)
        Q8_OUT(10) Q8_OUT(11) Q8_OUT(12) Q8_OUT(13) Q8_OUT(14) Q8_OUT(15)
#undef Q8_OUT
    }
}

#endif
