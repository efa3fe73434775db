/* Products with a GGUF's 32-element block types (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 IQ4_NL) read in place,
 * straight from the file's mapping, on an x86-64 CPU with AVX2 + FMA (gpu/kernels/__init__.py
 * builds it; the C API is issue 28's: gguf_get_rows_TYPE, gguf_gemm_TYPE_f32, gguf_gemm_TYPE_q8;
 * on AVX512-VNNI, for weights packed once at load, gguf_pack_TYPE, gguf_gemm_TYPE_packed_q8 and
 * an MLP's act(gate) * up in one product, gguf_gemm_TYPE_packed_q8_gated).
 *
 * Layouts (the file's, as gguf-py's quants.py reads them). A weight is N rows of K / 32 blocks,
 * back to back; a block starts with its fp16 scale d, then (bytes, little endian):
 *   Q4_0   d | qs[16]                 w = d * (q - 8)      q: nibbles
 *   Q4_1   d | m (fp16) | qs[16]      w = d * q + m
 *   Q5_0   d | qh (u32) | qs[16]      w = d * (q - 16)     q: nibble | bit j of qh << 4
 *   Q5_1   d | m | qh | qs[16]        w = d * q + m
 *   Q8_0   d | qs[32] (int8)          w = d * q
 *   IQ4_NL d | qs[16]                 w = d * IQ4_NL_VALUES[nibble]
 * with element j < 16 in the low nibble of byte j and element j + 16 in its high nibble.
 * Every type is first unpacked to 32 int8 v (values below) so that w = d * v (+ m): one
 * dequantization and one integer product serve all six types. Blocks are 18-34 bytes, so
 * every load of w is unaligned; w is never written (a PROT_READ mapping).
 *
 * Numerics. get_rows and the _f32 products: v is exact as an int8 and as a float, d * v exact
 * too (an 11-bit fp16 d times an at most 8-bit v fits float32's 24 bits), + m one rounded sum:
 * numpy's (d * q) + m in gguf-py's dequantize, the same float32 values bit for bit (whether or
 * not the compiler fuses the two into an FMA). The _f32 products then differ from
 * dequantize-then-matmul only in the order of their sums.
 * The _q8 products are llama.cpp's arithmetic: x is quantized once per call per block of 32 to
 * int8 xq with an fp32 scale xd = amax / 127 (xq = x * (127 / amax) rounded to nearest even, as
 * llama.cpp's AVX2 quantize_row_q8_0; amax 0 gives 0), and for the types with a min also
 * xs = xd * sum(xq) (llama.cpp's Q8_1), so that a block's product is
 *     d xd sum_j v_j xq_j  (+ m xs)
 * with the sum an exact integer: uint8 x int8 products of 4 bytes summed into int32 lanes, by
 * AVX512-VNNI's vpdpbusd where the CPU has it, else AVX-VNNI's (chosen at run time), else AVX2's
 * maddubs (pairs into int16) then madd with ones. The unsigned operand is the block's codes
 * u = v + o (o: 8 for Q4_0, 16 for Q5_0, 128 for Q8_0 and IQ4_NL, 0 for the types with a min),
 * the sum started at -o sum(xq), computed with x's quantization. maddubs' int16 pairs would
 * saturate on 2 * 255 * 127, so on AVX2 Q8_0 and IQ4_NL put |v| there instead and v's signs onto xq
 * (_mm256_sign_epi8; at most 2 * 128 * 127). The result differs from the _f32 product by x's
 * rounding (at most amax / 254 per element) and the order of the float sums.
 *
 * Work split: rows in chunks of ROW_CHUNK over the OpenMP threads. The _q8 products take a
 * few rows together (ROW_TILE or half) and x in one of three layouts by the number of tokens
 * (x quantized into it): one token (decode), x's block loaded once for the rows
 * (rows_one_token); up to 2 * MAX_PAIRS tokens in pairs, a pair in the two 128-bit halves
 * (rows_pairs); more in tiles of X_TILE tokens, one token a vector lane (rows_tile), or, on
 * AVX-512, with ROW_CHUNK rows repacked side by side, one row a lane (rows_packed). The
 * more tokens, the more of them share a block's unpacking and each float scale-and-add.
 * The _f32 products take tokens TILE at a time, each block dequantized once per tile.
 */
#include <immintrin.h>
#include "simd_math.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
#define TILE 4        /* tokens an f32 product takes together: 8 sums + 4 weight vectors fit the 16 ymm registers */
#define ROW_CHUNK 16  /* rows a thread takes at a time */
#define ROW_TILE 4    /* rows a q8 product takes together */
#define X_TILE 16     /* tokens a q8 product takes together (more than 2 * MAX_PAIRS): two halves of 8 lanes */
#define PREFETCH_BYTES 4096 /* how far ahead (at least) a one-token q8 product prefetches w: measured */
#define MAX_PAIRS 4   /* up to 2 * MAX_PAIRS tokens a q8 product takes them in pairs (faster than a tile: measured) */

enum block_type { Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL };

static const int8_t IQ4_NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static inline __attribute__((always_inline)) int64_t block_bytes(int type) {
    switch (type) {
    case Q4_0: case IQ4_NL: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    default: return 34;  /* Q8_0 */
    }
}

static inline __attribute__((always_inline)) int has_min(int type) { return type == Q4_1 || type == Q5_1; }

/* the fp16 at p in every lane (a broadcast load and one conversion) */
static inline __m256 fp16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _mm256_cvtph_ps(_mm_set1_epi16((int16_t)h));
}

/* 16 bytes of nibbles -> 32 bytes: elements 0..15 (low nibbles) then 16..31 (high nibbles) */
static inline __m256i nibbles(const uint8_t *qs) {
    const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    return _mm256_and_si256(_mm256_srlv_epi64(both, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0x0F));
}

/* bit j of the 32 bits at p -> 0xFF in byte j, else 0 */
static inline __m256i bit_bytes(const uint8_t *p) {
    uint32_t bits;
    memcpy(&bits, p, sizeof bits);
    const __m256i spread = _mm256_shuffle_epi8(  /* byte j holds byte j / 8 of bits */
        _mm256_set1_epi32((int32_t)bits),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i select = _mm256_set1_epi64x((int64_t)0x8040201008040201);  /* bit j % 8 */
    return _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
}

/* IQ4_NL_VALUES in both 128-bit lanes, as a byte shuffle takes a table */
static inline __m256i iq4_nl_table(void) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_NL_VALUES));
}

/* the block's 32 values v (w = d * v + m): signed except Q4_1 and Q5_1's, which are 0..31 */
static inline __attribute__((always_inline)) __m256i values(int type, const uint8_t *b) {
    switch (type) {
    case Q4_0: return _mm256_sub_epi8(nibbles(b + 2), _mm256_set1_epi8(8));
    case Q4_1: return nibbles(b + 4);
    /* q - 16 as an int8: the nibble with 0xF0 above it where bit 4 is clear */
    case Q5_0: return _mm256_or_si256(nibbles(b + 6), _mm256_andnot_si256(bit_bytes(b + 2), _mm256_set1_epi8((char)0xF0)));
    case Q5_1: return _mm256_or_si256(nibbles(b + 8), _mm256_and_si256(bit_bytes(b + 4), _mm256_set1_epi8(0x10)));
    case IQ4_NL: return _mm256_shuffle_epi8(iq4_nl_table(), nibbles(b + 2));
    default: return _mm256_loadu_si256((const __m256i *)(b + 2));  /* Q8_0 */
    }
}

/* v as unsigned codes u = v + code_offset (bytes, wrapping): what the integer products take */
static inline __attribute__((always_inline)) int code_offset(int type) {
    switch (type) {
    case Q4_0: return 8;
    case Q5_0: return 16;
    case Q8_0: case IQ4_NL: return 128;
    default: return 0;
    }
}

