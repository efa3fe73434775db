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
 * _q8 is llama.cpp's integer arithmetic with x rounded more finely than its Q8_K: x is
 * quantized once per product to int8 with a scale per block of 32 (Q8_0's blocks: d = amax / 127,
 * q = round(x * 127 / amax) to nearest even; all zeros give d 0, q 0) and the 16 sums of q over
 * each group of 16 in `bsums` (Q8_K's). Q8_K's one scale per 256 rounds every value of a
 * superblock by its largest: the MLP's down projection takes act(gate) * up, whose few huge
 * values then round the rest of their 256 to a few levels, and on Gemma 3 that alone put the
 * mode over the README's quality bound (perf/results/quality_types.md). Per block of 32 the
 * dot product is integer: the weights' unsigned q (Q3_K's q + 4, Q6_K's q + 32) against x's
 * int8 q with maddubs (u8 x s8 -> pairs summed in int16, which never saturates here: at most
 * 2 * 127 * 127), times each group's integer scale with madd (-> int32), converted and scaled
 * by x's d of the block in float; Q3_K's and Q6_K's offsets are one more madd, of -4 or -32
 * times the group scales with bsums (lane i: block i, scaled by its d), so no per-value
 * subtraction. Then d_w times that sum, and for Q2_K/Q4_K/Q5_K minus dmin_w times the mins'
 * madd with bsums scaled likewise. IQ4_XS's values are signed: their magnitudes go in maddubs'
 * unsigned operand and their signs onto x. Rows go over the threads in chunks; the tokens in
 * tiles of TILE, each superblock's scales and quants unpacked once per tile. Where the CPU has
 * AVX-512VL and BW (chosen at run time), the tiles are of TILE_AVX512 (its 32 vector registers
 * hold their sums). From TILED_TOKENS tokens (but for IQ4_XS) the tiled products (rows_tiled)
 * take the same integers with the superblock's 8 blocks across the lanes, x and each row's
 * superblock transposed to match: a block's whole sum in one lane, the float work once a
 * superblock, vpdpbusd where the CPU has AVX512-VNNI or AVX-VNNI. On AVX512-VNNI, from
 * PACKED_FROM tokens, 16 rows are packed side by side at each call (rows_packed), and Q4_K and
 * Q6_K weights may be packed so once, at load (gguf_pack_q4_k, gguf_pack_q6_k at the end of the
 * file).
 */
#include <immintrin.h>
#include "simd_math.h"
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 256
#define TILE 4        /* tokens a superblock is unpacked for: 4 int sums + 4 float sums + the quants fit 16 ymm */
#define TILE_AVX512 8 /* the same in the AVX-512VL path, which has 32 */
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

#define QX 32  /* values of x that share a scale */

/* x quantized, T tokens: token t's superblock b is q[t Q_STRIDE(K) + 256 b ..], d[t D_STRIDE(K)
 * + 8 b ..] (its 8 blocks' scales), bsums[t G_STRIDE(K) + 16 b ..]; for the tiled products
 * (from TILED_TOKENS tokens) q transposed (transpose_8x8) and, per superblock, s[t G_STRIDE(K)
 * + 16 b ..] and c (the same indices): the sums of its groups of 16 as those products take them
 * (quantize_x) */
struct x_q8 {
    int8_t *q;
    float *d;
    int16_t *bsums;
    float *s;
    int32_t *c;
};

/* Token t's quantized x lies t Q_STRIDE(K) bytes, t D_STRIDE(K) scales, t G_STRIDE(K) group
 * sums after token 0's: past K, so that a tile's tokens are not a multiple of 4 KiB apart (at
 * K = 8192 they all fell in the same L1 sets: the tiled products measured 1.3-1.8x slower) */
#define Q_STRIDE(K) ((K) + 64)
#define D_STRIDE(K) ((K) / QX + 16)
#define G_STRIDE(K) ((K) / 16 + 16)

#define TILED_TOKENS 4  /* from this many tokens the tiled products (measured against one row at a time) */

/* K-quants whose groups have 16 values (a scale each), not 32 */
INLINE int groups_of_16(enum kquant type) { return type == Q2_K || type == Q3_K || type == Q6_K; }
INLINE int has_mins(enum kquant type) { return type == Q2_K || type == Q4_K || type == Q5_K; }
/* what the codes the tiled products take exceed the values by (Q3_K's q + 4, Q6_K's q + 32) */
INLINE int code_offset(enum kquant type) { return type == Q3_K ? 4 : type == Q6_K ? 32 : 0; }
/* IQ4_XS's signed values go through signs (superblock_q8), at any number of tokens */
INLINE int tiled(enum kquant type, int64_t T) { return type != IQ4_XS && T >= TILED_TOKENS; }

/* the sum of a block's first group of 16 q: pairs of q (int16, as the sign-extended halves)
 * summed by madd */
static inline int32_t first_group_sum(__m256i q) {
    return hsum_epi32(_mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)), _mm256_set1_epi16(1)));
}

/* K values of x (a multiple of 256) -> int8 q, a scale d per block of 32 (quantize_block_q8)
 * and bsums per group of 16; tiled: q transposed, and per superblock 16 sums of its groups in
 * the tiled products' lanes (lane b: block b, first 8 its first group, then its second), as the
 * type takes them: c = -offset * sum (Q3_K, Q6_K: their codes' offset), s = d * sum (Q2_K; Q4_K
 * and Q5_K, whose mins are per block of 32: its whole sum in the first 8) */
static void quantize_x(enum kquant type, int tiled, const float *x, int64_t K, int8_t *q, float *d, int16_t *bsums,
                       float *s, int32_t *c) {
    for (int64_t sb = 0; sb < K / QK; sb++) {
        __m256i packed[8];
        for (int b = 0; b < 8; b++) {
            const int64_t i = 8 * sb + b;  /* block of 32 */
            int32_t sum;
            packed[b] = quantize_block_q8(x + QX * i, d + i, &sum);
            const int32_t first = first_group_sum(packed[b]);
            bsums[2 * i] = (int16_t)first;
            bsums[2 * i + 1] = (int16_t)(sum - first);
            if (tiled) {
                if (code_offset(type)) {
                    c[16 * sb + b] = -code_offset(type) * first;
                    c[16 * sb + 8 + b] = -code_offset(type) * (sum - first);
                } else if (groups_of_16(type)) {
                    s[16 * sb + b] = d[i] * (float)first;
                    s[16 * sb + 8 + b] = d[i] * (float)(sum - first);
                } else {
                    s[16 * sb + b] = d[i] * (float)sum;
                }
            }
        }
        if (tiled) transpose_8x8(packed);
        for (int b = 0; b < 8; b++) _mm256_storeu_si256((__m256i *)(q + QK * sb + 32 * b), packed[b]);
    }
}

