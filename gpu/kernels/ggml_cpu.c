/* The one product kept on a repacked copy of a GGUF's blocks (gpu/quant/blocks.py builds and
 * loads this file): Q4_1 weights with int8 activations (--quantization gguf-q8), the blocks of
 * the embedded SmolLM2's projections. The in-place kernels (gguf_q32.c) read the file's own
 * layout, one row after another; here the rows are interleaved in groups of 8, which measured
 * ~2x less CPU a decode step's products (perf/results/gguf_repack.md). It goes once the
 * in-place Q4_1 kernel is as fast.
 *
 * Its arguments are the in-place kernels' (gguf_gemm_TYPE_q8): w is the repacked buffer, y[t]
 * at y + t * ldy, so callers take it as one of them.
 */
#include <immintrin.h>
#include "simd_math.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* --quantization gguf-q8: llama.cpp's arithmetic. The activations x are quantized once per
 * product, per 32-block, to int8 q with a scale d = amax / 127 (q = x * 127 / amax rounded to
 * nearest even by _mm256_cvtps_epi32, as llama.cpp's quantize_row_q8_1; amax 0 gives d 0, q 0)
 * and s = d * sum(q), so that for a Q4_1 weight block
 *     sum_j (d_w q_w + m_w) (d_x q_x) = d_w d_x sum_j q_w q_x + m_w s_x
 * with an integer dot product: maddubs (uint8 x int8 -> int16 sums of pairs) then madd with
 * ones (-> int32), or AVX-VNNI's vpdpbusd (int32 sums of 4 at once) where the CPU has it and no
 * AVX-512: the same integers. The numerics change from fp32 by x's rounding only.
 *
 * Unlike llama.cpp's vec_dot (one row and token at a time, a horizontal sum per pair), the
 * weights are in groups of 8 rows interleaved 4 bytes at a time (gpu/quant/blocks.py
 * repack_q4_1): one 32-byte load holds the same 4 quantized bytes of 8 rows, maddubs with
 * 4 bytes of x broadcast sums them into one int16 lane per row, and a group's 8 results come
 * out in one vector (scales, mins and the store all 8 rows wide, no horizontal sums). Far
 * fewer instructions than one row at a time (measured), so a product of a few tokens is
 * memory bound again.
 */
static inline int32_t load_i32(const int8_t *p) {  /* 4 bytes of x as one int32, without aliasing UB */
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* x: [T, K] -> q: int8 [T, K], d, s: [T, K/32] */
static void quantize_q8(const float *x, int64_t T, int64_t K, int8_t *q, float *d, float *s) {
    for (int64_t i = 0; i < T * (K / 32); i++) {  /* [T, K] row-major: block i is x[32 i, 32 i + 32) */
        int32_t sum;
        _mm256_storeu_si256((__m256i *)(q + 32 * i), quantize_block_q8(x + 32 * i, d + i, &sum));
        s[i] = d[i] * (float)sum;
    }
}

#define ROWS 8     /* rows per interleaved group: one ymm lane each */
#define TILE_Q8 4  /* tokens per pass over a group: 4 int sums + 4 float sums + block, x, constants */
#define CHUNK 4    /* groups a thread takes at a time (32 rows): 1 and 16 were slower at 1-512 tokens */
/* From this many tokens a chunk's work dwarfs a dynamic schedule's atomic fetch, and a
 * thread the OS preempts (the server's other processes share these cores) no longer holds up
 * the product: the other takes its remaining chunks. Below it each thread fetches its whole
 * share at once, as a static schedule would. */
#define DYNAMIC_TOKENS 8

/* y[t0 .. t0 + tt, 8 g .. 8 g + 8] for one group: tt and vnni are constants at each call (a
 * switch below) so that the token loops unroll and the sums stay in registers. vnni: the sums
 * by AVX-VNNI's vpdpbusd (int32 lanes, a row each) instead of maddubs (int16 pairs of a row).
 * xq, xd, xs: the tile's tokens; qs: the group's [K/32, 4, ROWS, 4] bytes; d, m: its
 * [K/32, ROWS] scales and mins. */
static inline __attribute__((always_inline)) void group_tile_q8(
        int tt, int vnni, const int8_t *xq, const float *xd, const float *xs, int64_t K,
        const uint8_t *qs, const float *d, const float *m, float *y, int64_t ldy) {
    const int64_t nb = K / 32, block_bytes = ROWS * 16;
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
    __m256 acc[TILE_Q8];
    for (int t = 0; t < tt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = qs + b * block_bytes;
        const int8_t *xb = xq + 32 * b;  /* token t's block at xb + t * K */
        /* int16 lanes: 8 maddubs of at most 2 * 15 * 127 each, <= 30480 */
        __m256i isum[TILE_Q8];
        for (int t = 0; t < tt; t++) isum[t] = _mm256_setzero_si256();
        /* bytes 4 c .. 4 c + 3 of the 8 rows: low nibbles are elements 4 c .., high ones 16 + 4 c ..
         * The c loop stays rolled: unrolled, gcc hoisted every c's weights and spilled the sums
         * to the stack (measurably slower: docs/perf-notes.md) */
        _Pragma("GCC unroll 1")
        for (int c = 0; c < 4; c++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(wb + 32 * c));
            const __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
            for (int t = 0; t < tt; t++) {
                const int8_t *xt = xb + t * K + 4 * c;
                const __m256i x_lo = _mm256_set1_epi32(load_i32(xt)), x_hi = _mm256_set1_epi32(load_i32(xt + 16));
                isum[t] = vnni ? dpbusd_vex(dpbusd_vex(isum[t], lo, x_lo), hi, x_hi)
                               : _mm256_add_epi16(isum[t], _mm256_add_epi16(_mm256_maddubs_epi16(lo, x_lo),
                                                                            _mm256_maddubs_epi16(hi, x_hi)));
            }
        }
        const __m256 dw = _mm256_loadu_ps(d + b * ROWS), mw = _mm256_loadu_ps(m + b * ROWS);
        for (int t = 0; t < tt; t++) {
            const __m256 dot = _mm256_cvtepi32_ps(vnni ? isum[t] : _mm256_madd_epi16(isum[t], ones));
            acc[t] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dw, _mm256_set1_ps(xd[t * nb + b])), acc[t]);
            acc[t] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs[t * nb + b]), acc[t]);  /* + m_w s_x */
        }
    }
    for (int t = 0; t < tt; t++) _mm256_storeu_ps(y + t * ldy, acc[t]);
}

