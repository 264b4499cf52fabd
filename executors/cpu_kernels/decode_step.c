/* A whole decode step of a dense float32 decoder, every layer, in one OpenMP parallel region.
 *
 * Calling the kernels of this directory op by op from Python costs a step of SmolLM2 ~300
 * calls: ~2.5 ms of Python on the 2-core EPYC of bench/RESULTS.md, with the pool threads
 * idle between the calls. Here the threads stay inside one region for the step and meet at
 * a barrier between the phases of a layer (each phase needs all of the previous one's
 * output):
 *
 *   RMSNorm | q/k/v matmul | q/k norm, rotation, K/V store | attention from the pool |
 *   o matmul + residual | RMSNorm | gate/up matmul, activation | down matmul + residual
 *
 * or, in a layer that norms attention's and the MLP's outputs (Gemma 2 and 3, OLMo 2 and 3):
 *
 *   [RMSNorm] | q/k/v matmul | [q/k norm statistics of whole rows] | q/k norm, rotation, K/V
 *   store | attention | o matmul | residual + RMSNorm of it | [RMSNorm] | gate/up, activation |
 *   down matmul | residual + RMSNorm of it
 *
 * (past DOT_ROWS rows of float32 weights the down matmul computes the activation as it packs
 * its rows: no phase of its own.)
 *
 * The matmuls read the weights as float32 6-column panels (weight_panel.h) or int8 16-column
 * ones with float32 scales (weight_q8.h), x packed once per matmul into a scratch the team
 * shares. The layers are Llama / Qwen2 / Qwen3 / Mistral shaped: optional q/k/v, o and MLP
 * biases, optional q/k norms (per head, or over every head at once), a sliding window, score
 * scale, score cap and rotary table (or none) per layer, and optional norms of attention's
 * and the MLP's outputs.
 * Steps of up to ME_STEP_MAX_ROWS decode rows (one new token each, at its position, with a
 * cache).
 */
#include <stdlib.h>
#include <string.h>

#include "attention_row.h"
#include "decode_layer.h"

#define ME_STEP_MAX_ROWS 64

/* Keys a query sees in every layer: the widest window, 0 where some layer sees them all. */
static int64_t widest_window(const me_decoder *m) {
    int64_t widest = 0;
    for (int64_t l = 0; l < m->layers; l++) {
        if (m->windows[l] <= 0) return 0;
        widest = m->windows[l] > widest ? m->windows[l] : widest;
    }
    return widest;
}

/* Every position inside the rotary tables, every slot and every block a row reads inside
 * the pool: the loops below index with them unchecked. A row reads the blocks of its keys
 * [lo, hi) in some layer, lo the least of the layers' window starts; the entries before
 * lo's block are never read, and may be FREED (-1) once a window that every layer slides
 * has left them (kvcache's KvCacheManager.slide). */
static int in_range(const me_decoder *m, const me_step *s) {
    const int64_t slots = s->pool_blocks * s->block_size, widest = widest_window(m);
    for (int64_t r = 0; r < s->rows; r++) {
        const int64_t p = s->positions[r];
        if (p < 0 || p >= m->max_positions || p / s->block_size >= s->ldt || s->slots[r] < 0 || s->slots[r] >= slots)
            return 0;
        const int64_t hi = p + 1, lo = widest > 0 && hi > widest ? hi - widest : 0;
        for (int64_t b = lo / s->block_size; b <= p / s->block_size; b++) {
            const int32_t block = s->tables[r * s->ldt + b];
            if (block < 0 || block >= s->pool_blocks) return 0;
        }
    }
    for (int64_t z = 0; z < s->zero_count; z++)
        if (s->zero_slots[z] < 0 || s->zero_slots[z] >= slots) return 0;
    return 1;
}

/* Returns 0; -1 when a scratch allocation failed, -2 for an unsupported shape, -3 for an
 * index out of range (nothing was written then). */
