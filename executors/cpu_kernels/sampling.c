/* The SAMPLE policy's draw for each row of scaled logits (logits / temperature), as
 * executors/logits.py's _draw computes it with torch ops: the top_k cut (ties at the cut
 * stay in), softmax, the nucleus (the most probable tokens until their mass reaches top_p,
 * and every token as probable as the last one kept), the min_p cut, then the first token in
 * id order whose cumulative probability exceeds u times the total.
 *
 * torch takes ~0.44 ms a row of SmolLM2's 49152 logits with top_p on the 2-core EPYC, and
 * no less a row at batch 32 (~14 ms): a dozen ops, each a pass over the whole batch, which
 * has left the L2 cache by then. Here each row is a few passes over itself while it stays
 * in the L2, and the rows are threaded. The nucleus is found as the torch path finds it:
 * the probabilities' masses binned by the top bits of their float32 encoding (monotone in
 * the value), the bin where the mass from the top reaches top_p located, and only that
 * bin's probabilities sorted. Sums run in double, so a draw can differ from the torch
 * path's only where float32 rounding decides, as two torch builds can.
 */
#include <float.h>
#include <math.h>
#include <string.h>

#include "simd.h"

#define BIN_SHIFT 18                                /* exponent and 5 mantissa bits: bins ~3 % wide */
#define NUM_BINS ((0x3F800000 >> BIN_SHIFT) + 1)    /* probabilities are at most 1.0f */

static inline void swap_f(float *a, float *b) {
    float t = *a;
    *a = *b;
    *b = t;
}

/* The (k + 1)-th largest of v[0..n) (v is reordered): a three-way quickselect. */
static float kth_largest(float *v, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        float a = v[lo], b = v[mid], c = v[hi];  /* the median of three as the pivot */
        const float pivot = a < b ? (b < c ? b : (a < c ? c : a)) : (a < c ? a : (b < c ? c : b));
        int64_t lt = lo, i = lo, gt = hi;  /* [lo, lt) > pivot, [lt, i) == pivot, (gt, hi] < pivot */
        while (i <= gt) {
            if (v[i] > pivot) swap_f(v + lt++, v + i++);
            else if (v[i] < pivot) swap_f(v + i, v + gt--);
            else i++;
        }
        if (k < lt) hi = lt - 1;
        else if (k > gt) lo = gt + 1;
        else return pivot;
    }
    return v[lo];
}

