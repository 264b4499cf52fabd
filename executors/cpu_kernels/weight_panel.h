/* float32 matmuls y = x @ w^T over weights stored as 6-column panels (weight_panel.c,
 * decode_step.c; the layout in panels.py).
 *
 * A weight [n, k] is stored as ceil(n / 6) panels of [k, 6]: panel p holds output columns
 * 6 p .. 6 p + 5, k-major, zero-padded past n. Each panel streams once from memory per
 * chunk of rows:
 *
 * - steps of up to DOT_ROWS rows read x in place: per k, one load of each of two or three
 *   panels' six floats and a broadcast of each row's x (weight_dot);
 * - larger steps pack x as 8-row panels [k, 8] (zero-padded rows), and a tile of one weight
 *   panel against two x panels keeps its 6 x 16 outputs in 12 accumulators: per k, six
 *   broadcasts of the weight, two vector loads of x from the L2, twelve FMAs. Each 64-byte
 *   line of the weight then feeds 32 FMAs as it streams, where a 16-column panel broadcasting
 *   x fed 12, and one core's share of the memory's rate could not keep up with the
 *   arithmetic at 8-64 rows (bench/RESULTS.md run 16). Up to 8 rows, one x panel meets two
 *   weight panels instead (8 x 12).
 *
 * Every output is one FMA chain over k in order, on every path: a row's result does not
 * depend on its batch mates, and matches the 16-column panels' bit for bit. The tiles'
 * outputs come out as columns of rows; an in-register 8 x 8 transpose turns them into rows
 * of six for the store, the bias and the residual.
 */
#ifndef MODELEXEC_WEIGHT_PANEL_H
#define MODELEXEC_WEIGHT_PANEL_H

#include <string.h>

#include "simd.h"

#define WPANEL 6           /* output columns of a weight panel */
#define XPANEL 8           /* rows of an x panel: one vector */
#define DOT_ROWS 6         /* steps of up to this many rows read x in place, with no packing */
#define DOT_WIDE_ROWS 4    /* ... three weight panels at a time up to this many, two past it */
#define X_CHUNK_FLOATS (96 * 1024)  /* packed rows of x the threads share per chunk: 384 KiB, in the L2 */

/* Rows of x packed per chunk for inner dimension k: a multiple of 2 x panels, at least one tile. */
static inline int64_t wpanel_chunk_rows(int64_t m, int64_t k) {
    int64_t rows = (X_CHUNK_FLOATS / k) & ~(int64_t)(2 * XPANEL - 1);
    rows = rows < 2 * XPANEL ? 2 * XPANEL : rows;
    return m < rows ? m : rows;
}

/* Floats of packed x that weight_linear_team needs for m rows of inner dimension k: a chunk's
 * rows as x panels of 8 rows, or of 16 (weight_panel512.h). */
static inline int64_t wpanel_x_floats(int64_t m, int64_t k) {
    return m <= DOT_ROWS ? 0 : (wpanel_chunk_rows(m, k) + 2 * XPANEL - 1) / (2 * XPANEL) * (2 * XPANEL) * k;
}

/* 8 x 8 transpose of r0..r7 in place. */
#define TRANSPOSE8(r0, r1, r2, r3, r4, r5, r6, r7)                                                   \
    do {                                                                                             \
        const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);               \
        const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);               \
        const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);               \
        const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);               \
        const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);     \
        const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);     \
        const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);     \
        const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);     \
        r0 = _mm256_permute2f128_ps(u0, u4, 0x20); r1 = _mm256_permute2f128_ps(u1, u5, 0x20);        \
        r2 = _mm256_permute2f128_ps(u2, u6, 0x20); r3 = _mm256_permute2f128_ps(u3, u7, 0x20);        \
        r4 = _mm256_permute2f128_ps(u0, u4, 0x31); r5 = _mm256_permute2f128_ps(u1, u5, 0x31);        \
        r6 = _mm256_permute2f128_ps(u2, u6, 0x31); r7 = _mm256_permute2f128_ps(u3, u7, 0x31);        \
    } while (0)

/* Two floats at p (a float's alignment) as the low lanes of a vector, the others zero, and
 * back: a memcpy through a double, one 64-bit move (vmovq / vmovlps) once compiled, as the
 * _mm_load_sd / _mm_store_sd through a cast pointer were. Such a cast (double *) of a row
 * with an odd stride or offset is misaligned: undefined, and UBSan reports it. */
static inline __m128 load_pair(const float *p) {
    double two;
    memcpy(&two, p, sizeof two);
    return _mm_castpd_ps(_mm_set_sd(two));
}