/* + 16 in byte j where bit j of the 32 bits at p is set: AVX-512's mask registers take the 32
 * bits as they are (two instructions, against bit_bytes' five). In asm, as dpbusd below; k1 is
 * not declared clobbered because gcc refuses that without AVX-512 enabled, and then allocates
 * no mask register of its own (nor does an ABI call keep one: they are call-clobbered). */
#ifdef __AVX512F__
#error "built with AVX-512 enabled, gcc may use k1: declare it clobbered in add_fifth_bits"
#endif
static inline __m256i add_fifth_bits(__m256i u, const uint8_t *p) {
    __asm__("kmovd %[bits], %%k1\n\tvpaddb %[sixteen], %[u], %[u]%{%%k1%}"
            : [u] "+x"(u)
            : [bits] "m"(*(const uint32_t(*)[1])p), [sixteen] "x"(_mm256_set1_epi8(16)));
    return u;
}

/* avx512: the CPU has AVX512-BW and VL (the VNNI path) */
static inline __attribute__((always_inline)) __m256i codes(int type, int avx512, const uint8_t *b) {
    switch (type) {
    case Q4_0: return nibbles(b + 2);
    case Q5_0:
        return avx512 ? add_fifth_bits(nibbles(b + 6), b + 2)
                      : _mm256_or_si256(nibbles(b + 6), _mm256_and_si256(bit_bytes(b + 2), _mm256_set1_epi8(0x10)));
    case Q5_1: return avx512 ? add_fifth_bits(nibbles(b + 8), b + 4) : values(type, b);
    case Q4_1: return values(type, b);
    case IQ4_NL: /* the table's codes: a constant, out of the loops */
        return _mm256_shuffle_epi8(_mm256_xor_si256(iq4_nl_table(), _mm256_set1_epi8((char)0x80)), nibbles(b + 2));
    default: return _mm256_xor_si256(values(type, b), _mm256_set1_epi8((char)0x80));  /* Q8_0 */
    }
}

/* the block's 32 weights as gguf-py's dequantize gives them, 8 at a time */
static inline __attribute__((always_inline)) void dequantize(int type, const uint8_t *b, __m256 w[4]) {
    const __m256i v = values(type, b);
    const __m256 d = fp16_at(b);
    const __m128i halves[2] = {_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)};
    for (int i = 0; i < 4; i++) {
        const __m128i eight = i % 2 ? _mm_srli_si128(halves[i / 2], 8) : halves[i / 2];
        w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)));
        if (has_min(type)) w[i] = _mm256_add_ps(w[i], fp16_at(b + 2));
    }
}

static inline __attribute__((always_inline)) void get_rows(int type, const uint8_t *w, int64_t K,
                                                           const int64_t *ids, int64_t n_ids, float *out) {
    const int64_t nb = K / QK, row_bytes = nb * block_bytes(type);
    for (int64_t i = 0; i < n_ids; i++) {
        const uint8_t *row = w + ids[i] * row_bytes;
        for (int64_t b = 0; b < nb; b++) {
            __m256 v[4];
            dequantize(type, row + b * block_bytes(type), v);
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + i * K + b * QK + 8 * j, v[j]);
        }
    }
}

/* y[t, n] for t < tt (a constant at each call: the token loops unroll, the sums stay in
 * registers), one row, x as it is */
static inline __attribute__((always_inline)) void row_tile_f32(int type, int tt, const float *x, int64_t K,
                                                               const uint8_t *row, float *y, int64_t ldy) {
    const int64_t nb = K / QK;
    __m256 acc[TILE][2];
    for (int t = 0; t < tt; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256 w[4];
        dequantize(type, row + b * block_bytes(type), w);
        for (int t = 0; t < tt; t++) {
            const float *xb = x + t * K + b * QK;
            acc[t][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xb), acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb + 8), acc[t][1]);
            acc[t][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), acc[t][1]);
        }
    }
    for (int t = 0; t < tt; t++) y[t * ldy] = hsum(_mm256_add_ps(acc[t][0], acc[t][1]));
}

/* x quantized: per block of 32, int8 xq, scale xd, xs = xd * sum(xq) and, for codes with an
 * offset o, corrections that take the codes' sum u xq back to sum v xq (v = u - o) in the
 * integer product's lanes. Three layouts (enum x_layout):
 * - one token: q [K]; d, s [K / 32]; c [K / 32, 8]: -o * (sum of xq's bytes 4 i .. 4 i + 3)
 * - pairs of tokens (T padded to even): q [T / 2, K / 32, 2, 2, 16]: the block's groups 0..3 of
 *   both tokens, then groups 4..7 (a group: 4 bytes); d [T / 2, K / 32, 8]: each token's xd 4
 *   times; s likewise, xs then 3 zeros; c [T / 2, K / 32, 8]: lane i of token h (4 h + i):
 *   -o * (sum of groups i and i + 4)
 * - tiles of X_TILE tokens (T padded with zeros): q [T / X_TILE, K / 32, 8, X_TILE, 4], a
 *   block's 4-byte group g of the tile's tokens side by side; d, s, c [T / X_TILE, K / 32,
 *   X_TILE], c: -o * sum(xq) */
enum x_layout { ONE_TOKEN, PAIRS, TILES };

static inline enum x_layout q8_layout(int64_t T) { return T == 1 ? ONE_TOKEN : T <= 2 * MAX_PAIRS ? PAIRS : TILES; }

struct q8_activations {
    int8_t *q;
    float *d, *s;
    int32_t *c;
    int vnni;  /* the product's instruction (enum vnni): a constant at each call (specializes the kernels) */
};

/* The q8 products' integer instruction: AVX2's maddubs; AVX512-VNNI's vpdpbusd on ymm, the
 * fifth bits unpacked through AVX-512BW's mask registers; AVX-VNNI's (its VEX encoding), the
 * blocks unpacked as on AVX2. */
enum vnni { NO_VNNI = 0, VNNI_EVEX = 1, VNNI_VEX = 2 };

/* the code offset the product corrects for with a.c: VNNI's products take every type's codes
 * (no int16 step to saturate); AVX2's maddubs would saturate on 255 * 127 pairs, so Q8_0 and
 * IQ4_NL go through signs there instead */
static inline __attribute__((always_inline)) int corrected_offset(int type, int vnni) {
    return vnni || code_offset(type) <= 16 ? code_offset(type) : 0;
}

/* token t of x [T, K] into a, in the given layout (t >= T: padding, all zeros) */
static void quantize_token(const float *x, int64_t T, int64_t K, int64_t t, struct q8_activations a, int offset,
                           enum x_layout layout) {
    const int64_t nb = K / QK;
    static const float zeros[QK];
    for (int64_t b = 0; b < nb; b++) {
        float d;
        int32_t sum;
        const __m256i packed = quantize_block_q8(t < T ? x + t * K + b * QK : zeros, &d, &sum);
        const __m256i group_sums =
            _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8((char)offset), packed), _mm256_set1_epi16(1));
        if (layout == TILES) {
            const int64_t block = t / X_TILE * nb + b, at = block * X_TILE + t % X_TILE;
            int8_t bytes[QK];
            _mm256_storeu_si256((__m256i *)bytes, packed);
            for (int g = 0; g < QK / 4; g++) memcpy(a.q + (block * QK / 4 + g) * X_TILE * 4 + t % X_TILE * 4, bytes + 4 * g, 4);
            a.d[at] = d;
            a.s[at] = d * (float)sum;
            a.c[at] = -offset * sum;
        } else if (layout == PAIRS) {
            const int64_t block = t / 2 * nb + b, h = t % 2;
            _mm_storeu_si128((__m128i *)(a.q + block * 2 * QK + 16 * h), _mm256_castsi256_si128(packed));
            _mm_storeu_si128((__m128i *)(a.q + block * 2 * QK + QK + 16 * h), _mm256_extracti128_si256(packed, 1));
            _mm_storeu_ps(a.d + 8 * block + 4 * h, _mm_set1_ps(d));
            _mm_storeu_ps(a.s + 8 * block + 4 * h, _mm_set_ss(d * (float)sum));
            const __m128i lane_sums = _mm_add_epi32(_mm256_castsi256_si128(group_sums), _mm256_extracti128_si256(group_sums, 1));
            _mm_storeu_si128((__m128i *)(a.c + 8 * block + 4 * h), _mm_sub_epi32(_mm_setzero_si128(), lane_sums));
        } else {
            _mm256_storeu_si256((__m256i *)(a.q + b * QK), packed);
            a.d[b] = d;
            a.s[b] = d * (float)sum;
            _mm256_storeu_si256((__m256i *)(a.c + 8 * b), _mm256_sub_epi32(_mm256_setzero_si256(), group_sums));
        }
    }
}

