/* The sampler's row reductions on an x86-64 CPU with AVX2 (gpu/sampling/reductions.py loads
 * this file): torch's argmax and max-with-index over a row of a large vocabulary run a scalar
 * loop (a 262k-token row ~0.3 ms, ~10x torch's amax), and greedy decoding takes one a row a
 * step; a sampled token's logprob needs only its row's log-softmax normaliser, not the whole
 * log_softmax row torch writes.
 *
 * argmax_rows is torch.argmax(x, dim=-1) exactly: the first index of the largest value, where a
 * NaN counts as larger than everything (the first NaN's index): each block's maximum (and
 * whether it holds a NaN), then the first index that equals the largest in the first block that
 * holds it.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include "simd_math.h"

#define PARALLEL_ROWS 2  /* rows from which the threads share them */

static int64_t first_index(const float *row, int64_t V, float value, int nan) {
    int64_t i = 0;
    const __m256 target = _mm256_set1_ps(value);
    for (; i + 8 <= V; i += 8) {
        const __m256 v = _mm256_loadu_ps(row + i);
        const int hits = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, target, _CMP_EQ_OQ));
        if (hits) return i + __builtin_ctz((unsigned)hits);
    }
    for (; i < V; i++)
        if (nan ? isnan(row[i]) : row[i] == value) return i;
    return 0;
}

/* A row goes in blocks of BLOCK values, small enough to stay in L1 between a block's passes
 * (its max, then its e^ or the first index of its max): the row is read once from memory,
 * not two or three times (a 262k vocabulary's row is 1 MB; 32 of them are most of the caches). */
#define BLOCK 1024

/* the largest of p[0..n); *nan set where one of them is a NaN (the result is then meaningless) */
static float block_max(const float *p, int64_t n, int *nan) {
    __m256 m = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(p + i);
        m = _mm256_max_ps(m, v);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float best = hmax(m);
    if (_mm256_movemask_ps(unordered)) *nan = 1;
    for (; i < n; i++) {
        if (isnan(p[i])) *nan = 1;
        else if (p[i] > best) best = p[i];
    }
    return best;
}

/* the first index of the row's largest value, as torch.argmax (a NaN counts as the largest);
 * *block: the first block holding it */
static int64_t row_argmax_in(const float *row, int64_t V, int nan, float best, int64_t block) {
    if (nan) return first_index(row, V, 0.0f, 1);
    return block + first_index(row + block, V - block < BLOCK ? V - block : BLOCK, best, 0);
}

static int64_t row_argmax(const float *row, int64_t V) {
    int nan = 0;
    float best = -INFINITY;
    int64_t at = 0;
    for (int64_t b = 0; b < V; b += BLOCK) {
        const float m = block_max(row + b, V - b < BLOCK ? V - b : BLOCK, &nan);
        if (m > best) best = m, at = b;
    }
    return row_argmax_in(row, V, nan, best, at);
}

/* out[r] = argmax of row r of x [rows, V] (rows ld floats apart) */
void argmax_rows(const float *x, int64_t rows, int64_t V, int64_t ld, int64_t *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax(x + r * ld, V);
}

/* sum_j e^(p[j] - m) over a block whose largest value m is finite: e^ in float lanes
 * (simd_math.h's, ~2e-7), 128 values a lane */
static double block_sum_exp(const float *p, int64_t n, float m) {
    const __m256 vm = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(p + i), vm)));
    double sum = hsum(acc);
    for (; i < n; i++) sum += expf(p[i] - m);
    return sum;
}

/* For row r of x [rows, V] (rows ld floats apart): argmax[r] as argmax_rows, top[r] its value
 * and log_sum[r] = log(sum_j e^(x[r, j] - top[r])), so that (x[r, j] - top[r]) - log_sum[r] is
 * torch.log_softmax's x[r, j] (its order of operations). A row whose top is not finite (a NaN,
 * +inf, or every value -inf) gets a NaN log_sum, as its log_softmax is NaN. */
void log_softmax_parts(const float *x, int64_t rows, int64_t V, int64_t ld, int64_t *argmax, float *top,
                       float *log_sum, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * ld;
        /* each block's sum against its own max m, carried to the row's max so far in double:
         * sum_j e^(x_j - top) = sum over blocks of e^(m - top) sum_(j in block) e^(x_j - m) */
        int nan = 0;
        float best = -INFINITY;
        int64_t at = 0;
        double sum = 0.0;
        for (int64_t b = 0; b < V; b += BLOCK) {
            const int64_t n = V - b < BLOCK ? V - b : BLOCK;
            const float m = block_max(row + b, n, &nan);
            if (nan || !(m > -INFINITY) || !(m < INFINITY)) {  /* the result is NaN, or the block adds 0 */
                if (m > best) best = m, at = b;
                continue;
            }
            const double block_sum = block_sum_exp(row + b, n, m);
            if (m > best) {
                sum = sum * exp((double)best - m) + block_sum;
                best = m, at = b;
            } else {
                sum += block_sum * exp((double)m - best);
            }
        }
        argmax[r] = row_argmax_in(row, V, nan, best, at);
        top[r] = row[argmax[r]];
        log_sum[r] = isfinite(top[r]) ? (float)log(sum) : NAN;
    }
}
