/* One decode row's attention over the paged pool (paged_attention.c, decode_step.c). */
#ifndef MODELEXEC_ATTENTION_ROW_H
#define MODELEXEC_ATTENTION_ROW_H

#include <math.h>

#include "simd.h"

#define MAX_HEADS 256

/* Load one float of every 64-byte line in [from, to) of p, in ascending order, and drop them.
 * A run of slots is read so before its heads read it in strides: this CPU's prefetchers
 * follow demand loads in ascending order, not the strided ones (nor software prefetches). */
static inline void touch(const float *p, int64_t from, int64_t to) {
    __m256 sink = _mm256_setzero_ps();
    for (int64_t i = from; i < to; i += 16) sink = _mm256_add_ps(sink, _mm256_loadu_ps(p + i));
    __asm__ volatile("" : : "x"(sink));
}

/* Scores of one query head against `n` (<= 8) consecutive slots of a block, slots `stride`
 * floats apart: the eight dot products reduced together (lane j: slot j). */
static inline __attribute__((always_inline)) __m256 scores8(const float *q, const float *k, int64_t stride, int n,
                                                            int64_t d) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += 8) {
        const __m256 qv = _mm256_loadu_ps(q + c);
        for (int j = 0; j < n; j++) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + j * stride + c), acc[j]);
    }
    return reduce8(acc);
}

/* The run of slots from position p (< hi): up to 8, inside p's block; *slot its first slot. */
static inline int64_t run_at(const float *pool, const int32_t *table, int64_t bs, int64_t stride, int64_t p,
                             int64_t hi, const float **slot) {
    const int64_t offset = p % bs, n = bs - offset < hi - p ? bs - offset : hi - p;
    *slot = pool + ((int64_t)table[p / bs] * bs + offset) * stride;
    return n < 8 ? n : 8;
}

/* One row's query heads [h0, h1) over their KV heads (query head h reads KV head h / group): q
 * and out hold the row's [heads, d]; scores: (h1 - h0) * keys floats. A task may take whole
 * KV heads' groups or part of one (one KV head's 16 heads split over the threads: DeepSeek's
 * latent rows). Block by block, each K and V block (all its KV
 * heads: a contiguous run of the pool) is read once, in order, while it sits in L1.
 * softcap > 0: each scaled score s becomes softcap * tanh(s / softcap) before the softmax
 * (Gemma 2); 0: none. sinks: one logit per query head of the model (GPT-OSS's attention
 * sinks), a key with no value that each head's softmax also normalises over; NULL: none. */
static inline void attend_row(const float *q, int64_t group, int64_t d, const float *kpool, const float *vpool,
                       int64_t bs, int64_t kv_heads, int64_t h0, int64_t h1, const int32_t *table, int64_t lo,
                       int64_t hi, float scale, float softcap, const float *sinks, float *scores, float *out) {
    const int64_t keys = hi - lo;
    const int64_t stride = kv_heads * d;  /* floats between consecutive slots of a block */
    const int64_t heads = h1 - h0;  /* query heads of this task */
    const __m256 vscale = _mm256_set1_ps(scale);
    const int whole = h0 == 0 && h1 == kv_heads * group;  /* the task reads whole slots */
    q += h0 * d;
    out += h0 * d;
    if (sinks) sinks += h0;
    int64_t kv_offset[MAX_HEADS];  /* floats into a slot of each head's KV head: no division in the loops */
    for (int64_t h = 0; h < heads; h++) kv_offset[h] = ((h0 + h) / group) * d;
    /* Scores, a run of slots of one block (up to 8) at a time. A task that reads whole slots
     * reads the next run in order while this one's scores are computed, a share before each
     * head (bench/RESULTS.md run 15: 30 layers from memory 11.0 -> 10.1 ms at 32 rows); the
     * first run it reads in order before it starts. */
    const float *slot = NULL;
    int64_t n = lo < hi ? run_at(kpool, table, bs, stride, lo, hi, &slot) : 0;
    if (whole && n) touch(slot, 0, n * stride);
    for (int64_t p = lo; p < hi;) {
        const float *next = NULL;
        const int64_t next_n = p + n < hi ? run_at(kpool, table, bs, stride, p + n, hi, &next) : 0;
        const int64_t ahead = whole ? next_n * stride : 0;  /* floats of the next run to read now */
        const int64_t share = (ahead / heads + 15) / 16 * 16;  /* whole lines per head */
        for (int64_t h = 0; h < heads; h++) {
            if (ahead) {  /* head h's share, clipped to the run; the last head takes the rest */
                const int64_t from = h * share < ahead ? h * share : ahead, to = (h + 1) * share;
                touch(next, from, h == heads - 1 || to > ahead ? ahead : to);
            }
            const float *k = slot + kv_offset[h];
            /* A constant 8 unrolls scores8's loop over the slots: its accumulators stay in registers. */
            const __m256 raw = n == 8 ? scores8(q + h * d, k, stride, 8, d) : scores8(q + h * d, k, stride, (int)n, d);
            const __m256 s = _mm256_mul_ps(raw, vscale);
            float *dst = scores + h * keys + (p - lo);
            if (n == 8) _mm256_storeu_ps(dst, s);
            else _mm256_maskstore_ps(dst, tail_mask(n), s);
        }
        p += n;
        n = next_n;
        slot = next;
    }
    /* Softmax of each query head's scores. */
    float inv_sum[MAX_HEADS];
    for (int64_t h = 0; h < heads; h++) {
        float *sh = scores + h * keys;
        if (softcap > 0.0f)
            for (int64_t t = 0; t < keys; t++) sh[t] = tanhf(sh[t] / softcap) * softcap;
        __m256 mx = _mm256_set1_ps(-INFINITY);
        int64_t j = 0;
        for (; j + 8 <= keys; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sh + j));
        float best = -INFINITY, lanes[8];
        _mm256_storeu_ps(lanes, mx);
        for (int i = 0; i < 8; i++) best = lanes[i] > best ? lanes[i] : best;
        for (int64_t t = j; t < keys; t++) best = sh[t] > best ? sh[t] : best;
        const float sink = sinks ? sinks[h] : -INFINITY;  /* exp(-inf) adds nothing */
        best = sink > best ? sink : best;
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
        inv_sum[h] = 1.0f / (hsum(acc) + expf(sink - best));
    }
    /* The values, weighted, into out (which accumulates, then is scaled by 1 / sum). */
    const int64_t chunks = d / 8;
    for (int64_t i = 0; i < heads * d; i++) out[i] = 0.0f;
    for (int64_t p = lo; p < hi; p++) {
        const float *slot = vpool + ((int64_t)table[p / bs] * bs + p % bs) * stride;
        for (int64_t h = 0; h < heads; h++) {
            const float *v = slot + kv_offset[h];
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

#endif
