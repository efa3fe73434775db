/* GGUF's K-quants (Q2_K Q3_K Q4_K Q5_K Q6_K) and IQ4_XS multiplied in place, straight from
 * the file's blocks, on an x86-64 CPU with AVX2 + FMA: the API of the GGUF block kernels'
 * contract, three functions a type (gguf_get_rows_T, gguf_gemm_T_f32, gguf_gemm_T_q8).
 *
 * A weight is N rows of K values, a row K / 256 superblocks one after another, a superblock
 * as in the file (little-endian, fp16 scales, no alignment: every load is unaligned):
 *   Q2_K  84 B: scales[16] (low nibble: scale, high: min of a group of 16), qs[64], d, dmin.
 *   Q3_K 110 B: hmask[32], qs[64], scales[12] (16 6-bit scales, minus 32), d.
 *   Q4_K 144 B: d, dmin, scales[12] (8 6-bit scales and 8 6-bit mins), qs[128].
 *   Q5_K 176 B: d, dmin, scales[12] (as Q4_K), qh[32], qs[128].
 *   Q6_K 210 B: ql[128], qh[64], scales[16] (int8), d.
 *   IQ4_XS 136 B: d, scales_h (uint16, 2 high bits a scale), scales_l[4] (nibbles), qs[128].
 * Q2_K, Q3_K and Q6_K take their 256 values in two halves of 128; quarter g (32 values, two
 * groups of 16) of half h takes bits 2g.. of the half's bytes: Q2_K/Q3_K qs[32 h + i] >> 2 g
 * (2 bits), Q6_K the nibble (g & 1 ? ql[64 h + 32 + i] : ql[64 h + i]) >> 4 (g >> 1) and the
 * 2 bits qh[32 h + i] >> 2 g above it; Q3_K's third bit is hmask[i] >> (4 h + g), and the
 * value is 4 less when that bit is clear. Q4_K/Q5_K/IQ4_XS take 8 sub-blocks of 32: Q4_K's
 * and Q5_K's pair 2j, 2j + 1 are the low and high nibbles of qs[32 j + i], Q5_K's fifth bit
 * qh[i] >> s; IQ4_XS's sub-block s is qs[16 s ..] (low nibbles, then high), each nibble an
 * index into IQ4_NL's 16 int8 values. Q4_K's 12 scale bytes (as Q5_K's): bytes 0-3 hold
 * scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3, bytes 8-11 the low 4 bits of scales
 * 4-7 (low nibble) and mins 4-7 (high nibble), whose 2 high bits are the top 2 bits of
 * bytes 0-3 (scales) and 4-7 (mins). Q3_K's 12: bytes 0-7 hold the low 4 bits of scales 0-7
 * (low nibbles) and 8-15 (high nibbles), bytes 8-11 the high 2 bits, scale j at bit
 * 2 (j / 4) of byte 8 + j % 4. IQ4_XS's scale s: nibble s % 2 of scales_l[s / 2] and bits
 * 2 s of scales_h above it, minus 32.
 *
 * Every value is (d * sc) * q - (dmin * m) for a group's integer scale sc, min m and the
 * integer q (dmin * m absent without mins), as gguf-py dequantizes it: each product rounded
 * to float in that order, so gguf_get_rows equals gguf.quants.dequantize exactly and _f32
 * differs from dequantize-then-matmul only in the order of the sums.
 *
 * _q8 is llama.cpp's arithmetic: x is quantized once per product to Q8_K (per 256: d =
 * max / -127 for the value of largest magnitude, q = round(x / d) to nearest even, at most
 * 127, and the 16 sums of q over each group of 16 in `bsums`), then per superblock the dot
 * product is integer: the weights' unsigned q (Q3_K's q + 4, Q6_K's q + 32) against x's int8 q
 * with maddubs (u8 x s8 -> pairs summed in int16, which never saturates here: at most
 * 2 * 127 * 127), times each group's integer scale with madd (-> int32); Q3_K's and Q6_K's
 * offsets are one more madd, of -4 or -32 times the group scales with bsums, so no per-value
 * subtraction. Then d_w * d_x times that sum in float, and for Q2_K/Q4_K/Q5_K minus
 * dmin_w * d_x times the mins' madd with bsums. IQ4_XS's values are signed: their magnitudes
 * go in maddubs' unsigned operand and their signs onto x. Rows go over the threads in chunks;
 * the tokens in tiles of TILE, each superblock's scales and quants unpacked once per tile.
 * Where the CPU has AVX512-VNNI and AVX512VL (chosen at run time), each madd and the add after
 * it are one vpdpwssd, the same integers, in tiles of TILE_VNNI.
 */