static inline void store_pair(float *p, __m128 v) {
    const double two = _mm_cvtsd_f64(_mm_castps_pd(v));
    memcpy(p, &two, sizeof two);
}

/* One output row of six columns (lanes 0..cols-1 of v) into out (+ bias) (+ residual). */
static inline void store_row6(__m256 v, int cols, __m256 bias, const float *residual, float *out) {
    v = _mm256_add_ps(v, bias);
    if (cols == WPANEL) {
        __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
        if (residual) {
            lo = _mm_add_ps(lo, _mm_loadu_ps(residual));
            hi = _mm_add_ps(hi, load_pair(residual + 4));
        }
        _mm_storeu_ps(out, lo);
        store_pair(out + 4, hi);
    } else {
        float lanes[8];
        _mm256_storeu_ps(lanes, v);
        for (int j = 0; j < cols; j++) out[j] = lanes[j] + (residual ? residual[j] : 0.0f);
    }
}

static inline __m256 bias6(const float *bias, int cols) {
    return bias ? _mm256_maskload_ps(bias, tail_mask(cols)) : _mm256_setzero_ps();
}

/* Rows [0, rows) (rows <= 8) of a tile's six column vectors c0..c5 (lane i: row i), turned
 * into rows by an 8 x 8 transpose, into y (+ bias) (+ residual). */
#define STORE_COLUMNS(c0, c1, c2, c3, c4, c5, rows, cols, bias, residual, ldr, y, ldy)                   \
    do {                                                                                                \
        __m256 r0 = c0, r1 = c1, r2 = c2, r3 = c3, r4 = c4, r5 = c5, r6 = _mm256_setzero_ps(), r7 = r6; \
        TRANSPOSE8(r0, r1, r2, r3, r4, r5, r6, r7);                                                     \
        const __m256 r_[8] = {r0, r1, r2, r3, r4, r5, r6, r7}, b_ = bias6(bias, cols);                  \
        for (int64_t i_ = 0; i_ < (rows); i_++)                                                         \
            store_row6(r_[i_], cols, b_, (residual) ? (residual) + i_ * (ldr) : NULL, (y) + i_ * (ldy)); \
    } while (0)

/* A tile of twelve accumulators, sequential over k (each output one FMA chain, so a row's
 * result does not depend on its batch mates or the path):
 *   shape TILE_16x6: weight panel wa against x panels xa and xb (16 rows, 6 columns);
 *   shape TILE_8x12: weight panels wa and wb against x panel xa (8 rows, 12 columns);
 *   shape TILE_8x6:  wa against xa (8 rows, 6 columns).
 * Rows [0, rows) and columns [0, cols) (of 6 or 12) go to y. Where next is set, each k-step
 * prefetches its line of the panel at next (and of the one after it, for TILE_8x12). */
enum { TILE_16x6, TILE_8x12, TILE_8x6 };
static inline __attribute__((always_inline)) void weight_tile(const float *wa, const float *wb, const float *xa,
                                                              const float *xb, const int shape, int64_t k,
                                                              int64_t rows, int cols, const float *bias,
                                                              const float *residual, int64_t ldr, float *y,
                                                              int64_t ldy, const float *next) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, b0 = a0, b1 = a0, b2 = a0,
           b3 = a0, b4 = a0, b5 = a0;
    for (int64_t c = 0; c < k; c++) {
        const __m256 x0 = _mm256_loadu_ps(xa + c * XPANEL);
        const __m256 x1 = shape == TILE_16x6 ? _mm256_loadu_ps(xb + c * XPANEL) : x0;
        const float *w = wa + c * WPANEL, *v = shape == TILE_8x12 ? wb + c * WPANEL : w;
        if (next) {
            _mm_prefetch((const char *)(next + c * WPANEL), _MM_HINT_T0);
            if (shape == TILE_8x12) _mm_prefetch((const char *)(next + (k + c) * WPANEL), _MM_HINT_T0);
        }
#define WT_COL(j)                                                                 \
    {                                                                             \
        const __m256 s = _mm256_broadcast_ss(w + j);                              \
        a##j = _mm256_fmadd_ps(s, x0, a##j);                                      \
        if (shape == TILE_16x6) b##j = _mm256_fmadd_ps(s, x1, b##j);              \
        if (shape == TILE_8x12) b##j = _mm256_fmadd_ps(_mm256_broadcast_ss(v + j), x0, b##j); \
    }
        WT_COL(0) WT_COL(1) WT_COL(2) WT_COL(3) WT_COL(4) WT_COL(5)
#undef WT_COL
    }
    const int first = cols < WPANEL ? cols : WPANEL;
    STORE_COLUMNS(a0, a1, a2, a3, a4, a5, rows < XPANEL ? rows : XPANEL, first, bias, residual, ldr, y, ldy);
    if (shape == TILE_16x6 && rows > XPANEL)
        STORE_COLUMNS(b0, b1, b2, b3, b4, b5, rows - XPANEL, first, bias, residual ? residual + XPANEL * ldr : NULL,
                      ldr, y + XPANEL * ldy, ldy);
    if (shape == TILE_8x12 && cols > WPANEL)
        STORE_COLUMNS(b0, b1, b2, b3, b4, b5, rows, cols - WPANEL, bias ? bias + WPANEL : NULL,
                      residual ? residual + WPANEL : NULL, ldr, y + WPANEL, ldy);
}

