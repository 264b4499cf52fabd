/* Matmuls over weights stored as 6-column panels (weight_panel.h), float32 or int8 with
 * float32 scales, for steps of every size: decode rows (the weights stream at the memory's
 * rate), batched decode and prefill (compute-bound, x re-read from the L2). Threads split
 * the weight panels statically; the library links the libgomp torch loaded, so the region
 * reuses torch's thread pool. */
#include <stdlib.h>

#include "weight_panel.h"

static int linear(const float *x, int64_t m, int64_t ldx, const float *panels, q8_weight qw, int64_t n, int64_t k,
                  const float *bias, const float *residual, int64_t ldr, float *y, int64_t ldy, int threads) {
    const int64_t floats = wpanel_x_floats(m, k);
    const int64_t dequantized = panels == NULL && m > DOT_ROWS ? threads * q8_scratch_floats(k) : 0;
    float *xp = floats ? malloc(sizeof(float) * (size_t)floats) : NULL;
    float *wq = dequantized ? malloc(sizeof(float) * (size_t)dequantized) : NULL;
    if ((floats && !xp) || (dequantized && !wq)) {
        free(xp);
        free(wq);
        return -1;
    }
    #pragma omp parallel num_threads(threads)
    weight_linear_team(x, m, ldx, panels, qw, n, k, bias, residual, ldr, y, ldy, xp, wq);
    free(xp);
    free(wq);
    return 0;
}

/* y[b, :n] = x[b, :k] @ w[:n, :k]^T (+ bias[:n]) (+ residual[b, :n]) for b < m, w as panels
 * (ceil(n / 6) x [k, 6]). Row strides ldx, ldr, ldy; bias, residual may be NULL; residual
 * may be y itself. Returns 0, or -1 when a scratch could not be allocated. */
int me_weight_linear_f32(const float *x, int64_t m, int64_t ldx, const float *panels, int64_t n, int64_t k,
                         const float *bias, const float *residual, int64_t ldr, float *y, int64_t ldy, int threads) {
    const q8_weight none = {NULL, NULL};
    return linear(x, m, ldx, panels, none, n, k, bias, residual, ldr, y, ldy, threads);
}

/* The same with w as int8 panels q (ceil(n / 6) x [k, 6] bytes) and their float32 scales
 * (ceil(n / 6) x [ceil(k / 32), 6]), each buffer followed by its slack (weight_panel.h):
 * exactly what me_weight_linear_f32 gives for the panels of the dequantized weights. */
int me_weight_linear_q8(const float *x, int64_t m, int64_t ldx, const int8_t *q, const float *scales, int64_t n,
                        int64_t k, const float *bias, const float *residual, int64_t ldr, float *y, int64_t ldy,
                        int threads) {
    const q8_weight w = {q, scales};
    return linear(x, m, ldx, NULL, w, n, k, bias, residual, ldr, y, ldy, threads);
}