#include <immintrin.h>
#include "simd_math.h"
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 256
#define TILE 4        /* tokens a superblock is unpacked for: 4 int sums + 4 float sums + the quants fit 16 ymm */
#define TILE_VNNI 8   /* the same in the VNNI path, which has AVX-512VL's 32 */
#define ROW_CHUNK 16  /* rows a thread takes at a time: a tile of x is reused over them from L1 */
#define DYNAMIC_TOKENS 8  /* from this many tokens, chunks are handed out one at a time (as ggml_cpu.c's q8 GEMMs) */
#define INLINE static inline __attribute__((always_inline))

enum kquant { Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS };

static const int8_t iq4nl_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

static inline uint32_t u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Q4_K/Q5_K's 12 bytes at p (dwords a0 a1 a2; the 4 bytes after them are read, still in the
 * superblock) -> the 8 scales (bytes 0-7) and 8 mins (bytes 8-15): dwords a0 & 0x3f..,
 * a2 & 0x0f.. | the top 2 bits of a0's bytes, a1 & 0x3f.., a2 >> 4 & 0x0f.. | a1's top 2 bits */
static inline __m128i unpack_scales_k4(const uint8_t *p) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    const __m128i low = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0)), _mm_setr_epi32(0, 0, 0, 4)),
                                      _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    const __m128i high = _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0)), 2),
                                       _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    return _mm_or_si128(low, high);
}

/* Q3_K's 12 bytes at p (dwords a0 a1 a2, the last of the superblock but for d) -> its 16
 * scales, int8 -32..31: dword i is a0, a1, a0 >> 4, a1 >> 4 (& 0x0f..) | bits 2 i of a2's bytes
 * above them */
static inline __m128i unpack_scales_q3(const uint8_t *p) {
    const __m128i v = _mm_srli_si128(_mm_loadu_si128((const __m128i *)(p - 2)), 2);  /* no read past the superblock */
    const __m128i low = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 1, 0)), _mm_setr_epi32(0, 0, 4, 4)),
                                      _mm_set1_epi8(0x0F));
    const __m128i high = _mm_slli_epi32(_mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(2, 2, 2, 2)),
                                                                     _mm_setr_epi32(0, 2, 4, 6)),
                                                      _mm_set1_epi8(0x03)),
                                        4);
    return _mm_sub_epi8(_mm_or_si128(low, high), _mm_set1_epi8(32));
}

/* IQ4_XS's scales_h and scales_l -> its 8 scales, int16 -32..31 */
static inline __m128i unpack_scales_iq4xs(const uint8_t *blk) {
    const uint32_t sl = u32(blk + 4);
    const __m128i low = _mm_unpacklo_epi8(_mm_cvtsi32_si128(sl & 0x0f0f0f0f), _mm_cvtsi32_si128((sl >> 4) & 0x0f0f0f0f));
    const __m256i high = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(blk[2] | blk[3] << 8),
                                                            _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                          _mm256_set1_epi32(3));
    const __m256i sc = _mm256_sub_epi32(_mm256_or_si256(_mm256_cvtepu8_epi32(low), _mm256_slli_epi32(high, 4)),
                                        _mm256_set1_epi32(32));
    return _mm_packs_epi32(_mm256_castsi256_si128(sc), _mm256_extracti128_si256(sc, 1));
}

/* ---- dequantization, exactly as gguf-py ---- */

/* out[i] = dl[i / 16] * q[i] - ml[i / 16]. Each product is exact in float (an fp16 d has at
 * most 11 significant bits and |sc * q| <= 127 * 32 at most 12), so gcc fusing the product and
 * the subtraction into an FMA (its default -ffp-contract=fast does) rounds exactly as numpy. */
static void scale_groups(const int8_t q[QK], const float dl[16], const float ml[16], float *out) {
    for (int i = 0; i < QK; i += 8) {
        const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + i))));
        _mm256_storeu_ps(out + i, _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(dl[i / 16]), v), _mm256_set1_ps(ml[i / 16])));
    }
}