/* one block's integer product: sum_j v_j xq_j in 8 int32 lanes (lane i: bytes 4 i .. 4 i + 3)
 * from the codes (or values) u and their magnitudes (unpack_q8); start: the corrections */
static inline __attribute__((always_inline)) __m256i block_dot(int type, int vnni, __m256i u, __m256i magnitude,
                                                                __m256i xq, __m256i start) {
    const int corrected = corrected_offset(type, vnni) || has_min(type);
    const __m256i signed_xq = corrected ? xq : _mm256_sign_epi8(xq, u);
    if (vnni == VNNI_EVEX) return dpbusd(start, magnitude, signed_xq);
    if (vnni == VNNI_VEX) return dpbusd_vex(start, magnitude, signed_xq);
    return _mm256_add_epi32(start, _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_xq), _mm256_set1_epi16(1)));
}

/* block b of a row: its codes as the product takes them, their magnitudes, its scale */
struct unpacked {
    __m256i u, magnitude;
    __m256 d;
};

static inline __attribute__((always_inline)) struct unpacked unpack_q8(int type, int vnni, const uint8_t *blk) {
    /* the codes go in as they are where corrected for, else signed values: |v| and signs onto x */
    const int corrected = corrected_offset(type, vnni) || has_min(type);
    const __m256i u = corrected ? codes(type, vnni == VNNI_EVEX, blk) : values(type, blk);
    return (struct unpacked){u, corrected ? u : _mm256_sign_epi8(u, u), fp16_at(blk)}; /* -128 reads as 128 */
}

/* y[n + r] for r < R rows (row_bytes apart from row) at one token, R a constant at each
 * call: each block of x (values, corrections, scale) loaded once for the R rows, and R
 * independent chains of FMAs (a row at a time measured 5-15% slower). The R rows, read a block
 * of each in turn, are R streams the hardware prefetcher does not follow (a 178 MB weight ran at
 * a quarter of a plain read's speed, slower than the _f32 product's one row at a time): w is
 * prefetched linearly, whole tiles of R rows ahead, this block's share of a later tile. */