int me_decode_step_f32(const me_decoder *m, const me_step *s, int threads) {
    const int64_t rows = s->rows, hidden = m->hidden, d = m->head_dim, heads = m->heads, kvh = m->kv_heads;
    const int64_t hq = heads * d, hk = kvh * d, width = hq + 2 * hk, inter = m->inter;
    if (rows < 1 || rows > ME_STEP_MAX_ROWS || d % 8 || d > MAX_HEAD_DIM || heads > MAX_HEADS || heads % kvh)
        return -2;
    if (!in_range(m, s)) return -3;
    int64_t longest = 0;
    for (int64_t r = 0; r < rows; r++) longest = s->positions[r] + 1 > longest ? s->positions[r] + 1 : longest;
    const int64_t group = heads / kvh;
    const int64_t split = rows >= 2 * threads ? 1 : kvh;  /* attention tasks: rows, or (row, KV head) */
    /* the packed x of the widest matmul input (none where the rows are few: read in place) */
    const int64_t inputs[] = {hidden, hq, inter};
    int64_t packed = 0;
    for (int i = 0; i < 3; i++) {
        const int64_t floats = wpanel_x_floats(rows, inputs[i]);
        packed = floats > packed ? floats : packed;
    }
    /* each thread's dequantized int8 panels, where the matrices are int8 (pack_model stores
     * all of a model's one way), the rows many and the CPU without AVX-512 */
    step_scratch sc = {NULL, NULL, use_avx512()};
    const int quantized = m->layers > 0 && field(m, 0, W_QKV_SCALES) != NULL;
    const int64_t widest = hidden > hq ? (hidden > inter ? hidden : inter) : (hq > inter ? hq : inter);
    const int64_t dequantized = quantized && q8_needs_scratch(rows, sc.avx512) ? threads * q8_scratch_floats(widest) : 0;
    if (quantized && !q8_needs_scratch(rows, sc.avx512)) packed = 0;  /* nor packed x */
    sc.xp = packed ? malloc(sizeof(float) * (size_t)packed) : NULL;
    sc.wq = dequantized ? malloc(sizeof(float) * (size_t)dequantized) : NULL;
    /* the outputs of attention and the MLP before their norms, and whole rows' q/k norms */
    const int post_norms = m->layers > 0 && field(m, 0, W_POST_FF_NORM) != NULL;
    float *y = post_norms ? malloc(sizeof(float) * (size_t)(rows * hidden)) : NULL;
    float *inv_rms = m->qk_norm_across ? malloc(sizeof(float) * (size_t)(2 * rows)) : NULL;
    if ((packed && !sc.xp) || (dequantized && !sc.wq) || (post_norms && !y) || (m->qk_norm_across && !inv_rms)) {
        free(sc.xp);
        free(sc.wq);
        free(y);
        free(inv_rms);
        return -1;
    }
    int failed = 0;
    int64_t attended = 0;  /* attention tasks finished, over the layers so far */
    #pragma omp parallel num_threads(threads)
    {
        float *scores = thread_scratch(heads * (longest + 8), &failed);
        float *h = thread_scratch(rows * hidden, &failed);  /* this thread's normed rows */
        float *act = rows <= DOT_ROWS ? thread_scratch(rows * inter, &failed) : NULL;  /* its activations */
        #pragma omp barrier
        if (!failed) {
            for (int64_t l = 0; l < m->layers; l++) {
                float *kpool = s->kpool + l * s->layer_stride, *vpool = s->vpool + l * s->layer_stride;
                /* q, k, v (of the rows themselves where the layer norms no input: OLMo 2 and 3) */
                const float *input = field(m, l, W_INPUT_NORM) ? h : s->x;
                if (input == h) own_norm(m, s->x, rows, field(m, l, W_INPUT_NORM), h);
                step_linear(m, l, W_QKV, W_QKV_SCALES, input, rows, hidden, width, field(m, l, W_QKV_BIAS), NULL,
                            s->qkv, &sc);
                if (m->qk_norm_across && field(m, l, W_Q_NORM)) whole_row_norms(m, s, inv_rms);
                /* q/k norms and rotation, the new K and V into the pool, attention. A task's rows
                 * and KV heads read only K and V they stored themselves or older steps did: one
                 * phase, unless stale slots are to be cleared first (in every layer, before any
                 * attention reads the blocks). */
                const int64_t window = m->windows[l];
                if (s->zero_count) {
                    #pragma omp for schedule(static)
                    for (int64_t task = 0; task < rows * kvh; task++)
                        rotate_and_store(m, s, l, task / kvh, task % kvh, task % kvh + 1, kpool, vpool, inv_rms);
                    #pragma omp for schedule(static)
                    for (int64_t z = 0; z < s->zero_count; z++) {
                        memset(kpool + s->zero_slots[z] * hk, 0, sizeof(float) * (size_t)hk);
                        memset(vpool + s->zero_slots[z] * hk, 0, sizeof(float) * (size_t)hk);
                    }
                }
                #pragma omp for schedule(dynamic, 1) nowait
                for (int64_t task = 0; task < rows * split; task++) {
                    const int64_t r = task / split, kv0 = split == 1 ? 0 : task % split, kv1 = split == 1 ? kvh : kv0 + 1;
                    const int64_t hi = s->positions[r] + 1, lo = window > 0 && hi > window ? hi - window : 0;
                    if (!s->zero_count) rotate_and_store(m, s, l, r, kv0, kv1, kpool, vpool, inv_rms);
                    attend_row(s->qkv + r * width, group, d, kpool, vpool, s->block_size, kvh, kv0 * group, kv1 * group,
                               s->tables + r * s->ldt, lo, hi, m->scales[l], m->softcaps ? m->softcaps[l] : 0.0f, NULL,
                               scores, s->attn + r * hq);
                    __atomic_add_fetch(&attended, 1, __ATOMIC_RELEASE);
                }
                if (!quantized) fetch_o_while_attending(m, l, rows, &attended, (l + 1) * rows * split);
                #pragma omp barrier
                if (!field(m, l, W_POST_FF_NORM)) {  /* x += attn @ o^T; the MLP */
                    step_linear(m, l, W_O, W_O_SCALES, s->attn, rows, hq, hidden, field(m, l, W_O_BIAS), s->x, s->x,
                                &sc);
                    /* a parallel layer's MLP reads h as the input norm left it: nothing has written it since */
                    if (!m->parallel) own_norm(m, s->x, rows, field(m, l, W_POST_NORM), h);
                    step_mlp(m, s, l, h, &sc, act, s->x, s->x);
                    continue;
                }
                /* x += norm(attn @ o^T); x += norm(MLP(norm(x) or x)) */
                step_linear(m, l, W_O, W_O_SCALES, s->attn, rows, hq, hidden, field(m, l, W_O_BIAS), NULL, y, &sc);
                add_normed(m, s->x, y, rows, field(m, l, W_POST_NORM));
                const float *mlp_input = field(m, l, W_PRE_FF_NORM) ? h : s->x;
                if (mlp_input == h) own_norm(m, s->x, rows, field(m, l, W_PRE_FF_NORM), h);
                step_mlp(m, s, l, mlp_input, &sc, act, NULL, y);
                add_normed(m, s->x, y, rows, field(m, l, W_POST_FF_NORM));
            }
            step_norm(m, s->x, rows, m->final_norm, s->x);
        }
        free(scores);
        free(h);
        free(act);
    }
    free(sc.xp);
    free(sc.wq);
    free(y);
    free(inv_rms);
    return failed ? -1 : 0;
}
