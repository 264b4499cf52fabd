/* The ARGMAX policy's two figures for each logits row: the first index of the largest
 * logit and its log-probability, max - logsumexp = -log(sum(exp(x - max))).
 *
 * torch takes ~0.35 ms a row of SmolLM2's 49152 logits on the 2-core EPYC (argmax, then
 * logsumexp's max, subtract, exp, sum and log as separate ops); these three passes over
 * the row, which stays in the L2 cache, take a tenth of that.
 */
#include <math.h>

#include "simd.h"

/* One row's token and log-probability; 1 when it holds a NaN or its largest logit is infinite. */
static int argmax_row(const float *row, int64_t n, int64_t *token, float *logprob) {
    __m256 mx = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 v = _mm256_loadu_ps(row + j);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        mx = _mm256_max_ps(mx, v);
    }
    if (_mm256_movemask_ps(nan)) return 1;
    float best = -INFINITY;
    float lanes[8];
    _mm256_storeu_ps(lanes, mx);
    for (int i = 0; i < 8; i++) best = lanes[i] > best ? lanes[i] : best;
    for (int64_t t = j; t < n; t++) {
        if (row[t] != row[t]) return 1;
        best = row[t] > best ? row[t] : best;
    }
    int64_t at = 0;
    const __m256 target = _mm256_set1_ps(best);
    for (j = 0; j + 8 <= n; j += 8) {
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + j), target, _CMP_EQ_OQ));
        if (hit) { at = j + __builtin_ctz(hit); break; }
    }
    if (j + 8 > n)
        for (at = j; at < n && row[at] != best; at++) {}
    if (!isfinite(best)) return 1;  /* torch's inf - inf and -inf rules: the caller's fallback */
    double sum = 0.0;
    __m256 acc = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), target)));
    sum = hsum(acc);
    for (int64_t t = j; t < n; t++) sum += expf(row[t] - best);
    *token = at;
    *logprob = (float)-log(sum);
    return 0;
}

/* Returns 0, or 1 when a row holds a NaN or its largest logit is infinite: the caller then
 * falls back to torch (whose argmax takes NaN as the largest value). Threaded over rows
 * (a batch-32 step's 32 rows: ~1 ms on one core). */
int me_argmax_logprob_f32(const float *x, int64_t rows, int64_t n, int64_t ldx, int64_t *token, float *logprob,
                          int threads) {
    int refused = 0;
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows * n >= 262144) reduction(| : refused)
    for (int64_t r = 0; r < rows; r++) refused |= argmax_row(x + r * ldx, n, token + r, logprob + r);
    return refused;
}