/* Up to three weight panels (np, at w, w + k 6, w + 2 k 6) against mr rows of x (1..6, read
 * in place, rows ldx apart): per k, one load of each panel's six floats (eight lanes, two
 * ignored) and a broadcast of each row's x, each output one FMA chain over k as in the
 * tiles; the accumulators are named registers (an array of them spills). The last k-step
 * loads six lanes only, so that no read passes the weights' end. As it walks k it prefetches
 * the ahead_bytes at `ahead`, front to back as one stream: the thread's next group, or its
 * first of the step's next matmul (weight_linear.h). One stream runs 5-7 % faster than a
 * stream a panel (three; RESULTS run 22), and a decode row streams the weights 1.3-1.5x
 * faster than the hardware's prefetchers alone make it (run 21). */
static inline __attribute__((always_inline)) void weight_dot(const float *w, const int np, const float *x,
                                                             int64_t ldx, const int mr, int64_t k, int cols,
                                                             const float *bias, const float *residual,
                                                             int64_t ldr, float *y, int64_t ldy, const char *ahead,
                                                             int64_t ahead_bytes) {
    const int64_t stride = k * WPANEL;
    const __m256 z = _mm256_setzero_ps();
    __m256 c00 = z, c01 = z, c02 = z, c10 = z, c11 = z, c12 = z, c20 = z, c21 = z, c22 = z, c30 = z, c31 = z,
           c32 = z, c40 = z, c41 = z, c42 = z, c50 = z, c51 = z, c52 = z;
    const __m256i six = tail_mask(WPANEL);
    const int64_t per = (ahead_bytes + k - 1) / k;  /* bytes of `ahead` to prefetch a k-step */
#define DOT_ROW(i, step)                                                \
    if (mr > i) {                                                      \
        const __m256 s = _mm256_broadcast_ss(x + i * ldx + (step));    \
        c##i##0 = _mm256_fmadd_ps(w0, s, c##i##0);                     \
        if (np > 1) c##i##1 = _mm256_fmadd_ps(w1, s, c##i##1);         \
        if (np > 2) c##i##2 = _mm256_fmadd_ps(w2, s, c##i##2);         \
    }
#define DOT_STEP(step, LOAD)                                                           \
    {                                                                                  \
        const float *at = w + (step) * WPANEL;                                         \
        const __m256 w0 = LOAD(at), w1 = np > 1 ? LOAD(at + stride) : z,               \
                     w2 = np > 2 ? LOAD(at + 2 * stride) : z;                          \
        DOT_ROW(0, step) DOT_ROW(1, step) DOT_ROW(2, step) DOT_ROW(3, step) DOT_ROW(4, step) DOT_ROW(5, step) \
    }
#define LOAD8(at) _mm256_loadu_ps(at)
#define LOAD6(at) _mm256_maskload_ps(at, six)
    for (int64_t c = 0; c + 1 < k; c++) {
        for (int64_t o = 0; o <= per; o += 64) _mm_prefetch(ahead + c * per + o, _MM_HINT_T0);
        DOT_STEP(c, LOAD8)
    }
    DOT_STEP(k - 1, LOAD6)
#undef LOAD6
#undef LOAD8
#undef DOT_STEP
#undef DOT_ROW
    for (int p = 0; p < np; p++) {
        const int valid = cols - p * WPANEL < WPANEL ? cols - p * WPANEL : WPANEL;
        if (valid <= 0) break;
        const __m256 b = bias6(bias ? bias + p * WPANEL : NULL, valid);
        const float *r = residual ? residual + p * WPANEL : NULL;
        float *out = y + p * WPANEL;
#define DOT_OUT(i)                                                                                     \
    if (mr > i)                                                                                        \
        store_row6(p == 0 ? c##i##0 : p == 1 ? c##i##1 : c##i##2, valid, b, r ? r + i * ldr : NULL,    \
                   out + i * ldy);
        DOT_OUT(0) DOT_OUT(1) DOT_OUT(2) DOT_OUT(3) DOT_OUT(4) DOT_OUT(5)
#undef DOT_OUT
    }
}

