/* The float32 matmul over 6-column weight panels, for steps of every size, shared out over
 * the calling OpenMP team: the dot products (weight_panel.h) up to DOT_ROWS rows, past them
 * the packed tiles, AVX-512 (weight_panel512.h) where use_avx512() says so, else AVX2. */
#ifndef MODELEXEC_WEIGHT_LINEAR_H
#define MODELEXEC_WEIGHT_LINEAR_H

#include <omp.h>

#include "pack_x.h"
#include "weight_panel512.h"

/* The matmul a step runs after this one (its weight panels, outputs and inputs), for the dot
 * products to prefetch: panels NULL for none. */
typedef struct {
    const float *panels;
    int64_t n, k;
} next_matmul;

/* Thread t of T's share [*g0, *g1) of `groups` groups: the dot products share them out by
 * hand, not by `omp for`, so that a thread knows its first group of the next matmul. */
static inline void dot_share(int64_t groups, int t, int T, int64_t *g0, int64_t *g1) {
    *g0 = groups * t / T;
    *g1 = groups * (t + 1) / T;
}

/* The tiles' half of weight_linear_team (m > DOT_ROWS rows), over the calling team; where up
 * is set, x and up are a gated MLP's gate and up halves (rows ldx apart, k columns each) and
 * the rows multiplied are act(x) * up, computed as they are packed (pack_x.h). */
static inline void weight_rows_team(const float *x, const float *up, int activation, int64_t m, int64_t ldx,
                                    const float *panels, int64_t n, int64_t k, const float *bias,
                                    const float *residual, int64_t ldr, float *y, int64_t ldy, int avx512,
                                    float *xp) {
    const int64_t count = (n + WPANEL - 1) / WPANEL, chunk = wpanel_chunk_rows(m, k);
    for (int64_t m0 = 0; m0 < m; m0 += chunk) {
        const int64_t rows = m - m0 < chunk ? m - m0 : chunk;
        const float *r = residual ? residual + m0 * ldr : NULL, *u = up ? up + m0 * ldx : NULL;
        float *out = y + m0 * ldy;
        if (avx512) {
            pack_x_team(x + m0 * ldx, u, activation, rows, ldx, k, XPANEL16, xp);
            #pragma omp for schedule(static)
            for (int64_t p = 0; p < count; p += panels512(rows))
                weight_rows512(xp, rows, panels, p, n, k, bias, r, ldr, out, ldy);
        } else {
            pack_x_team(x + m0 * ldx, u, activation, rows, ldx, k, XPANEL, xp);
            #pragma omp for schedule(static)
            for (int64_t p = 0; p < count; p += rows <= XPANEL ? 2 : 1)
                weight_panel_rows(xp, rows, panels + p * k * WPANEL, p * WPANEL, n, k, bias, r, ldr, out, ldy, 1);
        }
    }
}

/* y[:m, :n] = x @ w^T (+ bias) (+ residual) over the calling team, the tiles on AVX-512 where
 * avx512 (the caller's use_avx512(), the same for the whole team). Up to DOT_ROWS rows read
 * x in place, each thread prefetching its next group as it goes and, in its last, its first
 * group of `next` where that is given: a decode step's matmuls follow each other with little
 * between, and each thread's share would otherwise start cold (3-4 % of a batch-1 step's
 * kernel, RESULTS run 22). More rows are packed chunk by chunk into xp (wpanel_x_floats(m, k)
 * floats, shared by the team). Ends with a barrier: the caller may read y and reuse xp at once. */
static inline void weight_linear_team(const float *x, int64_t m, int64_t ldx, const float *panels, int64_t n,
                                      int64_t k, const float *bias, const float *residual, int64_t ldr, float *y,
                                      int64_t ldy, int avx512, float *xp, next_matmul next) {
    const int64_t count = (n + WPANEL - 1) / WPANEL;
    if (m <= 0 || k <= 0) return;  /* the whole team returns (the caller handles k = 0) */
    if (m <= DOT_ROWS) {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t group = dot_group(m), bytes = dot_group_bytes(m, k);
        int64_t g0, g1;
        dot_share((count + group - 1) / group, t, T, &g0, &g1);
        for (int64_t g = g0; g < g1; g++) {
            const char *ahead = (const char *)(panels + (g + 1) * group * k * WPANEL);
            int64_t ahead_bytes = bytes;
            if (g + 1 == g1 && next.panels) {  /* this thread's first group of the next matmul */
                int64_t n0, n1;
                dot_share(((next.n + WPANEL - 1) / WPANEL + group - 1) / group, t, T, &n0, &n1);
                ahead = (const char *)(next.panels + n0 * group * next.k * WPANEL);
                ahead_bytes = dot_group_bytes(m, next.k);
            }
            weight_dot_group(x, ldx, m, panels, n, k, bias, residual, ldr, y, ldy, g, ahead, ahead_bytes);
        }
        #pragma omp barrier
        return;
    }
    weight_rows_team(x, NULL, 0, m, ldx, panels, n, k, bias, residual, ldr, y, ldy, avx512, xp);
}

#endif