static inline __attribute__((always_inline)) void rows_one_token(int type, int R, struct q8_activations a, int64_t K,
                                                                 const uint8_t *row, int64_t row_bytes, float *y) {
    const int64_t nb = K / QK;
    __m256 acc[ROW_TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const int64_t tile_bytes = R * row_bytes, ahead = (PREFETCH_BYTES / tile_bytes + 1) * tile_bytes;
    for (int64_t b = 0; b < nb; b++) {
        const __m256i xq = _mm256_loadu_si256((const __m256i *)(a.q + b * QK));
        const __m256i start = corrected_offset(type, a.vnni) ? _mm256_loadu_si256((const __m256i *)(a.c + 8 * b))
                                                             : _mm256_setzero_si256();
        const __m256 xd = _mm256_broadcast_ss(a.d + b);
        for (int line = 0; line < R * block_bytes(type); line += 64)  /* a constant count: unrolled */
            _mm_prefetch((const char *)row + ahead + b * R * block_bytes(type) + line, _MM_HINT_T0);
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = row + r * row_bytes + b * block_bytes(type);
            const struct unpacked w = unpack_q8(type, a.vnni, blk);
            const __m256i sum = block_dot(type, a.vnni, w.u, w.magnitude, xq, start);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(w.d, xd), acc[r]);
            if (has_min(type)) /* + m xs, in lane 0 only */
                acc[r] = _mm256_fmadd_ps(fp16_at(blk + 2), _mm256_zextps128_ps256(_mm_load_ss(a.s + b)), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) y[r] = hsum(acc[r]);
}

/* y[t, n + r] for t < tokens (<= 8 * halves, the rest padding) and r < R rows, at a tile of
 * X_TILE tokens (a: its first, tiled layout). Lane t of half h is token 8 h + t: each 4-byte
 * group of the block's codes, broadcast, meets the tokens' same group in one integer product,
 * so a block's 8 sums come out in one vector and one conversion, scale product and FMA serve 8
 * tokens, and the block's unpacking and broadcasts the 16 of both halves (a token at a time,
 * these were most of the instructions: measured 1.5-2x slower at 64 tokens). */
static inline __attribute__((always_inline)) void rows_tile(int type, int R, int halves, struct q8_activations a,
                                                            int64_t K, const uint8_t *row, int64_t row_bytes,
                                                            float *y, int64_t ldy, int64_t tokens) {
    const int64_t nb = K / QK;
    __m256 acc[ROW_TILE][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *xb = a.q + b * X_TILE * QK;
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = row + r * row_bytes + b * block_bytes(type);
            const struct unpacked w = unpack_q8(type, a.vnni, blk);
            __m256i sum[2][2];  /* [half][chain]: two chains of integer products at one half */
            for (int h = 0; h < halves; h++) {
                sum[h][0] = corrected_offset(type, a.vnni) ? _mm256_loadu_si256((const __m256i *)(a.c + b * X_TILE + 8 * h))
                                                           : _mm256_setzero_si256();
                sum[h][1] = _mm256_setzero_si256();
            }
            for (int g = 0; g < QK / 4; g++) {
                const __m256i group = _mm256_set1_epi32(g);  /* one shuffle broadcasts a group */
                const __m256i u = _mm256_permutevar8x32_epi32(w.u, group);
                const __m256i magnitude = _mm256_permutevar8x32_epi32(w.magnitude, group);
                for (int h = 0; h < halves; h++)
                    sum[h][g % 2] = block_dot(type, a.vnni, u, magnitude,
                                              _mm256_loadu_si256((const __m256i *)(xb + (g * X_TILE + 8 * h) * 4)),
                                              sum[h][g % 2]);
            }
            for (int h = 0; h < halves; h++) {
                const __m256 xd = _mm256_loadu_ps(a.d + b * X_TILE + 8 * h);
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(sum[h][0], sum[h][1])),
                                            _mm256_mul_ps(w.d, xd), acc[r][h]);
                if (has_min(type))
                    acc[r][h] = _mm256_fmadd_ps(fp16_at(blk + 2), _mm256_loadu_ps(a.s + b * X_TILE + 8 * h), acc[r][h]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        float per_token[X_TILE];
        for (int h = 0; h < halves; h++) _mm256_storeu_ps(per_token + 8 * h, acc[r][h]);
        for (int t = 0; t < tokens; t++) y[t * ldy + r] = per_token[t];
    }
}

static inline float hsum128(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[t, n + r] for t < tokens (<= 2 * pairs, the rest padding) and r < R rows, x in pairs: one
 * vector holds groups 0..3 of both tokens of a pair, another groups 4..7, and the block's codes
 * go in as two vectors, groups 0..3 and 4..7 in both halves: two integer products give a pair
 * its sums (half h: token h), and one conversion, scale product and FMA serve both tokens. The
 * block is unpacked once for all the pairs (a token at a time it was unpacked for each, and
 * a tile of 8 or 16 lanes pays for its padding). */
static inline __attribute__((always_inline)) void rows_pairs(int type, int R, int pairs, struct q8_activations a,
                                                             int64_t K, const uint8_t *row, int64_t row_bytes,
                                                             float *y, int64_t ldy, int64_t tokens) {
    const int64_t nb = K / QK;
    __m256 acc[ROW_TILE][MAX_PAIRS];
    for (int r = 0; r < R; r++)
        for (int p = 0; p < pairs; p++) acc[r][p] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = row + r * row_bytes + b * block_bytes(type);
            const struct unpacked w = unpack_q8(type, a.vnni, blk);
            const __m256i u_low = _mm256_permute4x64_epi64(w.u, 0x44), u_high = _mm256_permute4x64_epi64(w.u, 0xEE);
            const __m256i m_low = _mm256_permute4x64_epi64(w.magnitude, 0x44);
            const __m256i m_high = _mm256_permute4x64_epi64(w.magnitude, 0xEE);
            for (int p = 0; p < pairs; p++) {
                const int64_t block = p * nb + b;
                const int8_t *xb = a.q + block * 2 * QK;
                const __m256i start = corrected_offset(type, a.vnni)
                                          ? _mm256_loadu_si256((const __m256i *)(a.c + 8 * block))
                                          : _mm256_setzero_si256();
                const __m256i low = block_dot(type, a.vnni, u_low, m_low, _mm256_loadu_si256((const __m256i *)xb), start);
                const __m256i sum =
                    block_dot(type, a.vnni, u_high, m_high, _mm256_loadu_si256((const __m256i *)(xb + QK)), low);
                acc[r][p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(w.d, _mm256_loadu_ps(a.d + 8 * block)),
                                            acc[r][p]);
                if (has_min(type)) acc[r][p] = _mm256_fmadd_ps(fp16_at(blk + 2), _mm256_loadu_ps(a.s + 8 * block), acc[r][p]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int p = 0; p < pairs; p++) {
            y[2 * p * ldy + r] = hsum128(_mm256_castps256_ps128(acc[r][p]));
            if (2 * p + 1 < tokens) y[(2 * p + 1) * ldy + r] = hsum128(_mm256_extractf128_ps(acc[r][p], 1));
        }
}

/* rows [n0, n1), all tokens, in x's layout (q8_layout's for T, or tiles where the packed
 * products were chosen): ROW_TILE rows at a time, or half as many where the sums of more
 * tokens take the registers (3-4 pairs, both halves of a tile) */
static inline __attribute__((always_inline)) void rows_q8(int type, struct q8_activations a, enum x_layout layout,
                                                          int64_t T, int64_t K, const uint8_t *w, float *y,
                                                          int64_t ldy, int64_t n0, int64_t n1) {
    const int64_t nb = K / QK, row_bytes = nb * block_bytes(type);
    if (layout == ONE_TOKEN) {
        int64_t n = n0;
        for (; n + ROW_TILE <= n1; n += ROW_TILE) rows_one_token(type, ROW_TILE, a, K, w + n * row_bytes, row_bytes, y + n);
        for (; n < n1; n++) rows_one_token(type, 1, a, K, w + n * row_bytes, row_bytes, y + n);
        return;
    }
    if (layout == PAIRS) {
        int64_t n = n0;
#define PAIRS_CASE(PAIRS, R)                                                                                        \
    case PAIRS:                                                                                                    \
        for (; n + R <= n1; n += R) rows_pairs(type, R, PAIRS, a, K, w + n * row_bytes, row_bytes, y + n, ldy, T);  \
        for (; n < n1; n++) rows_pairs(type, 1, PAIRS, a, K, w + n * row_bytes, row_bytes, y + n, ldy, T);          \
        break;
        switch ((T + 1) / 2) { PAIRS_CASE(1, ROW_TILE) PAIRS_CASE(2, ROW_TILE) PAIRS_CASE(3, ROW_TILE / 2) PAIRS_CASE(4, ROW_TILE / 2) }
#undef PAIRS_CASE
        return;
    }
    for (int64_t t0 = 0; t0 < T; t0 += X_TILE) {
        const struct q8_activations at = {a.q + t0 * K, a.d + t0 * nb, a.s + t0 * nb, a.c + t0 * nb, a.vnni};
        const int64_t tokens = T - t0 < X_TILE ? T - t0 : X_TILE;
        float *yt = y + t0 * ldy;
        int64_t n = n0;
        if (tokens > 8) {
            for (; n + ROW_TILE / 2 <= n1; n += ROW_TILE / 2)
                rows_tile(type, ROW_TILE / 2, 2, at, K, w + n * row_bytes, row_bytes, yt + n, ldy, tokens);
            for (; n < n1; n++) rows_tile(type, 1, 2, at, K, w + n * row_bytes, row_bytes, yt + n, ldy, tokens);
        } else {
            for (; n + ROW_TILE <= n1; n += ROW_TILE)
                rows_tile(type, ROW_TILE, 1, at, K, w + n * row_bytes, row_bytes, yt + n, ldy, tokens);
            for (; n < n1; n++) rows_tile(type, 1, 1, at, K, w + n * row_bytes, row_bytes, yt + n, ldy, tokens);
        }
    }
}

/* Many tokens on AVX-512 (VNNI, 512-bit vectors): a thread's ROW_CHUNK rows are repacked
 * (PACK_ROWS, one int32 lane each), so that one vector holds a block's 4-byte group g of all 16
 * rows, and each token's same group, broadcast from x's tiled layout (a broadcast load: no
 * shuffle), meets them in one vpdpbusd. A block of a row is unpacked once for all the tokens
 * instead of once a tile of X_TILE, the 16 rows' scales come in one vector, and eight tokens'
 * sums are eight independent chains (past PACKED_FROM tokens, x then quantized in the tiled
 * layout whatever T). Sums in the same order as rows_tile (each block's integer sum, times d
 * xd, added in block order), so the results are bit for bit the same. Built for AVX-512 by its
 * target attribute alone (the file is not: see add_fifth_bits), and called only where
 * vnni_available() is VNNI_EVEX. */
#define PACK_ROWS 16   /* rows a packed vector holds: one a 32-bit lane */
#define PACK_TOKENS 8  /* tokens a packed product takes together: 8 sums and 8 accumulators */
/* more tokens than this are packed: below 8 a weight held in the caches costs more to repack
 * than the packed product saves (measured; from 6 a weight read from memory gains) */
#define PACKED_FROM 7
#define AVX512_TARGET "avx512f,avx512bw,avx512vl,avx512vnni"
_Static_assert(PACK_ROWS == ROW_CHUNK, "a thread's chunk of rows is one packed set");

struct packed_rows {
    /* Q8_0: [nb, 8, PACK_ROWS, 4], block b's group g of each row (codes u, as unpack_q8 takes them);
     * the nibble types: [nb, 4, PACK_ROWS, 4], bytes 4 g .. 4 g + 3 of each row's qs, whose low
     * nibbles are group g and high nibbles group g + 4: the blocks' own bytes, half of Q8_0's */
    uint8_t *q;
    uint64_t *h;  /* Q5_0, Q5_1: [nb, 8], group g's fifth bits, bit 4 r + j of row r's element 4 g + j */
    uint16_t *d, *m;  /* [nb, PACK_ROWS]: each row's block scale, and min (Q4_1, Q5_1), fp16 as in the block */
};

static inline __attribute__((always_inline)) int has_fifth_bits(int type) { return type == Q5_0 || type == Q5_1; }

/* bytes of a block's codes in a packed chunk, per row */
static inline __attribute__((always_inline)) int packed_code_bytes(int type) { return type == Q8_0 ? QK : QK / 2; }

/* where the nibble types' qs and qh start in a block */
static inline __attribute__((always_inline)) int qs_at(int type) { return block_bytes(type) - QK / 2; }
static inline __attribute__((always_inline)) int qh_at(int type) { return has_min(type) ? 4 : 2; }

/* rows [0, rows) of w (rows <= PACK_ROWS) into p; the rows past them are zeros. The chunk's
 * rows are one run of memory, read once in order first (read_in_order); then a block at a
 * time: Q8_0's 16 rows' codes transposed 8 x 8 dwords by shuffles, the nibble types' qs moved
 * 4 bytes at a time, as they are, and the fifth bits regrouped into one 64-bit mask a group. */
static inline __attribute__((always_inline)) void pack_rows(int type, const uint8_t *w, int64_t nb, int64_t row_bytes,
                                                           int64_t rows, struct packed_rows p) {
    read_in_order(w, rows * row_bytes);
    for (int64_t b = 0; b < nb; b++) {
        __m256i half[2][8];
        uint64_t fifth[QK / 4] = {0};
        for (int r = 0; r < PACK_ROWS; r++) {
            uint16_t d = 0, m = 0;
            const uint8_t *blk = w + r * row_bytes + b * block_bytes(type);
            if (type == Q8_0) {
                half[r / 8][r % 8] = r < rows ? codes(type, 0, blk) : _mm256_setzero_si256();
            } else {
                for (int g = 0; g < QK / 8; g++) {
                    uint32_t four = 0;
                    if (r < rows) memcpy(&four, blk + qs_at(type) + 4 * g, 4);
                    memcpy(p.q + ((b * (QK / 8) + g) * PACK_ROWS + r) * 4, &four, 4);
                }
            }
            if (r < rows) {
                memcpy(&d, blk, sizeof d);
                if (has_min(type)) memcpy(&m, blk + 2, sizeof m);
                if (has_fifth_bits(type)) {
                    uint32_t qh;
                    memcpy(&qh, blk + qh_at(type), sizeof qh);
                    for (int g = 0; g < QK / 4; g++) fifth[g] |= (uint64_t)(qh >> (4 * g) & 0xF) << (4 * r);
                }
            }
            p.d[b * PACK_ROWS + r] = d;
            if (has_min(type)) p.m[b * PACK_ROWS + r] = m;
        }
        if (has_fifth_bits(type)) memcpy(p.h + b * (QK / 4), fifth, sizeof fifth);
        if (type != Q8_0) continue;
        transpose_8x8(half[0]); /* half[h][g] lane r: group g of row 8 h + r */
        transpose_8x8(half[1]);
        for (int g = 0; g < QK / 4; g++)
            for (int h = 0; h < 2; h++)
                _mm256_storeu_si256((__m256i *)(p.q + ((b * (QK / 4) + g) * PACK_ROWS + 8 * h) * 4), half[h][g]);
    }
}

/* block b's codes u of group g (Q8_0, or any type's codes unpacked to bytes: `as_bytes`) or
 * groups g and g + 4 (the nibble types: u[0], u[1]), all 16 rows */
static inline __attribute__((always_inline, target(AVX512_TARGET))) void packed_codes(int type, int as_bytes,
                                                                                      struct packed_rows p, int64_t b,
                                                                                      int g, __m512i u[2]) {
    if (type == Q8_0 || as_bytes) {
        u[0] = _mm512_loadu_si512(p.q + (b * (QK / 4) + g) * PACK_ROWS * 4);
        return;
    }
    const __m512i raw = _mm512_loadu_si512(p.q + (b * (QK / 8) + g) * PACK_ROWS * 4), low = _mm512_set1_epi8(0x0F);
    u[0] = _mm512_and_si512(raw, low);
    u[1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    if (has_fifth_bits(type)) {
        const __m512i sixteen = _mm512_set1_epi8(16);
        u[0] = _mm512_mask_add_epi8(u[0], _cvtu64_mask64(p.h[b * (QK / 4) + g]), u[0], sixteen);
        u[1] = _mm512_mask_add_epi8(u[1], _cvtu64_mask64(p.h[b * (QK / 4) + g + 4]), u[1], sixteen);
    }
    if (type == IQ4_NL) { /* the table's codes */
        const __m512i table = _mm512_broadcast_i32x4(_mm_xor_si128(_mm_loadu_si128((const __m128i *)IQ4_NL_VALUES),
                                                                   _mm_set1_epi8((char)0x80)));
        u[0] = _mm512_shuffle_epi8(table, u[0]);
        u[1] = _mm512_shuffle_epi8(table, u[1]);
    }
}

/* y[t, r] for the TT (a constant at each call: <= PACK_TOKENS) tokens of a tile's lanes from
 * `lane`, r < rows: x in the tiled layout (a: the tile's first token). `next_bytes` of `next`
 * (a later chunk's rows: nothing else asks for them while these products run) are prefetched,
 * a share at each block, into L2: into L1 they held up a weight streamed from memory (Gemma
 * 3's Q8_0 head at 1 token took 1.6x as long, at 32 1.08x). */
static inline __attribute__((always_inline, target(AVX512_TARGET))) void packed_tokens(
    int type, int as_bytes, int TT, struct packed_rows p, struct q8_activations a, int64_t nb, int lane, float *y,
    int64_t ldy, int64_t rows, const uint8_t *next, int64_t next_bytes, int stream) {
    const int bytes = type == Q8_0 || as_bytes;  /* a group's codes a vector: 8 groups a block */
    __m512 acc[PACK_TOKENS];
    for (int t = 0; t < TT; t++) acc[t] = _mm512_setzero_ps();
    const int64_t share = (next_bytes / nb + 63) / 64 * 64;
    for (int64_t b = 0; b < nb; b++) {
        for (int64_t line = b * share; line < (b + 1) * share && line < next_bytes; line += 64)
            _mm_prefetch((const char *)next + line, _MM_HINT_T2);
        const int64_t at = b * X_TILE + lane;  /* the first token's scale, sum and correction */
        const int32_t *xg = (const int32_t *)(a.q + b * X_TILE * QK) + lane;  /* its group 0 */
        __m512i sum[PACK_TOKENS];
        for (int t = 0; t < TT; t++)
            sum[t] = corrected_offset(type, 1) ? _mm512_set1_epi32(a.c[at + t]) : _mm512_setzero_si512();
        for (int g = 0; g < (bytes ? QK / 4 : QK / 8); g++) {
            __m512i u[2];
            packed_codes(type, as_bytes, p, b, g, u);
            for (int t = 0; t < TT; t++) sum[t] = _mm512_dpbusd_epi32(sum[t], u[0], _mm512_set1_epi32(xg[g * X_TILE + t]));
            if (!bytes)
                for (int t = 0; t < TT; t++)
                    sum[t] = _mm512_dpbusd_epi32(sum[t], u[1], _mm512_set1_epi32(xg[(g + 4) * X_TILE + t]));
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p.d + b * PACK_ROWS)));
        for (int t = 0; t < TT; t++) {
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[t]), _mm512_mul_ps(d, _mm512_set1_ps(a.d[at + t])), acc[t]);
            if (has_min(type))
                acc[t] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p.m + b * PACK_ROWS))),
                                         _mm512_set1_ps(a.s[at + t]), acc[t]);
        }
    }
    store_packed_rows(acc, TT, rows, y, ldy, stream);
}

