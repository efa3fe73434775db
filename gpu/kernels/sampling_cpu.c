/* The sampler's index reductions on an x86-64 CPU with AVX2 (gpu/sampling/argmax.py loads this
 * file): torch's argmax and max-with-index over a row of a large vocabulary run a scalar loop
 * (a 262k-token row ~0.3 ms, ~10x torch's amax), and greedy decoding takes one a row a step.
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
