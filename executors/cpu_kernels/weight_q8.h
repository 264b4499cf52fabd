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

#include "pack_x.h"
#include "weight_q8_dot.h"

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
            if (blocks <= Q8_PREFETCH_BLOCKS)
                q8_dot_group_avx512(x + r0 * ldx, ldx, rows, w, n, k, bias, res, ldr, y + r0 * ldy, ldy, g);
            else
                q8_dot_group_avx512_blocks(x + r0 * ldx, ldx, rows, w, n, k, bias, res, ldr, y + r0 * ldy, ldy, g);
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
        pack_x_team(x + m0 * ldx, NULL, 0, rows, ldx, k, XPANEL, xp);
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