/* y[t, r] for tokens t_first .. T - 1 (t_first a multiple of PACK_TOKENS) and the chunk's rows
 * (<= PACK_ROWS) in p, x in the tiled layout; each tile's products prefetch a share of `next`
 * (spread over the tiles rather than all in the first: Gemma 3's head at 32 tokens 1.02x).
 * `codes` (nb * QK * PACK_ROWS bytes, or NULL): where a nibble type's codes are unpacked to
 * bytes once for all of the tiles (a Q5_0 product from 128 tokens 1.07-1.15x); integer sums,
 * so the results do not change. */
static inline __attribute__((always_inline, target(AVX512_TARGET))) void packed_chunk(
    int type, struct packed_rows p, struct q8_activations a, int64_t t_first, int64_t T, int64_t nb, float *y,
    int64_t ldy, int64_t rows, const uint8_t *next, int64_t next_bytes, uint8_t *codes, int stream) {
    const int64_t tiles = (T - t_first + PACK_TOKENS - 1) / PACK_TOKENS;
    const int as_bytes = type != Q8_0 && codes != NULL && tiles > 2; /* at 2 tiles: no gain (measured) */
    if (as_bytes) { /* the nibble types' codes split (and their fifth bits added) once, not a tile at a time */
        for (int64_t b = 0; b < nb; b++)
            for (int g = 0; g < QK / 8; g++) {
                __m512i u[2];
                packed_codes(type, 0, p, b, g, u);
                _mm512_storeu_si512(codes + (b * (QK / 4) + g) * PACK_ROWS * 4, u[0]);
                _mm512_storeu_si512(codes + (b * (QK / 4) + g + QK / 8) * PACK_ROWS * 4, u[1]);
            }
        p.q = codes;
    }
    const int64_t part = (next_bytes / tiles + 63) / 64 * 64;
    for (int64_t t0 = t_first; t0 < T; t0 += PACK_TOKENS) {
        const int64_t tile = t0 / X_TILE, i = (t0 - t_first) / PACK_TOKENS;
        const int64_t left = next_bytes - i * part, ahead = left <= 0 ? 0 : left < part ? left : part;
        const struct q8_activations at = {a.q + tile * nb * X_TILE * QK, a.d + tile * nb * X_TILE,
                                          a.s + tile * nb * X_TILE, a.c + tile * nb * X_TILE, 1};
        const int lane = (int)(t0 % X_TILE);
#define TOKENS_CASE(B, TT) \
    case TT: packed_tokens(type, B, TT, p, at, nb, lane, y + t0 * ldy, ldy, rows, next + i * part, ahead, stream); break;
#define TOKENS_SWITCH(B)                                                                                           \
    switch (T - t0 < PACK_TOKENS ? T - t0 : PACK_TOKENS) {                                                         \
        TOKENS_CASE(B, 1) TOKENS_CASE(B, 2) TOKENS_CASE(B, 3) TOKENS_CASE(B, 4) TOKENS_CASE(B, 5) TOKENS_CASE(B, 6) \
        TOKENS_CASE(B, 7)                                                                                          \
        default: packed_tokens(type, B, PACK_TOKENS, p, at, nb, lane, y + t0 * ldy, ldy, rows, next + i * part, ahead, stream); \
    }
        if (as_bytes) {
            TOKENS_SWITCH(1)
        } else {
            TOKENS_SWITCH(0)
        }
#undef TOKENS_SWITCH
#undef TOKENS_CASE
    }
}