static int descending(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

static inline int64_t bin_of(float p) {
    int32_t bits;
    memcpy(&bits, &p, sizeof bits);
    return bits >> BIN_SHIFT;  /* p in [0, 1]: at most NUM_BINS - 1 */
}

static inline float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* The (k + 1)-th largest of s[0..n) for k < HEAP_K: a min-heap of the k + 1 largest seen, which
 * most values pass by with one comparison (with a quickselect, top_k=50 over 32 rows of 49152
 * took 9.47 ms, torch's ops 3.52: bench/RESULTS.md run 26b). */
#define HEAP_K 4096
static float kth_largest_heap(const float *s, int64_t n, int64_t k, float *heap) {
    const int64_t size = k + 1;
    int64_t filled = 0;
    for (int64_t j = 0; j < n; j++) {
        const float x = s[j];
        int64_t at;
        if (filled < size) {  /* sift up */
            at = filled++;
            while (at > 0 && heap[(at - 1) / 2] > x) {
                heap[at] = heap[(at - 1) / 2];
                at = (at - 1) / 2;
            }
            heap[at] = x;
        } else if (x > heap[0]) {  /* replace the smallest, sift down */
            at = 0;
            for (;;) {
                int64_t child = 2 * at + 1;
                if (child >= size) break;
                if (child + 1 < size && heap[child + 1] < heap[child]) child++;
                if (heap[child] >= x) break;
                heap[at] = heap[child];
                at = child;
            }
            heap[at] = x;
        }
    }
    return heap[0];
}

#define BLOCK 128  /* tokens a block of the inverse CDF: its sum locates the draw's block */

/* One row: s [n] scaled logits, finite or -inf (never drawn), the largest finite. Scratch: e
 * and spare of n floats, mass of NUM_BINS doubles, sums of n / BLOCK + 1 doubles.
 *
 * The probabilities stay unnormalised, e = exp(s - max) in (0, 1] (the largest is 1), and
 * every threshold is scaled instead: top_p's mass is top_p times their sum, min_p's floor is
 * min_p itself. */
static void sample_row(const float *s, int64_t n, int64_t top_k, float top_p, float min_p, double u, float *e,
                       float *spare, double *mass, double *sums, int64_t *token, double *drawn) {
    /* Logits below the cut are out: the top_k cut's, and (below, once the largest is known)
     * those more than 87 under it, -inf ones among them. */
    float cut = -FLT_MAX;
    if (top_k > 0 && top_k < n) {
        if (top_k <= HEAP_K) {
            cut = kth_largest_heap(s, n, top_k - 1, spare);
        } else {
            memcpy(spare, s, sizeof(float) * (size_t)n);
            cut = kth_largest(spare, n, top_k - 1);
        }
        cut = cut > -FLT_MAX ? cut : -FLT_MAX;
    }
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(s + j));
    float top = hmax(m8);
    for (; j < n; j++) top = s[j] > top ? s[j] : top;
    m8 = _mm256_set1_ps(top);
    /* exp8 floors its argument at -87, where expf would underflow, and would give those
     * logits 1.6e-38: their probability is 0, as the docstring of executors/logits.py
     * promises for underflowed tokens. */
    cut = cut > top - 87.0f ? cut : top - 87.0f;
    const __m256 cut8 = _mm256_set1_ps(cut);
    __m256 acc = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) {
        const __m256 x = _mm256_loadu_ps(s + j);
        const __m256 v = _mm256_and_ps(exp8(_mm256_sub_ps(x, m8)), _mm256_cmp_ps(x, cut8, _CMP_GE_OQ));
        _mm256_storeu_ps(e + j, v);
        acc = _mm256_add_ps(acc, v);
    }
    double sum = hsum(acc);
    for (; j < n; j++) {
        e[j] = s[j] >= cut ? expf(s[j] - top) : 0.0f;
        sum += e[j];
    }
    float floor = min_p;  /* min_p of the largest, which is 1 */
    if (top_p < 1.0f) {
        const double wanted = (double)top_p * sum;
        memset(mass, 0, sizeof(double) * NUM_BINS);
        for (j = 0; j < n; j++) mass[bin_of(e[j])] += e[j];
        /* The first bin from the top where the mass reaches top_p (the bottom one where
         * rounding leaves the total short of it: then everything is kept). */
        double higher = 0.0;
        int64_t b = NUM_BINS - 1;
        for (; b > 0 && higher + mass[b] < wanted; b--) higher += mass[b];
        if (b > 0) {
            int64_t count = 0;
            for (j = 0; j < n; j++)
                if (bin_of(e[j]) == b) spare[count++] = e[j];
            qsort(spare, (size_t)count, sizeof(float), descending);
            int64_t kept = 0;  /* kept while the mass of the tokens more probable is below top_p's */
            for (double before = higher; kept < count && before < wanted; kept++) before += spare[kept];
            floor = spare[kept - 1] > floor ? spare[kept - 1] : floor;
        }
    }
    /* The cuts, and each block's sum (float32 lanes, then double across blocks). */
    const __m256 floor8 = _mm256_set1_ps(floor);
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
    double total = 0.0;
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t end = (blk + 1) * BLOCK < n ? (blk + 1) * BLOCK : n;
        __m256 part = _mm256_setzero_ps();
        float tail = 0.0f;
        for (j = blk * BLOCK; j + 8 <= end; j += 8) {
            const __m256 v = _mm256_loadu_ps(e + j);
            const __m256 kept = _mm256_and_ps(v, _mm256_cmp_ps(v, floor8, _CMP_GE_OQ));
            _mm256_storeu_ps(e + j, kept);
            part = _mm256_add_ps(part, kept);
        }
        for (; j < end; j++) {
            if (e[j] < floor) e[j] = 0.0f;
            tail += e[j];
        }
        total += (double)hsum(part) + tail;
        sums[blk] = total;
    }
    /* The block where the running sum passes u * total, then the token inside it; targets are
     * kept strictly under the sums they are compared with, so the token drawn has a positive
     * probability even where rounding would carry u * total up to them. */
    double target = u * total;
    if (target >= total) target = nextafter(total, 0.0);
    int64_t blk = 0;
    while (blk < blocks - 1 && sums[blk] <= target) blk++;
    double running = blk > 0 ? sums[blk - 1] : 0.0;
    const int64_t first = blk * BLOCK, end = (blk + 1) * BLOCK < n ? (blk + 1) * BLOCK : n;
    int64_t at = -1, last = -1;
    for (j = first; j < end; j++) {
        if (e[j] <= 0.0f) continue;
        last = j;
        running += e[j];
        if (running > target) {
            at = j;
            break;
        }
    }
    if (at < 0) at = last;  /* rounding left the block's own sum short of its total's share */
    *token = at;
    *drawn = log((double)e[at] / total);
}

/* x [rows, n] (rows ldx floats apart): each row's token and the log of the probability it was
 * drawn with, top_k [rows] (0: all), top_p and min_p [rows] (1 and 0: all), u [rows] in
 * [0, 1). Returns 0, or 1 when scratch could not be allocated (nothing is written then). */
int me_sample_f32(const float *x, int64_t rows, int64_t n, int64_t ldx, const int64_t *top_k, const float *top_p,
                  const float *min_p, const double *u, int64_t *token, double *drawn, int threads) {
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (rows > 1 && rows * n >= 262144)
    {
        /* e, spare, then mass and the block sums as doubles */
        float *p = thread_scratch(2 * n + 2 * NUM_BINS + 2 * (n / BLOCK + 1), &failed);
        #pragma omp barrier
        if (!failed) {
            #pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++)
                sample_row(x + r * ldx, n, top_k[r], top_p[r], min_p[r], u[r], p, p + n, (double *)(p + 2 * n),
                           (double *)(p + 2 * n) + NUM_BINS, token + r, drawn + r);
        }
        free(p);
    }
    return failed;
}
