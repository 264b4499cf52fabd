/* The phases of one decoder layer in a decode step (decode_step.c): the model's and the
 * step's structures, the matmuls over the team, the norms, q/k norms and rotation with the
 * K/V store, the MLP and the residual adds of a layer that norms its outputs. Each phase is
 * called by every thread of the step's OpenMP team; those that share work out end at a
 * barrier (step_linear, whole_row_norms, add_normed), the others are a thread's own.
 */
#ifndef MODELEXEC_DECODE_LAYER_H
#define MODELEXEC_DECODE_LAYER_H

#include <stdlib.h>
#include <string.h>

#include "pointwise.h"
#include "weight_linear.h"
#include "weight_q8.h"

/* Addresses of one layer's tensors, in a [layers, LAYER_FIELDS] int64 table; 0 where absent.
 * A matrix whose *_SCALES entry is set is int8 panels with those scales, else float32 panels. */
enum { W_INPUT_NORM, W_QKV, W_QKV_BIAS, W_O, W_O_BIAS, W_Q_NORM, W_K_NORM, W_POST_NORM, W_GATE_UP, W_GATE_UP_BIAS,
       W_DOWN, W_DOWN_BIAS, W_QKV_SCALES, W_O_SCALES, W_GATE_UP_SCALES, W_DOWN_SCALES,
       /* set where the layer norms the MLP's output (its attention's then by W_POST_NORM), and
        * maybe its input (W_PRE_FF_NORM) too */
       W_PRE_FF_NORM, W_POST_FF_NORM, LAYER_FIELDS };

typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, inter;
    float eps;
    int32_t activation;          /* ACT_SILU or ACT_GELU_TANH */
    const int64_t *weights;      /* [layers, LAYER_FIELDS]; every matrix as panels (panel.h) */
    const int32_t *windows;      /* [layers]: keys a query sees, 0 for all */
    const float *scales;         /* [layers]: of q.k */
    const float *final_norm;
    const float *cos, *signed_sin;  /* [max_positions, head_dim] */
    int64_t max_positions;
    const int32_t *rotary;       /* [layers]: 0 where a layer does not rotate q and k (NoPE), 1 by cos and
                                  * signed_sin, 2 by local_cos and local_sin; NULL: 1 for all */
    const float *local_cos, *local_sin;  /* [max_positions, head_dim] (Gemma 3's sliding layers), or NULL */
    const float *softcaps;       /* [layers]: scores s -> c tanh(s / c) where c > 0 (Gemma 2); NULL: none */
    int32_t qk_norm_across;      /* 1: q_norm and k_norm span every head of a row (OLMo 2 and 3) */
    int32_t norm_kind;           /* the layers' and the final norm: NORM_RMS, or LayerNorms (Cohere, StableLM) */
    int32_t parallel;            /* 1: the MLP reads the input norm's output, x + attn(h) + mlp(h) (Cohere) */
    int32_t ungated;             /* 1: W_GATE_UP is up alone, [inter, hidden]: down(act(up(h))) (StarCoder2) */
} me_decoder;

/* The rows of a layer's W_GATE_UP: gate's and up's, or up's alone. */
static inline int64_t gate_up_rows(const me_decoder *m) { return m->ungated ? m->inter : 2 * m->inter; }

/* NORM_LAYER_BIAS: each norm's address holds its n weights, then its n biases. */
enum { NORM_RMS = 0, NORM_LAYER = 1, NORM_LAYER_BIAS = 2 };

/* y = the model's norm of one row of n floats with weights w (q/k norms are RMSNorms). */
static inline void norm_row(const me_decoder *m, const float *x, int64_t n, const float *w, float *y) {
    if (m->norm_kind == NORM_RMS) rms_norm_row(x, n, w, m->eps, y);
    else layer_norm_row(x, n, w, m->norm_kind == NORM_LAYER_BIAS ? w + n : NULL, m->eps, y);
}

typedef struct {
    int64_t rows;
    const int64_t *positions;    /* [rows]: each row's new token's position (its cache holds the ones before) */
    const int64_t *slots;        /* [rows]: its pool slot, checked against the pool by the caller */
    const int32_t *tables;       /* [rows, ldt] block tables */
    int64_t ldt;
    const int64_t *zero_slots;   /* [zero_count] stale slots to clear in every layer */
    int64_t zero_count;
    float *kpool, *vpool;        /* layer 0's [blocks, block_size, kv_heads, head_dim] */
    int64_t layer_stride;        /* floats from one layer's pool to the next */
    int64_t block_size;
    int64_t pool_blocks;         /* blocks of a layer's pool (scratch blocks included) */
    float *x;                    /* [rows, hidden]: the embeddings in, the final normed hidden states out */
    float *h;                    /* unused (NULL): each thread norms into a buffer of its own */
    float *qkv, *attn, *gu, *act;  /* scratch: [rows, (heads + 2 kv_heads) head_dim], [rows, heads head_dim],
                                    * [rows, 2 inter], [rows, inter] */
} me_step;

