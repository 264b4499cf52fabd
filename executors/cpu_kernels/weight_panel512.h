/* The float32 6-column weight panels' tiles with AVX-512 (weight_panel.h has the layout and
 * the AVX2 tiles): what steps of more than DOT_ROWS rows run where the CPU has AVX-512.
 *
 * Those steps are compute-bound, and the AVX2 tiles run at the two cores' AVX2 FMA peak
 * (~245 GFLOP/s on the Zen 5 of bench/RESULTS.md run 21). Here x is packed as 16-row panels
 * [k, 16] (one zmm a k-step), and a tile keeps up to 24 accumulators of 16 rows x 1 column:
 *   rows > 16: two x panels against two weight panels (32 rows x 12 columns): per k, two
 *              loads of x from the L2, twelve broadcasts of the weights, 24 FMAs;
 *   rows <= 16: one x panel against up to four weight panels (16 rows x 24 columns).
 * As it walks k, a tile prefetches the same k-step of the nw panels after its own: the next
 * task of its thread under a static schedule. Steps of 16-64 rows are bound by the weights'
 * stream as much as by the FMAs, and the hardware's prefetchers alone let the two take
 * turns: 1.7-1.9x on a 32-row step of SmolLM2's lm_head and gate/up matrices (RESULTS run
 * 21). A prefetch past the weights' end is harmless (prefetches do not fault).
 * Each output is the same FMA chain over k in order as on every other path, so the results
 * equal the AVX2 tiles' and the dot products' bit for bit. The stores reuse the AVX2 ones:
 * each zmm is two 8-row halves, transposed in registers into rows of six.
 */
#ifndef MODELEXEC_WEIGHT_PANEL512_H
#define MODELEXEC_WEIGHT_PANEL512_H

#include "isa.h"
#include "weight_panel.h"

#define XPANEL16 16  /* rows of an AVX-512 x panel */

/* The two 8-row halves of a column vector. */
#define LO8(v) _mm512_castps512_ps256(v)
#define HI8(v) _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))

/* nx (1, 2) x panels at xa ([k, 16] each, k * 16 apart) against nw (1..4, nw * nx <= 4)
 * weight panels at w (k * 6 apart): rows [0, rows) and columns [0, cols) of the tile into y
 * (+ bias) (+ residual). The accumulators are named registers a<x panel><weight panel><column>;
 * the unused ones compile away where nx and nw are constants. */