/* s: 8 int16 in both 128-bit halves -> int16 lanes 0-7 = s[lo], 8-15 = s[hi]: the scales of
 * the values maddubs sums into lanes 0-7 (bytes 0-15) and 8-15 (bytes 16-31), one shuffle */
static inline __m256i pick_scales(__m256i s, int lo, int hi) {
    return _mm256_shuffle_epi8(s, _mm256_set_m128i(_mm_set1_epi16((short)((2 * hi + 1) << 8 | 2 * hi)),
                                                   _mm_set1_epi16((short)((2 * lo + 1) << 8 | 2 * lo))));
}

static inline __m256i load256(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* acc + block * d: a block of 32's 8 int32 lane sums, scaled by x's d of the block */
INLINE __m256 add_block(__m256 acc, __m256i block, float d) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(block), _mm256_set1_ps(d), acc);
}

/* Where token t's data for superblock b starts, the tile's first token at t = 0 */
#define XQ(t) (xq + (t) * Q_STRIDE(K))
#define XBS(t) (xbs + (t) * G_STRIDE(K))
#define XD(t) (xd + (t) * D_STRIDE(K))

/* One superblock for tt tokens: acc[t] += its dot product with token t (8 lanes to sum).
 * xq, xbs, xd: token 0's quantized superblock (quants, bsums, the 8 blocks' d). */
INLINE void superblock_q8(enum kquant type, int tt, const uint8_t *blk, const int8_t *xq, const int16_t *xbs,
                          const float *xd, int64_t K, __m256 acc[TILE_AVX512]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03), m1 = _mm256_set1_epi8(0x01);
    /* one token: two chains of FMAs (every other block of 32), not one chain of 8 dependent
     * ones whose latency would show; several tokens' chains overlap */
    const int chains = tt == 1 ? 2 : 1;
    __m256 sums[2][TILE_AVX512];  /* sum over blocks of x's d times the block's integer sum */
    for (int t = 0; t < tt; t++) sums[0][t] = sums[1][t] = _mm256_setzero_ps();
#define SUM(t, block) sums[(block) % chains][t]
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
                    SUM(t, g) = add_block(SUM(t, g), _mm256_madd_epi16(s, _mm256_maddubs_epi16(qv, load256(XQ(t) + 128 * h + 32 * g))),
                                          XD(t)[4 * h + g]);
            }
        }
        if (type != Q2_K) {  /* the offset: sum sc (q + off) x - off sum sc bsums, off 4 or 32 (-off sc fits int16) */
            const __m256i offsets = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(_mm256_cvtepi8_epi16(sc), type == Q3_K ? 2 : 5));
            for (int t = 0; t < tt; t++)  /* lane i: groups 2 i, 2 i + 1, block i */
                SUM(t, 0) = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(offsets, load256(XBS(t)))),
                                            _mm256_loadu_ps(XD(t)), SUM(t, 0));
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
                SUM(t, 0) = add_block(SUM(t, 0), _mm256_madd_epi16(slo, _mm256_maddubs_epi16(lo, load256(x))), XD(t)[2 * j]);
                SUM(t, 1) = add_block(SUM(t, 1), _mm256_madd_epi16(shi, _mm256_maddubs_epi16(hi, load256(x + 32))), XD(t)[2 * j + 1]);
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
                SUM(t, 0) = add_block(SUM(t, 0), _mm256_madd_epi16(s0, _mm256_maddubs_epi16(a0, _mm256_sign_epi8(load256(x), v0))),
                                      XD(t)[2 * j]);
                SUM(t, 1) = add_block(SUM(t, 1), _mm256_madd_epi16(s1, _mm256_maddubs_epi16(a1, _mm256_sign_epi8(load256(x + 32), v1))),
                                      XD(t)[2 * j + 1]);
            }
        }
        break;
    }
    }
#undef SUM
    for (int t = 0; t < tt; t++) {
        const __m256 sum = chains == 2 ? _mm256_add_ps(sums[0][t], sums[1][t]) : sums[0][t];
        acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d), sum, acc[t]);
        if (type == Q2_K || type == Q4_K || type == Q5_K)  /* lane i: the mins of block i times its bsums */
            acc[t] = _mm256_fnmadd_ps(_mm256_set1_ps(dmin),
                                      _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(mins, load256(XBS(t)))), _mm256_loadu_ps(XD(t))),
                                      acc[t]);
    }
}

/* y[t * ldy] for t < tt = one row's products with tt tokens (quantized x at token 0) */
INLINE void row_q8(enum kquant type, int tt, const uint8_t *row, int64_t block_bytes, int64_t K, const int8_t *xq,
                   const int16_t *xbs, const float *xd, float *y, int64_t ldy) {
    __m256 acc[TILE_AVX512];
    for (int t = 0; t < tt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / QK; b++)
        superblock_q8(type, tt, row + b * block_bytes, xq + b * QK, xbs + b * 16, xd + b * (QK / QX), K, acc);
    for (int t = 0; t < tt; t++) y[t * ldy] = hsum(acc[t]);
}

/* Rows n0 .. n1, all tokens, a tile at a time: the chunk's rows (a few KiB) stay in L1/L2 for
 * every tile, and a tile of x is read from L1 for every row. */
INLINE void rows_q8(enum kquant type, int avx512, int64_t block_bytes, const struct x_q8 *xq, int64_t T, int64_t K,
                    const uint8_t *w, float *y, int64_t ldy, int64_t n0, int64_t n1) {
    const int64_t row_bytes = K / QK * block_bytes, tile = avx512 ? TILE_AVX512 : TILE;
    for (int64_t t0 = 0; t0 < T; t0 += tile) {
        const int8_t *q = xq->q + t0 * Q_STRIDE(K);
        const int16_t *bs = xq->bsums + t0 * G_STRIDE(K);
        const float *d = xq->d + t0 * D_STRIDE(K);
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t *row = w + n * row_bytes;
            float *yt = y + t0 * ldy + n;
#define TOKENS(TT) \
    case TT: row_q8(type, TT, row, block_bytes, K, q, bs, d, yt, ldy); break;
            if (avx512)
                switch (T - t0 < tile ? T - t0 : tile) { TOKENS(8) TOKENS(7) TOKENS(6) TOKENS(5) TOKENS(4) TOKENS(3) TOKENS(2) TOKENS(1) }
            else
                switch (T - t0 < tile ? T - t0 : tile) { TOKENS(4) TOKENS(3) TOKENS(2) TOKENS(1) }
#undef TOKENS
        }
    }
}

