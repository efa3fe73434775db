/* Vector math shared by the CPU kernels (included, so each kernel stays one translation unit). */
#ifndef RINGSERVE_SIMD_MATH_H
#define RINGSERVE_SIMD_MATH_H
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

/* *buf grown (realloc) to hold at least `need` bytes, *cap its size: a kernel's scratch kept
 * between calls, one per thread (__thread), since a fresh one per call would be mmap'ed and
 * page-faulted in every time once past malloc's threshold. NULL when it cannot grow (*buf as
 * it was). */
static inline char *grown_scratch(char **buf, int64_t *cap, int64_t need) {
    if (need > *cap) {
        char *grown = realloc(*buf, need);
        if (grown == NULL) return NULL;
        *buf = grown;
        *cap = need;
    }
    return *buf;
}

/* Whether the CPU has AVX512-VNNI with BW and VL, the products' 512-bit and VNNI paths (never in a
 * RINGSERVE_AVX_VNNI_AS_EVEX build: see cpu_has_avx_vnni) */
static inline int cpu_has_avx512_vnni(void) {
#ifdef RINGSERVE_AVX_VNNI_AS_EVEX
    return 0;
#else
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw");
#endif
}

/* Whether the CPU has AVX-VNNI (vpdpbusd on ymm in a VEX encoding, without AVX-512: Intel's client
 * cores since Alder Lake), the products' 256-bit VNNI path there. A RINGSERVE_AVX_VNNI_AS_EVEX
 * build (the tests', on a CPU with AVX512-VNNI and VL but no AVX-VNNI) takes that path as such a
 * CPU would, with the instruction in its EVEX encoding (dpbusd_vex): the same operation. */
static inline int cpu_has_avx_vnni(void) {
    __builtin_cpu_init();
#ifdef RINGSERVE_AVX_VNNI_AS_EVEX
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
#else
    return __builtin_cpu_supports("avxvnni");
#endif
}

/* Reads `bytes` at p in order, a byte a cache line, so that they are in the caches for reads
 * in another order (a strided walk over rows is several streams the prefetcher does not follow) */
static inline void read_in_order(const uint8_t *p, int64_t bytes) {
    uint32_t touched = 0;
    for (int64_t at = 0; at < bytes; at += 64) touched += p[at];
    __asm__ volatile("" ::"r"(touched));
}

/* horizontal sum and max of the 8 lanes, and the sum of 8 int32 lanes */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

/* One block of 32 values of x rounded to int8, the CPU kernels' activations (llama.cpp's AVX2
 * quantize_row_q8_0): d = amax / 127, q = x * (127 / amax) rounded to nearest even by cvtps
 * (a block of zeros: d 0, every q 0). Returns the 32 q in order; *d, and *sum = sum(q). */
static inline __m256i quantize_block_q8(const float *x, float *d, int32_t *sum) {
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(x + 8 * j);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[j]));
    }
    const float a = hmax(amax);
    const __m256 inverse = _mm256_set1_ps(a != 0.0f ? 127.0f / a : 0.0f);
    __m256i q[4];
    for (int j = 0; j < 4; j++) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inverse));
    *d = a / 127.0f;
    *sum = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    /* the packs interleave 128-bit lanes: dwords 0 4 1 5 2 6 3 7 put them back in order */
    return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
                                       _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* 8 vectors of 8 dwords: v[k] lane b <- v[b] lane k */
