/* The KV cache's element types (--kv-cache-dtype) as the C kernels see them: 8 values of a
 * row read as fp32 (attention_cpu.c), a row written from fp32 (decode_cpu.c). fp32 -> fp16,
 * bf16 and fp8 e5m2 round to nearest even, as torch's .to(float16 / bfloat16 / float8_e5m2)
 * do, so the C decode loop stores the bits the Python forward's store stores. F16C: every
 * AVX2 CPU. An e5m2 byte is the high byte of the fp16 with the same value, so it is read by
 * F16C too.
 */
#ifndef RINGSERVE_KV_DTYPE_H
#define RINGSERVE_KV_DTYPE_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

enum { KV_F32, KV_F16, KV_BF16, KV_F8E5M2 };  /* gpu/attention/cpu.py KV_DTYPE_CODES */

static inline int64_t kv_elem_bytes(int dtype) { return dtype == KV_F32 ? 4 : dtype == KV_F8E5M2 ? 1 : 2; }

/* elements i .. i + 7 of row, widened to fp32 */
static inline __m256 kv_load8(const void *row, int64_t i, int dtype) {
    if (dtype == KV_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
    if (dtype == KV_F8E5M2)  /* each byte becomes the high byte of an fp16 */
        return _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64((const __m128i *)((const uint8_t *)row + i))));
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

/* torch's fp32 -> float8_e5m2 (c10 fp8e5m2_from_fp32_value) of 8 values, the 8 bytes in the low
 * half: nearest even; |f| from 61440 (half way to 2^16) to inf becomes inf, NaN stays NaN; below
 * 2^-14 (e5m2's subnormals) f + 2^7 rounds f to 2^-16 units; else the exponent is rebiased and
 * the 21 dropped mantissa bits rounded. The three cases are computed for all lanes and blended. */
static inline __m128i e5m2_round8(__m256 f) {
    const __m256i u = _mm256_castps_si256(f), sign = _mm256_and_si256(u, _mm256_set1_epi32((int)0x80000000u));
    const __m256i a = _mm256_xor_si256(u, sign);  /* |f|'s bits: below 2^31, so signed compares work */
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 21), _mm256_set1_epi32(1));
    const __m256i normal = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, odd),
                                                               _mm256_set1_epi32((int)(((uint32_t)(15 - 127) << 23) + 0xFFFFFu))), 21);
    const __m256i bias = _mm256_set1_epi32((int)(134u << 23));
    const __m256i sub = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(bias))), bias);
    const __m256i big = _mm256_blendv_epi8(_mm256_set1_epi32(0x7C), _mm256_set1_epi32(0x7F),
                                           _mm256_cmpgt_epi32(a, _mm256_set1_epi32((int)(255u << 23))));
    __m256i r = _mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(113u << 23)), a));
    r = _mm256_blendv_epi8(r, big, _mm256_cmpgt_epi32(a, _mm256_set1_epi32((int)((143u << 23) - 1))));
    r = _mm256_or_si256(_mm256_and_si256(r, _mm256_set1_epi32(0xFF)), _mm256_srli_epi32(sign, 24));
    const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(r, r), _mm256_setzero_si256());
    return _mm_unpacklo_epi32(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1));
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
    } else if (dtype == KV_F8E5M2) {
        uint8_t *d = dst;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) _mm_storel_epi64((__m128i *)(d + i), e5m2_round8(_mm256_loadu_ps(src + i)));
        if (i < n) {  /* the last n % 8 through a zero-padded copy */
            float tail[8] = {0};
            uint8_t bytes[8];
            memcpy(tail, src + i, sizeof(float) * (n - i));
            _mm_storel_epi64((__m128i *)bytes, e5m2_round8(_mm256_loadu_ps(tail)));
            memcpy(d + i, bytes, n - i);
        }
    } else {
        memcpy(dst, src, sizeof(float) * n);
    }
}

#endif