/* One superblock -> its 256 integer values q and each group of 16's dl = d * sc, ml = dmin * m. */
static void unpack_superblock(enum kquant type, const uint8_t *blk, int8_t q[QK], float dl[16], float ml[16]) {
    memset(ml, 0, 16 * sizeof(float));
    switch (type) {
    case Q2_K: {
        const float d = f16(blk + 80), dmin = f16(blk + 82);
        for (int g = 0; g < 16; g++) {
            dl[g] = d * (float)(blk[g] & 0xF);
            ml[g] = dmin * (float)(blk[g] >> 4);
        }
        for (int h = 0; h < 2; h++)
            for (int g = 0; g < 4; g++)
                for (int i = 0; i < 32; i++) q[128 * h + 32 * g + i] = (blk[16 + 32 * h + i] >> 2 * g) & 3;
        break;
    }
    case Q3_K: {
        const float d = f16(blk + 108);
        int8_t sc[16];
        _mm_storeu_si128((__m128i *)sc, unpack_scales_q3(blk + 96));
        for (int g = 0; g < 16; g++) dl[g] = d * (float)sc[g];
        for (int h = 0; h < 2; h++)
            for (int g = 0; g < 4; g++)
                for (int i = 0; i < 32; i++)  /* 4 less where the hmask bit is clear */
                    q[128 * h + 32 * g + i] = ((blk[32 + 32 * h + i] >> 2 * g) & 3) + (((blk[i] >> (4 * h + g)) & 1) << 2) - 4;
        break;
    }
    case Q4_K:
    case Q5_K: {
        const float d = f16(blk), dmin = f16(blk + 2);
        uint8_t sm[16];
        _mm_storeu_si128((__m128i *)sm, unpack_scales_k4(blk + 4));
        for (int g = 0; g < 16; g++) {
            dl[g] = d * (float)sm[g / 2];
            ml[g] = dmin * (float)sm[8 + g / 2];
        }
        const uint8_t *qs = blk + (type == Q4_K ? 16 : 48), *qh = blk + 16;
        for (int j = 0; j < 4; j++)
            for (int i = 0; i < 32; i++) {
                q[64 * j + i] = qs[32 * j + i] & 0xF;
                q[64 * j + 32 + i] = qs[32 * j + i] >> 4;
                if (type == Q5_K) {
                    q[64 * j + i] |= ((qh[i] >> 2 * j) & 1) << 4;
                    q[64 * j + 32 + i] |= ((qh[i] >> (2 * j + 1)) & 1) << 4;
                }
            }
        break;
    }
    case Q6_K: {
        const float d = f16(blk + 208);
        for (int g = 0; g < 16; g++) dl[g] = d * (float)(int8_t)blk[192 + g];
        for (int h = 0; h < 2; h++)
            for (int g = 0; g < 4; g++)
                for (int i = 0; i < 32; i++) {
                    const int low = (blk[64 * h + 32 * (g & 1) + i] >> 4 * (g >> 1)) & 0xF;
                    q[128 * h + 32 * g + i] = (low | ((blk[128 + 32 * h + i] >> 2 * g) & 3) << 4) - 32;
                }
        break;
    }
    case IQ4_XS: {
        const float d = f16(blk);
        int16_t sc[8];
        _mm_storeu_si128((__m128i *)sc, unpack_scales_iq4xs(blk));
        for (int s = 0; s < 8; s++) dl[2 * s] = dl[2 * s + 1] = d * (float)sc[s];
        const __m128i values = _mm_loadu_si128((const __m128i *)iq4nl_values), m4 = _mm_set1_epi8(0x0F);
        for (int s = 0; s < 8; s++) {  /* sub-block s: low nibbles of qs[16 s ..], then the high ones */
            const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 8 + 16 * s));
            _mm_storeu_si128((__m128i *)(q + 32 * s), _mm_shuffle_epi8(values, _mm_and_si128(raw, m4)));
            _mm_storeu_si128((__m128i *)(q + 32 * s + 16), _mm_shuffle_epi8(values, _mm_and_si128(_mm_srli_epi16(raw, 4), m4)));
        }
        break;
    }
    }
}

