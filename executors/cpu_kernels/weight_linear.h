/* The float32 matmul over 6-column weight panels, for steps of every size, shared out over
 * the calling OpenMP team: the dot products (weight_panel.h) up to DOT_ROWS rows, past them
 * the packed tiles, AVX-512 (weight_panel512.h) where use_avx512() says so, else AVX2. */
#ifndef MODELEXEC_WEIGHT_LINEAR_H
#define MODELEXEC_WEIGHT_LINEAR_H

#include "weight_panel512.h"

/* y[:m, :n] = x @ w^T (+ bias) (+ residual) over the calling team, the tiles on AVX-512 where
 * avx512 (the caller's use_avx512(), the same for the whole team). Up to DOT_ROWS rows read
 * x in place; more are packed chunk by chunk into xp (wpanel_x_floats(m, k) floats, shared
 * by the team). Ends with a barrier: the caller may read y and reuse xp at once. */
static inline void weight_linear_team(const float *x, int64_t m, int64_t ldx, const float *panels, int64_t n,
                                      int64_t k, const float *bias, const float *residual, int64_t ldr, float *y,
                                      int64_t ldy, int avx512, float *xp) {
    const int64_t count = (n + WPANEL - 1) / WPANEL;
    if (m <= 0 || k <= 0) return;  /* the whole team returns (the caller handles k = 0) */
    if (m <= DOT_ROWS) {
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < (count + dot_group(m) - 1) / dot_group(m); g++)
            weight_dot_group(x, ldx, m, panels, n, k, bias, residual, ldr, y, ldy, g);
        return;
    }
    const int64_t chunk = wpanel_chunk_rows(m, k);
    for (int64_t m0 = 0; m0 < m; m0 += chunk) {
        const int64_t rows = m - m0 < chunk ? m - m0 : chunk;
        const float *r = residual ? residual + m0 * ldr : NULL;
        float *out = y + m0 * ldy;
        if (avx512) {
            pack_x_team(x + m0 * ldx, rows, ldx, k, XPANEL16, xp);
            #pragma omp for schedule(static)
            for (int64_t p = 0; p < count; p += panels512(rows))
                weight_rows512(xp, rows, panels, p, n, k, bias, r, ldr, out, ldy);
        } else {
            pack_x_team(x + m0 * ldx, rows, ldx, k, XPANEL, xp);
            #pragma omp for schedule(static)
            for (int64_t p = 0; p < count; p += rows <= XPANEL ? 2 : 1)
                weight_panel_rows(xp, rows, panels + p * k * WPANEL, p * WPANEL, n, k, bias, r, ldr, out, ldy, 1);
        }
    }
}

#endif
