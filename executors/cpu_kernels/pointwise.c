/* RMSNorm, rotary embedding and the gated activation for float32 rows: the small per-layer
 * ops of a decode step.
 *
 * At batch 1 torch spends ~45 us on an F.rms_norm of one 576-float row (dispatch and the
 * op's own set-up, not the arithmetic) and ~15 us on a rotation; a step of SmolLM2 runs 61
 * norms and 30 rotations, ~3.5 ms of a ~30 ms step. These loops take well under a
 * microsecond a row.
 */
#include "pointwise.h"

/* y = x * rsqrt(mean(x^2) + eps) * w over rows of n floats. Rows are addressed in two levels
 * (outer, inner) so that one call covers a [m, heads, d] view of a fused projection's output:
 * row (o, i) starts at x + o * ldx_outer + i * ldx_inner, and lands at y + o * ldy_outer +
 * i * ldy_inner. y may be x. */
void me_rms_norm_f32(const float *x, int64_t outer, int64_t inner, int64_t ldx_outer, int64_t ldx_inner, int64_t n,
                     const float *w, float eps, float *y, int64_t ldy_outer, int64_t ldy_inner, int threads) {
    const int64_t rows = outer * inner;
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows * n >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t o = r / inner, i = r % inner;
        rms_norm_row(x + o * ldx_outer + i * ldx_inner, n, w, eps, y + o * ldy_outer + i * ldy_inner);
    }
}

/* NeoX rotation of `heads` heads of d floats for each of m tokens, in place:
 * x = x * cos[p] + swap_halves(x) * signed_sin[p], p = positions[t]; the tables are
 * [max_positions, d] (signed_sin: sin with its first half negated, layers.py's table).
 * Token t's heads start at x + t * ldx, d floats apart. d even, at most MAX_HEAD_DIM.
 * Threaded over tokens for prefill-sized steps (decode steps stay on the caller's thread:
 * waking the team costs more than their rows). */
void me_rope_f32(float *x, int64_t m, int64_t heads, int64_t ldx, int64_t d, const int64_t *positions,
                 const float *cos_table, const float *signed_sin_table, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (m * heads * d >= 65536)
    for (int64_t t = 0; t < m; t++)
        for (int64_t h = 0; h < heads; h++)
            rope_head(x + t * ldx + h * d, d, cos_table + positions[t] * d, signed_sin_table + positions[t] * d);
}

/* A gated MLP's activation: y[t, j] = act(gu[t, j]) * gu[t, inter + j], act SiLU (0) or
 * GELU with the tanh approximation (1); gu rows ldg apart, y [m, inter] contiguous. Threaded
 * over rows for prefill-sized steps, as the rotation. */
void me_glu_f32(const float *gu, int64_t m, int64_t ldg, int64_t inter, int activation, float *y, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (m * inter >= 65536)
    for (int64_t t = 0; t < m; t++) glu_row(gu + t * ldg, gu + t * ldg + inter, inter, activation, y + t * inter);
}