/* ---- _q8 of a tile of tokens, a superblock's 8 blocks across the vector lanes ----
 * With x transposed (quantize_x), a row's superblock unpacked likewise once for the tile
 * (unpack_tiled: its codes as 8 vectors, vector k's lane b bytes 4 k .. of block b) and a token
 * takes 8 u8 x s8 products whose int32 lane b sums all of block b (groups of 16: vectors 0-3
 * its first group, 4-7 its second, two sums): then one convert and FMA a superblock (or two),
 * by the lanes' d sc times x's d, and the mins' one FNMADD with x's s, where one row at a time
 * (superblock_q8) takes a convert and an FMA for each block of 32. */

#define TILE_TILED 4          /* tokens a tile: 8 codes + 4 sums + scales fit 16 ymm */
#define TILE_TILED_AVX512 8   /* the same in 32 */

/* one row's superblock as the tiled products take it */
struct tiled_block {
    __m256i w[8];  /* codes, transposed */
    __m256 sc[2];  /* lane b: d times block b's scale; groups of 16: of its first group, then its second */
    __m256 m[2];   /* the same of dmin and the mins (types with mins) */
};

/* 16 int8 of groups 0-15 -> f times them, lane b: group 2 b (out[0]) and 2 b + 1 (out[1]) */
INLINE void group_floats(__m128i g, float f, __m256 out[2]) {
    const __m256i v = _mm256_cvtepi8_epi16(g);  /* int32 lane b: group 2 b's int16, 2 b + 1's above */
    out[0] = _mm256_mul_ps(_mm256_set1_ps(f), _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 16)));
    out[1] = _mm256_mul_ps(_mm256_set1_ps(f), _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 16)));
}

INLINE void unpack_tiled(enum kquant type, const uint8_t *blk, struct tiled_block *u) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03), m1 = _mm256_set1_epi8(0x01);
    __m256i *v = u->w;  /* first block b's 32 codes in order, in v[b] */
    switch (type) {
    case Q2_K:
    case Q3_K:
    case Q6_K: {  /* block 4 h + g: quarter g of half h */
        if (type == Q2_K) {
            const __m128i raw = _mm_loadu_si128((const __m128i *)blk);
            group_floats(_mm_and_si128(raw, _mm_set1_epi8(0x0F)), f16(blk + 80), u->sc);
            group_floats(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F)), f16(blk + 82), u->m);
        } else if (type == Q3_K) {
            group_floats(unpack_scales_q3(blk + 96), f16(blk + 108), u->sc);
        } else {
            group_floats(_mm_loadu_si128((const __m128i *)(blk + 192)), f16(blk + 208), u->sc);
        }
        for (int h = 0; h < 2; h++) {
            __m256i lo2 = _mm256_setzero_si256(), hi = lo2, ql0 = lo2, ql1 = lo2;
            if (type == Q6_K) {
                ql0 = load256(blk + 64 * h), ql1 = load256(blk + 64 * h + 32), hi = load256(blk + 128 + 32 * h);
            } else {
                lo2 = load256(blk + (type == Q2_K ? 16 : 32) + 32 * h);
                if (type == Q3_K) hi = load256(blk);
            }
            for (int g = 0; g < 4; g++) {  /* as superblock_q8's */
                if (type == Q6_K) {
                    const __m256i low = g & 2 ? _mm256_and_si256(_mm256_srli_epi16(g & 1 ? ql1 : ql0, 4), m4)
                                              : _mm256_and_si256(g & 1 ? ql1 : ql0, m4);
                    v[4 * h + g] = _mm256_or_si256(low, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, 2 * g), m2), 4));
                } else {
                    v[4 * h + g] = _mm256_and_si256(_mm256_srli_epi16(lo2, 2 * g), m2);
                    if (type == Q3_K)
                        v[4 * h + g] = _mm256_or_si256(
                            v[4 * h + g], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, 4 * h + g), m1), 2));
                }
            }
        }
        break;
    }
    case Q4_K:
    case Q5_K: {
        const __m128i sm = unpack_scales_k4(blk + 4);
        u->sc[0] = _mm256_mul_ps(_mm256_set1_ps(f16(blk)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm)));
        u->m[0] = _mm256_mul_ps(_mm256_set1_ps(f16(blk + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))));
        const uint8_t *qs = blk + (type == Q4_K ? 16 : 48);
        const __m256i qh = type == Q5_K ? load256(blk + 16) : _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256i raw = load256(qs + 32 * j);
            v[2 * j] = _mm256_and_si256(raw, m4);
            v[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            if (type == Q5_K) {
                v[2 * j] = _mm256_or_si256(v[2 * j], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), m1), 4));
                v[2 * j + 1] =
                    _mm256_or_si256(v[2 * j + 1], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), m1), 4));
            }
        }
        break;
    }
    case IQ4_XS:
        break;  /* not tiled */
    }
    transpose_8x8(v);
}

/* acc + the sums of 4 u8 x s8 products in each int32 lane: vpdpbusd (vnni: 1 AVX512-VNNI's, 2
 * AVX-VNNI's), or maddubs + madd (the codes are at most 63: a pair's sum fits int16) */
