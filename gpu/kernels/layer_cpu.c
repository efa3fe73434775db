/* The per-layer glue of a CPU decode step (rms_norm, rope, silu or gelu_tanh * up) as one call each, on an
 * x86-64 CPU with AVX2 + FMA (gpu/models/llama.py builds and loads this file).
 *
 * In torch each is 1-8 small ops, ~20 of them per layer, each paying a dispatch and an
 * OpenMP fork/join that dwarf its work at a few tokens; here each is one pass over the rows.
 * Rows go over OpenMP threads only from PARALLEL_ROWS rows: at a few rows a parallel
 * region's fork/join costs more than the work.
 *
 * Numerics follow the torch ops they replace (tests/unit/test_gpu_layer_kernels.py): no FMA
 * contraction (torch rounds each product before the sum), rms_norm's sum of squares in double
 * (closer to torch's cascade sum than a float running sum), silu through an exp polynomial of
 * ~2e-7 relative error.
 */
#pragma GCC optimize("fp-contract=off")
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include "simd_math.h"

#define PARALLEL_ROWS 16

/* out[t] = w * (x[t] * rsqrt(mean(x[t]^2) + eps)), as F.rms_norm / LlamaRMSNorm in fp32; with
 * residual != NULL first x[t] += residual[t] (in place), the norm then taken of the sum. */
void rms_norm(float *x, const float *residual, const float *w, int64_t T, int64_t H, float eps, float *out,
              int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (T >= PARALLEL_ROWS)
    for (int64_t t = 0; t < T; t++) {
        float *xr = x + t * H;
        float *o = out + t * H;
        if (residual) {
            const float *r = residual + t * H;
            for (int64_t j = 0; j < H; j++) xr[j] += r[j];
        }
        __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
        int64_t j = 0;
        for (; j + 8 <= H; j += 8) {
            const __m256 v = _mm256_loadu_ps(xr + j);
            const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
            const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
            acc0 = _mm256_add_pd(acc0, _mm256_mul_pd(lo, lo));  /* exact: a float's square fits a double */
            acc1 = _mm256_add_pd(acc1, _mm256_mul_pd(hi, hi));
        }
        double lanes[4];
        _mm256_storeu_pd(lanes, _mm256_add_pd(acc0, acc1));
        double ss = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
        for (; j < H; j++) ss += (double)xr[j] * xr[j];
        const float rstd = 1.0f / sqrtf((float)(ss / (double)H) + eps);
        for (j = 0; j < H; j++) o[j] = w[j] * (xr[j] * rstd);
    }
}

/* rms_norm of each of the n heads [D] at the start of every row of x (rows row_stride apart), in
 * place: the q or k heads of the fused qkv rows (Gemma 3's and Qwen3's norms before the rope) */
void norm_heads(float *x, int64_t row_stride, int64_t T, int64_t n, int64_t D, const float *w, float eps, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (T * n >= 64)
    for (int64_t t = 0; t < T; t++) rms_norm(x + t * row_stride, NULL, w, n, D, eps, x + t * row_stride, 1);
}

/* In place on the first n_heads heads of each row of x (the q and k heads of the fused qkv
 * rows, row t at x + t * row_stride, head h at + h * D): rope at positions[t], cos / sin rows
 * of the [P, D/2] tables, pair j rotated as x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin.
 * Pair j is dims (j, j + D/2) (rotate-half), or with `pairs` dims (2j, 2j + 1) (llama.cpp's
 * NORM rope, for the q/k rows of a Llama-architecture GGUF). */
void rope(float *x, int64_t row_stride, int64_t T, int64_t n_heads, int64_t D, const int64_t *positions,
          const float *cos_table, const float *sin_table, int pairs, int threads) {
    const int64_t half = D / 2;
    const int64_t step = pairs ? 2 : 1, second = pairs ? 1 : half;  /* pair j: dims j * step, j * step + second */
    #pragma omp parallel for schedule(static) num_threads(threads) if (T >= PARALLEL_ROWS)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_table + positions[t] * half;
        const float *s = sin_table + positions[t] * half;
        for (int64_t h = 0; h < n_heads; h++) {
            float *head = x + t * row_stride + h * D;
            for (int64_t j = 0; j < half; j++) {
                float *x1 = head + j * step, *x2 = x1 + second;
                const float a = *x1, b = *x2;
                *x1 = a * c[j] - b * s[j];
                *x2 = b * c[j] + a * s[j];
            }
        }
    }
}


/* out[t] = act(g) * u for g, u the halves of gate_up[t] (gate_up [T, 2I], out [T, I]): simd_math.h's
 * gated8, its scalar form for the last I % 8 */
static void gated_mul(const float *gate_up, int64_t T, int64_t I, float *out, int threads, int gelu) {
    const float c = 2 * 0.7978845608028654f, k = 0.044715f;
    #pragma omp parallel for schedule(static) num_threads(threads) if (T >= PARALLEL_ROWS)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * I;
        const float *u = g + I;
        float *o = out + t * I;
        int64_t j = 0;
        for (; j + 8 <= I; j += 8)
            _mm256_storeu_ps(o + j, gelu ? gated8(_mm256_loadu_ps(g + j), _mm256_loadu_ps(u + j), 1)
                                         : gated8(_mm256_loadu_ps(g + j), _mm256_loadu_ps(u + j), 0));
        for (; j < I; j++) {
            const float sj = gelu ? c * (g[j] + k * g[j] * g[j] * g[j]) : g[j];
            o[j] = g[j] / (1.0f + expf(-sj)) * u[j];
        }
    }
}

void silu_mul(const float *gate_up, int64_t T, int64_t I, float *out, int threads) {
    gated_mul(gate_up, T, I, out, threads, 0);
}

void gelu_tanh_mul(const float *gate_up, int64_t T, int64_t I, float *out, int threads) {
    gated_mul(gate_up, T, I, out, threads, 1);
}