/* rows [n0, n1) (n1 - n0 <= PACK_ROWS), all T tokens, x in the tiled layout: packed here */
static inline __attribute__((always_inline, target(AVX512_TARGET))) void rows_packed(
    int type, struct q8_activations a, int64_t T, int64_t K, const uint8_t *w, float *y, int64_t ldy, int64_t n0,
    int64_t n1, struct packed_rows p, int stream) {
    const int64_t nb = K / QK, row_bytes = nb * block_bytes(type);
    pack_rows(type, w + n0 * row_bytes, nb, row_bytes, n1 - n0, p);
    packed_chunk(type, p, a, 0, T, nb, y + n0, ldy, n1 - n0, w + n1 * row_bytes, PACK_ROWS * row_bytes, NULL, stream);
}

/* A weight packed once (gguf_pack_<type>): its chunks of PACK_ROWS rows one after another, each
 * [codes q, fifth bits h, scales d (, mins m)] as struct packed_rows, the last chunk's missing
 * rows zeros. As many bytes as the blocks: the products read it as they read the blocks,
 * without unpacking them at every call. */
static inline int64_t packed_chunk_bytes(int type, int64_t nb) {
    return nb * (PACK_ROWS * (packed_code_bytes(type) + (int64_t)sizeof(uint16_t) * (1 + has_min(type))) +
                 has_fifth_bits(type) * (QK / 4) * (int64_t)sizeof(uint64_t));
}

static inline struct packed_rows packed_chunk_at(int type, const uint8_t *w, int64_t nb, int64_t c) {
    uint8_t *base = (uint8_t *)w + c * packed_chunk_bytes(type, nb);
    uint64_t *h = (uint64_t *)(base + nb * PACK_ROWS * packed_code_bytes(type));
    uint16_t *d = (uint16_t *)(h + has_fifth_bits(type) * nb * (QK / 4));
    return (struct packed_rows){base, has_fifth_bits(type) ? h : NULL, d, has_min(type) ? d + nb * PACK_ROWS : NULL};
}

/* The packed rows are kept between calls (one per OpenMP thread), as the quantized x is */
static __thread char *pack_scratch = NULL;
static __thread int64_t pack_scratch_bytes = 0;

static int packed_rows_for(int type, int64_t K, struct packed_rows *p) {
    const int64_t nb = K / QK;
    if (grown_scratch(&pack_scratch, &pack_scratch_bytes, packed_chunk_bytes(type, nb)) == NULL) return -1;
    *p = packed_chunk_at(type, (const uint8_t *)pack_scratch, nb, 0);
    return 0;
}

/* rows [n0, n1), all tokens, TILE at a time, x as it is */
static inline __attribute__((always_inline)) void rows_f32(int type, const float *x, int64_t T, int64_t K,
                                                           const uint8_t *w, float *y, int64_t ldy, int64_t n0,
                                                           int64_t n1) {
    const int64_t row_bytes = K / QK * block_bytes(type);
    for (int64_t t0 = 0; t0 < T; t0 += TILE)
        for (int64_t n = n0; n < n1; n++) {
            const float *xt = x + t0 * K;
            float *yt = y + t0 * ldy + n;
            const uint8_t *row = w + n * row_bytes;
            switch (T - t0 < TILE ? T - t0 : TILE) {
            case 4: row_tile_f32(type, 4, xt, K, row, yt, ldy); break;
            case 3: row_tile_f32(type, 3, xt, K, row, yt, ldy); break;
            case 2: row_tile_f32(type, 2, xt, K, row, yt, ldy); break;
            default: row_tile_f32(type, 1, xt, K, row, yt, ldy); break;
            }
        }
}

/* The quantized x is kept between calls (one per calling thread): a fresh one per call would
 * be mmap'ed and page-faulted in every time once it outgrows malloc's heap threshold (a
 * 2048-token prefill's x is 1-3 MB). */
static __thread char *q8_scratch = NULL;
static __thread int64_t q8_scratch_bytes = 0;

/* for T tokens (padded as the layout needs) */
static int q8_activations_for(int64_t T, int64_t K, struct q8_activations *a) {
    const int64_t blocks = T * (K / QK), need = blocks * (int64_t)(8 * sizeof(float) + 8 * sizeof(int32_t)) + T * K;
    if (grown_scratch(&q8_scratch, &q8_scratch_bytes, need) == NULL) return -1;
    a->d = (float *)q8_scratch;
    a->s = a->d + 4 * blocks;
    a->c = (int32_t *)(a->s + 4 * blocks);
    a->q = (int8_t *)(a->c + 8 * blocks);
    return 0;
}

/* The products' enum vnni on this CPU: AVX512-VNNI (and BW's mask registers) on 256-bit vectors,
 * else AVX-VNNI, where the CPU has them (a build with GGUF_Q32_AVX2_ONLY defined takes neither:
 * the tests' way to check the AVX2 path on such a CPU) */
static int vnni_available(void) {
#ifdef GGUF_Q32_AVX2_ONLY
    return NO_VNNI;
#else
    return cpu_has_avx512_vnni() ? VNNI_EVEX : cpu_has_avx_vnni() ? VNNI_VEX : NO_VNNI;
#endif
}

/* One set of functions per type, each parallel region written out in it with the type a
 * constant, so that each is compiled for its own block (an OpenMP region is outlined before
 * inlining: a type passed down into it would be a run-time value); likewise the two
 * instructions of the q8 products, one call each. */
#define CHUNKS(N) (((N) + ROW_CHUNK - 1) / ROW_CHUNK)
#define CHUNK_END(c, N) ((c) * ROW_CHUNK + ROW_CHUNK < (N) ? (c) * ROW_CHUNK + ROW_CHUNK : (N))