static inline const float *field(const me_decoder *m, int64_t layer, int f) {
    return (const float *)(intptr_t)m->weights[layer * LAYER_FIELDS + f];
}

/* The step's scratch for the matmuls, shared by the team: packed x, each thread's
 * dequantized int8 panels (AVX2 only), and whether the matmuls run on AVX-512. */
typedef struct {
    float *xp, *wq;
    int avx512;
} step_scratch;

/* The float32 matmul the step runs after field f of layer l: q/k/v, o, gate/up, down, then
 * the next layer's q/k/v (none after the last layer's down). */
static next_matmul next_of(const me_decoder *m, int64_t l, int f) {
    const int64_t hq = m->heads * m->head_dim, width = hq + 2 * m->kv_heads * m->head_dim;
    switch (f) {
    case W_QKV: return (next_matmul){field(m, l, W_O), m->hidden, hq};
    case W_O: return (next_matmul){field(m, l, W_GATE_UP), gate_up_rows(m), m->hidden};
    case W_GATE_UP: return (next_matmul){field(m, l, W_DOWN), m->hidden, m->inter};
    default: return l + 1 < m->layers ? (next_matmul){field(m, l + 1, W_QKV), width, m->hidden} : (next_matmul){0};
    }
}

/* y = x @ w^T (+ bias) (+ residual) for field f of layer l (and its scales, where int8),
 * shared out over the team (x packed into the scratch where the rows are many, int8 panels
 * dequantized there too without AVX-512; float32 dot products prefetching the next matmul's
 * weights as they end); a barrier ends it. */
static void step_linear(const me_decoder *m, int64_t l, int f, int scales_field, const float *x, int64_t rows,
                        int64_t k, int64_t n, const float *bias, const float *residual, float *y,
                        const step_scratch *sc) {
    const float *scales = field(m, l, scales_field), *w = field(m, l, f);
    if (scales) {
        const q8_weight q = {(const int8_t *)w, scales};
        q8_linear_team(x, rows, k, q, n, k, bias, residual, n, y, n, sc->avx512, sc->xp, sc->wq);
    } else {
        weight_linear_team(x, rows, k, w, n, k, bias, residual, n, y, n, sc->avx512, sc->xp, next_of(m, l, f));
    }
}

static void step_norm(const me_decoder *m, const float *x, int64_t rows, const float *w, float *y) {
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) norm_row(m, x + r * m->hidden, m->hidden, w, y + r * m->hidden);
}

/* Every row normed by the calling thread alone, into its own h: the matmul after it reads h
 * (in place, or packing its share of x), so no barrier waits for the other threads' rows. A
 * thread that has nothing to do in a phase parks at its barrier and wakes late (tens of
 * microseconds in a VM, bench/RESULTS.md run 19): a norm of a few rows costs less. */
static void own_norm(const me_decoder *m, const float *x, int64_t rows, const float *w, float *h) {
    for (int64_t r = 0; r < rows; r++) norm_row(m, x + r * m->hidden, m->hidden, w, h + r * m->hidden);
}

/* 1 / rms of each row's q and of its k, [rows, 2], where the norms span every head (a phase
 * of its own: the tasks after it norm their heads in place). */
static void whole_row_norms(const me_decoder *m, const me_step *s, float *inv_rms) {
    const int64_t hq = m->heads * m->head_dim, hk = m->kv_heads * m->head_dim, width = hq + 2 * hk;
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < s->rows; r++) {
        const float *row = s->qkv + r * width;
        inv_rms[2 * r] = 1.0f / sqrtf(sum_squares(row, hq) / (float)hq + m->eps);
        inv_rms[2 * r + 1] = 1.0f / sqrtf(sum_squares(row + hq, hk) / (float)hk + m->eps);
    }
}

/* q/k norms and rotation of KV heads [kv0, kv1) of row r and their query heads, and the new
 * K and V of those heads into the pool. `inv_rms`: whole_row_norms' where the norms span
 * every head. */
static void rotate_and_store(const me_decoder *m, const me_step *s, int64_t l, int64_t r, int64_t kv0, int64_t kv1,
                             float *kpool, float *vpool, const float *inv_rms) {
    const int64_t d = m->head_dim, heads = m->heads, kvh = m->kv_heads, group = heads / kvh;
    const int64_t hq = heads * d, hk = kvh * d, width = hq + 2 * hk;
    const float *qn = field(m, l, W_Q_NORM), *kn = field(m, l, W_K_NORM);
    const int32_t table = m->rotary ? m->rotary[l] : 1;
    const float *cos = (table == 2 ? m->local_cos : m->cos) + s->positions[r] * d;
    const float *sin = (table == 2 ? m->local_sin : m->signed_sin) + s->positions[r] * d;
    float *row = s->qkv + r * width;
    for (int64_t kv = kv0; kv < kv1; kv++) {
        for (int64_t head = kv * group; head < (kv + 1) * group; head++) {
            float *q = row + head * d;
            if (qn && m->qk_norm_across) scale_row(q, d, inv_rms[2 * r], qn + head * d, q);
            else if (qn) rms_norm_row(q, d, qn, m->eps, q);
            if (table) rope_head(q, d, cos, sin);
        }
        float *k = row + hq + kv * d;
        if (kn && m->qk_norm_across) scale_row(k, d, inv_rms[2 * r + 1], kn + kv * d, k);
        else if (kn) rms_norm_row(k, d, kn, m->eps, k);
        if (table) rope_head(k, d, cos, sin);
        const int64_t at = s->slots[r] * hk + kv * d;
        memcpy(kpool + at, k, sizeof(float) * (size_t)d);
        memcpy(vpool + at, row + hq + hk + kv * d, sizeof(float) * (size_t)d);
    }
}

