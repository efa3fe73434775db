/* Decode attention straight from the paged KV cache on an x86-64 CPU with AVX2 + FMA
 * (gpu/attention/cpu.py builds and loads this file).
 *
 * One query token per request attends to its kv_lens[b] cached tokens, read in place from
 * their pages: no gathered copy of K and V, no padding to the longest request, which is
 * what the torch backend pays for (index_select + a masked SDPA over the padded batch).
 *
 * Layouts (fp32): q [B, Hq, D] with request b's heads at q + b * q_stride (q can be a slice of
 * the fused qkv projection); out [B, Hq, D]; k, v one layer's pages [num_pages, page_size, Hkv,
 * D]; page_table int32 [B, pt_stride]. D is a multiple of 8, Hq / Hkv <= MAX_GROUP and
 * Hkv <= MAX_KV_HEADS. Softmax in two passes over the scores (max, then exp and sum), in fp32
 * as SDPA computes it.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include "simd_math.h"

#define MAX_GROUP 16  /* query heads per kv head */
#define MAX_KV_HEADS 64

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}


/* e^(s - max) in place over n scores; returns their sum */
static float exp_and_sum(float *s, int64_t n) {
    float mx = s[0];
    for (int64_t j = 1; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmx));
        _mm256_storeu_ps(s + j, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum(vsum);
    if (j < n) {  /* the tail through a padded copy */
        float tail[8] = {0};
        for (int64_t t = j; t < n; t++) tail[t - j] = s[t];
        _mm256_storeu_ps(tail, exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), vmx)));
        for (int64_t t = j; t < n; t++) {
            s[t] = tail[t - j];
            sum += tail[t - j];
        }
    }
    return sum;
}

/* q . k over D = 8 * nv floats, in two FMA chains */
static inline float dot(const float *q, const float *k, int64_t nv) {
    __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
    __m256 a1 = _mm256_setzero_ps();
    int64_t c = 1;
    for (; c + 1 < nv; c += 2) {
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), _mm256_loadu_ps(k + 8 * c), a1);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c + 8), _mm256_loadu_ps(k + 8 * c + 8), a0);
    }
    if (c < nv) a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), _mm256_loadu_ps(k + 8 * c), a1);
    return hsum(_mm256_add_ps(a0, a1));
}

/* Pages sit anywhere in the pool and the hardware prefetchers stop at every 4 KiB boundary, so
 * the row AHEAD tokens on is prefetched. */
#define AHEAD 16
static inline void prefetch_row(const float *base, const int32_t *pages, int64_t j, int64_t len,
                                int64_t page_size, int64_t token_stride) {
    if (j >= len) return;
    const char *row = (const char *)(base + ((int64_t)pages[j / page_size] * page_size + j % page_size) * token_stride);
    for (int64_t x = 0; x < token_stride * (int64_t)sizeof(float); x += 64) _mm_prefetch(row + x, _MM_HINT_T0);
}

/* Returns 0, or -1 when a scratch buffer could not be allocated. */
int paged_decode_attention(const float *q, int64_t q_stride, const float *k, const float *v, const int32_t *page_table,
                           int64_t pt_stride, const int32_t *kv_lens, int64_t B, int64_t Hq, int64_t Hkv,
                           int64_t D, int64_t page_size, float scale, float *out, int threads) {
    const int64_t G = Hq / Hkv, token_stride = Hkv * D, nv = D / 8;
    /* one request per iteration, all its heads: each K and V row is read whole, once, in order
     * (splitting a request's kv heads over threads measured slower, even at batch 1) */
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++)
        if (kv_lens[b] > max_len) max_len = kv_lens[b];
    int failed = 0;
    _Pragma("omp parallel num_threads(threads) reduction(|:failed)")
    {
        float *scores = malloc(sizeof(float) * Hq * (max_len > 0 ? max_len : 1));  /* [Hq, len] */
        float *acc = malloc(sizeof(float) * Hq * D);                              /* [Hq, D] */
        if (scores == NULL || acc == NULL) failed = 1;
        _Pragma("omp for schedule(static)")
        for (int64_t b = 0; b < B; b++) {
            if (failed) continue;
            const int64_t len = kv_lens[b];
            const int32_t *pages = page_table + b * pt_stride;
            const float *qb = q + b * q_stride;  /* [Hq, D] */
            float *ob = out + b * Hq * D;
            /* scores[i, j] = q_i . k_j * scale, query head i reading kv head i / G */
            for (int64_t j0 = 0; j0 < len; j0 += page_size) {
                const float *page = k + (int64_t)pages[j0 / page_size] * page_size * token_stride;
                const int64_t n = len - j0 < page_size ? len - j0 : page_size;
                for (int64_t t = 0; t < n; t++) {
                    prefetch_row(k, pages, j0 + t + AHEAD, len, page_size, token_stride);
                    for (int64_t i = 0; i < Hq; i++)
                        scores[i * len + j0 + t] = dot(qb + i * D, page + t * token_stride + i / G * D, nv) * scale;
                }
            }
            float inv_sum[MAX_GROUP * MAX_KV_HEADS];
            for (int64_t i = 0; i < Hq; i++) inv_sum[i] = 1.0f / exp_and_sum(scores + i * len, len);
            /* acc[i] = sum_j p[i, j] v_j */
            for (int64_t x = 0; x < Hq * D; x++) acc[x] = 0.0f;
            for (int64_t j0 = 0; j0 < len; j0 += page_size) {
                const float *page = v + (int64_t)pages[j0 / page_size] * page_size * token_stride;
                const int64_t n = len - j0 < page_size ? len - j0 : page_size;
                for (int64_t t = 0; t < n; t++) {
                    prefetch_row(v, pages, j0 + t + AHEAD, len, page_size, token_stride);
                    for (int64_t i = 0; i < Hq; i++) {
                        const __m256 p = _mm256_set1_ps(scores[i * len + j0 + t]);
                        const float *vj = page + t * token_stride + i / G * D;
                        float *a = acc + i * D;
                        for (int64_t c = 0; c < nv; c++)
                            _mm256_storeu_ps(a + 8 * c, _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8 * c),
                                                                        _mm256_loadu_ps(a + 8 * c)));
                    }
                }
            }
            for (int64_t i = 0; i < Hq; i++) {
                const __m256 inv = _mm256_set1_ps(inv_sum[i]);
                for (int64_t c = 0; c < nv; c++)
                    _mm256_storeu_ps(ob + i * D + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(acc + i * D + 8 * c), inv));
            }
        }
        free(scores);
        free(acc);
    }
    return failed ? -1 : 0;
}