#define GGUF_KERNELS(NAME, TYPE)                                                                               \
    static __attribute__((target(AVX512_TARGET), noinline)) void packed_##NAME(                               \
        struct q8_activations a, int64_t T, int64_t K, const uint8_t *w, float *y, int64_t ldy, int64_t n0,    \
        int64_t n1, struct packed_rows p, int stream) {                                                        \
        rows_packed(TYPE, a, T, K, w, y, ldy, n0, n1, p, stream);                                              \
    }                                                                                                          \
    void gguf_get_rows_##NAME(const uint8_t *w, int64_t K, const int64_t *ids, int64_t n_ids, float *out) {    \
        get_rows(TYPE, w, K, ids, n_ids, out);                                                                 \
    }                                                                                                          \
    int gguf_gemm_##NAME##_f32(const float *x, int64_t T, int64_t K, const uint8_t *w, int64_t N, float *y,    \
                               int64_t ldy, int threads) {                                                     \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                      \
        for (int64_t c = 0; c < CHUNKS(N); c++)                                                                \
            rows_f32(TYPE, x, T, K, w, y, ldy, c * ROW_CHUNK, CHUNK_END(c, N));                                \
        return 0;                                                                                              \
    }                                                                                                          \
    int gguf_gemm_##NAME##_q8(const float *x, int64_t T, int64_t K, const uint8_t *w, int64_t N, float *y,     \
                              int64_t ldy, int threads) {                                                      \
        struct q8_activations a;                                                                               \
        if (T == 0) return 0;                                                                                  \
        const int vnni = vnni_available(), packs = vnni == VNNI_EVEX && T > PACKED_FROM;                       \
        const enum x_layout layout = packs ? TILES : q8_layout(T);                                             \
        const int64_t padded = layout == ONE_TOKEN ? 1 : layout == PAIRS ? (T + 1) / 2 * 2                     \
                                                                         : (T + X_TILE - 1) / X_TILE * X_TILE; \
        if (q8_activations_for(padded, K, &a) != 0) return -1;                                                 \
        /* the packed products read the T tokens only, not a tile's padding */                              \
        const int64_t quantized = packs ? T : padded;                                                          \
        const int offset = corrected_offset(TYPE, vnni);                                                       \
        const int stream = packs && streams_output(T, N, N * (K / QK) * block_bytes(TYPE));                    \
        _Pragma("omp parallel num_threads(threads)")                                                           \
        {                                                                                                      \
            struct packed_rows packed;                                                                         \
            const int pack = packs && packed_rows_for(TYPE, K, &packed) == 0;                                  \
            _Pragma("omp for schedule(static)")                                                                \
            for (int64_t t = 0; t < quantized; t++) quantize_token(x, T, K, t, a, offset, layout);           \
            _Pragma("omp for schedule(static)")                                                                \
            for (int64_t c = 0; c < CHUNKS(N); c++) {                                                          \
                if (pack)                                                                                      \
                    packed_##NAME(a, T, K, w, y, ldy, c * ROW_CHUNK, CHUNK_END(c, N), packed, stream);         \
                else if (vnni == VNNI_EVEX)                                                                    \
                    rows_q8(TYPE, (struct q8_activations){a.q, a.d, a.s, a.c, VNNI_EVEX}, layout, T, K, w, y,  \
                            ldy, c * ROW_CHUNK, CHUNK_END(c, N));                                              \
                else if (vnni == VNNI_VEX)                                                                     \
                    rows_q8(TYPE, (struct q8_activations){a.q, a.d, a.s, a.c, VNNI_VEX}, layout, T, K, w, y,   \
                            ldy, c * ROW_CHUNK, CHUNK_END(c, N));                                              \
                else                                                                                           \
                    rows_q8(TYPE, (struct q8_activations){a.q, a.d, a.s, a.c, NO_VNNI}, layout, T, K, w, y,    \
                            ldy, c * ROW_CHUNK, CHUNK_END(c, N));                                              \
            }                                                                                                  \
            if (stream) _mm_sfence();                                                                          \
        }                                                                                                      \
        return 0;                                                                                              \
    }

GGUF_KERNELS(q4_0, Q4_0)
GGUF_KERNELS(q4_1, Q4_1)
GGUF_KERNELS(q5_0, Q5_0)
GGUF_KERNELS(q5_1, Q5_1)
GGUF_KERNELS(q8_0, Q8_0)
GGUF_KERNELS(iq4_nl, IQ4_NL)

/* Weights packed once, at load (gpu/quant/blocks.py), where gguf_q32_packs(): the products read
 * chunks laid out as they use them and the same size as the blocks, instead of unpacking 16
 * rows of blocks at every call, and take any number of tokens. */
int gguf_q32_packs(void) { return vnni_available() == VNNI_EVEX; }

#define PACKED_AHEAD 2 /* chunks ahead of its products a packed weight's are prefetched: measured */

/* Many tokens: the products run over x a block of tokens at a time, each thread over its rows,
 * so that the block's quantized x stays in L2 while every chunk of rows meets it; the whole x
 * (1.8 MB at 2048 tokens of K = 640) was read again from L3 for each chunk of 16 rows */
#define X_BLOCK_BYTES (256 * 1024)
static inline int64_t x_block_tokens(int64_t K) {
    const int64_t per_token = K + K / QK * (2 * (int64_t)sizeof(float) + (int64_t)sizeof(int32_t));
    const int64_t tokens = X_BLOCK_BYTES / per_token / X_TILE * X_TILE;
    return tokens > X_TILE ? tokens : X_TILE;
}

/* A chunk's codes unpacked to bytes (packed_chunk), kept between calls (one per OpenMP thread);
 * NULL where it could not be allocated: the products then unpack a tile at a time, with the
 * same results */
static __thread char *codes_scratch = NULL;
static __thread int64_t codes_scratch_bytes = 0;

static uint8_t *codes_for(int type, int64_t nb) {
    return type == Q8_0 ? NULL : (uint8_t *)grown_scratch(&codes_scratch, &codes_scratch_bytes, nb * QK * PACK_ROWS);
}

/* row r of a packed chunk, dequantized as get_rows does the blocks (gguf-py's values) */
static inline __attribute__((always_inline)) void packed_row(int type, struct packed_rows p, int64_t nb, int64_t r,
                                                             float *out) {
    for (int64_t b = 0; b < nb; b++) {
        const float d = _cvtsh_ss(p.d[b * PACK_ROWS + r]), m = has_min(type) ? _cvtsh_ss(p.m[b * PACK_ROWS + r]) : 0;
        for (int e = 0; e < QK; e++) {
            int code;
            if (type == Q8_0) {
                code = p.q[((b * (QK / 4) + e / 4) * PACK_ROWS + r) * 4 + e % 4];
            } else {
                const uint8_t byte = p.q[((b * (QK / 8) + e % 16 / 4) * PACK_ROWS + r) * 4 + e % 4];
                code = e < 16 ? byte & 0xF : byte >> 4;
                if (has_fifth_bits(type)) code |= (int)(p.h[b * (QK / 4) + e / 4] >> (4 * r + e % 4) & 1) << 4;
            }
            const int v = type == IQ4_NL ? IQ4_NL_VALUES[code] : code - code_offset(type);
            out[b * QK + e] = has_min(type) ? d * (float)v + m : d * (float)v;
        }
    }
}

/* A gated product's pairs of chunks (gguf_gemm_<type>_packed_q8_gated) kept between calls, one per OpenMP
 * thread: a gate chunk's and its up chunk's products for every token, [T, ROW_CHUNK] each */
static __thread char *pair_scratch = NULL;
static __thread int64_t pair_scratch_bytes = 0;

/* y[t, 0..ROW_CHUNK) = act(g[t]) * u[t] for tokens [t0, t1) of a pair of chunks' products (rows
 * of ROW_CHUNK), as layer_cpu.c's gated_mul: simd_math.h's gated8 without contraction into
 * FMAs, there and here, so the same bits */