/* act(gate) * up for every row: the fused gate/up matmul into gu, then the activation, into
 * own (this thread's, every row: the down matmul of at most DOT_ROWS rows reads it in place,
 * with no barrier between) where given, else into s->act shared out over the team. Returns
 * where the activations are. */
static const float *step_glu(const me_decoder *m, const me_step *s, int64_t l, const float *h,
                             const step_scratch *sc, float *own) {
    const int64_t rows = s->rows, inter = m->inter, width = gate_up_rows(m);
    step_linear(m, l, W_GATE_UP, W_GATE_UP_SCALES, h, rows, m->hidden, width, field(m, l, W_GATE_UP_BIAS),
                NULL, s->gu, sc);
    if (own) {
        for (int64_t r = 0; r < rows; r++)
            glu_row(s->gu + r * width, m->ungated ? NULL : s->gu + r * width + inter, inter, m->activation,
                    own + r * inter);
        return own;
    }
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        glu_row(s->gu + r * width, m->ungated ? NULL : s->gu + r * width + inter, inter, m->activation,
                s->act + r * inter);
    return s->act;
}

/* A thread done with its attention tasks while others still attend fetches its share of
 * the o matmul's weights (the dot products' groups it will read, weight_linear.h), until the
 * last task ends: the memory idles through attention otherwise, ~29 us a layer of a batch-1
 * step at a context of 128, with one thread of two waiting for the other (RESULTS run 23). */
static void fetch_o_while_attending(const me_decoder *m, int64_t l, int64_t rows, const int64_t *attended,
                                    int64_t goal) {
    if (rows > DOT_ROWS) return;  /* the tiles' o matmul is compute-bound */
    const int64_t k = m->heads * m->head_dim, count = (m->hidden + WPANEL - 1) / WPANEL, group = dot_group(rows);
    int64_t g0, g1;
    dot_share((count + group - 1) / group, omp_get_thread_num(), omp_get_num_threads(), &g0, &g1);
    const int64_t first = g0 * group, end = g1 * group < count ? g1 * group : count;  /* its panels */
    const char *from = (const char *)(field(m, l, W_O) + first * k * WPANEL);
    const int64_t bytes = (end - first) * k * WPANEL * (int64_t)sizeof(float);
    for (int64_t at = 0; at < bytes && __atomic_load_n(attended, __ATOMIC_ACQUIRE) < goal; at += 512)
        for (int64_t line = 0; line < 512; line += 64) _mm_prefetch(from + at + line, _MM_HINT_T0);
}

/* y = down(act(gate) * up) (+ residual) of the normed rows h (the MLP). Past DOT_ROWS rows of
 * float32 weights, the down matmul computes the activation as it packs its rows (pack_x.h):
 * no activation buffer and no phase of its own. */
static void step_mlp(const me_decoder *m, const me_step *s, int64_t l, const float *h, const step_scratch *sc,
                     float *own, const float *residual, float *y) {
    const int64_t rows = s->rows, inter = m->inter, hidden = m->hidden;
    if (!own && !field(m, l, W_DOWN_SCALES) && !m->ungated) {  /* (packing computes act(gate) * up only) */
        step_linear(m, l, W_GATE_UP, W_GATE_UP_SCALES, h, rows, hidden, 2 * inter, field(m, l, W_GATE_UP_BIAS),
                    NULL, s->gu, sc);
        weight_rows_team(s->gu, s->gu + inter, m->activation, rows, 2 * inter, field(m, l, W_DOWN), hidden, inter,
                         field(m, l, W_DOWN_BIAS), residual, hidden, y, hidden, sc->avx512, sc->xp);
        return;
    }
    const float *a = step_glu(m, s, l, h, sc, own);
    step_linear(m, l, W_DOWN, W_DOWN_SCALES, a, rows, inter, hidden, field(m, l, W_DOWN_BIAS), residual, y, sc);
}

/* x += norm(y) with weight w, row by row, shared out over the team (the residual add of a
 * layer that norms attention's or the MLP's output). */
static void add_normed(const me_decoder *m, float *x, float *y, int64_t rows, const float *w) {
    const int64_t hidden = m->hidden;
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *yr = y + r * hidden, *xr = x + r * hidden;
        norm_row(m, yr, hidden, w, yr);
        for (int64_t j = 0; j < hidden; j++) xr[j] += yr[j];
    }
}

#endif
