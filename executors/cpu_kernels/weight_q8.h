/* int8 matmul weights (qpanels.py): y = x @ w^T with w[j, k] = (float)q[j, k] * scale[j, k / 32].
 *
 * A weight [n, k] is stored as ceil(n / 16) panels of [k, 16] bytes (k-major, zero-padded past
 * n) and their scales as [ceil(n / 16), ceil(k / QGROUP), 16] floats: a scale for each QGROUP
 * inputs of each output column, llama.cpp's Q8_0 grouping.
 *
 * Each weight becomes the float (float)q * scale as it is loaded, and from there every path
 * computes exactly what weight_panel.h computes for the float32 panels of those dequantized
 * weights: each output one FMA chain over k in order, then + bias, then + residual. So a
 * row's result does not depend on its batch mates, and the tests hold these kernels to the
 * float32 ones bit for bit.
 *
 * - Dot products read x in place and convert the weights in registers (sign extension, int
 *   to float, the scale): a decode row streams 1.125 bytes a weight instead of 4. Sixteen
 *   columns a panel keep every lane of a load useful: two 8-lane halves with AVX2 (up to
 *   DOT_ROWS rows), one 16-lane vector where the CPU has AVX-512 (chosen at run time:
 *   isa.h), which takes every step this way, 16 rows at a time (bench/RESULTS.md run 19:
 *   about twice the speed of the float32 AVX2 tiles at batch 8 to 32 and prefill; past batch
 *   8 the float32 AVX-512 tiles of run 21 are as fast, having no conversion to do. Run 22
 *   tried dequantizing panels for those tiles past 16 rows instead: 1.7x slower at 17 rows,
 *   1.1x at 64, 3 % faster at 128).
 * - With AVX2, more rows dequantize a panel into three float32 6-column panels in a thread's
 *   scratch, which the float32 tiles then read from the L1/L2 for every chunk of rows.
 * - As they walk k, the dot products of a step of up to two blocks of rows (32 with AVX-512)
 *   prefetch the same k-step of the np panels after theirs (the thread's next group under a
 *   static schedule), as the float32 ones do: the hardware's prefetchers alone left a decode
 *   row at half the memory's rate (bench/RESULTS.md run 21). A step of more blocks reads
 *   every panel once a block, and there the prefetches cost 8-12 % (128 rows, run 22).
 */
#ifndef MODELEXEC_WEIGHT_Q8_H
#define MODELEXEC_WEIGHT_Q8_H

#include <omp.h>

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

/* Panels a dot call takes for mr rows: as many as the registers hold (16 ymm, 32 zmm). */
static inline int64_t q8_dot_group(int64_t mr, int avx512) {
    return avx512 ? (mr <= 4 ? 3 : mr <= 8 ? 2 : 1) : (mr <= 2 ? 2 : 1);
}

/* Group g of q8_dot_group(mr) panels against the mr rows of x (up to DOT_ROWS with AVX2,
 * Q8_ROWS512 with AVX-512); one inlined copy a row count and panel count, the AVX-512 ones in
 * a function of that target. */
#define Q8_GROUP_PROLOGUE(AVX512)                                                                         \
    const int64_t group = q8_dot_group(mr, AVX512), col = g * group * Q8PANEL;                           \
    const int64_t count = (n + Q8PANEL - 1) / Q8PANEL - g * group;                                       \
    const int np = count < group ? (int)count : (int)group;                                              \
    const int cols = (int)(n - col < group * Q8PANEL ? n - col : group * Q8PANEL);                       \
    const q8_weight q = {w.q + g * group * k * Q8PANEL, w.scales + g * group * q8_groups(k) * Q8PANEL};  \
    const float *b = bias ? bias + col : NULL, *r = residual ? residual + col : NULL;
#define Q8_NP3(DOT, rows)                                                                    \
    case rows:                                                                               \
        if (np == 3) DOT(q, 3, x, ldx, rows, k, cols, b, r, ldr, y + col, ldy, prefetch);              \
        else if (np == 2) DOT(q, 2, x, ldx, rows, k, cols, b, r, ldr, y + col, ldy, prefetch);         \
        else DOT(q, 1, x, ldx, rows, k, cols, b, r, ldr, y + col, ldy, prefetch);                      \
        break;
#define Q8_NP2(DOT, rows)                                                                    \
    case rows:                                                                               \
        if (np == 2) DOT(q, 2, x, ldx, rows, k, cols, b, r, ldr, y + col, ldy, prefetch);              \
        else DOT(q, 1, x, ldx, rows, k, cols, b, r, ldr, y + col, ldy, prefetch);                      \
        break;
#define Q8_NP1(DOT, rows)                                                                    \
    case rows:                                                                               \
        DOT(q, 1, x, ldx, rows, k, cols, b, r, ldr, y + col, ldy, prefetch);                           \
        break;

