/* Products with GGUF-quantized weights on an x86-64 CPU with AVX2 + FMA (gpu/quant.py builds
 * and loads this file).
 *
 * y[T, N] = x[T, K] @ W^T where W is N rows of K / 32 blocks; block b of row n holds 32
 * quantized values q (Q4_1: nibbles 0..15, element j in the low nibble of byte j and element
 * j + 16 in its high nibble; Q8_0: int8), a scale d and, for Q4_1, a min m, so that the weight
 * is d * q + m, computed as a product then a sum, exactly as gguf-py (and so the fp32 weights
 * ringserve converts a GGUF into) dequantizes it. Only the order of the dot products' sums
 * differs from an fp32 product.
 *
 * A decode step reads every weight once: Q4_1 is 24 bytes per 32 weights here against 128 in
 * fp32, which is the whole gain where the step is memory bound (few tokens). Rows are split
 * over `threads` OpenMP threads; tokens go in tiles of 4, each block dequantized once per tile
 * into 4 vectors of 8 floats.
 */
#include <immintrin.h>
#include <stdint.h>

#define TILE 4  /* tokens multiplied together: 8 accumulators + 4 weight vectors fit the 16 ymm registers */

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline void dequant_q4_1(const uint8_t *qs, float d, float m, __m256 w[4]) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, mask);                      /* elements 0..15 */
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);   /* elements 16..31 */
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; i++)
        w[i] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), vd), vm);
}

static inline void dequant_q8_0(const uint8_t *qs, float d, float m, __m256 w[4]) {
    (void)m;
    const __m256 vd = _mm256_set1_ps(d);
    for (int i = 0; i < 4; i++) {
        const __m128i q = _mm_loadl_epi64((const __m128i *)(qs + 8 * i));
        w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), vd);
    }
}

/* qs: [N, K/32, qbytes]; d, m: [N, K/32] (m unused for Q8_0); x: [T, K]; y: [T, N] */
#define GEMM(NAME, DEQUANT, QBYTES)                                                             \
    void NAME(const float *x, int64_t T, int64_t K, const uint8_t *qs, const float *d,          \
              const float *m, int64_t N, float *y, int threads) {                               \
        const int64_t nb = K / 32;                                                              \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                       \
        for (int64_t n = 0; n < N; n++) {                                                       \
            const uint8_t *row = qs + n * nb * QBYTES;                                          \
            const float *rd = d + n * nb, *rm = m + n * nb;                                     \
            for (int64_t t0 = 0; t0 < T; t0 += TILE) {                                          \
                const int64_t tt = T - t0 < TILE ? T - t0 : TILE;                               \
                __m256 acc[TILE][2];                                                            \
                for (int t = 0; t < TILE; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();     \
                for (int64_t b = 0; b < nb; b++) {                                              \
                    __m256 w[4];                                                                \
                    DEQUANT(row + b * QBYTES, rd[b], rm[b], w);                                 \
                    const float *xb = x + t0 * K + b * 32;                                      \
                    for (int t = 0; t < tt; t++, xb += K) {                                     \
                        acc[t][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xb), acc[t][0]);      \
                        acc[t][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb + 8), acc[t][1]);  \
                        acc[t][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), acc[t][0]); \
                        acc[t][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), acc[t][1]); \
                    }                                                                           \
                }                                                                               \
                for (int t = 0; t < tt; t++)                                                    \
                    y[(t0 + t) * N + n] = hsum(_mm256_add_ps(acc[t][0], acc[t][1]));            \
            }                                                                                   \
        }                                                                                       \
    }

GEMM(gemm_q4_1, dequant_q4_1, 16)
GEMM(gemm_q8_0, dequant_q8_0, 32)
