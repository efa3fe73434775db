/* The KV cache's element types (--kv-cache-dtype) as the C kernels see them: 8 values of a
 * row read as fp32 (attention_cpu.c), a row written from fp32 (decode_cpu.c). fp32 -> fp16 and
 * fp32 -> bf16 round to nearest even, as torch's .to(float16) / .to(bfloat16) do, so the C
 * decode loop stores the bits the Python forward's index_copy_ stores. F16C: every AVX2 CPU.
 */
#ifndef RINGSERVE_KV_DTYPE_H
#define RINGSERVE_KV_DTYPE_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

enum { KV_F32, KV_F16, KV_BF16 };  /* gpu/attention/cpu.py KV_DTYPE_CODES */

static inline int64_t kv_elem_bytes(int dtype) { return dtype == KV_F32 ? 4 : 2; }

/* elements i .. i + 7 of row, widened to fp32 */
static inline __m256 kv_load8(const void *row, int64_t i, int dtype) {
    if (dtype == KV_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
    if (dtype == KV_BF16)  /* a bf16 is the high half of the fp32 with the same bits */
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i))), 16));
    return _mm256_loadu_ps((const float *)row + i);
}

static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  /* NaN stays NaN (rounding could carry it to -0) */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* src [n] fp32 -> dst, a row of the cache */
static inline void kv_store_row(void *dst, const float *src, int64_t n, int dtype) {
    if (dtype == KV_F16) {
        uint16_t *d = dst;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
        for (; i < n; i++) d[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
    } else if (dtype == KV_BF16) {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = bf16_round(src[i]);
    } else {
        memcpy(dst, src, sizeof(float) * n);
    }
}

#endif
