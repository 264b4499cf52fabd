/* float32 matmuls over weights stored as 6-column panels (weight_panel.h), for steps of
 * every size: decode rows (the weights stream at the memory's rate), batched decode and
 * prefill (compute-bound, x re-read from the L2). Threads split the weight panels
 * statically; the library links the libgomp torch loaded, so the region reuses torch's
 * thread pool. */
#include <stdlib.h>

#include "weight_panel.h"

/* y[b, :n] = x[b, :k] @ w[:n, :k]^T (+ bias[:n]) (+ residual[b, :n]) for b < m, w as panels
 * (ceil(n / 6) x [k, 6]). Row strides ldx, ldr, ldy; bias, residual may be NULL; residual
 * may be y itself. Returns 0, or -1 when the packed x's scratch could not be allocated. */
int me_weight_linear_f32(const float *x, int64_t m, int64_t ldx, const float *panels, int64_t n, int64_t k,
                         const float *bias, const float *residual, int64_t ldr, float *y, int64_t ldy, int threads) {
    const int64_t floats = wpanel_x_floats(m, k);
    float *xp = floats ? malloc(sizeof(float) * (size_t)floats) : NULL;
    if (floats && !xp) return -1;
    #pragma omp parallel num_threads(threads)
    weight_linear_team(x, m, ldx, panels, n, k, bias, residual, ldr, y, ldy, xp);
    free(xp);
    return 0;
}