/* Groups g0 .. g1 of 8 rows, all tokens, TILE_Q8 at a time: a tile of x (4 K bytes) is read
 * from L1 for every group of the chunk, whose blocks (a few KiB a group) stay in L1/L2 for
 * every tile, instead of all of x streaming past each group. */
static inline __attribute__((always_inline)) void groups_q8(
        int vnni, const int8_t *xq, const float *xd, const float *xs, int64_t T, int64_t K,
        const uint8_t *qs, const float *d, const float *m, float *y, int64_t ldy, int64_t g0, int64_t g1) {
    const int64_t nb = K / 32, group_bytes = nb * ROWS * 16;
    for (int64_t t0 = 0; t0 < T; t0 += TILE_Q8) {
        for (int64_t g = g0; g < g1; g++) {
#define TILE_CASE(TT)                                                                                 \
    case TT:                                                                                          \
        group_tile_q8(TT, vnni, xq + t0 * K, xd + t0 * nb, xs + t0 * nb, K, qs + g * group_bytes,     \
                      d + g * nb * ROWS, m + g * nb * ROWS, y + t0 * ldy + g * ROWS, ldy);            \
        break;
            switch (T - t0 < TILE_Q8 ? T - t0 : TILE_Q8) { TILE_CASE(4) TILE_CASE(3) TILE_CASE(2) TILE_CASE(1) }
#undef TILE_CASE
        }
    }
}

