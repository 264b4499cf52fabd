/* AVX2 (and scratch) helpers shared by the kernels of this directory. */
#ifndef MODELEXEC_SIMD_H
#define MODELEXEC_SIMD_H

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

/* A thread's scratch of `floats` floats inside a parallel region (the caller frees it); NULL,
 * with *failed set for the whole team to see, when malloc fails. */
static inline float *thread_scratch(int64_t floats, int *failed) {
    float *scratch = malloc(sizeof(float) * (size_t)floats);
    if (!scratch) {
        #pragma omp atomic write
        *failed = 1;
    }
    return scratch;
}

/* 1..8 valid lanes of a chunk of 8 floats. */
static inline __m256i tail_mask(int64_t valid) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)valid), lanes);
}

/* The eight accumulators' horizontal sums as one vector: lane r holds sum(acc[r]). */
static inline __m256 reduce8(const __m256 acc[8]) {
    __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]);
    __m256 t1 = _mm256_hadd_ps(acc[2], acc[3]);
    __m256 t2 = _mm256_hadd_ps(acc[4], acc[5]);
    __m256 t3 = _mm256_hadd_ps(acc[6], acc[7]);
    t0 = _mm256_hadd_ps(t0, t1);
    t2 = _mm256_hadd_ps(t2, t3);
    __m256 lo = _mm256_permute2f128_ps(t0, t2, 0x20);
    __m256 hi = _mm256_permute2f128_ps(t0, t2, 0x31);
    return _mm256_add_ps(lo, hi);
}

/* The sum of the eight lanes. */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* e^x, lane by lane, for x <= 88 (Cephes' expf: a range reduction by ln 2 and a degree-5
 * polynomial; relative error ~2e-7, as accurate as float32 softmax needs). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#endif