static void dequantize_superblock(enum kquant type, const uint8_t *blk, float *out) {
    int8_t q[QK];
    float dl[16], ml[16];
    unpack_superblock(type, blk, q, dl, ml);
    scale_groups(q, dl, ml, out);
}

#define GET_ROWS(NAME, TYPE, BYTES)                                                                  \
    void gguf_get_rows_##NAME(const uint8_t *w, int64_t K, const int64_t *ids, int64_t n_ids, float *out) { \
        const int64_t nsb = K / QK;                                                                  \
        for (int64_t r = 0; r < n_ids; r++)                                                          \
            for (int64_t b = 0; b < nsb; b++)                                                        \
                dequantize_superblock(TYPE, w + (ids[r] * nsb + b) * BYTES, out + r * K + b * QK);   \
    }

/* ---- _f32: each row dequantized once (into the thread's K floats), then a tile of tokens
 * at a time against it with FMAs ---- */

INLINE void dot_rows_f32(int tt, const float *wrow, const float *x, int64_t K, float *y, int64_t ldy) {
    __m256 acc[TILE][2];
    for (int t = 0; t < tt; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __m256 w0 = _mm256_loadu_ps(wrow + k), w1 = _mm256_loadu_ps(wrow + k + 8);
        for (int t = 0; t < tt; t++) {
            acc[t][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + t * K + k), acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + t * K + k + 8), acc[t][1]);
        }
    }
    for (int t = 0; t < tt; t++) y[t * ldy] = hsum(_mm256_add_ps(acc[t][0], acc[t][1]));
}

#define GEMM_F32(NAME, TYPE, BYTES)                                                                  \
    int gguf_gemm_##NAME##_f32(const float *x, int64_t T, int64_t K, const uint8_t *w, int64_t N,    \
                               float *y, int64_t ldy, int threads) {                                 \
        if (T <= 0 || N <= 0) return 0;                                                              \
        const int64_t nsb = K / QK;                                                                  \
        float *const rows = malloc((size_t)threads * K * sizeof(float));                             \
        if (rows == NULL) return -1;                                                                 \
        _Pragma("omp parallel num_threads(threads)")                                                 \
        {                                                                                            \
            float *const wrow = rows + omp_get_thread_num() * K;                                     \
            _Pragma("omp for schedule(static)")                                                      \
            for (int64_t n = 0; n < N; n++) {                                                        \
                for (int64_t b = 0; b < nsb; b++)                                                    \
                    dequantize_superblock(TYPE, w + (n * nsb + b) * BYTES, wrow + b * QK);           \
                for (int64_t t0 = 0; t0 < T; t0 += TILE) {                                           \
                    const float *xt = x + t0 * K;                                                    \
                    float *yt = y + t0 * ldy + n;                                                    \
                    switch (T - t0 < TILE ? T - t0 : TILE) {                                         \
                    case 4: dot_rows_f32(4, wrow, xt, K, yt, ldy); break;                            \
                    case 3: dot_rows_f32(3, wrow, xt, K, yt, ldy); break;                            \
                    case 2: dot_rows_f32(2, wrow, xt, K, yt, ldy); break;                            \
                    default: dot_rows_f32(1, wrow, xt, K, yt, ldy); break;                           \
                    }                                                                                \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        free(rows);                                                                                  \
        return 0;                                                                                    \
    }

/* ---- _q8 ---- */

/* x quantized to Q8_K, [T, K] as three arrays: token t's superblock b is q[t K + 256 b ..],
 * d[t K/256 + b], bsums[t K/16 + 16 b ..] */
struct q8k {
    int8_t *q;
    float *d;
    int16_t *bsums;
};

/* llama.cpp's quantize_row_q8_K: max is the first value of the largest magnitude, iscale =
 * -127 / max, q = min(127, round-to-nearest-even(iscale * x)), d = 1 / iscale; all zeros give
 * d 0, q 0. */
static void quantize_q8_k(const float *x, int64_t nsb, int8_t *q, float *d, int16_t *bsums) {
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  /* undoes the packs' lane interleave */
    for (int64_t b = 0; b < nsb; b++, x += QK, q += QK, bsums += 16) {
        __m256 amax = _mm256_setzero_ps();
        for (int j = 0; j < QK; j += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, _mm256_loadu_ps(x + j)));
        const float a = hmax(amax);
        if (a == 0.0f) {
            d[b] = 0.0f;
            memset(q, 0, QK);
            memset(bsums, 0, 16 * sizeof(int16_t));
            continue;
        }
        float max = 0.0f;
        for (int j = 0; j < QK; j++)
            if (__builtin_fabsf(x[j]) == a) {
                max = x[j];
                break;
            }
        const float iscale = -127.0f / max;
        const __m256 vs = _mm256_set1_ps(iscale);
        const __m256i top = _mm256_set1_epi32(127);
        for (int j = 0; j < QK; j += 32) {
            __m256i iq[4];
            for (int i = 0; i < 4; i++)
                iq[i] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + j + 8 * i), vs)), top);
            const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(iq[0], iq[1]), _mm256_packs_epi32(iq[2], iq[3]));
            _mm256_storeu_si256((__m256i *)(q + j), _mm256_permutevar8x32_epi32(packed, order));
        }
        for (int g = 0; g < 16; g++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += q[16 * g + i];
            bsums[g] = (int16_t)s;
        }
        d[b] = 1.0f / iscale;
    }
}

