/* The sampler's row reductions on an x86-64 CPU with AVX2 (gpu/sampling/reductions.py loads
 * this file): torch's argmax and max-with-index over a row of a large vocabulary run a scalar
 * loop (a 262k-token row ~0.3 ms, ~10x torch's amax), and greedy decoding takes one a row a
 * step; a sampled token's logprob needs only its row's log-softmax normaliser, not the whole
 * log_softmax row torch writes.
 *
 * argmax_rows is torch.argmax(x, dim=-1) exactly: the first index of the largest value, where a
 * NaN counts as larger than everything (the first NaN's index). Two passes over a row: its
 * maximum (and whether it holds a NaN), then the first index that equals it.
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

static int64_t row_argmax(const float *row, int64_t V) {
    __m256 m = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= V; i += 8) {
        const __m256 v = _mm256_loadu_ps(row + i);
        m = _mm256_max_ps(m, v);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float best = hmax(m);
    int nan = _mm256_movemask_ps(unordered) != 0;
    for (; i < V; i++) {
        if (isnan(row[i])) nan = 1;
        else if (row[i] > best) best = row[i];
    }
    return first_index(row, V, best, nan);
}

/* out[r] = argmax of row r of x [rows, V] (rows ld floats apart) */
void argmax_rows(const float *x, int64_t rows, int64_t V, int64_t ld, int64_t *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax(x + r * ld, V);
}

/* log(sum_j e^(row[j] - m)) of a row whose largest value m is finite: e^ in float lanes
 * (simd_math.h's, ~2e-7), their sum in double */
static float log_sum_exp_below(const float *row, int64_t V, float m) {
    const __m256 vm = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    double sum = 0.0;
    int64_t i = 0;
    for (; i + 8 <= V; i += 8) {
        acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(row + i), vm)));
        if ((i & 1023) == 1016) {  /* every 1024 values into the double, before float sums lose bits */
            sum += hsum(acc);
            acc = _mm256_setzero_ps();
        }
    }
    sum += hsum(acc);
    for (; i < V; i++) sum += expf(row[i] - m);
    return (float)log(sum);
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
        argmax[r] = row_argmax(row, V);
        top[r] = row[argmax[r]];
        log_sum[r] = isfinite(top[r]) ? log_sum_exp_below(row, V, top[r]) : NAN;
    }
}