INLINE __m256i dot4(int vnni, __m256i acc, __m256i u, __m256i s) {
    if (vnni == 1) return dpbusd(acc, u, s);
    if (vnni == 2) return dpbusd_vex(acc, u, s);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

/* acc[t] += one superblock's products with tt tokens (token 0's quantized superblock at xq, its
 * d, s, c at xd, xs, xc; token t K values later, in each) */
INLINE void superblock_tiled(enum kquant type, int vnni, int tt, const struct tiled_block *u, const int8_t *xq,
                             const float *xd, const float *xs, const int32_t *xc, int64_t K, __m256 acc[]) {
    /* unrolled: the sums stay in registers, and the tokens' chains of products overlap */
    _Pragma("GCC unroll 16")
    for (int t = 0; t < tt; t++) {
        const int8_t *x = xq + t * Q_STRIDE(K);
        /* the sums start at the codes' offset times the groups' sums of x */
        __m256i sum[2];
        for (int h = 0; h < 2; h++)
            sum[h] = code_offset(type) ? load256(xc + t * G_STRIDE(K) + 8 * h) : _mm256_setzero_si256();
        for (int k = 0; k < 8; k++) sum[groups_of_16(type) && k >= 4] = dot4(vnni, sum[groups_of_16(type) && k >= 4], u->w[k], load256(x + 32 * k));
        const __m256 d = _mm256_loadu_ps(xd + t * D_STRIDE(K));
        for (int h = 0; h < 1 + groups_of_16(type); h++) {
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[h]), _mm256_mul_ps(u->sc[h], d), acc[t]);
            if (has_mins(type)) acc[t] = _mm256_fnmadd_ps(u->m[h], _mm256_loadu_ps(xs + t * G_STRIDE(K) + 8 * h), acc[t]);
        }
    }
}

/* y[t * ldy] for t < tt = one row's products with tt tokens (x's tile at token 0) */
INLINE void row_tiled(enum kquant type, int vnni, int tt, const uint8_t *row, int64_t block_bytes, int64_t K,
                      const struct x_q8 *xq, float *y, int64_t ldy) {
    __m256 acc[TILE_TILED_AVX512];
    for (int t = 0; t < tt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / QK; b++) {
        struct tiled_block u;
        unpack_tiled(type, row + b * block_bytes, &u);
        superblock_tiled(type, vnni, tt, &u, xq->q + b * QK, xq->d + b * (QK / QX), xq->s + b * 16, xq->c + b * 16, K, acc);
    }
    for (int t = 0; t < tt; t++) y[t * ldy] = hsum(acc[t]);
}

/* rows_q8's tiled form: tiles of a power of two tokens, the largest that fits what is left */
INLINE void rows_tiled(enum kquant type, int avx512, int vnni, int64_t block_bytes, const struct x_q8 *xq, int64_t T,
                       int64_t K, const uint8_t *w, float *y, int64_t ldy, int64_t n0, int64_t n1) {
    const int64_t row_bytes = K / QK * block_bytes;
    for (int64_t t0 = 0, tt; t0 < T; t0 += tt) {
        for (tt = avx512 ? TILE_TILED_AVX512 : TILE_TILED; tt > T - t0; tt /= 2) {}
        const struct x_q8 at = {xq->q + t0 * Q_STRIDE(K), xq->d + t0 * D_STRIDE(K), NULL, xq->s + t0 * G_STRIDE(K),
                                xq->c + t0 * G_STRIDE(K)};
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t *row = w + n * row_bytes;
            float *yt = y + t0 * ldy + n;
#define TOKENS(TT) \
    case TT: row_tiled(type, vnni, TT, row, block_bytes, K, &at, yt, ldy); break;
            if (avx512)
                switch (tt) { TOKENS(8) TOKENS(4) TOKENS(2) TOKENS(1) }
            else
                switch (tt) { TOKENS(4) TOKENS(2) TOKENS(1) }
#undef TOKENS
        }
    }
}

/* The quantized copy of x is kept between calls (one per calling thread): a fresh one per call
 * would be mmap'ed and page-faulted in every time once past malloc's threshold. */
static __thread char *q8_scratch = NULL;
static __thread int64_t q8_scratch_cap = 0;

static int reserve_x_q8(int64_t T, int64_t K, struct x_q8 *xq) {
    const int64_t groups = T * G_STRIDE(K);
    const int64_t need = T * Q_STRIDE(K) + groups * (int64_t)(sizeof(int16_t) + sizeof(float) + sizeof(int32_t)) +
                         T * D_STRIDE(K) * (int64_t)sizeof(float);
    if (grown_scratch(&q8_scratch, &q8_scratch_cap, need) == NULL) return -1;
    xq->d = (float *)q8_scratch;
    xq->s = xq->d + T * D_STRIDE(K);
    xq->c = (int32_t *)(xq->s + groups);
    xq->bsums = (int16_t *)(xq->c + groups);
    xq->q = (int8_t *)(xq->bsums + groups);
    return 0;
}

/* Many tokens on AVX512-VNNI (512-bit vectors), as gguf_q32.c's rows_packed: a thread's
 * ROW_CHUNK rows are unpacked once (unpack_superblock) into PACK_ROWS lanes, a vector holding a
 * block of 32's 4-byte group g of all 16 rows as unsigned codes (the value plus packed_offset),
 * beside each row's group scales dl and mins ml as floats. Each token's group, a broadcast
 * load from x's tiled layout (x_tiles), meets them in one vpdpbusd, eight tokens at a time; a
 * group of 16's integer sum starts at -offset * its bsum and is scaled by dl xd, a min taken off
 * as ml * xd * bsum. The same integer sums as the other paths; the float steps in another order. */
#define PACK_ROWS 16   /* rows a packed vector holds: one a 32-bit lane */
#define PACK_TOKENS 8  /* tokens a packed product takes together */
#define PACKED_FROM 48 /* more tokens than this are packed: unpacking a superblock costs ~50 tokens' gain */
#define PACKED_TARGET __attribute__((target("avx512f,avx512vl,avx512bw,avx512vnni")))
_Static_assert(PACK_ROWS == ROW_CHUNK, "a thread's chunk of rows is one packed set");

/* what a value is raised by to be an unsigned code (Q3_K's and Q6_K's as the tiled products;
 * IQ4_XS's signed values by 128) */
INLINE int packed_offset(enum kquant type) { return type == IQ4_XS ? 128 : code_offset(type); }

struct packed_rows {
    /* [K / 32, 8, PACK_ROWS, 4]: block i's group g of each row as codes; Q4_K's (nibbles_kept)
     * [K / 64, 8, PACK_ROWS, 4]: bytes 4 g .. 4 g + 3 of each row's qs[32 j ..], whose low
     * nibbles are block 2 j's group g and high nibbles block 2 j + 1's, the blocks' own bytes */
    uint8_t *q;
    float *dl, *ml;  /* [K / 16 (K / 32 where groups are 32 values), PACK_ROWS]; ml only with mins */
};