/* Weight panels a dot call takes for mr rows: as many as the sixteen registers hold. */
static inline int64_t dot_group(int64_t mr) { return mr <= DOT_WIDE_ROWS ? 3 : 2; }

/* Bytes of a group of dot_group(mr) panels at inner dimension k. */
static inline int64_t dot_group_bytes(int64_t mr, int64_t k) {
    return dot_group(mr) * k * WPANEL * (int64_t)sizeof(float);
}

/* Group g of dot_group(mr) weight panels against the mr (<= DOT_ROWS) rows of x, prefetching
 * the ahead_bytes at `ahead` as it goes (weight_dot). */
static inline void weight_dot_group(const float *x, int64_t ldx, int64_t mr, const float *panels, int64_t n,
                                    int64_t k, const float *bias, const float *residual, int64_t ldr, float *y,
                                    int64_t ldy, int64_t g, const char *ahead, int64_t ahead_bytes) {
    const int64_t group = dot_group(mr), col = g * group * WPANEL, count = (n + WPANEL - 1) / WPANEL - g * group;
    const int np = count < group ? (int)count : (int)group;
    const int cols = (int)(n - col < group * WPANEL ? n - col : group * WPANEL);
    const float *w = panels + g * group * k * WPANEL, *b = bias ? bias + col : NULL;
    const float *r = residual ? residual + col : NULL;
#define DOT_CASE(rows)                                                                         \
    case rows:                                                                                 \
        if (np == 3) weight_dot(w, 3, x, ldx, rows, k, cols, b, r, ldr, y + col, ldy, ahead, ahead_bytes);      \
        else if (np == 2) weight_dot(w, 2, x, ldx, rows, k, cols, b, r, ldr, y + col, ldy, ahead, ahead_bytes); \
        else weight_dot(w, 1, x, ldx, rows, k, cols, b, r, ldr, y + col, ldy, ahead, ahead_bytes);              \
        break;
    switch (mr) { DOT_CASE(6) DOT_CASE(5) DOT_CASE(4) DOT_CASE(3) DOT_CASE(2) default: DOT_CASE(1) }
#undef DOT_CASE
}

/* A packed chunk of `rows` rows against the weight panel at w, output columns col.. of y
 * (up to n), and the panel after it where rows <= 8 (one x panel: 8 x 12 tiles, 8 x 6 for a
 * last odd panel), or against that panel alone where more (16-row tiles, an 8-row one to
 * end). Where prefetch, the tiles prefetch the panels of the thread's next task as they walk
 * k (weight_panel512.h says why); the int8 tiles (weight_q8.h) pass panels they dequantized
 * into a scratch, and 0. */
static inline void weight_panel_rows(const float *xp, int64_t rows, const float *w, int64_t col, int64_t n,
                                     int64_t k, const float *bias, const float *residual, int64_t ldr, float *y,
                                     int64_t ldy, int prefetch) {
    const int cols = (int)(n - col < 2 * WPANEL ? n - col : 2 * WPANEL);
    const float *b = bias ? bias + col : NULL, *res = residual ? residual + col : NULL;
    float *out = y + col;
    if (rows <= XPANEL) {
        const float *next = prefetch ? w + 2 * k * WPANEL : NULL;
        if (cols > WPANEL) weight_tile(w, w + k * WPANEL, xp, NULL, TILE_8x12, k, rows, cols, b, res, ldr, out, ldy, next);
        else weight_tile(w, NULL, xp, NULL, TILE_8x6, k, rows, cols, b, res, ldr, out, ldy, NULL);
        return;
    }
    const float *next = prefetch ? w + k * WPANEL : NULL;
    for (int64_t i = 0; i < rows; i += 2 * XPANEL) {
        const float *xa = xp + i * k, *ri = res ? res + i * ldr : NULL;
        const int64_t left = rows - i < 2 * XPANEL ? rows - i : 2 * XPANEL;
        const int c6 = cols < WPANEL ? cols : WPANEL;
        if (left > XPANEL)
            weight_tile(w, NULL, xa, xa + XPANEL * k, TILE_16x6, k, left, c6, b, ri, ldr, out + i * ldy, ldy, next);
        else
            weight_tile(w, NULL, xa, NULL, TILE_8x6, k, left, c6, b, ri, ldr, out + i * ldy, ldy, next);
    }
}

#endif
