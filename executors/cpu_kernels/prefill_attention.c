/* Causal attention of fresh prompts over themselves (a prefill's attention), float32.
 *
 * torch's SDPA takes ~360 us a layer for one 128-token prompt of SmolLM2 (9 query heads over
 * 3 KV heads of 64) on the 2-core EPYC of bench/RESULTS.md, ~11 ms of a ~184 ms prefill.
 * Here each prompt's KV head is laid out once as panels (panel.h): K^T as 16-key panels of
 * [d, 16], V as 16-dimension panels of [n, 16]. A tile of up to 6 consecutive tokens of one
 * query head then runs two panel matmuls: its scores against the key panels up to its last
 * token (the causal triangle: later panels are never touched), a softmax over each token's
 * own keys (the rest zeroed), and the weights against the value panels.
 *
 * Token t of prompt c is row c * n + t of q ([rows, heads, d], rows ldq floats apart), k and
 * v ([rows, kv_heads, d], rows ldk / ldv apart) and out ([rows, heads, d], rows ldo apart).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "panel.h"

/* Scale row s[0, valid) (softcap > 0: then cap it, softcap * tanh(s / softcap), Gemma 2),
 * softmax it in place, normalising over one more logit, `sink` (GPT-OSS's attention sink, a
 * key without a value; -INFINITY: none), and zero s[valid, width). */
static void softmax_row(float *s, int64_t valid, int64_t width, float scale, float softcap, float sink) {
    if (softcap > 0.0f) {  /* scaled and capped here; the loops below scale by 1 */
        for (int64_t j = 0; j < valid; j++) s[j] = tanhf(s[j] * scale / softcap) * softcap;
        scale = 1.0f;
    }
    const __m256 vscale = _mm256_set1_ps(scale);
    const int64_t full = valid & ~(int64_t)7;
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < full; j += 8) {
        const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + j), vscale);
        _mm256_storeu_ps(s + j, x);
        vmax = _mm256_max_ps(vmax, x);
    }
    float top = -INFINITY;
    for (int64_t j = full; j < valid; j++) {
        s[j] *= scale;
        top = s[j] > top ? s[j] : top;
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    for (int i = 0; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
    top = sink > top ? sink : top;
    const __m256 vtop = _mm256_set1_ps(top);
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t j = 0; j < full; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vtop));
        _mm256_storeu_ps(s + j, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum(vsum) + expf(sink - top);
    for (int64_t j = full; j < valid; j++) {
        s[j] = expf(s[j] - top);
        sum += s[j];
    }
    const float inv = 1.0f / sum;
    const __m256 vinv = _mm256_set1_ps(inv);
    for (int64_t j = 0; j < full; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), vinv));
    for (int64_t j = full; j < valid; j++) s[j] *= inv;
    if (width > valid) memset(s + valid, 0, sizeof(float) * (size_t)(width - valid));
}

/* One prompt's KV head as panels: keys [n, d] (rows ld apart) as ceil(n / 16) panels of
 * [d, 16] (K^T, key-major columns), values as ceil(d / 16) panels of [n, 16]; zero-padded. */
static void pack_kv(const float *k, const float *v, int64_t n, int64_t ld_k, int64_t ld_v, int64_t d, float *kp,
                    float *vp) {
    const int64_t key_panels = (n + PANEL - 1) / PANEL, dim_panels = (d + PANEL - 1) / PANEL;
    memset(kp, 0, sizeof(float) * (size_t)(key_panels * d * PANEL));
    memset(vp, 0, sizeof(float) * (size_t)(dim_panels * n * PANEL));
    for (int64_t t = 0; t < n; t++) {
        float *kcol = kp + (t / PANEL) * d * PANEL + t % PANEL;
        for (int64_t c = 0; c < d; c++) kcol[c * PANEL] = k[t * ld_k + c];
        for (int64_t p = 0; p < dim_panels; p++) {
            const int64_t width = d - p * PANEL < PANEL ? d - p * PANEL : PANEL;
            memcpy(vp + p * n * PANEL + t * PANEL, v + t * ld_v + p * PANEL, sizeof(float) * (size_t)width);
        }
    }
}

/* out = causal attention of `count` prompts of n tokens each over themselves (see the top).
 * heads a multiple of kv_heads; softcap > 0 caps the scaled scores (softmax_row), 0 leaves
 * them; sinks: a logit per query head each softmax also normalises over, NULL: none. Returns 0, or -1 when a scratch allocation failed. */
int me_prefill_attention_f32(const float *q, const float *k, const float *v, int64_t count, int64_t n, int64_t ldq,
                             int64_t ldk, int64_t ldv, int64_t heads, int64_t kv_heads, int64_t d, float scale,
                             float softcap, const float *sinks, float *out, int64_t ldo, int threads) {
    const int64_t group = heads / kv_heads;
    const int64_t key_panels = (n + PANEL - 1) / PANEL, dim_panels = (d + PANEL - 1) / PANEL;
    const int64_t width = key_panels * PANEL;  /* a score row's floats */
    const int64_t kv_size = key_panels * d * PANEL + dim_panels * n * PANEL;  /* one prompt's KV head */
    float *packed = malloc(sizeof(float) * (size_t)(count * kv_heads * kv_size));
    if (!packed) return -1;
    const int64_t tiles = (n + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t tasks = count * heads * tiles;
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (count * heads * n * n * d >= (1 << 20))
    {
        #pragma omp for schedule(static)
        for (int64_t task = 0; task < count * kv_heads; task++) {
            const int64_t c = task / kv_heads, g = task % kv_heads;
            float *kp = packed + task * kv_size;
            pack_kv(k + c * n * ldk + g * d, v + c * n * ldv + g * d, n, ldk, ldv, d, kp, kp + key_panels * d * PANEL);
        }
        float *scores = thread_scratch(TILE_ROWS * width, &failed);
        /* The last tiles of a prompt see the most keys: they go out first. */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (!scores) continue;
            const int64_t i = tiles - 1 - task % tiles, ch = task / tiles;
            const int64_t c = ch / heads, h = ch % heads;
            const int64_t t0 = i * TILE_ROWS, t1 = t0 + TILE_ROWS < n ? t0 + TILE_ROWS : n, mr = t1 - t0;
            const float *kp = packed + (c * kv_heads + h / group) * kv_size, *vp = kp + key_panels * d * PANEL;
            const float *x = q + (c * n + t0) * ldq + h * d;
            const int64_t seen = (t1 + PANEL - 1) / PANEL;  /* key panels up to the tile's last token */
            for (int64_t j = 0; j < seen; j++)
                panel_tile_rows(x, ldq, mr, kp + j * d * PANEL, d, PANEL, NULL, NULL, 0, scores + j * PANEL, width);
            for (int64_t r = 0; r < mr; r++) softmax_row(scores + r * width, t0 + r + 1, t1, scale, softcap,
                                                     sinks ? sinks[h] : -INFINITY);
            float *y = out + (c * n + t0) * ldo + h * d;
            for (int64_t p = 0; p < dim_panels; p++) {
                const int cols = (int)(d - p * PANEL < PANEL ? d - p * PANEL : PANEL);
                panel_tile_rows(scores, width, mr, vp + p * n * PANEL, t1, cols, NULL, NULL, 0, y + p * PANEL, ldo);
            }
        }
        free(scores);
    }
    free(packed);
    return failed ? -1 : 0;
}