/* On AVX512-VNNI: two groups side by side in one 512-bit vector (16 rows, one a 32-bit lane),
 * each token's 4 bytes of x a broadcast load into vpdpbusd (exact int32 sums, no int16 step),
 * up to 8 tokens at a time, so a block's nibbles are split once for 8 tokens and 16 rows:
 * 1.3-1.9x faster at every token count measured, 1 to 512 (docs/perf-notes.md). The same
 * integer sums and float steps in the same order as group_tile_q8: the same results, bit for
 * bit. Built for AVX-512 by its target attribute alone; taken only where the CPU has it. */
#define WIDE_TOKENS 8
#define WIDE_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

/* the products this CPU takes, set when the library loads: the wide ones where it has AVX512-VNNI
 * (BW, VL), else group_tile_q8's with AVX-VNNI's vpdpbusd where it has that, else with maddubs */
enum products { MADDUBS, AVX_VNNI, WIDE };
static enum products products = MADDUBS;

__attribute__((constructor)) static void choose_products(void) {
#ifndef GGML_CPU_AVX2_ONLY /* a build with it defined takes maddubs: the tests' way to compare */
    products = cpu_has_avx512_vnni() ? WIDE : cpu_has_avx_vnni() ? AVX_VNNI : MADDUBS;
#endif
}

WIDE_TARGET static inline __m512i two_groups(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

WIDE_TARGET static inline __m512 two_groups_ps(const float *a, const float *b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(_mm256_loadu_ps(a))),
                                               _mm256_castps_pd(_mm256_loadu_ps(b)), 1));
}

/* y[t0 .. t0 + tt, 8 g .. 8 g + 16] for groups g and g + 1: tt (<= WIDE_TOKENS) a constant at
 * each call (two_groups_tile's switch), as group_tile_q8's */
WIDE_TARGET static inline __attribute__((always_inline)) void two_groups_q8(
        int tt, const int8_t *xq, const float *xd, const float *xs, int64_t K,
        const uint8_t *qs, const float *d, const float *m, float *y, int64_t ldy) {
    const int64_t nb = K / 32, block_bytes = ROWS * 16, group_bytes = nb * block_bytes;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[WIDE_TOKENS];
    for (int t = 0; t < tt; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = qs + b * block_bytes;
        __m512i isum[WIDE_TOKENS];
        for (int t = 0; t < tt; t++) isum[t] = _mm512_setzero_si512();
        for (int c = 0; c < 4; c++) {
            const __m512i raw = two_groups(wb + 32 * c, wb + group_bytes + 32 * c);
            const __m512i lo = _mm512_and_si512(raw, low), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            for (int t = 0; t < tt; t++) {
                const int8_t *xt = xq + t * K + 32 * b + 4 * c;
                isum[t] = _mm512_dpbusd_epi32(isum[t], lo, _mm512_set1_epi32(load_i32(xt)));
                isum[t] = _mm512_dpbusd_epi32(isum[t], hi, _mm512_set1_epi32(load_i32(xt + 16)));
            }
        }
        const __m512 dw = two_groups_ps(d + b * ROWS, d + nb * ROWS + b * ROWS);
        const __m512 mw = two_groups_ps(m + b * ROWS, m + nb * ROWS + b * ROWS);
        for (int t = 0; t < tt; t++) {
            const __m512 dot = _mm512_cvtepi32_ps(isum[t]);
            acc[t] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, _mm512_set1_ps(xd[t * nb + b])), acc[t]);
            acc[t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[t * nb + b]), acc[t]);
        }
    }
    for (int t = 0; t < tt; t++) _mm512_storeu_ps(y + t * ldy, acc[t]);
}