/* s: 8 int16 in both 128-bit halves -> int16 lanes 0-7 = s[lo], 8-15 = s[hi]: the scales of
 * the values maddubs sums into lanes 0-7 (bytes 0-15) and 8-15 (bytes 16-31), one shuffle */
static inline __m256i pick_scales(__m256i s, int lo, int hi) {
    return _mm256_shuffle_epi8(s, _mm256_set_m128i(_mm_set1_epi16((short)((2 * hi + 1) << 8 | 2 * hi)),
                                                   _mm_set1_epi16((short)((2 * lo + 1) << 8 | 2 * lo))));
}

static inline __m256i load256(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* acc + madd(a, b): int16 pairs multiplied and summed into int32. With VNNI one instruction,
 * vpdpwssd, written as asm so that this file builds with the -mavx2 of every kernel and the
 * VNNI path is chosen at run time (gguf_kquants_vnni). */
INLINE __m256i madd_acc(int vnni, __m256i acc, __m256i a, __m256i b) {
    if (vnni) {
        __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
        return acc;
    }
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
}

/* Where token t's data for superblock b starts, the tile's first token at t = 0 */
#define XQ(t) (xq + (t) * K)
#define XBS(t) (xbs + (t) * (K / 16))
#define XD(t) (xd[(t) * (K / QK)])

/* One superblock for tt tokens: acc[t] += its dot product with token t (8 lanes to sum).
 * xq, xbs, xd: token 0's Q8_K superblock (quants, bsums, d). */
INLINE void superblock_q8(enum kquant type, int tt, int vnni, const uint8_t *blk, const int8_t *xq, const int16_t *xbs,
                          const float *xd, int64_t K, __m256 acc[TILE_VNNI]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03), m1 = _mm256_set1_epi8(0x01);
    /* VNNI at one token: two chains of vpdpwssd (every other chunk of 32), not one chain of 8
     * dependent ones whose latency shows (measured); elsewhere the chains of several tokens or
     * AVX2's adds (latency 1) overlap. */
    const int chains = vnni && tt == 1 ? 2 : 1;
    __m256i isums[2][TILE_VNNI];
    for (int t = 0; t < tt; t++) isums[0][t] = isums[1][t] = _mm256_setzero_si256();
#define ISUM(t, chunk) isums[(chunk) % chains][t]
    float d, dmin = 0.0f;
    __m256i mins = _mm256_setzero_si256();  /* int16, a group of 16's min (Q2_K, Q4_K, Q5_K) */
    switch (type) {
    case Q2_K:
    case Q3_K:
    case Q6_K: {
        /* 2 halves x 4 quarters of 32 values, groups 8 h + 2 g and 8 h + 2 g + 1 */
        __m128i sc;
        if (type == Q2_K) {
            const __m128i raw = _mm_loadu_si128((const __m128i *)blk);
            sc = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
            mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F)));
            d = f16(blk + 80), dmin = f16(blk + 82);
        } else if (type == Q3_K) {
            sc = unpack_scales_q3(blk + 96);
            d = f16(blk + 108);
        } else {
            sc = _mm_loadu_si128((const __m128i *)(blk + 192));
            d = f16(blk + 208);
        }
        /* groups 0-7 and 8-15's scales, int16, each in both halves for pick_scales */
        const __m256i sc_lo = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(sc)),
                      sc_hi = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_unpackhi_epi64(sc, sc)));
        for (int h = 0; h < 2; h++) {
            __m256i lo2 = _mm256_setzero_si256(), hi = _mm256_setzero_si256(), ql0 = hi, ql1 = hi;
            if (type == Q6_K) {
                ql0 = load256(blk + 64 * h), ql1 = load256(blk + 64 * h + 32), hi = load256(blk + 128 + 32 * h);
            } else {
                lo2 = load256(blk + (type == Q2_K ? 16 : 32) + 32 * h);
                if (type == Q3_K) hi = load256(blk);
            }
            _Pragma("GCC unroll 4")
            for (int g = 0; g < 4; g++) {
                __m256i qv;  /* 32 unsigned values: Q2_K's q, Q3_K's q + 4, Q6_K's q + 32 */
                if (type == Q6_K) {
                    const __m256i low = g & 2 ? _mm256_and_si256(_mm256_srli_epi16(g & 1 ? ql1 : ql0, 4), m4)
                                              : _mm256_and_si256(g & 1 ? ql1 : ql0, m4);
                    qv = _mm256_or_si256(low, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, 2 * g), m2), 4));
                } else {
                    qv = _mm256_and_si256(_mm256_srli_epi16(lo2, 2 * g), m2);
                    if (type == Q3_K)
                        qv = _mm256_or_si256(qv, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, 4 * h + g), m1), 2));
                }
                const __m256i s = pick_scales(h ? sc_hi : sc_lo, 2 * g, 2 * g + 1);
                for (int t = 0; t < tt; t++)
                    ISUM(t, g) = madd_acc(vnni, ISUM(t, g), s, _mm256_maddubs_epi16(qv, load256(XQ(t) + 128 * h + 32 * g)));
            }
        }
        if (type != Q2_K) {  /* the offset: sum sc (q + off) x - off sum sc bsums, off 4 or 32 (-off sc fits int16) */
            const __m256i offsets = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(_mm256_cvtepi8_epi16(sc), type == Q3_K ? 2 : 5));
            for (int t = 0; t < tt; t++) ISUM(t, 0) = madd_acc(vnni, ISUM(t, 0), offsets, load256(XBS(t)));
        }
        break;
    }
    case Q4_K:
    case Q5_K: {
        const __m128i sm = unpack_scales_k4(blk + 4);
        d = f16(blk), dmin = f16(blk + 2);
        mins = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm, sm));  /* min s for groups 2 s, 2 s + 1 */
        __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
        const uint8_t *qs = blk + (type == Q4_K ? 16 : 48);
        __m256i qh = type == Q5_K ? load256(blk + 16) : _mm256_setzero_si256();
        /* rolled, j's scales and high bits shifted down each time: unrolled, gcc hoisted every
         * j's quants and scales out of the token loop and spilled them (slower at 4 tokens) */
        _Pragma("GCC unroll 1")
        for (int j = 0; j < 4; j++) {
            const __m256i raw = load256(qs + 32 * j);
            __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            if (type == Q5_K) {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(qh, m1), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 1), m1), 4));
                qh = _mm256_srli_epi16(qh, 2);
            }
            const __m256i slo = pick_scales(scales, 0, 0), shi = pick_scales(scales, 1, 1);
            scales = _mm256_srli_si256(scales, 4);
            for (int t = 0; t < tt; t++) {
                const int8_t *x = XQ(t) + 64 * j;
                ISUM(t, 0) = madd_acc(vnni, ISUM(t, 0), slo, _mm256_maddubs_epi16(lo, load256(x)));
                ISUM(t, 1) = madd_acc(vnni, ISUM(t, 1), shi, _mm256_maddubs_epi16(hi, load256(x + 32)));
            }
        }
        break;
    }
    case IQ4_XS: {
        d = f16(blk);
        const __m256i values = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)iq4nl_values));
        __m256i scales = _mm256_broadcastsi128_si256(unpack_scales_iq4xs(blk));
        _Pragma("GCC unroll 1")  /* as Q4_K's */
        for (int j = 0; j < 4; j++) {
            const __m256i raw = load256(blk + 8 + 32 * j);  /* sub-blocks 2 j (bytes 0-15), 2 j + 1 */
            const __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            const __m256i v0 = _mm256_shuffle_epi8(values, _mm256_permute2x128_si256(lo, hi, 0x20));
            const __m256i v1 = _mm256_shuffle_epi8(values, _mm256_permute2x128_si256(lo, hi, 0x31));
            const __m256i a0 = _mm256_sign_epi8(v0, v0), a1 = _mm256_sign_epi8(v1, v1);
            const __m256i s0 = pick_scales(scales, 0, 0), s1 = pick_scales(scales, 1, 1);
            scales = _mm256_srli_si256(scales, 4);
            for (int t = 0; t < tt; t++) {
                const int8_t *x = XQ(t) + 64 * j;
                ISUM(t, 0) = madd_acc(vnni, ISUM(t, 0), s0, _mm256_maddubs_epi16(a0, _mm256_sign_epi8(load256(x), v0)));
                ISUM(t, 1) = madd_acc(vnni, ISUM(t, 1), s1, _mm256_maddubs_epi16(a1, _mm256_sign_epi8(load256(x + 32), v1)));
            }
        }
        break;
    }
    }