/* Q4_K's packed codes are its nibbles as they are: half the bytes of whole codes */
INLINE int nibbles_kept(enum kquant type) { return type == Q4_K; }
/* group scales a block of 32 */
INLINE int scales_a_block(enum kquant type) { return groups_of_16(type) ? 2 : 1; }

/* x quantized for the packed products, in tiles of PACK_TOKENS tokens (the last one of the
 * tokens left, W = T mod PACK_TOKENS of them) whose values lie side by side, so that one pointer
 * reaches every token of a tile at constant offsets (a token's own pointers were eight and more
 * registers, spilled): tile j (W tokens wide) starts at j PACK_TOKENS tokens' room; its block i
 * is q[(i 8 + g) W + t] (group g of token t, 4 bytes an int32) and d[i W + t], its scale slot k
 * (a block of 32, or its groups of 16 where the type's groups are: slot 2 i + h) c[k W + t] =
 * -offset * the slot's sum of q (the codes' offset taken off), s[the same] = d * that sum (the
 * mins). A tile as wide as its tokens: at one token the tile is that token's x alone, as compact
 * as the plain layout (eight lanes wide, x outgrew L1 from K = 3072 and the products at one
 * token were slower than with the plain layout: perf/kquant_products_bench.py). */
struct x_tiles {
    int32_t *q;
    float *d, *s;
    int32_t *c;
};

static __thread char *tiles_scratch = NULL;
static __thread int64_t tiles_scratch_cap = 0;

static int reserve_x_tiles(int64_t T, int64_t K, struct x_tiles *xt) {
    const int64_t tokens = (T + PACK_TOKENS - 1) / PACK_TOKENS * PACK_TOKENS;
    const int64_t need = tokens * (K + (K / QX + 2 * (K / 16)) * 4);
    if (grown_scratch(&tiles_scratch, &tiles_scratch_cap, need) == NULL) return -1;
    xt->q = (int32_t *)tiles_scratch;
    xt->d = (float *)(xt->q + tokens * K / 4);
    xt->s = xt->d + tokens * (K / QX);
    xt->c = (int32_t *)(xt->s + tokens * (K / 16));
    return 0;
}

/* the tokens of tile `tile` of T */
static inline int64_t tile_width(int64_t T, int64_t tile) {
    return T - tile * PACK_TOKENS < PACK_TOKENS ? T - tile * PACK_TOKENS : PACK_TOKENS;
}

/* where tile `tile` of xt starts */
static inline struct x_tiles tile_of(struct x_tiles xt, int64_t K, int64_t tile) {
    return (struct x_tiles){xt.q + tile * K / 4 * PACK_TOKENS, xt.d + tile * (K / QX) * PACK_TOKENS,
                            xt.s + tile * (K / 16) * PACK_TOKENS, xt.c + tile * (K / 16) * PACK_TOKENS};
}

/* token t of x [T, K] into xt */
static void quantize_x_tiles(enum kquant type, const float *x, int64_t T, int64_t K, int64_t t, struct x_tiles xt) {
    const int64_t nb = K / QX, W = tile_width(T, t / PACK_TOKENS), lane = t % PACK_TOKENS;
    const int per = scales_a_block(type);
    const struct x_tiles at = tile_of(xt, K, t / PACK_TOKENS);
    int32_t *q = at.q + lane, *c = at.c + lane;
    float *d = at.d + lane, *s = at.s + lane;
    for (int64_t i = 0; i < nb; i++) {
        int32_t groups[8], sum;
        float di;
        const __m256i packed = quantize_block_q8(x + t * K + QX * i, &di, &sum);
        _mm256_storeu_si256((__m256i *)groups, packed);
        const int32_t first = first_group_sum(packed);
        for (int g = 0; g < 8; g++) q[(i * 8 + g) * W] = groups[g];
        d[i * W] = di;
        for (int h = 0; h < per; h++) {
            const int32_t part = per == 1 ? sum : h ? sum - first : first;
            c[(per * i + h) * W] = -packed_offset(type) * part;
            s[(per * i + h) * W] = di * (float)part;
        }
    }
}

static __thread char *pack_scratch = NULL;
static __thread int64_t pack_scratch_cap = 0;

static int packed_rows_for(int64_t K, struct packed_rows *p) {
    const int64_t need = K / QX * 8 * PACK_ROWS * 4 + 2 * (K / 16) * PACK_ROWS * (int64_t)sizeof(float);
    if (grown_scratch(&pack_scratch, &pack_scratch_cap, need) == NULL) return -1;
    p->dl = (float *)pack_scratch;
    p->ml = p->dl + K / 16 * PACK_ROWS;
    p->q = (uint8_t *)(p->ml + K / 16 * PACK_ROWS);
    return 0;
}

/* rows [0, rows) of w (rows <= PACK_ROWS) into p; the rows past them have scales and mins 0.
 * The chunk's rows are one run of memory, read once in order first (into the caches: a
 * superblock of each row in turn would be 16 streams the prefetcher does not follow); then a
 * superblock at a time, its 16 rows unpacked and each block of 32's codes transposed 8 x 8
 * dwords by shuffles, or Q4_K's qs moved 4 bytes at a time as they are. */
INLINE void pack_rows(enum kquant type, int bytes, const uint8_t *w, int64_t K, int64_t rows, struct packed_rows p) {
    const int64_t nsb = K / QK, per = scales_a_block(type);
    read_in_order(w, rows * nsb * bytes);
    const __m256i offset = _mm256_set1_epi8((char)packed_offset(type));
    for (int64_t sb = 0; sb < nsb; sb++) {
        int8_t q[PACK_ROWS][QK];
        for (int r = 0; r < PACK_ROWS; r++) {
            float dl[16] = {0}, ml[16] = {0};
            const uint8_t *blk = w + (r * nsb + sb) * bytes;
            if (r < rows)
                unpack_superblock(type, blk, q[r], dl, ml);
            else
                memset(q[r], 0, QK);
            for (int g = 0; g < 8 * per; g++) { /* a block of 32's two groups of 16 share its scale */
                p.dl[(8 * per * sb + g) * PACK_ROWS + r] = dl[g * 2 / per];
                if (has_mins(type)) p.ml[(8 * per * sb + g) * PACK_ROWS + r] = ml[g * 2 / per];
            }
            if (nibbles_kept(type))
                for (int j = 0; j < QK / 64; j++)
                    for (int g = 0; g < 8; g++) {
                        uint32_t four = 0;
                        if (r < rows) memcpy(&four, blk + 16 + 32 * j + 4 * g, 4);
                        memcpy(p.q + (((sb * 4 + j) * 8 + g) * PACK_ROWS + r) * 4, &four, 4);
                    }
        }
        if (nibbles_kept(type)) continue;
        for (int b = 0; b < QK / QX; b++) {
            __m256i half[2][8];
            for (int r = 0; r < PACK_ROWS; r++) half[r / 8][r % 8] = _mm256_add_epi8(load256(q[r] + QX * b), offset);
            transpose_8x8(half[0]); /* half[h][g] lane r: group g of row 8 h + r */
            transpose_8x8(half[1]);
            for (int g = 0; g < 8; g++)
                for (int h = 0; h < 2; h++)
                    _mm256_storeu_si256((__m256i *)(p.q + (((sb * 8 + b) * 8 + g) * PACK_ROWS + 8 * h) * 4), half[h][g]);
        }
    }
}