static inline void q8_dot_group_avx2(const float *x, int64_t ldx, int64_t mr, q8_weight w, int64_t n, int64_t k,
                                     const float *bias, const float *residual, int64_t ldr, float *y, int64_t ldy,
                                     int64_t g) {
    const int prefetch = 1;  /* up to DOT_ROWS rows, all in one block: each weight streams once */
    Q8_GROUP_PROLOGUE(0)
    switch (mr) {
    Q8_NP2(q8_dot, 6) Q8_NP2(q8_dot, 5) Q8_NP2(q8_dot, 4) Q8_NP2(q8_dot, 3) Q8_NP2(q8_dot, 2)
    default: Q8_NP2(q8_dot, 1)
    }
}

/* One copy that prefetches (steps of up to Q8_PREFETCH_BLOCKS blocks of rows) and one that
 * does not: a run-time test in the loop made both slower, 30 % at 128 rows (run 22). */
#define Q8_GROUP_AVX512(NAME, PREFETCH)                                                                   \
    static ME_AVX512 void NAME(const float *x, int64_t ldx, int64_t mr, q8_weight w, int64_t n, int64_t k, \
                               const float *bias, const float *residual, int64_t ldr, float *y, int64_t ldy, \
                               int64_t g) {                                                               \
        const int prefetch = PREFETCH;                                                                    \
        Q8_GROUP_PROLOGUE(1)                                                                              \
        switch (mr) {                                                                                     \
        Q8_NP1(q8_dot512, 16) Q8_NP1(q8_dot512, 15) Q8_NP1(q8_dot512, 14) Q8_NP1(q8_dot512, 13)          \
        Q8_NP1(q8_dot512, 12) Q8_NP1(q8_dot512, 11) Q8_NP1(q8_dot512, 10) Q8_NP1(q8_dot512, 9)           \
        Q8_NP2(q8_dot512, 8) Q8_NP2(q8_dot512, 7) Q8_NP2(q8_dot512, 6) Q8_NP2(q8_dot512, 5)              \
        Q8_NP3(q8_dot512, 4) Q8_NP3(q8_dot512, 3) Q8_NP3(q8_dot512, 2)                                   \
        default: Q8_NP3(q8_dot512, 1)                                                                     \
        }                                                                                                 \
    }
Q8_GROUP_AVX512(q8_dot_group_avx512, 1)
Q8_GROUP_AVX512(q8_dot_group_avx512_blocks, 0)
#undef Q8_GROUP_AVX512
#undef Q8_GROUP_PROLOGUE
#undef Q8_NP3
#undef Q8_NP2
#undef Q8_NP1

/* Panel p of w as three float32 6-column panels [k, 6] one after the other at out (columns
 * 0-5, 6-11 and 12-15 of the panel, the last two columns zero), exactly the weights the dot
 * products compute with. */
static inline void q8_dequantize(q8_weight w, int64_t k, int64_t p, float *out) {
    const int8_t *q = w.q + p * k * Q8PANEL;
    const float *scales = w.scales + p * q8_groups(k) * Q8PANEL;
    float *sub0 = out, *sub1 = out + k * WPANEL, *sub2 = out + 2 * k * WPANEL;
    const __m256i up2 = _mm256_setr_epi32(2, 3, 4, 5, 6, 7, 0, 1), up4 = _mm256_setr_epi32(4, 5, 6, 7, 0, 1, 2, 3);
    const __m256 z = _mm256_setzero_ps();
    __m256 first1 = z, first2 = z;
    for (int64_t g = 0; g < q8_groups(k); g++) {
        const __m256 s_lo = _mm256_loadu_ps(scales + g * Q8PANEL), s_hi = _mm256_loadu_ps(scales + g * Q8PANEL + 8);
        const int64_t end = (g + 1) * QGROUP < k ? (g + 1) * QGROUP : k;
        for (int64_t c = g * QGROUP; c < end; c++) {
            const __m256 lo = q8_load8(q + c * Q8PANEL, s_lo), hi = q8_load8(q + c * Q8PANEL + 8, s_hi);
            /* columns 6-11: lanes 6, 7 of lo and 0-3 of hi; 12-15: lanes 4-7 of hi, then zeros */
            const __m256 v1 = _mm256_permutevar8x32_ps(_mm256_permute2f128_ps(lo, hi, 0x21), up2);
            const __m256 v2 = _mm256_blend_ps(_mm256_permutevar8x32_ps(hi, up4), z, 0xF0);
            /* eight lanes a store: the next k-step's stores overwrite the two past this one's six */
            _mm256_storeu_ps(sub0 + c * WPANEL, lo);
            _mm256_storeu_ps(sub1 + c * WPANEL, v1);
            _mm256_storeu_ps(sub2 + c * WPANEL, v2);
            if (c == 0) {
                first1 = v1;
                first2 = v2;
            }
        }
    }
    /* the last k-step's stores into sub0 and sub1 ran into the first k-step of sub1 and sub2 */
    const __m256i six = tail_mask(WPANEL);
    _mm256_maskstore_ps(sub1, six, first1);
    _mm256_maskstore_ps(sub2, six, first2);
}