#undef ISUM
    for (int t = 0; t < tt; t++) {
        const __m256i isum = chains == 2 ? _mm256_add_epi32(isums[0][t], isums[1][t]) : isums[0][t];
        acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * XD(t)), _mm256_cvtepi32_ps(isum), acc[t]);
        if (type == Q2_K || type == Q4_K || type == Q5_K)
            acc[t] = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * XD(t)), _mm256_cvtepi32_ps(_mm256_madd_epi16(mins, load256(XBS(t)))), acc[t]);
    }
}

/* y[t * ldy] for t < tt = one row's products with tt tokens (Q8_K x at token 0) */
INLINE void row_q8(enum kquant type, int tt, int vnni, const uint8_t *row, int64_t block_bytes, int64_t K, const int8_t *xq,
                   const int16_t *xbs, const float *xd, float *y, int64_t ldy) {
    __m256 acc[TILE_VNNI];
    for (int t = 0; t < tt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / QK; b++)
        superblock_q8(type, tt, vnni, row + b * block_bytes, xq + b * QK, xbs + b * 16, xd + b, K, acc);
    for (int t = 0; t < tt; t++) y[t * ldy] = hsum(acc[t]);
}

/* Rows n0 .. n1, all tokens, a tile at a time: the chunk's rows (a few KiB) stay in L1/L2 for
 * every tile, and a tile of x is read from L1 for every row. */