/* block i's group g of codes, all 16 rows */
INLINE PACKED_TARGET __m512i packed_codes(enum kquant type, struct packed_rows p, int64_t i, int g) {
    if (!nibbles_kept(type)) return _mm512_loadu_si512(p.q + (i * 8 + g) * PACK_ROWS * 4);
    const __m512i raw = _mm512_loadu_si512(p.q + (i / 2 * 8 + g) * PACK_ROWS * 4);
    return _mm512_and_si512(i % 2 ? _mm512_srli_epi16(raw, 4) : raw, _mm512_set1_epi8(0x0F));
}

/* y[t, r] for the TT tokens of tile xt, TT wide (TT a constant at each call: <= PACK_TOKENS) */
INLINE PACKED_TARGET void packed_tokens(enum kquant type, int TT, struct packed_rows p, struct x_tiles xt, int64_t K,
                                        float *y, int64_t ldy, int64_t rows, int stream) {
    __m512 acc[PACK_TOKENS];
    __m512i sum[PACK_TOKENS];
    for (int t = 0; t < TT; t++) acc[t] = _mm512_setzero_ps();
    const int per = scales_a_block(type), n = 8 / per;
    /* Q4_K's blocks two at a time: a pair shares its bytes, low nibbles and high (packed_codes) */
    const int blocks = nibbles_kept(type) ? 2 : 1;
    for (int64_t first = 0; first < K / QX; first += blocks)
#pragma GCC unroll 2
    for (int64_t i = first; i < first + blocks; i++) {
        const int32_t *xg = xt.q + i * 8 * TT;
        const float *xd = xt.d + i * TT;
        for (int half = 0; half < per; half++) {
            const int64_t slot = (per * i + half) * TT;
            for (int t = 0; t < TT; t++)
                sum[t] = packed_offset(type) ? _mm512_set1_epi32(xt.c[slot + t]) : _mm512_setzero_si512();
#pragma GCC unroll 1 /* unrolled, the one-token products of Q6_K were slower (kquant_products_bench) */
            for (int g = n * half; g < n * half + n; g++) {
                const __m512i u = packed_codes(type, p, i, g);
                for (int t = 0; t < TT; t++)
                    sum[t] = _mm512_dpbusd_epi32(sum[t], u, _mm512_set1_epi32(xg[g * TT + t]));
            }
            const __m512 dl = _mm512_loadu_ps(p.dl + (per * i + half) * PACK_ROWS);
            for (int t = 0; t < TT; t++)
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[t]), _mm512_mul_ps(dl, _mm512_set1_ps(xd[t])), acc[t]);
            if (has_mins(type)) {
                const __m512 ml = _mm512_loadu_ps(p.ml + (per * i + half) * PACK_ROWS);
                for (int t = 0; t < TT; t++) acc[t] = _mm512_fnmadd_ps(ml, _mm512_set1_ps(xt.s[slot + t]), acc[t]);
            }
        }
    }
    store_packed_rows(acc, TT, rows, y, ldy, stream);
}

/* tile `tile` of T tokens: packed_tokens with its width a constant */
INLINE PACKED_TARGET void packed_tile(enum kquant type, struct packed_rows p, struct x_tiles xt, int64_t K,
                                      int64_t tile, int64_t T, float *y, int64_t ldy, int64_t rows, int stream) {
    const struct x_tiles at = tile_of(xt, K, tile);
    switch (tile_width(T, tile)) {
#define TOKENS_CASE(TT) \
    case TT: packed_tokens(type, TT, p, at, K, y, ldy, rows, stream); break;
        TOKENS_CASE(1) TOKENS_CASE(2) TOKENS_CASE(3) TOKENS_CASE(4) TOKENS_CASE(5) TOKENS_CASE(6) TOKENS_CASE(7)
#undef TOKENS_CASE
    default: packed_tokens(type, PACK_TOKENS, p, at, K, y, ldy, rows, stream);
    }
}

/* rows [n0, n1) (n1 - n0 <= PACK_ROWS), all T tokens, x in tiles */
INLINE PACKED_TARGET void rows_packed(enum kquant type, int bytes, struct x_tiles xt, int64_t T, int64_t K,
                                      const uint8_t *w, float *y, int64_t ldy, int64_t n0, int64_t n1,
                                      struct packed_rows p, int stream) {
    pack_rows(type, bytes, w + n0 * (K / QK) * bytes, K, n1 - n0, p);
    for (int64_t t0 = 0; t0 < T; t0 += PACK_TOKENS)
        packed_tile(type, p, xt, K, t0 / PACK_TOKENS, T, y + t0 * ldy + n0, ldy, n1 - n0, stream);
}

/* The q8 products' instructions: 0 AVX2 alone, 1 AVX-512VL (the AVX512_TARGET subsets), 2 the
 * same and AVX512-VNNI's vpdpbusd in the tiled products, 3 AVX2 and AVX-VNNI's vpdpbusd in them
 * (a CPU with AVX-VNNI and no AVX-512). Set from the CPU when the library loads; a variable the
 * tests set to run each path the CPU has. */
int gguf_kquants_path = 0;

__attribute__((constructor)) static void choose_path(void) {
    __builtin_cpu_init();
#ifndef RINGSERVE_AVX_VNNI_AS_EVEX /* such a build behaves as on a CPU with AVX-VNNI alone (simd_math.h) */
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw")) {
        gguf_kquants_path = 1 + !!__builtin_cpu_supports("avx512vnni");
        return;
    }
