/* The FMA units' rate, for bench/peers.py's "share of the fp32 peak": each thread of the
 * team runs independent chains of vector FMAs out of registers, as wide as the matmuls'
 * tiles run (16 lanes where use_avx512(), else 8). Twelve chains cover the FMA latency
 * (4 cycles) times two pipes with room; no memory is touched. A torch sgemm is no ceiling
 * here: the kernels' own AVX-512 tiles beat MKL's (bench/RESULTS.md run 21). */
#include <stdint.h>

#include "isa.h"
#include "simd.h"

#define CHAINS 12

static ME_AVX512 float fma_loop512(int64_t steps) {
    __m512 acc[CHAINS];
    const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_set1_ps((float)i);
    for (int64_t s = 0; s < steps; s++)
        for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
    __m512 sum = acc[0];
    for (int i = 1; i < CHAINS; i++) sum = _mm512_add_ps(sum, acc[i]);
    return _mm512_reduce_add_ps(sum);
}

static float fma_loop256(int64_t steps) {
    __m256 acc[CHAINS];
    const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm256_set1_ps((float)i);
    for (int64_t s = 0; s < steps; s++)
        for (int i = 0; i < CHAINS; i++) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
    __m256 sum = acc[0];
    for (int i = 1; i < CHAINS; i++) sum = _mm256_add_ps(sum, acc[i]);
    return hsum(sum);
}

/* Runs `steps` rounds of CHAINS FMAs on each of `threads` threads; returns the floating-point
 * operations done (2 a lane of an FMA), the caller timing the call. */
int64_t me_fma_flops(int64_t steps, int threads) {
    const int avx512 = use_avx512(), lanes = avx512 ? 16 : 8;
    float sink = 0.0f;
    #pragma omp parallel num_threads(threads) reduction(+ : sink)
    sink += avx512 ? fma_loop512(steps) : fma_loop256(steps);
    /* the chains' sum, so the loops are not dead code; it is finite for any steps */
    volatile float keep = sink;
    (void)keep;
    return 2 * (int64_t)lanes * CHAINS * steps * threads;
}