WIDE_TARGET __attribute__((noinline)) static void two_groups_tile(
        int64_t tt, const int8_t *xq, const float *xd, const float *xs, int64_t K,
        const uint8_t *qs, const float *d, const float *m, float *y, int64_t ldy) {
    switch (tt) {
#define WIDE_CASE(TT) case TT: two_groups_q8(TT, xq, xd, xs, K, qs, d, m, y, ldy); break;
    WIDE_CASE(8) WIDE_CASE(7) WIDE_CASE(6) WIDE_CASE(5) WIDE_CASE(4) WIDE_CASE(3) WIDE_CASE(2) WIDE_CASE(1)
#undef WIDE_CASE
    }
}

/* groups g0 .. g1 as groups_q8, two at a time (an odd last one by groups_q8) */
static void groups_wide_q8(const int8_t *xq, const float *xd, const float *xs, int64_t T, int64_t K,
                           const uint8_t *qs, const float *d, const float *m, float *y, int64_t ldy, int64_t g0,
                           int64_t g1) {
    const int64_t nb = K / 32, group_bytes = nb * ROWS * 16;
    int64_t g = g0;
    for (; g + 2 <= g1; g += 2)
        for (int64_t t0 = 0; t0 < T; t0 += WIDE_TOKENS)
            two_groups_tile(T - t0 < WIDE_TOKENS ? T - t0 : WIDE_TOKENS, xq + t0 * K, xd + t0 * nb, xs + t0 * nb, K,
                          qs + g * group_bytes, d + g * nb * ROWS, m + g * nb * ROWS, y + t0 * ldy + g * ROWS, ldy);
    if (g < g1) groups_q8(0, xq, xd, xs, T, K, qs, d, m, y, ldy, g, g1);
}

/* y[t, :N] (row t at y + t * ldy) = x[t] @ W^T, W N rows (a multiple of 8) repacked into one
 * buffer w: qs [N/8, K/32, 4, 8, 4] bytes, then d and m, float [N/8, K/32, 8] each.
 * In one parallel region, x [T, K] is quantized (quantize_q8, the tokens split over the
 * threads) into a scratch buffer, then chunks of groups go over the threads. The scratch is
 * kept between calls (one per calling thread): a fresh one per call was mmap'ed and
 * page-faulted in every time once it outgrew malloc's heap threshold (a 2048-token prefill's
 * x is 1-3 MB). Returns 0, or -1 when the scratch cannot be allocated (y untouched). */
static __thread char *q8_scratch = NULL;
static __thread int64_t q8_scratch_cap = 0;

int gemm_q4_1_repacked_q8(const float *x, int64_t T, int64_t K, const uint8_t *w, int64_t N, float *y, int64_t ldy,
                          int threads) {
    const int64_t nb = K / 32, groups = N / ROWS, need = T * nb * (int64_t)(2 * sizeof(float)) + T * K;
    const uint8_t *qs = w;
    const float *d = (const float *)(w + N * K / 2), *m = d + N * nb;
    if (T == 0) return 0;
    if (grown_scratch(&q8_scratch, &q8_scratch_cap, need) == NULL) return -1;
    float *const xd = (float *)q8_scratch, *const xs = xd + T * nb;
    int8_t *const xq = (int8_t *)(xs + T * nb);
    const int64_t iters = (groups + CHUNK - 1) / CHUNK, share = (iters + threads - 1) / threads;
    const int64_t per_fetch = T >= DYNAMIC_TOKENS || share < 1 ? 1 : share;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) quantize_q8(x + t * K, 1, K, xq + t * K, xd + t * nb, xs + t * nb);
        #pragma omp for schedule(dynamic, per_fetch)
        for (int64_t c = 0; c < groups; c += CHUNK) {
            const int64_t end = c + CHUNK < groups ? c + CHUNK : groups;
            if (products == WIDE)
                groups_wide_q8(xq, xd, xs, T, K, qs, d, m, y, ldy, c, end);
            else if (products == AVX_VNNI)
                groups_q8(1, xq, xd, xs, T, K, qs, d, m, y, ldy, c, end);
            else
                groups_q8(0, xq, xd, xs, T, K, qs, d, m, y, ldy, c, end);
        }
    }
    return 0;
}