#endif
    if (cpu_has_avx_vnni()) gguf_kquants_path = 3;
}

/* The same 256-bit instructions, with AVX-512VL's 16 more vector registers: tiles of
 * TILE_AVX512 (TILE_TILED_AVX512) tokens without spills. */
#define AVX512_TARGET __attribute__((target("avx512f,avx512vl,avx512bw")))
#define AVX512VNNI_TARGET AVX512_TARGET
#define AVX2_TARGET
#define AVXVNNI_TARGET /* AVX2's registers; its vpdpbusd in asm (simd_math.h's dpbusd_vex) */

/* One function a type and path, not run-time flags, so that each parallel region is compiled
 * for its own block. x is quantized in the same parallel region (tokens over the threads),
 * then row chunks go over the threads. */
#define GEMM_Q8_PATH(NAME, TYPE, BYTES, PATH, AVX512, VNNI)                                          \
    /* -1 where a thread had no memory for its packed rows (their chunks are left unwritten) */    \
    PATH##_TARGET static int NAME##_q8_##PATH(const float *x, int64_t T, int64_t K, const uint8_t *w, \
                                               int64_t N, float *y, int64_t ldy, int threads,         \
                                               const struct x_q8 *xq, struct x_tiles xt) {              \
        const int64_t chunks = (N + ROW_CHUNK - 1) / ROW_CHUNK;                                      \
        const int64_t share = (chunks + threads - 1) / threads, per_fetch = T >= DYNAMIC_TOKENS ? 1 : share; \
        const int packed = VNNI == 1 && T > PACKED_FROM, by_tiles = !packed && tiled(TYPE, T);       \
        const int stream = packed && streams_output(T, N, N * (K / QK) * BYTES);                     \
        int failed = 0;                                                                              \
        _Pragma("omp parallel num_threads(threads)")                                                 \
        {                                                                                            \
            struct packed_rows rows_p;                                                               \
            const int pack = packed && packed_rows_for(K, &rows_p) == 0;                             \
            if (packed && !pack) {                                                                   \
                _Pragma("omp atomic write")                                                          \
                failed = 1;                                                                          \
            }                                                                                        \
            _Pragma("omp for schedule(static)")                                                      \
            for (int64_t t = 0; t < T; t++)                                                          \
                if (packed)                                                                          \
                    quantize_x_tiles(TYPE, x, T, K, t, xt);                                          \
                else                                                                                 \
                    quantize_x(TYPE, by_tiles, x + t * K, K, xq->q + t * Q_STRIDE(K), xq->d + t * D_STRIDE(K), \
                               xq->bsums + t * G_STRIDE(K), xq->s + t * G_STRIDE(K), xq->c + t * G_STRIDE(K)); \
            _Pragma("omp for schedule(dynamic, per_fetch)")                                          \
            for (int64_t c = 0; c < chunks; c++) {                                                   \
                const int64_t n1 = (c + 1) * ROW_CHUNK < N ? (c + 1) * ROW_CHUNK : N;                \
                if (packed) {                                                                        \
                    if (pack) NAME##_q8_packed(xt, T, K, w, y, ldy, c * ROW_CHUNK, n1, rows_p, stream);  \
                } else if (by_tiles)                                                                 \
                    rows_tiled(TYPE, AVX512, VNNI, BYTES, xq, T, K, w, y, ldy, c * ROW_CHUNK, n1);      \
                else                                                                                 \
                    rows_q8(TYPE, AVX512, BYTES, xq, T, K, w, y, ldy, c * ROW_CHUNK, n1);              \
            }                                                                                        \
            if (stream) _mm_sfence();                                                                \
        }                                                                                            \
        return failed ? -1 : 0;                                                                      \
    }

