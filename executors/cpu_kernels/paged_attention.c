/* Decode attention straight from the paged KV pool: one query token a row, float32.
 *
 * torch's path gathers each row's blocks into a padded copy (index_select) and then runs
 * SDPA over the copy, reading every key and value twice and paying ~60 us of set-up per
 * call; at batch 32 and context ~128 that was ~39 ms of a 126 ms step on the 2-core EPYC
 * of bench/RESULTS.md. Here each task (a row; one KV head of a row when rows are too few
 * to share out; a share of one KV head's query heads when even those are too few, as
 * DeepSeek's latent rows, one KV head of 16 query heads) walks the row's block table and
 * reads each key and value once, in place and in order: scores for every query head
 * (grouped-query heads share their KV head's reads), an exact softmax (max, exp, sum), then
 * the weighted values.
 *
 * The pool of one layer is [blocks, block_size, kv_heads, d] floats. Row r sees the keys
 * at positions lo[r] .. hi[r] - 1 (lo > 0 under a sliding window), found through its block
 * table tables[r * ldt + position / block_size].
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention_row.h"

/* out[r] = attention of q[r] ([heads, d], rows ldq apart) over row r's keys, for r < rows;
 * out rows ldo apart; softcap > 0 caps the scores (attend_row), 0 leaves them; sinks: a
 * logit per query head the softmax also normalises over (attend_row), NULL: none. heads <=
 * MAX_HEADS and d a multiple of 8 (the caller checks). Returns 0, or -1 when a scratch
 * allocation failed. */
int me_decode_attention_f32(const float *q, int64_t rows, int64_t ldq, int64_t heads, int64_t kv_heads, int64_t d,
                            const float *kpool, const float *vpool, int64_t bs, const int32_t *tables, int64_t ldt,
                            const int32_t *lo, const int32_t *hi, float scale, float softcap, const float *sinks,
                            float *out, int64_t ldo,
                            int threads) {
    const int64_t group = heads / kv_heads;
    int64_t longest = 0;
    for (int64_t r = 0; r < rows; r++) longest = hi[r] - lo[r] > longest ? hi[r] - lo[r] : longest;
    /* Enough rows to keep every thread busy: a task is a row (all its heads, each block read
     * once, in order); otherwise a task is one KV head of a row. Threads where rows x keys x
     * KV heads reach 4096. */
    int64_t split = rows >= 2 * threads ? 1 : kv_heads;
    int parallel = rows * longest * kv_heads >= 4096;
    /* Where even the KV heads are fewer than the threads and one serves 16 query heads or more
     * (DeepSeek's latent rows: one KV head of 16 to 128), a task is an equal share of a row's
     * query heads, threaded from 2^21 query-head-dimension products (~230 keys there). Each
     * share reads all of the KV head's keys (the second from L3), which pays where many heads'
     * scores and values a key outweigh the reads: 1.35-1.6x on 16 heads of 576, nothing on 8
     * heads of 256 (bench/RESULTS.md run 32). */
    if (rows * split < threads && group >= 16 && rows * longest * heads * d >= (1 << 21)) {
        split = heads < threads ? heads : threads;
        parallel = 1;
    }
    const int64_t tasks = rows * split;
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (tasks >= 2 && parallel)
    {
        float *scores = thread_scratch(heads * (longest + 8), &failed);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (!scores) continue;
            const int64_t r = task / split, part = task % split;
            attend_row(q + r * ldq, group, d, kpool, vpool, bs, kv_heads, part * heads / split,
                       (part + 1) * heads / split, tables + r * ldt, lo[r], hi[r], scale, softcap, sinks, scores,
                       out + r * ldo);
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
