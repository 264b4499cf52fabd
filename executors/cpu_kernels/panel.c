/* float32 matmuls over weights stored in panels (panel.h), for steps of every size: decode
 * rows (the weights stream at the memory's rate), batched decode and prefill (compute-bound,
 * the panels re-read from the L2). Threads split the panels statically; the library links
 * the libgomp torch loaded, so the region reuses torch's thread pool. */
#include "panel.h"

/* y[b, :n] = x[b, :k] @ w[:n, :k]^T (+ bias[:n]) (+ residual[b, :n]) for b < m, w as panels
 * (ceil(n / 16) x [k, 16]). Row strides ldx, ldr, ldy; bias, residual may
 * be NULL; residual may be y itself. */
void me_panel_linear_f32(const float *x, int64_t m, int64_t ldx, const float *panels, int64_t n, int64_t k,
                         const float *bias, const float *residual, int64_t ldr, float *y, int64_t ldy, int threads) {
    #pragma omp parallel num_threads(threads)
    panel_linear_team(x, m, ldx, panels, n, k, bias, residual, ldr, y, ldy);
}