#define GEMM_Q8(NAME, TYPE, BYTES)                                                                   \
    PACKED_TARGET __attribute__((noinline)) static void NAME##_q8_packed(                            \
        struct x_tiles xt, int64_t T, int64_t K, const uint8_t *w, float *y, int64_t ldy,            \
        int64_t n0, int64_t n1, struct packed_rows p, int stream) {                                  \
        rows_packed(TYPE, BYTES, xt, T, K, w, y, ldy, n0, n1, p, stream);                            \
    }                                                                                                \
    GEMM_Q8_PATH(NAME, TYPE, BYTES, AVX2, 0, 0)                                                      \
    GEMM_Q8_PATH(NAME, TYPE, BYTES, AVX512, 1, 0)                                                    \
    GEMM_Q8_PATH(NAME, TYPE, BYTES, AVX512VNNI, 1, 1)                                                \
    GEMM_Q8_PATH(NAME, TYPE, BYTES, AVXVNNI, 0, 2)                                                   \
    int gguf_gemm_##NAME##_q8(const float *x, int64_t T, int64_t K, const uint8_t *w, int64_t N,     \
                              float *y, int64_t ldy, int threads) {                                  \
        if (T <= 0 || N <= 0) return 0;                                                              \
        struct x_q8 xq = {0};                                                                         \
        struct x_tiles xt = {0};                                                                      \
        /* the layout the path quantizes x into: tiles where it packs (GEMM_Q8_PATH's `packed`) */   \
        if (gguf_kquants_path == 2 && T > PACKED_FROM ? reserve_x_tiles(T, K, &xt) : reserve_x_q8(T, K, &xq)) \
            return -1;                                                                                \
        return (gguf_kquants_path == 2   ? NAME##_q8_AVX512VNNI                                       \
                : gguf_kquants_path == 1 ? NAME##_q8_AVX512                                           \
                : gguf_kquants_path == 3 ? NAME##_q8_AVXVNNI                                          \
                                         : NAME##_q8_AVX2)(x, T, K, w, N, y, ldy, threads, &xq, xt);  \
    }

#define KQUANT(NAME, TYPE, BYTES) GET_ROWS(NAME, TYPE, BYTES) GEMM_F32(NAME, TYPE, BYTES) GEMM_Q8(NAME, TYPE, BYTES)

KQUANT(q2_k, Q2_K, 84)
KQUANT(q3_k, Q3_K, 110)
KQUANT(q4_k, Q4_K, 144)
KQUANT(q5_k, Q5_K, 176)
KQUANT(q6_k, Q6_K, 210)
KQUANT(iq4_xs, IQ4_XS, 136)

/* Q4_K and Q6_K packed once, at load (gpu/quant/blocks.py), where gguf_kquants_packs(): each
 * chunk of PACK_ROWS rows as pack_rows lays it out, [q, dl (, ml)], one after another (the last
 * chunk's missing rows zeros), so that the products unpack no superblock at any call. Q4_K's
 * nibbles as they are and its scales and mins as floats: 0.75 bytes a value against the blocks'
 * 0.5625; Q6_K's codes as bytes and its scales as floats: 1.25 against 0.82. */
int gguf_kquants_packs(void) { return gguf_kquants_path == 2; }

static inline int64_t packed_chunk_bytes(enum kquant type, int64_t K) {
    const int64_t scales = K / QX * scales_a_block(type) * PACK_ROWS * (int64_t)sizeof(float);
    return K * PACK_ROWS / (nibbles_kept(type) ? 2 : 1) + scales * (1 + has_mins(type));
}

static inline struct packed_rows packed_chunk_at(enum kquant type, const uint8_t *w, int64_t K, int64_t c) {
    uint8_t *base = (uint8_t *)w + c * packed_chunk_bytes(type, K);
    float *dl = (float *)(base + K * PACK_ROWS / (nibbles_kept(type) ? 2 : 1));
    return (struct packed_rows){base, dl, has_mins(type) ? dl + K / QX * scales_a_block(type) * PACK_ROWS : NULL};
}

#define PACKED_AHEAD 2 /* chunks ahead of its products a packed weight's are prefetched, into L2 */

#define PACKED_KQUANT(NAME, TYPE, BYTES)                                                             \
    /* w [N, K] into out; with out NULL, the bytes out needs */                                    \
    int64_t gguf_pack_##NAME(const uint8_t *w, int64_t N, int64_t K, uint8_t *out, int threads) {   \
        const int64_t chunks = (N + ROW_CHUNK - 1) / ROW_CHUNK;                                      \
        if (out == NULL) return chunks * packed_chunk_bytes(TYPE, K);                                \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                            \
        for (int64_t c = 0; c < chunks; c++) {                                                       \
            const int64_t n1 = (c + 1) * ROW_CHUNK < N ? (c + 1) * ROW_CHUNK : N;                    \
            pack_rows(TYPE, BYTES, w + c * ROW_CHUNK * (K / QK) * BYTES, K, n1 - c * ROW_CHUNK,      \
                      packed_chunk_at(TYPE, out, K, c));                                             \
        }                                                                                            \
        return 0;                                                                                    \
    }                                                                                                \
    PACKED_TARGET __attribute__((noinline)) static void NAME##_packed_chunk(                         \
        struct x_tiles xt, int64_t T, int64_t K, const uint8_t *w, int64_t c, float *y,              \
        int64_t ldy, int64_t rows, int stream) {                                                     \
        const int64_t chunk = packed_chunk_bytes(TYPE, K);                                           \
        const char *next = (const char *)w + (c + PACKED_AHEAD) * chunk;                             \
        for (int64_t line = 0; line < chunk; line += 64) _mm_prefetch(next + line, _MM_HINT_T2);     \
        for (int64_t t0 = 0; t0 < T; t0 += PACK_TOKENS)                                              \
            packed_tile(TYPE, packed_chunk_at(TYPE, w, K, c), xt, K, t0 / PACK_TOKENS, T, y + t0 * ldy, ldy, rows, \
                        stream);                                                                     \
    }                                                                                                \
    /* as gguf_gemm_<type>_q8, w packed by gguf_pack_<type>; only where gguf_kquants_packs() */    \
    int gguf_gemm_##NAME##_packed_q8(const float *x, int64_t T, int64_t K, const uint8_t *w,        \
                                     int64_t N, float *y, int64_t ldy, int threads) {                \
        if (T <= 0 || N <= 0) return 0;                                                              \
        struct x_tiles xt;                                                                            \
        if (reserve_x_tiles(T, K, &xt)) return -1;                                                    \
        const int64_t chunks = (N + ROW_CHUNK - 1) / ROW_CHUNK;                                      \
        const int stream = streams_output(T, N, chunks * packed_chunk_bytes(TYPE, K));               \
        _Pragma("omp parallel num_threads(threads)")                                                 \
        {                                                                                            \
            _Pragma("omp for schedule(static)")                                                      \
            for (int64_t t = 0; t < T; t++) quantize_x_tiles(TYPE, x, T, K, t, xt);                 \
            _Pragma("omp for schedule(static)")                                                      \
            for (int64_t c = 0; c < chunks; c++) {                                                   \
                const int64_t n1 = (c + 1) * ROW_CHUNK < N ? (c + 1) * ROW_CHUNK : N;                \
                NAME##_packed_chunk(xt, T, K, w, c, y + c * ROW_CHUNK, ldy, n1 - c * ROW_CHUNK, stream); \
            }                                                                                        \
            if (stream) _mm_sfence();                                                                \
        }                                                                                            \
        return 0;                                                                                    \
    }                                                                                                \
    /* rows ids of a weight packed by gguf_pack_<type>, dequantized as gguf_get_rows_<type> */     \
    void gguf_get_rows_##NAME##_packed(const uint8_t *w, int64_t K, const int64_t *ids, int64_t n_ids, float *out) { \
        for (int64_t n = 0; n < n_ids; n++) {                                                        \
            const struct packed_rows p = packed_chunk_at(TYPE, w, K, ids[n] / PACK_ROWS);            \
            const int64_t r = ids[n] % PACK_ROWS;                                                    \
            for (int64_t e = 0; e < K; e++) {                                                        \
                const int64_t i = e / QX, g = e % QX / 4, at = e / (QX / scales_a_block(TYPE)) * PACK_ROWS + r; \
                const uint8_t byte = nibbles_kept(TYPE) ? p.q[((i / 2 * 8 + g) * PACK_ROWS + r) * 4 + e % 4] \
                                                        : p.q[((i * 8 + g) * PACK_ROWS + r) * 4 + e % 4]; \
                const int v = (nibbles_kept(TYPE) ? (i % 2 ? byte >> 4 : byte & 0xF) : byte) - packed_offset(TYPE); \
                out[n * K + e] = p.dl[at] * (float)v - (has_mins(TYPE) ? p.ml[at] : 0.0f);          \
            }                                                                                        \
        }                                                                                            \
    }

PACKED_KQUANT(q4_k, Q4_K, 144)
PACKED_KQUANT(q6_k, Q6_K, 210)