/* Whether q8_linear_team needs packed x and dequantized panels for m rows: only the AVX2
 * tiles do. The caller asks once (use_avx512) and passes the same answer to the team. */
static inline int q8_needs_scratch(int64_t m, int avx512) { return !avx512 && m > DOT_ROWS; }

/* y[:m, :n] = x @ w^T (+ bias) (+ residual) over the calling team: with AVX-512 (avx512, the
 * caller's use_avx512()) through the dot products, otherwise as weight_linear_team, where
 * q8_needs_scratch says so with x packed into xp (wpanel_x_floats(m, k) floats, shared) and
 * the dequantized panels in wq (q8_scratch_floats(k) floats for each thread of the team, by
 * thread number). Ends with a barrier. */
static inline void q8_linear_team(const float *x, int64_t m, int64_t ldx, q8_weight w, int64_t n, int64_t k,
                                  const float *bias, const float *residual, int64_t ldr, float *y, int64_t ldy,
                                  int avx512, float *xp, float *wq) {
    const int64_t count = (n + Q8PANEL - 1) / Q8PANEL;
    if (m <= 0 || k <= 0) return;  /* the whole team returns (the caller handles k = 0) */
    if (avx512) {  /* every step through the dot products, Q8_ROWS512 rows at a time */
        const int64_t blocks = (m + Q8_ROWS512 - 1) / Q8_ROWS512;
        const int64_t first = m < Q8_ROWS512 ? m : Q8_ROWS512, last = m - (blocks - 1) * Q8_ROWS512;
        const int64_t groups = (count + q8_dot_group(first, 1) - 1) / q8_dot_group(first, 1);
        const int64_t last_groups = (count + q8_dot_group(last, 1) - 1) / q8_dot_group(last, 1);
        #pragma omp for schedule(static)
        for (int64_t task = 0; task < (blocks - 1) * groups + last_groups; task++) {
            const int64_t block = task / groups < blocks - 1 ? task / groups : blocks - 1;
            const int64_t g = block < blocks - 1 ? task % groups : task - (blocks - 1) * groups;
            const int64_t r0 = block * Q8_ROWS512, rows = block < blocks - 1 ? Q8_ROWS512 : last;
            const float *res = residual ? residual + r0 * ldr : NULL;
            if (blocks <= Q8_PREFETCH_BLOCKS) q8_dot_group_avx512(x + r0 * ldx, ldx, rows, w, n, k, bias, res, ldr, y + r0 * ldy, ldy, g);
            else q8_dot_group_avx512_blocks(x + r0 * ldx, ldx, rows, w, n, k, bias, res, ldr, y + r0 * ldy, ldy, g);
        }
        return;
    }
    if (m <= DOT_ROWS) {
        const int64_t group = q8_dot_group(m, 0);
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < (count + group - 1) / group; g++)
            q8_dot_group_avx2(x, ldx, m, w, n, k, bias, residual, ldr, y, ldy, g);
        return;
    }
    float *mine = wq + omp_get_thread_num() * q8_scratch_floats(k);
    const int64_t chunk = wpanel_chunk_rows(m, k);
    for (int64_t m0 = 0; m0 < m; m0 += chunk) {
        const int64_t rows = m - m0 < chunk ? m - m0 : chunk;
        pack_x_team(x + m0 * ldx, rows, ldx, k, XPANEL, xp);
        const float *r = residual ? residual + m0 * ldr : NULL;
        float *out = y + m0 * ldy;
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < count; p++) {
            q8_dequantize(w, k, p, mine);
            const int64_t col = p * Q8PANEL, end = n < col + Q8PANEL ? n : col + Q8PANEL;
            if (rows <= XPANEL) {  /* columns 0-11 as one pair of panels, then 12-15 */
                weight_panel_rows(xp, rows, mine, col, end, k, bias, r, ldr, out, ldy, 0);
                if (end > col + 2 * WPANEL)
                    weight_panel_rows(xp, rows, mine + 2 * k * WPANEL, col + 2 * WPANEL, end, k, bias, r, ldr, out, ldy, 0);
            } else {
                for (int64_t i = 0; i < 3 && col + i * WPANEL < end; i++)
                    weight_panel_rows(xp, rows, mine + i * k * WPANEL, col + i * WPANEL, end, k, bias, r, ldr, out, ldy, 0);
            }
        }
    }
}

#endif
