/* Matmuls over weights stored as panels, for steps of every size: float32 6-column panels
 * (weight_panel.h) or int8 16-column panels with float32 scales (weight_q8.h). Decode rows
 * stream the weights at the memory's rate (int8: as fast as they convert), batched decode
 * and prefill are compute-bound, x re-read from the L2. Threads split the weight panels
 * statically; the library links the libgomp torch loaded, so the region reuses torch's
 * thread pool. */
#include <stdlib.h>

#include "weight_linear.h"
#include "weight_q8.h"

int isa_avx512 = -1;

/* The wide paths' instructions (isa.h): want 0 asks for AVX2, 1 for AVX-512 where the CPU
 * has it, -1 leaves the choice as it is. Returns 1 when AVX-512 serves from now on. */
int me_isa(int want) {
    if (want == 0) __atomic_store_n(&isa_avx512, 0, __ATOMIC_RELAXED);
    if (want == 1) __atomic_store_n(&isa_avx512, -1, __ATOMIC_RELAXED);
    return use_avx512();
}

/* y[b, :n] = x[b, :k] @ w[:n, :k]^T (+ bias[:n]) (+ residual[b, :n]) for b < m, w as panels
 * (ceil(n / 6) x [k, 6]). Row strides ldx, ldr, ldy; bias, residual may be NULL; residual
 * may be y itself. Returns 0, or -1 when the packed x's scratch could not be allocated. */
int me_weight_linear_f32(const float *x, int64_t m, int64_t ldx, const float *panels, int64_t n, int64_t k,
                         const float *bias, const float *residual, int64_t ldr, float *y, int64_t ldy, int threads) {
    const int64_t floats = wpanel_x_floats(m, k);
    float *xp = floats ? malloc(sizeof(float) * (size_t)floats) : NULL;
    if (floats && !xp) return -1;
    #pragma omp parallel num_threads(threads)
    weight_linear_team(x, m, ldx, panels, n, k, bias, residual, ldr, y, ldy, use_avx512(), xp, (next_matmul){0});
    free(xp);
    return 0;
}

/* y = act(gu[:, :k]) * gu[:, k:] @ w^T (+ bias) (+ residual): a gated MLP's down projection
 * over its gate/up output gu (m rows ldg apart, 2 k columns), exactly what me_glu_f32 then
 * me_weight_linear_f32 give, without the [m, k] activation between them: past DOT_ROWS rows
 * the activation is computed as the rows are packed (pack_x.h); up to DOT_ROWS, into a
 * scratch first (the dot products read x in place). activation as me_glu_f32's. Returns 0,
 * or -1 when a scratch could not be allocated. */
int me_glu_linear_f32(const float *gu, int64_t m, int64_t ldg, int activation, const float *panels, int64_t n,
                      int64_t k, const float *bias, const float *residual, int64_t ldr, float *y, int64_t ldy,
                      int threads) {
    if (m <= DOT_ROWS) {
        float *act = malloc(sizeof(float) * (size_t)(m * k + 1));
        if (!act) return -1;
        for (int64_t r = 0; r < m; r++) glu_row(gu + r * ldg, gu + r * ldg + k, k, activation, act + r * k);
        const int failed = me_weight_linear_f32(act, m, k, panels, n, k, bias, residual, ldr, y, ldy, threads);
        free(act);
        return failed;
    }
    float *xp = malloc(sizeof(float) * (size_t)wpanel_x_floats(m, k));
    if (!xp) return -1;
    #pragma omp parallel num_threads(threads)
    weight_rows_team(gu, gu + k, activation, m, ldg, panels, n, k, bias, residual, ldr, y, ldy, use_avx512(), xp);
    free(xp);
    return 0;
}

/* The same with w as int8 panels q (ceil(n / 16) x [k, 16] bytes) and their float32 scales
 * (ceil(n / 16) x [ceil(k / 32), 16]): exactly what me_weight_linear_f32 gives for the
 * panels of the dequantized weights. Returns 0, or -1 when a scratch could not be allocated. */
int me_weight_linear_q8(const float *x, int64_t m, int64_t ldx, const int8_t *q, const float *scales, int64_t n,
                        int64_t k, const float *bias, const float *residual, int64_t ldr, float *y, int64_t ldy,
                        int threads) {
    const q8_weight w = {q, scales};
    const int avx512 = use_avx512(), scratch = q8_needs_scratch(m, avx512);
    const int64_t floats = scratch ? wpanel_x_floats(m, k) : 0, dequantized = scratch ? threads * q8_scratch_floats(k) : 0;
    float *xp = floats ? malloc(sizeof(float) * (size_t)floats) : NULL;
    float *wq = dequantized ? malloc(sizeof(float) * (size_t)dequantized) : NULL;
    if ((floats && !xp) || (dequantized && !wq)) {
        free(xp);
        free(wq);
        return -1;
    }
    #pragma omp parallel num_threads(threads)
    q8_linear_team(x, m, ldx, w, n, k, bias, residual, ldr, y, ldy, avx512, xp, wq);
    free(xp);
    free(wq);
    return 0;
}