static inline __attribute__((always_inline)) void transpose_8x8(__m256i v[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {  /* u[4 i + k] lane j < 4: v[4 i + j] lane k, lane 4 + j: lane 4 + k */
        u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_permute2x128_si256(u[k], u[4 + k], 0x20);
        v[4 + k] = _mm256_permute2x128_si256(u[k], u[4 + k], 0x31);
    }
}

/* A product whose output and weight both reach this many bytes writes its output with
 * non-temporal stores (store_packed_rows): a vocabulary's logits for a batch (Gemma 3's head at
 * 32 tokens: 33.5 MB of output, 178 MB of weight) pass through the caches beside a weight
 * streamed from memory, and plain stores read each line in first and pushed the weight's
 * prefetched lines out (the head 1.15x faster streamed). A product of a small weight keeps its
 * output cached for the next op, which reads it at once (an MLP's gate and up at 2048 tokens:
 * 33.5 MB, but streamed the prefill was ~4% slower). docs/perf-notes.md */
#define STREAM_OUTPUT_BYTES (16 << 20)

/* whether a product of T tokens into N float outputs each, from weight_bytes of weight, streams */
static inline int streams_output(int64_t T, int64_t N, int64_t weight_bytes) {
    return T * N * (int64_t)sizeof(float) >= STREAM_OUTPUT_BYTES && weight_bytes >= STREAM_OUTPUT_BYTES;
}

/* The packed products' results (gguf_q32.c, gguf_kquants.c): token t's 16 rows in acc[t], of
 * which the first `rows` go to y + t * ldy; `stream` (streams_output): 64-byte aligned rows go
 * out with non-temporal stores, and the caller fences (_mm_sfence) each thread's before its
 * results are read. Only for callers built for AVX-512 (a target). */
__attribute__((target("avx512f"))) static inline void store_packed_rows(const __m512 *acc, int64_t tokens,
                                                                       int64_t rows, float *y, int64_t ldy,
                                                                       int stream) {
    for (int64_t t = 0; t < tokens; t++) {
        if (rows == 16 && stream && ((uintptr_t)(y + t * ldy) & 63) == 0) {
            _mm512_stream_ps(y + t * ldy, acc[t]);
        } else if (rows == 16) {
            _mm512_storeu_ps(y + t * ldy, acc[t]);
        } else {
            float row_values[16];
            _mm512_storeu_ps(row_values, acc[t]);
            for (int64_t r = 0; r < rows; r++) y[t * ldy + r] = row_values[r];
        }
    }
}

/* AVX512-VNNI's u8 x s8 product of 4 bytes into each int32 lane of acc (vpdpbusd), in asm: an
 * intrinsic would need the file built for AVX-512, and the AVX2 paths must run without it. Only
 * for a caller that checked the CPU has AVX512-VNNI and VL. */
static inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
    __asm__("%{evex%} vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "vm"(s));
    return acc;
}

/* The same product as AVX-VNNI's VEX-encoded vpdpbusd (ymm0-15 only), for a caller that checked
 * cpu_has_avx_vnni() (the EVEX form in a RINGSERVE_AVX_VNNI_AS_EVEX build) */
static inline __m256i dpbusd_vex(__m256i acc, __m256i u, __m256i s) {
#ifdef RINGSERVE_AVX_VNNI_AS_EVEX
    return dpbusd(acc, u, s);
#else
    __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "xm"(s));
    return acc;
#endif
}

/* e^x, relative error ~2e-7 over [-87, 88] (clamped outside, where e^x under- or overflows a
 * normal float anyway): x = n ln2 + r, |r| <= ln2/2, e^r by its degree-6 Taylor polynomial,
 * 2^n through the exponent bits. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);   /* ln2 split in two */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* act(g) * u, 8 lanes: act(g) = g / (1 + e^-s), SiLU with s = g, Gemma's gelu_pytorch_tanh with
 * s = 2z, z = sqrt(2/pi) (g + 0.044715 g^3) (the same value as 0.5 g (1 + tanh z) without its
 * cancellation where tanh z nears -1). gelu: a constant at each call. */
static inline __attribute__((always_inline)) __m256 gated8(__m256 g, __m256 u, int gelu) {
    __m256 s = g;
    if (gelu) {
        const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
        s = _mm256_mul_ps(_mm256_set1_ps(2 * 0.7978845608028654f),
                          _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(0.044715f), cube)));
    }
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), s));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

#endif