INLINE void rows_q8(enum kquant type, int vnni, int64_t block_bytes, const struct q8k *xq, int64_t T, int64_t K,
                    const uint8_t *w, float *y, int64_t ldy, int64_t n0, int64_t n1) {
    const int64_t row_bytes = K / QK * block_bytes, tile = vnni ? TILE_VNNI : TILE;
    for (int64_t t0 = 0; t0 < T; t0 += tile) {
        const int8_t *q = xq->q + t0 * K;
        const int16_t *bs = xq->bsums + t0 * (K / 16);
        const float *d = xq->d + t0 * (K / QK);
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t *row = w + n * row_bytes;
            float *yt = y + t0 * ldy + n;
#define TOKENS(TT) \
    case TT: row_q8(type, TT, vnni, row, block_bytes, K, q, bs, d, yt, ldy); break;
            if (vnni)
                switch (T - t0 < tile ? T - t0 : tile) { TOKENS(8) TOKENS(7) TOKENS(6) TOKENS(5) TOKENS(4) TOKENS(3) TOKENS(2) TOKENS(1) }
            else
                switch (T - t0 < tile ? T - t0 : tile) { TOKENS(4) TOKENS(3) TOKENS(2) TOKENS(1) }
#undef TOKENS
        }
    }
}

/* The Q8_K copy of x is kept between calls (one per calling thread): a fresh one per call
 * would be mmap'ed and page-faulted in every time once past malloc's threshold. */
static __thread char *q8_scratch = NULL;
static __thread int64_t q8_scratch_cap = 0;

