/* Decode attention straight from the paged KV pool: one query token a row, float32.
 *
 * torch's path gathers each row's blocks into a padded copy (index_select) and then runs
 * SDPA over the copy, reading every key and value twice and paying ~60 us of set-up per
 * call; at batch 32 and context ~128 that was ~39 ms of a 126 ms step on the 2-core EPYC
 * of bench/RESULTS.md. Here each task (a row, or one KV head of a row when rows are too few
 * to share out) walks the row's block table and reads each key and value once, in place and
 * in order: scores for every query head (grouped-query heads share their KV head's reads),
 * an exact softmax (max, exp, sum), then the weighted values.
 *
 * The pool of one layer is [blocks, block_size, kv_heads, d] floats. Row r sees the keys
 * at positions lo[r] .. hi[r] - 1 (lo > 0 under a sliding window), found through its block
 * table tables[r * ldt + position / block_size].
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define MAX_HEADS 256

/* Scores of one query head against `n` (<= 8) consecutive slots of a block, slots `stride`
 * floats apart: the eight dot products reduced together (lane j: slot j). */
static inline __m256 scores8(const float *q, const float *k, int64_t stride, int n, int64_t d) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += 8) {
        const __m256 qv = _mm256_loadu_ps(q + c);
        for (int j = 0; j < n; j++) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + j * stride + c), acc[j]);
    }
    return reduce8(acc);
}

/* One row's query heads over KV heads [kv0, kv1): q and out hold the row's [heads, d];
 * scores: (kv1 - kv0) * group * keys floats. Block by block, each K and V block (all its KV
 * heads: a contiguous run of the pool) is read once, in order, while it sits in L1. */
static void attend_row(const float *q, int64_t group, int64_t d, const float *kpool, const float *vpool,
                       int64_t bs, int64_t kv_heads, int64_t kv0, int64_t kv1, const int32_t *table, int64_t lo,
                       int64_t hi, float scale, float *scores, float *out) {
    const int64_t keys = hi - lo;
    const int64_t stride = kv_heads * d;  /* floats between consecutive slots of a block */
    const int64_t heads = (kv1 - kv0) * group;  /* query heads of this task, from kv0 * group */
    const __m256 vscale = _mm256_set1_ps(scale);
    q += kv0 * group * d;
    out += kv0 * group * d;
    /* Scores, a run of slots of one block (up to 8) at a time. */
    for (int64_t p = lo; p < hi;) {
        const int64_t offset = p % bs;
        int64_t n = bs - offset < hi - p ? bs - offset : hi - p;
        n = n < 8 ? n : 8;
        const float *slot = kpool + ((int64_t)table[p / bs] * bs + offset) * stride;
        for (int64_t h = 0; h < heads; h++) {
            const float *k = slot + (kv0 + h / group) * d;
            __m256 s = _mm256_mul_ps(scores8(q + h * d, k, stride, (int)n, d), vscale);
            float *dst = scores + h * keys + (p - lo);
            if (n == 8) _mm256_storeu_ps(dst, s);
            else _mm256_maskstore_ps(dst, tail_mask(n), s);
        }
        p += n;
    }
    /* Softmax of each query head's scores. */
    float inv_sum[MAX_HEADS];
    for (int64_t h = 0; h < heads; h++) {
        float *sh = scores + h * keys;
        __m256 mx = _mm256_set1_ps(-INFINITY);
        int64_t j = 0;
        for (; j + 8 <= keys; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sh + j));
        float best = -INFINITY, lanes[8];
        _mm256_storeu_ps(lanes, mx);
        for (int i = 0; i < 8; i++) best = lanes[i] > best ? lanes[i] : best;
        for (int64_t t = j; t < keys; t++) best = sh[t] > best ? sh[t] : best;
        const __m256 top = _mm256_set1_ps(best);
        __m256 acc = _mm256_setzero_ps();
        for (j = 0; j + 8 <= keys; j += 8) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + j), top));
            _mm256_storeu_ps(sh + j, e);
            acc = _mm256_add_ps(acc, e);
        }
        if (j < keys) {
            __m256i mask = tail_mask(keys - j);
            __m256 e = exp8(_mm256_sub_ps(_mm256_maskload_ps(sh + j, mask), top));
            e = _mm256_and_ps(e, _mm256_castsi256_ps(mask));
            _mm256_maskstore_ps(sh + j, mask, e);
            acc = _mm256_add_ps(acc, e);
        }
        inv_sum[h] = 1.0f / hsum(acc);
    }
    /* The values, weighted, into out (which accumulates, then is scaled by 1 / sum). */
    const int64_t chunks = d / 8;
    for (int64_t i = 0; i < heads * d; i++) out[i] = 0.0f;
    for (int64_t p = lo; p < hi; p++) {
        const float *slot = vpool + ((int64_t)table[p / bs] * bs + p % bs) * stride;
        for (int64_t h = 0; h < heads; h++) {
            const float *v = slot + (kv0 + h / group) * d;
            const __m256 w = _mm256_set1_ps(scores[h * keys + (p - lo)]);
            float *o = out + h * d;
            for (int64_t c = 0; c < chunks; c++)
                _mm256_storeu_ps(o + c * 8, _mm256_fmadd_ps(w, _mm256_loadu_ps(v + c * 8), _mm256_loadu_ps(o + c * 8)));
        }
    }
    for (int64_t h = 0; h < heads; h++) {
        const __m256 s = _mm256_set1_ps(inv_sum[h]);
        float *o = out + h * d;
        for (int64_t c = 0; c < chunks; c++) _mm256_storeu_ps(o + c * 8, _mm256_mul_ps(_mm256_loadu_ps(o + c * 8), s));
    }
}

