/* Packing a step's rows of x as the tiles read them (weight_panel.h, weight_panel512.h,
 * weight_q8.h): x panels of 8 or 16 rows, [k, width], column c of the panel's rows at
 * c * width.
 *
 * Where the matmul is a gated MLP's down projection, x is act(gate) * up of the gate/up
 * matmul's output, and the packing computes it on the way (`up` set): the activation is
 * then computed once per element, as it goes into the panel, with no [m, inter] buffer
 * written and read back and no pass of its own (6 % of a large prefill's time, RESULTS run
 * 23). The lanes are pointwise.h's glu_row's, chunk for chunk (act8 on each eight columns
 * from 0, act1 past the last full eight), so the result is the unfused one bit for bit. */
#ifndef MODELEXEC_PACK_X_H
#define MODELEXEC_PACK_X_H

#include "pointwise.h"
#include "weight_panel.h"

/* Columns [c, c + 8) of one row of x, or act(gate) * up where up is set: an x row's chunk. */
static inline __m256 x_chunk8(const float *x, const float *up, int activation) {
    const __m256 v = _mm256_loadu_ps(x);
    return up ? _mm256_mul_ps(act8(v, activation), _mm256_loadu_ps(up)) : v;
}

/* Element c of one row, as x_chunk8 would give it: act8's lanes up to `full` (the row's
 * columns in whole chunks of eight), act1 past them. */
static inline float x_at(const float *x, const float *up, int activation, int64_t c, int64_t full) {
    if (!up) return x[c];
    if (c >= full) return act1(x[c], activation) * up[c];
    float lanes[8];
    _mm256_storeu_ps(lanes, x_chunk8(x + (c & ~(int64_t)7), up + (c & ~(int64_t)7), activation));
    return lanes[c & 7];
}

/* Columns [c0, c1) of rows [r0, r0 + 8) of x into `out`, column c at out + c * width (an x
 * panel [k, 8] where width is 8; half of a 16-row one [k, 16] where 16), rows past m zero.
 * c0 a multiple of 8. Where up is set, x and up are the gate and up halves of a gated MLP's
 * rows (both ldx apart) and the rows packed are act(x) * up over k columns. */
static inline void pack_x_block(const float *x, const float *up, int activation, int64_t m, int64_t ldx,
                                int64_t k, int64_t r0, int64_t c0, int64_t c1, int64_t width, float *out) {
    const int64_t valid = m - r0 < XPANEL ? m - r0 : XPANEL, full = k & ~(int64_t)7;
    int64_t c = c0;
    if (valid == XPANEL) {
        for (; c + 8 <= c1; c += 8) {
            const int64_t at = r0 * ldx + c;
            const float *s = x + at, *u = up ? up + at : NULL;
#define ROW(i) x_chunk8(s + (i) * ldx, u ? u + (i) * ldx : NULL, activation)
            __m256 v0 = ROW(0), v1 = ROW(1), v2 = ROW(2), v3 = ROW(3), v4 = ROW(4), v5 = ROW(5), v6 = ROW(6),
                   v7 = ROW(7);
#undef ROW
            TRANSPOSE8(v0, v1, v2, v3, v4, v5, v6, v7);
            float *d = out + c * width;
            _mm256_storeu_ps(d, v0); _mm256_storeu_ps(d + width, v1); _mm256_storeu_ps(d + 2 * width, v2);
            _mm256_storeu_ps(d + 3 * width, v3); _mm256_storeu_ps(d + 4 * width, v4);
            _mm256_storeu_ps(d + 5 * width, v5); _mm256_storeu_ps(d + 6 * width, v6);
            _mm256_storeu_ps(d + 7 * width, v7);
        }
    }
    for (; c < c1; c++)
        for (int64_t i = 0; i < XPANEL; i++) {
            const int64_t row = (r0 + i) * ldx;
            out[c * width + i] = i < valid ? x_at(x + row, up ? up + row : NULL, activation, c, full) : 0.0f;
        }
}

/* x[:m] as ceil(m / width) x panels of width (8 or 16) rows [k, width], shared out over the
 * team 8 rows at a time (the rows past m zero), a barrier at the end; act(x) * up where up
 * is set (pack_x_block). */
static inline void pack_x_team(const float *x, const float *up, int activation, int64_t m, int64_t ldx, int64_t k,
                               int64_t width, float *xp) {
    const int64_t blocks = (k + 63) / 64, halves = (m + width - 1) / width * (width / XPANEL);
    #pragma omp for schedule(static)
    for (int64_t task = 0; task < halves * blocks; task++) {
        const int64_t h = task / blocks, c0 = task % blocks * 64, c1 = c0 + 64 < k ? c0 + 64 : k;
        const int64_t q = h * XPANEL / width, lane = h * XPANEL % width;
        pack_x_block(x, up, activation, m, ldx, k, h * XPANEL, c0, c1, width, xp + q * width * k + lane);
    }
}

#endif