static int reserve_q8k(int64_t T, int64_t K, struct q8k *xq) {
    const int64_t need = T * K + T * (K / 16) * (int64_t)sizeof(int16_t) + T * (K / QK) * (int64_t)sizeof(float);
    if (need > q8_scratch_cap) {
        char *grown = realloc(q8_scratch, need);
        if (grown == NULL) return -1;
        q8_scratch = grown;
        q8_scratch_cap = need;
    }
    xq->d = (float *)q8_scratch;
    xq->bsums = (int16_t *)(xq->d + T * (K / QK));
    xq->q = (int8_t *)(xq->bsums + T * (K / 16));
    return 0;
}

/* 1: the q8 products take vpdpwssd (AVX512-VNNI, with the AVX-512 subsets VNNI_TARGET
 * compiles for), 0: AVX2 alone. Set from the CPU when the library loads; a variable the tests
 * set to run both paths. */
int gguf_kquants_vnni = 0;

__attribute__((constructor)) static void choose_vnni(void) {
    __builtin_cpu_init();
    gguf_kquants_vnni = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
}

/* The VNNI path may also use AVX-512VL's 16 more vector registers: fewer spills at 4 tokens. */
#define VNNI_TARGET __attribute__((target("avx512f,avx512vl,avx512bw,avx512vnni")))
#define AVX2_TARGET

/* One function a type and path, not run-time flags, so that each parallel region is compiled
 * for its own block. x is quantized in the same parallel region (tokens over the threads),
 * then row chunks go over the threads. */
#define GEMM_Q8_PATH(NAME, TYPE, BYTES, PATH, VNNI)                                                  \
    PATH##_TARGET static void NAME##_q8_##PATH(const float *x, int64_t T, int64_t K, const uint8_t *w, \
                                               int64_t N, float *y, int64_t ldy, int threads,         \
                                               const struct q8k *xq) {                                \
        const int64_t nsb = K / QK, chunks = (N + ROW_CHUNK - 1) / ROW_CHUNK;                        \
        const int64_t share = (chunks + threads - 1) / threads, per_fetch = T >= DYNAMIC_TOKENS ? 1 : share; \
        _Pragma("omp parallel num_threads(threads)")                                                 \
        {                                                                                            \
            _Pragma("omp for schedule(static)")                                                      \
            for (int64_t t = 0; t < T; t++)                                                          \
                quantize_q8_k(x + t * K, nsb, xq->q + t * K, xq->d + t * nsb, xq->bsums + t * (K / 16)); \
            _Pragma("omp for schedule(dynamic, per_fetch)")                                          \
            for (int64_t c = 0; c < chunks; c++)                                                     \
                rows_q8(TYPE, VNNI, BYTES, xq, T, K, w, y, ldy, c * ROW_CHUNK,                       \
                        (c + 1) * ROW_CHUNK < N ? (c + 1) * ROW_CHUNK : N);                          \
        }                                                                                            \
    }

#define GEMM_Q8(NAME, TYPE, BYTES)                                                                   \
    GEMM_Q8_PATH(NAME, TYPE, BYTES, AVX2, 0)                                                         \
    GEMM_Q8_PATH(NAME, TYPE, BYTES, VNNI, 1)                                                         \
    int gguf_gemm_##NAME##_q8(const float *x, int64_t T, int64_t K, const uint8_t *w, int64_t N,     \
                              float *y, int64_t ldy, int threads) {                                  \
        if (T <= 0 || N <= 0) return 0;                                                              \
        struct q8k xq;                                                                               \
        if (reserve_q8k(T, K, &xq)) return -1;                                                       \
        (gguf_kquants_vnni ? NAME##_q8_VNNI : NAME##_q8_AVX2)(x, T, K, w, N, y, ldy, threads, &xq);  \
        return 0;                                                                                    \
    }

#define KQUANT(NAME, TYPE, BYTES) GET_ROWS(NAME, TYPE, BYTES) GEMM_F32(NAME, TYPE, BYTES) GEMM_Q8(NAME, TYPE, BYTES)

KQUANT(q2_k, Q2_K, 84)
KQUANT(q3_k, Q3_K, 110)
KQUANT(q4_k, Q4_K, 144)
KQUANT(q5_k, Q5_K, 176)
KQUANT(q6_k, Q6_K, 210)
KQUANT(iq4_xs, IQ4_XS, 136)