/* out[r] = attention of q[r] ([heads, d], rows ldq apart) over row r's keys, for r < rows;
 * out rows ldo apart. heads <= MAX_HEADS and d a multiple of 8 (the caller checks). Returns 0, or -1 when a scratch allocation failed. */
int me_decode_attention_f32(const float *q, int64_t rows, int64_t ldq, int64_t heads, int64_t kv_heads, int64_t d,
                            const float *kpool, const float *vpool, int64_t bs, const int32_t *tables, int64_t ldt,
                            const int32_t *lo, const int32_t *hi, float scale, float *out, int64_t ldo, int threads) {
    const int64_t group = heads / kv_heads;
    int64_t longest = 0;
    for (int64_t r = 0; r < rows; r++) longest = hi[r] - lo[r] > longest ? hi[r] - lo[r] : longest;
    /* Enough rows to keep every thread busy: a task is a row (all its heads, each block read
     * once, in order); otherwise a task is one KV head of a row. */
    const int64_t split = rows >= 2 * threads ? 1 : kv_heads;
    const int64_t tasks = rows * split;
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (tasks >= 2 && tasks * longest * (kv_heads / split) >= 4096)
    {
        float *scores = malloc(sizeof(float) * (size_t)(heads * (longest + 8)));
        if (!scores) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (!scores) continue;
            const int64_t r = task / split, kv0 = split == 1 ? 0 : task % split;
            const int64_t kv1 = split == 1 ? kv_heads : kv0 + 1;
            attend_row(q + r * ldq, group, d, kpool, vpool, bs, kv_heads, kv0, kv1, tables + r * ldt, lo[r], hi[r],
                       scale, scores, out + r * ldo);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* Store the new tokens' K and V ([n, kv_heads * d] each, rows ldk / ldv floats apart) at
 * their pool slots (block * block_size + offset): what index_copy_ does, without its
 * per-call set-up. The caller checked every slot against the pool's size. */
void me_store_kv_f32(const float *k, const float *v, int64_t n, int64_t ldk, int64_t ldv, int64_t width,
                     const int64_t *slots, float *kpool, float *vpool) {
    for (int64_t t = 0; t < n; t++) {
        memcpy(kpool + slots[t] * width, k + t * ldk, sizeof(float) * (size_t)width);
        memcpy(vpool + slots[t] * width, v + t * ldv, sizeof(float) * (size_t)width);
    }
}
