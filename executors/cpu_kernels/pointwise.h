/* Row-sized pieces of the small ops (pointwise.c, decode_step.c). */
#ifndef MODELEXEC_POINTWISE_H
#define MODELEXEC_POINTWISE_H

#include <math.h>

#include "simd.h"

#define MAX_HEAD_DIM 512

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

/* The sum of x[j]^2 over one row of n floats. */
static inline float sum_squares(const float *x, int64_t n) {
    const int64_t full = n & ~(int64_t)7;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t j = 0; j < full; j += 8) {
        __m256 v = _mm256_loadu_ps(x + j);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum(acc);
    for (int64_t j = full; j < n; j++) ss += x[j] * x[j];
    return ss;
}

/* y = x * inv * w over one row of n floats; y may be x. */
static inline void scale_row(const float *x, int64_t n, float inv, const float *w, float *y) {
    const int64_t full = n & ~(int64_t)7;
    const __m256 s = _mm256_set1_ps(inv);
    for (int64_t j = 0; j < full; j += 8)
        _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j), s), _mm256_loadu_ps(w + j)));
    for (int64_t j = full; j < n; j++) y[j] = x[j] * inv * w[j];
}

/* y = x * rsqrt(mean(x^2) + eps) * w over one row of n floats; y may be x. */
static inline void rms_norm_row(const float *x, int64_t n, const float *w, float eps, float *y) {
    scale_row(x, n, 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps), w, y);
}

/* LayerNorm of one row of n floats: y = (x - mean) * rsqrt(var + eps) * w (+ b where b is not
 * NULL); y may be x. The mean first, then the variance about it (two passes, as torch's
 * float32 layer_norm rather than E[x^2] - mean^2, which cancels badly). */
static inline void layer_norm_row(const float *x, int64_t n, const float *w, const float *b, float eps, float *y) {
    float mean = 0.0f, var = 0.0f;
    for (int64_t j = 0; j < n; j++) mean += x[j];
    mean /= (float)n;
    for (int64_t j = 0; j < n; j++) var += (x[j] - mean) * (x[j] - mean);
    const float inv = 1.0f / sqrtf(var / (float)n + eps);
    for (int64_t j = 0; j < n; j++) y[j] = (x[j] - mean) * inv * w[j] + (b ? b[j] : 0.0f);
}

/* NeoX rotation of one head of d floats in place, by the tables' rows c and s (cos, and
 * sin with its first half negated). d even, at most MAX_HEAD_DIM. */
static inline void rope_head(float *x, int64_t d, const float *c, const float *s) {
    const int64_t half = d / 2;
    float row[MAX_HEAD_DIM];
    for (int64_t j = 0; j < d; j++) row[j] = x[j];
    for (int64_t j = 0; j < half; j++) {
        x[j] = row[j] * c[j] + row[j + half] * s[j];
        x[j + half] = row[j + half] * c[j + half] + row[j] * s[j + half];
    }
}

/* act(x) for eight lanes: SiLU, or GELU with the tanh approximation. */
static inline __m256 act8(__m256 x, int activation) {
    const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f), top = _mm256_set1_ps(87.0f);
    if (activation == ACT_SILU)  /* x / (1 + e^-x) */
        return _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), x), top))));
    /* 0.5 x (1 + tanh(y)), tanh(y) = 1 - 2 / (e^2y + 1) */
    __m256 inner = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                 _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), x), _mm256_mul_ps(x, x), x));
    __m256 e = exp8(_mm256_min_ps(_mm256_mul_ps(two, inner), top));
    __m256 tanh = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one)));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(one, tanh));
}

static inline float act1(float x, int activation) {
    return activation == ACT_SILU ? x / (1.0f + expf(-x))
                                  : 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

/* A gated MLP's activation over one row: out[j] = act(g[j]) * u[j] for j < inter; an ungated
 * one's (u NULL, StarCoder2): out[j] = act(g[j]). */
static inline void glu_row(const float *g, const float *u, int64_t inter, int activation, float *out) {
    int64_t j = 0;
    if (!u) {
        for (; j + 8 <= inter; j += 8) _mm256_storeu_ps(out + j, act8(_mm256_loadu_ps(g + j), activation));
        for (; j < inter; j++) out[j] = act1(g[j], activation);
        return;
    }
    for (; j + 8 <= inter; j += 8)
        _mm256_storeu_ps(out + j, _mm256_mul_ps(act8(_mm256_loadu_ps(g + j), activation), _mm256_loadu_ps(u + j)));
    for (; j < inter; j++) out[j] = act1(g[j], activation) * u[j];
}

#endif
