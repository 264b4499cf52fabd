/* RMSNorm, rotary embedding and the gated activation for float32 rows: the small per-layer
 * ops of a decode step.
 *
 * At batch 1 torch spends ~45 us on an F.rms_norm of one 576-float row (dispatch and the
 * op's own set-up, not the arithmetic) and ~15 us on a rotation; a step of SmolLM2 runs 61
 * norms and 30 rotations, ~3.5 ms of a ~30 ms step. These loops take well under a
 * microsecond a row.
 */
#include <math.h>

#include "simd.h"

#define MAX_HEAD_DIM 512

/* y = x * rsqrt(mean(x^2) + eps) * w over rows of n floats. Rows are addressed in two levels
 * (outer, inner) so that one call covers a [m, heads, d] view of a fused projection's output:
 * row (o, i) starts at x + o * ldx_outer + i * ldx_inner, and lands at y + o * ldy_outer +
 * i * ldy_inner. y may be x. */
void me_rms_norm_f32(const float *x, int64_t outer, int64_t inner, int64_t ldx_outer, int64_t ldx_inner, int64_t n,
                     const float *w, float eps, float *y, int64_t ldy_outer, int64_t ldy_inner, int threads) {
    const int64_t rows = outer * inner;
    const int64_t full = n & ~(int64_t)7;
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows * n >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t o = r / inner, i = r % inner;
        const float *xr = x + o * ldx_outer + i * ldx_inner;
        float *yr = y + o * ldy_outer + i * ldy_inner;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t j = 0; j < full; j += 8) {
            __m256 v = _mm256_loadu_ps(xr + j);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum(acc);
        for (int64_t j = full; j < n; j++) ss += xr[j] * xr[j];
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        const __m256 s = _mm256_set1_ps(inv);
        for (int64_t j = 0; j < full; j += 8)
            _mm256_storeu_ps(yr + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + j), s), _mm256_loadu_ps(w + j)));
        for (int64_t j = full; j < n; j++) yr[j] = xr[j] * inv * w[j];
    }
}

/* NeoX rotation of `heads` heads of d floats for each of m tokens, in place:
 * x = x * cos[p] + swap_halves(x) * signed_sin[p], p = positions[t]; the tables are
 * [max_positions, d] (signed_sin: sin with its first half negated, layers.py's table).
 * Token t's heads start at x + t * ldx, d floats apart. d even, at most MAX_HEAD_DIM. */
void me_rope_f32(float *x, int64_t m, int64_t heads, int64_t ldx, int64_t d, const int64_t *positions,
                 const float *cos_table, const float *signed_sin_table) {
    const int64_t half = d / 2;
    float row[MAX_HEAD_DIM];
    for (int64_t t = 0; t < m; t++) {
        const float *c = cos_table + positions[t] * d, *s = signed_sin_table + positions[t] * d;
        for (int64_t h = 0; h < heads; h++) {
            float *xr = x + t * ldx + h * d;
            for (int64_t j = 0; j < d; j++) row[j] = xr[j];
            for (int64_t j = 0; j < half; j++) {
                xr[j] = row[j] * c[j] + row[j + half] * s[j];
                xr[j + half] = row[j + half] * c[j + half] + row[j] * s[j + half];
            }
        }
    }
}

/* A gated MLP's activation: y[t, j] = act(gu[t, j]) * gu[t, inter + j], act SiLU (0) or
 * GELU with the tanh approximation (1); gu rows ldg apart, y [m, inter] contiguous. */
void me_glu_f32(const float *gu, int64_t m, int64_t ldg, int64_t inter, int activation, float *y) {
    const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f), top = _mm256_set1_ps(87.0f);
    for (int64_t t = 0; t < m; t++) {
        const float *g = gu + t * ldg, *u = g + inter;
        float *out = y + t * inter;
        int64_t j = 0;
        for (; j + 8 <= inter; j += 8) {
            __m256 x = _mm256_loadu_ps(g + j), a;
            if (activation == 0) {  /* x / (1 + e^-x) */
                a = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), x), top))));
            } else {  /* 0.5 x (1 + tanh(y)), tanh(y) = 1 - 2 / (e^2y + 1) */
                __m256 inner = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                             _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), x),
                                                             _mm256_mul_ps(x, x), x));
                __m256 e = exp8(_mm256_min_ps(_mm256_mul_ps(two, inner), top));
                __m256 tanh = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one)));
                a = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(one, tanh));
            }
            _mm256_storeu_ps(out + j, _mm256_mul_ps(a, _mm256_loadu_ps(u + j)));
        }
        for (; j < inter; j++) {
            const float x = g[j];
            const float a = activation == 0 ? x / (1.0f + expf(-x))
                                            : 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
            out[j] = a * u[j];
        }
    }
}