static __attribute__((noinline, optimize("fp-contract=off"))) void gated_rows(const float *g, const float *u,
                                                                             int64_t t0, int64_t t1, float *y,
                                                                             int64_t ldy, int gelu) {
    for (int64_t t = t0; t < t1; t++)
        for (int j = 0; j < ROW_CHUNK; j += 8) {
            const __m256 gv = _mm256_loadu_ps(g + t * ROW_CHUNK + j), uv = _mm256_loadu_ps(u + t * ROW_CHUNK + j);
            _mm256_storeu_ps(y + t * ldy + j, gelu ? gated8(gv, uv, 1) : gated8(gv, uv, 0));
        }
}

#define PACKED_KERNELS(NAME, TYPE)                                                                             \
    /* w [N, K] into out; with out NULL, the bytes out needs */                                              \
    int64_t gguf_pack_##NAME(const uint8_t *w, int64_t N, int64_t K, uint8_t *out, int threads) {             \
        const int64_t nb = K / QK, row_bytes = nb * block_bytes(TYPE);                                         \
        if (out == NULL) return CHUNKS(N) * packed_chunk_bytes(TYPE, nb);                                      \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                      \
        for (int64_t c = 0; c < CHUNKS(N); c++)                                                                \
            pack_rows(TYPE, w + c * ROW_CHUNK * row_bytes, nb, row_bytes, CHUNK_END(c, N) - c * ROW_CHUNK,     \
                      packed_chunk_at(TYPE, out, nb, c));                                                      \
        return 0;                                                                                              \
    }                                                                                                          \
    static __attribute__((target(AVX512_TARGET), noinline)) void packed_at_##NAME(                            \
        struct q8_activations a, int64_t t_first, int64_t T, int64_t nb, const uint8_t *w, int64_t c, float *y, \
        int64_t ldy, int64_t rows, uint8_t *codes, int stream) {                                               \
        const int64_t chunk = packed_chunk_bytes(TYPE, nb);                                                    \
        packed_chunk(TYPE, packed_chunk_at(TYPE, w, nb, c), a, t_first, T, nb, y, ldy, rows,                   \
                     w + (c + PACKED_AHEAD) * chunk, chunk, codes, stream);                                    \
    }                                                                                                          \
    /* as gguf_gemm_<type>_q8, w packed by gguf_pack_<type> */                                               \
    int gguf_gemm_##NAME##_packed_q8(const float *x, int64_t T, int64_t K, const uint8_t *w, int64_t N,       \
                                     float *y, int64_t ldy, int threads) {                                     \
        struct q8_activations a;                                                                               \
        if (T == 0) return 0;                                                                                  \
        if (q8_activations_for((T + X_TILE - 1) / X_TILE * X_TILE, K, &a) != 0) return -1;                     \
        const int64_t block = x_block_tokens(K);                                                               \
        const int stream = streams_output(T, N, CHUNKS(N) * packed_chunk_bytes(TYPE, K / QK));                 \
        _Pragma("omp parallel num_threads(threads)")                                                           \
        {                                                                                                      \
            uint8_t *const codes = codes_for(TYPE, K / QK);                                                    \
            _Pragma("omp for schedule(static)")                                                                \
            for (int64_t t = 0; t < T; t++) quantize_token(x, T, K, t, a, corrected_offset(TYPE, 1), TILES);  \
            for (int64_t t0 = 0; t0 < T; t0 += block) {                                                        \
                const int64_t t1 = t0 + block < T ? t0 + block : T;                                            \
                _Pragma("omp for schedule(static) nowait")                                                     \
                for (int64_t c = 0; c < CHUNKS(N); c++)                                                        \
                    packed_at_##NAME(a, t0, t1, K / QK, w, c, y + c * ROW_CHUNK, ldy,                          \
                                     CHUNK_END(c, N) - c * ROW_CHUNK, codes, stream);                          \
            }                                                                                                  \
            if (stream) _mm_sfence();                                                                          \
        }                                                                                                      \
        return 0;                                                                                              \
    }                                                                                                          \
    /* y [T, N / 2] (rows ldy apart) = act(g) * u for the halves g (gate), u (up) of x @ W^T [T, N], W     \
     * packed by gguf_pack_<type>, its halves whole chunks (N / 2 a multiple of ROW_CHUNK): a thread        \
     * multiplies a chunk of gate rows and the up chunk it pairs with into its scratch and writes their     \
     * act(g) * u (gated_rows), so the [T, N] product is never written or read back (an MLP's gate and up \
     * at 2048 tokens: 33.5 MB). gelu: Gemma's GELU-tanh, else SiLU. 0; -1: no memory; -2: N / 2 is not    \
     * whole chunks. */                                                                                      \
    int gguf_gemm_##NAME##_packed_q8_gated(const float *x, int64_t T, int64_t K, const uint8_t *w, int64_t N, \
                                           float *y, int64_t ldy, int gelu, int threads) {                   \
        struct q8_activations a;                                                                               \
        if (N / 2 % ROW_CHUNK || N % 2) return -2;                                                             \
        if (T == 0) return 0;                                                                                  \
        if (q8_activations_for((T + X_TILE - 1) / X_TILE * X_TILE, K, &a) != 0) return -1;                     \
        const int64_t block = x_block_tokens(K), half = CHUNKS(N) / 2;                                         \
        int failed = 0;                                                                                        \
        _Pragma("omp parallel num_threads(threads)")                                                           \
        {                                                                                                      \
            uint8_t *const codes = codes_for(TYPE, K / QK);                                                    \
            float *const pair = (float *)grown_scratch(&pair_scratch, &pair_scratch_bytes,                     \
                                                       2 * T * ROW_CHUNK * (int64_t)sizeof(float));            \
            if (pair == NULL) {                                                                                \
                _Pragma("omp atomic write")                                                                    \
                failed = 1;                                                                                    \
            }                                                                                                  \
            _Pragma("omp for schedule(static)") /* its barrier: every thread sees `failed` after it */         \
            for (int64_t t = 0; t < T; t++) quantize_token(x, T, K, t, a, corrected_offset(TYPE, 1), TILES);  \
            int stop;                                                                                          \
            _Pragma("omp atomic read")                                                                         \
            stop = failed;                                                                                     \
            for (int64_t t0 = 0; t0 < T && !stop; t0 += block) {                                               \
                const int64_t t1 = t0 + block < T ? t0 + block : T;                                            \
                float *const g = pair, *const u = pair + T * ROW_CHUNK;                                        \
                _Pragma("omp for schedule(static) nowait")                                                     \
                for (int64_t c = 0; c < half; c++) {                                                           \
                    packed_at_##NAME(a, t0, t1, K / QK, w, c, g, ROW_CHUNK, ROW_CHUNK, codes, 0);              \
                    packed_at_##NAME(a, t0, t1, K / QK, w, c + half, u, ROW_CHUNK, ROW_CHUNK, codes, 0);       \
                    gated_rows(g, u, t0, t1, y + c * ROW_CHUNK, ldy, gelu);                                    \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        return failed ? -1 : 0;                                                                                \
    }                                                                                                          \
    /* rows ids of a weight packed by gguf_pack_<type> */                                                    \
    void gguf_get_rows_##NAME##_packed(const uint8_t *w, int64_t K, const int64_t *ids, int64_t n_ids, float *out) { \
        const int64_t nb = K / QK;                                                                             \
        for (int64_t i = 0; i < n_ids; i++)                                                                    \
            packed_row(TYPE, packed_chunk_at(TYPE, w, nb, ids[i] / PACK_ROWS), nb, ids[i] % PACK_ROWS, out + i * K); \
    }

PACKED_KERNELS(q4_0, Q4_0)
PACKED_KERNELS(q4_1, Q4_1)
PACKED_KERNELS(q5_0, Q5_0)
PACKED_KERNELS(q5_1, Q5_1)
PACKED_KERNELS(q8_0, Q8_0)
PACKED_KERNELS(iq4_nl, IQ4_NL)