static inline ME_AVX512 __attribute__((always_inline)) void weight_tile512(const float *w, const int nw,
                                                                           const float *xa, const int nx,
                                                                           int64_t k, int64_t rows, int cols,
                                                                           const float *bias, const float *residual,
                                                                           int64_t ldr, float *y, int64_t ldy) {
    const int64_t wstride = k * WPANEL, xstride = k * XPANEL16;
    const __m512 z = _mm512_setzero_ps();
    __m512 a000 = z, a001 = z, a002 = z, a003 = z, a004 = z, a005 = z, a010 = z, a011 = z, a012 = z, a013 = z,
           a014 = z, a015 = z, a020 = z, a021 = z, a022 = z, a023 = z, a024 = z, a025 = z, a030 = z, a031 = z,
           a032 = z, a033 = z, a034 = z, a035 = z, a100 = z, a101 = z, a102 = z, a103 = z, a104 = z, a105 = z,
           a110 = z, a111 = z, a112 = z, a113 = z, a114 = z, a115 = z;
    /* never used (nw * nx <= 4): named so that T512_COL compiles for every panel */
    __m512 a120 = z, a121 = z, a122 = z, a123 = z, a124 = z, a125 = z, a130 = z, a131 = z, a132 = z, a133 = z,
           a134 = z, a135 = z;
#define T512_COL(p, j)                                                     \
    {                                                                      \
        const __m512 s = _mm512_set1_ps(wc[(p) * wstride + (j)]);          \
        a0##p##j = _mm512_fmadd_ps(s, x0, a0##p##j);                       \
        if (nx > 1 && p < 2) a1##p##j = _mm512_fmadd_ps(s, x1, a1##p##j);  \
    }
#define T512_PANEL(p)                                                                                  \
    if (nw > p) {                                                                                      \
        T512_COL(p, 0) T512_COL(p, 1) T512_COL(p, 2) T512_COL(p, 3) T512_COL(p, 4) T512_COL(p, 5)      \
    }
    /* The first `ahead` k-steps each fetch one row of the tile's residual and its output, which
     * the store then finds in the cache: a miss a row there held a prefill's o and down
     * matmuls 4-11 % below the others (bench/RESULTS.md run 23). */
    const int64_t ahead = rows < k ? rows : k;
    const int span = cols * (int)sizeof(float) - 1;  /* the row's last byte, maybe a line further */
    for (int64_t c = 0; c < k; c++) {
        const __m512 x0 = _mm512_loadu_ps(xa + c * XPANEL16);
        const __m512 x1 = nx > 1 ? _mm512_loadu_ps(xa + xstride + c * XPANEL16) : z;
        const float *wc = w + c * WPANEL;
        for (int p = nw; p < 2 * nw; p++) _mm_prefetch((const char *)(wc + p * wstride), _MM_HINT_T0);
        if (c < ahead) {
            if (residual) {
                _mm_prefetch((const char *)(residual + c * ldr), _MM_HINT_T0);
                _mm_prefetch((const char *)(residual + c * ldr) + span, _MM_HINT_T0);
            }
            __builtin_prefetch(y + c * ldy, 1, 3);
            __builtin_prefetch((const char *)(y + c * ldy) + span, 1, 3);
        }
        T512_PANEL(0) T512_PANEL(1) T512_PANEL(2) T512_PANEL(3)
    }
#undef T512_PANEL
#undef T512_COL
    /* x panel i, half h (rows 16 i + 8 h ..), weight panel p (columns 6 p ..) */
#define T512_STORE(i, p, h, HALF)                                                                             \
    if (nw > p && cols > (p) * WPANEL && rows > 16 * (i) + 8 * (h)) {                                          \
        const int64_t row0 = 16 * (i) + 8 * (h), left = rows - row0 < XPANEL ? rows - row0 : XPANEL;                 \
        const int c6 = cols - (p) * WPANEL < WPANEL ? cols - (p) * WPANEL : WPANEL;                            \
        STORE_COLUMNS(HALF(a##i##p##0), HALF(a##i##p##1), HALF(a##i##p##2), HALF(a##i##p##3), HALF(a##i##p##4), \
                      HALF(a##i##p##5), left, c6, bias ? bias + (p) * WPANEL : NULL,                          \
                      residual ? residual + row0 * ldr + (p) * WPANEL : NULL, ldr, y + row0 * ldy + (p) * WPANEL, ldy); \
    }
#define T512_STORE_PANEL(i, p) T512_STORE(i, p, 0, LO8) T512_STORE(i, p, 1, HI8)
    T512_STORE_PANEL(0, 0) T512_STORE_PANEL(0, 1) T512_STORE_PANEL(0, 2) T512_STORE_PANEL(0, 3)
    if (nx > 1) {
        T512_STORE_PANEL(1, 0) T512_STORE_PANEL(1, 1)
    }
#undef T512_STORE_PANEL
#undef T512_STORE
}

/* Weight panels that one task of weight_rows512 takes for a chunk of `rows` rows. */
static inline int64_t panels512(int64_t rows) { return rows <= XPANEL16 ? 4 : 2; }

/* A packed chunk of `rows` rows (16-row x panels at xp) against the panels512(rows) weight
 * panels from panel p (fewer at the end), output columns 6 p .. of y (up to n). */
static ME_AVX512 void weight_rows512(const float *xp, int64_t rows, const float *panels, int64_t p, int64_t n,
                                     int64_t k, const float *bias, const float *residual, int64_t ldr, float *y,
                                     int64_t ldy) {
    const int64_t col = p * WPANEL, left = (n - col + WPANEL - 1) / WPANEL;
    const float *w = panels + p * k * WPANEL, *b = bias ? bias + col : NULL, *res = residual ? residual + col : NULL;
    float *out = y + col;
    if (rows <= XPANEL16) {
        const int cols = (int)(n - col < 4 * WPANEL ? n - col : 4 * WPANEL);
        switch (left < 4 ? left : 4) {
        case 4: weight_tile512(w, 4, xp, 1, k, rows, cols, b, res, ldr, out, ldy); break;
        case 3: weight_tile512(w, 3, xp, 1, k, rows, cols, b, res, ldr, out, ldy); break;
        case 2: weight_tile512(w, 2, xp, 1, k, rows, cols, b, res, ldr, out, ldy); break;
        default: weight_tile512(w, 1, xp, 1, k, rows, cols, b, res, ldr, out, ldy); break;
        }
        return;
    }
    const int cols = (int)(n - col < 2 * WPANEL ? n - col : 2 * WPANEL);
    for (int64_t i = 0; i < rows; i += 2 * XPANEL16) {
        const float *xa = xp + i * k, *ri = res ? res + i * ldr : NULL;
        const int64_t tile_rows = rows - i < 2 * XPANEL16 ? rows - i : 2 * XPANEL16;
        float *yi = out + i * ldy;
        if (tile_rows > XPANEL16) {
            if (left > 1) weight_tile512(w, 2, xa, 2, k, tile_rows, cols, b, ri, ldr, yi, ldy);
            else weight_tile512(w, 1, xa, 2, k, tile_rows, cols, b, ri, ldr, yi, ldy);
        } else {
            if (left > 1) weight_tile512(w, 2, xa, 1, k, tile_rows, cols, b, ri, ldr, yi, ldy);
            else weight_tile512(w, 1, xa, 1, k, tile_rows, cols, b, ri, ldr, yi, ldy);
        }
    }
}

#undef LO8
#undef HI8

#endif
