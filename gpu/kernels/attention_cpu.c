/* Attention straight from the paged KV cache on an x86-64 CPU with AVX2 + FMA
 * (gpu/attention/cpu.py builds and loads this file): decode (one new token per request) and
 * extend (several: a prompt, a chunk of one, a prompt after a cached prefix).
 *
 * Each request's keys and values are read in place from its pages: no gathered copy of K and
 * V, no padding to the longest request, which is what the torch backend pays for (index_select
 * + a masked SDPA over the padded batch).
 *
 * Layouts: q [T, Hq, D] fp32 with token t's heads at q + t * q_stride (q can be a slice of the
 * fused qkv projection); out fp32; k, v one layer's pages [num_pages, page_size, Hkv, D] in
 * kv_dtype (kv_dtype.h: fp32, fp16, bf16 or fp8 e5m2, widened to fp32 as read); page_table int32
 * [B, pt_stride]. D is a multiple of 8, at most 256. Softmax in fp32 as SDPA computes it, but in
 * chunks of keys (online softmax), so its sums run in another order.
 *
 * Gemma's attention (gpu/attention/base.py configure()): a sliding window w > 0 lets a query at
 * position p see keys p - w + 1 .. p only (transformers' "p - w < key <= p"), and the keys before
 * the window are never read, so a long request's decode on a window layer costs the window, not
 * its context; a soft-cap c > 0 takes every score s = q . k * scale to c tanh(s / c) before the
 * softmax (Gemma 2). w = 0 and c = 0: plain causal attention.
 */
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <omp.h>
#include "simd_math.h"
#include "kv_dtype.h"



/* all ones in the lanes below n (none when n <= 0, all when n >= 8), as a float mask */
static inline __m256 lanes_below(int64_t n) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int n8 = n < 0 ? 0 : n > 8 ? 8 : (int)n;
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n8), lane));
}

/* tanh(x) within 2 float epsilons (relative), as Cephes' tanhf: x + x^3 P(x^2) for |x| < 0.625,
 * where 1 - 2 / (e^2x + 1) would cancel; that form above it, where the result is >= 0.55 and
 * keeps exp8's ~2e-7. exp8 clamps at 88, so a large |x| gives exactly +-1, as tanhf does. */
static inline __m256 tanh8(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    const __m256 a = _mm256_andnot_ps(sign, x), z = _mm256_mul_ps(x, x);
    __m256 p = _mm256_set1_ps(-5.70498872745e-3f);
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(2.06390887954e-2f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-5.37397155531e-2f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.33314422036e-1f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-3.33332819422e-1f));
    const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), x, x);
    const __m256 e = exp8(_mm256_add_ps(a, a));
    const __m256 large = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
    return _mm256_blendv_ps(_mm256_or_ps(large, _mm256_and_ps(sign, x)), small,
                            _mm256_cmp_ps(a, _mm256_set1_ps(0.625f), _CMP_LT_OQ));
}

/* Gemma 2's soft-capped scores: cap tanh(s / cap) */
static inline __m256 soft_cap8(__m256 s, float cap) {
    return _mm256_mul_ps(_mm256_set1_ps(cap), tanh8(_mm256_mul_ps(s, _mm256_set1_ps(1.0f / cap))));
}

/* x [n] -> cap tanh(x / cap), as the kernels cap their scores: tests/unit/test_attention_cpu_windows.py
 * holds it to torch's tanh */
void soft_cap(const float *x, int64_t n, float cap, float *out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, soft_cap8(_mm256_loadu_ps(x + i), cap));
    if (i < n) {
        float tail[8] = {0};
        for (int64_t t = i; t < n; t++) tail[t - i] = x[t];
        _mm256_storeu_ps(tail, soft_cap8(_mm256_loadu_ps(tail), cap));
        for (int64_t t = i; t < n; t++) out[t] = tail[t - i];
    }
}


/* Each request's cached tokens go in chunks of CHUNK (flash-decoding): a chunk's softmax is
 * taken against its own max and the chunks are merged per request at the end. The chunks of
 * every request are the work items spread over the threads, so one long request keeps both
 * cores busy; a request's result depends on its own length only, not on the batch or the
 * thread count. */
#define CHUNK 32
#define MAX_VECS 32  /* D <= 256 */

/* the 8 lanes' sums of each of a[0..7], as one vector: lane t = sum of a[t] */
static inline __m256 sum8x8(const __m256 a[8]) {
    const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    /* lanes: s0123 = [0 1 2 3 | 0 1 2 3] halves, s4567 likewise: add the halves */
    const __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20), hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
    return _mm256_add_ps(lo, hi);
}

typedef struct {
    const char *k, *v;
    const int32_t *pages;
    int64_t page_size, token_stride, elem_bytes;  /* token_stride in elements */
} KvRows;

static inline const void *row(const KvRows *r, const char *base, int64_t j) {
    const int64_t slot = (int64_t)r->pages[j / r->page_size] * r->page_size + j % r->page_size;
    return base + slot * r->token_stride * r->elem_bytes;
}

/* Pages sit anywhere in the pool, so the hardware prefetchers find little to follow: an item
 * fetches the next item's K and V rows a few lines at a time from inside its own score loop,
 * and the fetches overlap its arithmetic. Issued all at once at the item's start, the same
 * fetches bought nothing (most presumably met full miss buffers and were dropped); spread
 * out, they make a layer with its pages out of cache much faster (docs/perf-notes.md). Into
 * L2, not L1: an item's rows are as many bytes as L1 holds (32 keys of Gemma 3's K and V: 32
 * KiB), so fetched into L1 the next item's rows evicted the rows the item was still reading. */
typedef struct {
    const char *rows[2 * CHUNK];
    int64_t nrows, row_bytes, step;  /* step: lines per call */
    int64_t row, off;                /* the next line: rows[row] + off */
} Prefetch;

static void prefetch_plan(Prefetch *pf, const KvRows *r, int64_t j0, int64_t n, int64_t calls) {
    for (int64_t t = 0; t < n; t++) {
        pf->rows[2 * t] = row(r, r->k, j0 + t);
        pf->rows[2 * t + 1] = row(r, r->v, j0 + t);
    }
    pf->nrows = 2 * n;
    pf->row_bytes = r->token_stride * r->elem_bytes;
    const int64_t lines = pf->nrows * ((pf->row_bytes + 63) / 64);
    pf->step = (lines + calls - 1) / calls;
    pf->row = pf->off = 0;
}

static inline void prefetch_some(Prefetch *pf) {
    for (int64_t i = 0; i < pf->step && pf->row < pf->nrows; i++) {
        _mm_prefetch(pf->rows[pf->row] + pf->off, _MM_HINT_T1);
        pf->off += 64;
        if (pf->off >= pf->row_bytes) pf->off = 0, pf->row++;
    }
}

/* Query heads [h0, h0 + HB) (HB <= HEAD_BLOCK, a constant at each call) of a kv head, whose slice
 * of a row starts at element `off`, against a chunk's rows krow / vrow (n of them, CHUNK
 * pointers: past n the last row again, its score dropped): acc[i] = sum_j e^(s_ij - m_i) v_j,
 * l[i] = sum_j e^(s_ij - m_i), m[i] = max_j s_ij, s_ij = q_i . k_j * scale (soft-capped when
 * softcap > 0). The heads of a block share each K and V vector a load and a conversion to fp32
 * (a head at a time, the conversions were as many instructions as the FMAs); each head's sums
 * run in the same order as a head at a time would, so the results do not depend on HB. */
#define HEAD_BLOCK 4
static inline __attribute__((always_inline)) void attend_heads(int HB, const float *q, const void *const *krow,
                                                               const void *const *vrow, int64_t off, int64_t n,
                                                               int64_t D, float scale, float softcap, float *acc,
                                                               float *m, float *l, int dtype, Prefetch *pf) {
    const int64_t nv = D / 8;
    float s[HEAD_BLOCK][CHUNK];
    for (int64_t t0 = 0; t0 < n; t0 += 2) {  /* two keys at a time: 2 x HB sums in registers */
        if (t0 % 8 == 0)
            for (int h = 0; h < HB; h++) prefetch_some(pf);
        __m256 a[8];
        for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
        for (int64_t c = 0; c < nv; c++) {
            const __m256 k0 = kv_load8(krow[t0], off + 8 * c, dtype), k1 = kv_load8(krow[t0 + 1], off + 8 * c, dtype);
            for (int h = 0; h < HB; h++) {
                const __m256 qc = _mm256_loadu_ps(q + h * D + 8 * c);
                a[2 * h] = _mm256_fmadd_ps(qc, k0, a[2 * h]);
                a[2 * h + 1] = _mm256_fmadd_ps(qc, k1, a[2 * h + 1]);
            }
        }
        __m256 st = _mm256_mul_ps(sum8x8(a), _mm256_set1_ps(scale));  /* lane 2 h + k: head h, key t0 + k */
        if (softcap > 0.0f) st = soft_cap8(st, softcap);
        float lanes[8];
        _mm256_storeu_ps(lanes, st);
        for (int h = 0; h < HB; h++) s[h][t0] = lanes[2 * h], s[h][t0 + 1] = lanes[2 * h + 1];
    }
    for (int h = 0; h < HB; h++) {
        float mx = s[h][0];
        for (int64_t t = 1; t < n; t++) mx = s[h][t] > mx ? s[h][t] : mx;
        const __m256 vmx = _mm256_set1_ps(mx);
        __m256 vsum = _mm256_setzero_ps();
        for (int64_t t0 = 0; t0 < n; t0 += 8) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s[h] + t0), vmx));
            if (n - t0 < 8) e = _mm256_and_ps(e, lanes_below(n - t0));  /* zero the lanes past n */
            _mm256_storeu_ps(s[h] + t0, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        m[h] = mx;
        l[h] = hsum(vsum);
    }
    /* VB vectors of the output of every head at a time, in registers: HB x VB sums, VB values */
    const int VB = HB == 1 ? 8 : HB == 2 ? 4 : 2;
    for (int64_t c0 = 0; c0 < nv; c0 += VB) {
        const int nc = nv - c0 < VB ? (int)(nv - c0) : VB;
        __m256 o[HEAD_BLOCK][8];
        for (int h = 0; h < HB; h++)
            for (int c = 0; c < VB; c++) o[h][c] = _mm256_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            __m256 v[8];
            for (int c = 0; c < VB; c++)
                if (c < nc) v[c] = kv_load8(vrow[t], off + 8 * (c0 + c), dtype);
            for (int h = 0; h < HB; h++) {
                const __m256 p = _mm256_set1_ps(s[h][t]);
                for (int c = 0; c < VB; c++)
                    if (c < nc) o[h][c] = _mm256_fmadd_ps(p, v[c], o[h][c]);
            }
        }
        for (int h = 0; h < HB; h++)
            for (int c = 0; c < VB; c++)
                if (c < nc) _mm256_storeu_ps(acc + h * D + 8 * (c0 + c), o[h][c]);
    }
}

/* One chunk [j0, j0 + n) of one request, all Hq heads, each kv head's G query heads in blocks of
 * HEAD_BLOCK (attend_heads). Inlined into attend_chunk_as with a constant dtype: one copy of the
 * loops per KV element type, each with its row load and no branch on the type inside them. */
static inline __attribute__((always_inline)) void attend_chunk(const float *q, const KvRows *r, int64_t j0, int64_t n,
                                                               int64_t Hq, int64_t G, int64_t D, float scale,
                                                               float softcap, float *acc, float *m, float *l, int dtype,
                                                               Prefetch *pf) {
    const void *krow[CHUNK], *vrow[CHUNK];
    for (int64_t t = 0; t < CHUNK; t++) {  /* past n: the last row again, its score dropped */
        const int64_t j = j0 + (t < n ? t : n - 1);
        krow[t] = row(r, r->k, j);
        vrow[t] = row(r, r->v, j);
    }
    for (int64_t h0 = 0, h1; h0 < Hq; h0 = h1) {
        const int64_t kv_head = h0 / G, end = (kv_head + 1) * G < Hq ? (kv_head + 1) * G : Hq;
        h1 = h0 + HEAD_BLOCK < end ? h0 + HEAD_BLOCK : end;  /* a block within one kv head */
#define HEADS_CASE(HB)                                                                                             \
    case HB:                                                                                                       \
        attend_heads(HB, q + h0 * D, krow, vrow, kv_head * D, n, D, scale, softcap, acc + h0 * D, m + h0, l + h0, \
                     dtype, pf);                                                                                   \
        break;
        switch (h1 - h0) { HEADS_CASE(1) HEADS_CASE(2) HEADS_CASE(3) default: HEADS_CASE(4) }
#undef HEADS_CASE
    }
}

static void attend_chunk_as(int dtype, const float *q, const KvRows *r, int64_t j0, int64_t n, int64_t Hq, int64_t G,
                            int64_t D, float scale, float softcap, float *acc, float *m, float *l, Prefetch *pf) {
    switch (dtype) {
    case KV_F16: attend_chunk(q, r, j0, n, Hq, G, D, scale, softcap, acc, m, l, KV_F16, pf); break;
    case KV_BF16: attend_chunk(q, r, j0, n, Hq, G, D, scale, softcap, acc, m, l, KV_BF16, pf); break;
    case KV_F8E5M2: attend_chunk(q, r, j0, n, Hq, G, D, scale, softcap, acc, m, l, KV_F8E5M2, pf); break;
    default: attend_chunk(q, r, j0, n, Hq, G, D, scale, softcap, acc, m, l, KV_F32, pf);
    }
}

/* the first key a query at position pos sees */
static inline int64_t window_start(int64_t pos, int64_t window) {
    return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
}

/* Request b's query sits at position kv_lens[b] - 1: its chunks start at its window's first key.
 * Returns 0, or -1 when a scratch buffer could not be allocated. */
int paged_decode_attention_windowed(const float *q, int64_t q_stride, const void *k, const void *v, int kv_dtype,
                                    const int32_t *page_table, int64_t pt_stride, const int32_t *kv_lens, int64_t B,
                                    int64_t Hq, int64_t Hkv, int64_t D, int64_t page_size, float scale, int64_t window,
                                    float softcap, float *out, int threads) {
    const int64_t G = Hq / Hkv, part = Hq * (D + 2);  /* a chunk's acc [Hq, D], m [Hq], l [Hq] */
    if (D > 8 * MAX_VECS) return -1;
    /* scratch kept between calls (one per calling thread): a fresh one per call was mmap'ed
     * and page-faulted in every time once it outgrew malloc's heap threshold */
    static __thread int64_t *first_buf = NULL, first_cap = 0, parts_cap = 0;
    static __thread float *parts_buf = NULL;
    if (B + 1 > first_cap) {
        int64_t *grown = realloc(first_buf, sizeof(int64_t) * (B + 1));
        if (grown == NULL) return -1;
        first_buf = grown;
        first_cap = B + 1;
    }
    int64_t *const first = first_buf;  /* request b's chunks: first[b] .. first[b + 1] */
    first[0] = 0;
    for (int64_t b = 0; b < B; b++)
        first[b + 1] = first[b] + (kv_lens[b] - window_start(kv_lens[b] - 1, window) + CHUNK - 1) / CHUNK;
    const int64_t items = first[B];
    if (items * part > parts_cap) {
        float *grown = realloc(parts_buf, sizeof(float) * items * part);
        if (grown == NULL) return -1;
        parts_buf = grown;
        parts_cap = items * part;
    }
    float *const parts = parts_buf;  /* locals: the OpenMP threads have thread-locals of their own */
    _Pragma("omp parallel num_threads(threads)")
    {
        int64_t b = 0;
        _Pragma("omp for schedule(static)")
        for (int64_t it = 0; it < items; it++) {
            while (first[b + 1] <= it) b++;  /* items rise within a thread's static range */
            const KvRows r = {k, v, page_table + b * pt_stride, page_size, Hkv * D, kv_elem_bytes(kv_dtype)};
            const int64_t j0 = window_start(kv_lens[b] - 1, window) + (it - first[b]) * CHUNK;
            const int64_t n = kv_lens[b] - j0 < CHUNK ? kv_lens[b] - j0 : CHUNK;
            Prefetch pf = {.nrows = 0};
            if (it + 1 < items) {  /* the next item: this request's next chunk or the next request's first */
                const int64_t nb = first[b + 1] == it + 1 ? b + 1 : b;
                const int64_t nj0 = window_start(kv_lens[nb] - 1, window) + (it + 1 - first[nb]) * CHUNK;
                const KvRows nr = {k, v, page_table + nb * pt_stride, page_size, Hkv * D, kv_elem_bytes(kv_dtype)};
                prefetch_plan(&pf, &nr, nj0, kv_lens[nb] - nj0 < CHUNK ? kv_lens[nb] - nj0 : CHUNK, Hq * ((n + 7) / 8));
            }
            float *pc = parts + it * part;
            attend_chunk_as(kv_dtype, q + b * q_stride, &r, j0, n, Hq, G, D, scale, softcap, pc, pc + Hq * D,
                            pc + Hq * D + Hq, &pf);
        }
        /* merge: out_i = sum_c e^(m_ci - M_i) acc_ci / sum_c e^(m_ci - M_i) l_ci, M_i = max_c m_ci */
        _Pragma("omp for schedule(static)")
        for (int64_t bb = 0; bb < B; bb++) {
            const int64_t c0 = first[bb], c1 = first[bb + 1];
            for (int64_t i = 0; i < Hq; i++) {
                float mx = -INFINITY;
                for (int64_t c = c0; c < c1; c++) mx = fmaxf(mx, parts[c * part + Hq * D + i]);
                float denom = 0.0f;
                float *o = out + (bb * Hq + i) * D;
                for (int64_t x = 0; x < D; x++) o[x] = 0.0f;
                for (int64_t c = c0; c < c1; c++) {
                    const float *pc = parts + c * part;
                    const float w = expf(pc[Hq * D + i] - mx);
                    denom += w * pc[Hq * D + Hq + i];
                    const __m256 vw = _mm256_set1_ps(w);
                    for (int64_t x = 0; x < D; x += 8)
                        _mm256_storeu_ps(o + x, _mm256_fmadd_ps(vw, _mm256_loadu_ps(pc + i * D + x), _mm256_loadu_ps(o + x)));
                }
                const __m256 inv = _mm256_set1_ps(1.0f / denom);
                for (int64_t x = 0; x < D; x += 8) _mm256_storeu_ps(o + x, _mm256_mul_ps(_mm256_loadu_ps(o + x), inv));
            }
        }
    }
    return 0;
}

/* Extend: request b's q_lens[b] new tokens are the last of its kv_lens[b] positions; query i
 * sits at position kv_lens[b] - q_lens[b] + i and sees keys 0 .. that position (causal, aligned
 * bottom-right, so a cached prefix or earlier chunks are simply more keys).
 *
 * A work item is (request, kv head, block of queries): the block's queries times the G query
 * heads sharing that kv head are the item's rows, and they go through the keys in chunks of
 * EXT_KEYS, each chunk's K and V widened to fp32 once and used by every row (a small GEMM per
 * chunk: S = Q K^T by register tiles of 6 rows x 16 keys, then O += P V by tiles of 6 rows x 16
 * dims), with the softmax taken online per chunk in fp32. An item writes its own rows of out and
 * nothing else, so the result is the same whatever thread runs it. */
#define EXT_KEYS 64   /* keys per chunk: one online-softmax update of every row per chunk */
#define EXT_ROWS 192  /* rows per item (queries x G), about: each chunk is widened once for them all */
#define EXT_AHEAD 6   /* a query's row is fetched while the one EXT_AHEAD before it is copied (or written) */
#define TILE_ROWS 6   /* 6 x 2 accumulators + 2 loads + a broadcast: 15 of the 16 ymm registers */

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* rows r[0..7] become its columns */
static inline void transpose8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20), r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20), r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31), r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31), r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

/* Keys j0 .. j0 + n of kv head slice `off`, widened: kt [D, EXT_KEYS] transposed, vc [n16, DP];
 * keys n .. n16 and vc's columns D .. DP are zeros (so the tiles run whole, adding nothing). */
static inline __attribute__((always_inline)) void widen_chunk(const KvRows *r, int64_t j0, int64_t n, int64_t n16,
                                                              int64_t off, int64_t D, int64_t DP, float *kt,
                                                              float *vc, int dtype) {
    for (int64_t t0 = 0; t0 < n16; t0 += 8) {
        const void *krow[8];
        for (int t = 0; t < 8; t++) krow[t] = t0 + t < n ? row(r, r->k, j0 + t0 + t) : NULL;
        for (int64_t c = 0; c < D; c += 8) {
            __m256 x[8];
            for (int t = 0; t < 8; t++) x[t] = krow[t] ? kv_load8(krow[t], off + c, dtype) : _mm256_setzero_ps();
            transpose8(x);
            for (int d = 0; d < 8; d++) _mm256_storeu_ps(kt + (c + d) * EXT_KEYS + t0, x[d]);
        }
    }
    for (int64_t t = 0; t < n16; t++) {
        float *vt = vc + t * DP;
        const void *vrow = t < n ? row(r, r->v, j0 + t) : NULL;
        for (int64_t c = 0; c < DP; c += 8)
            _mm256_storeu_ps(vt + c, vrow && c < D ? kv_load8(vrow, off + c, dtype) : _mm256_setzero_ps());
    }
}

/* s[r, 0..16) = qs[r] . kt[:, 0..16) for TILE_ROWS rows (qs rows D apart, s rows EXT_KEYS apart) */
static inline void scores_tile(const float *qs, const float *kt, int64_t D, float *s) {
    __m256 a[TILE_ROWS][2];
    for (int i = 0; i < TILE_ROWS; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m256 k0 = _mm256_loadu_ps(kt + d * EXT_KEYS), k1 = _mm256_loadu_ps(kt + d * EXT_KEYS + 8);
        for (int i = 0; i < TILE_ROWS; i++) {
            const __m256 qd = _mm256_broadcast_ss(qs + i * D + d);
            a[i][0] = _mm256_fmadd_ps(qd, k0, a[i][0]);
            a[i][1] = _mm256_fmadd_ps(qd, k1, a[i][1]);
        }
    }
    for (int i = 0; i < TILE_ROWS; i++) {
        _mm256_storeu_ps(s + i * EXT_KEYS, a[i][0]);
        _mm256_storeu_ps(s + i * EXT_KEYS + 8, a[i][1]);
    }
}

/* acc[r, 0..16) = alpha[r] acc[r, 0..16) + p[r, 0..n16) . vc[0..n16, 0..16) for TILE_ROWS rows
 * (acc and vc rows DP apart, p rows EXT_KEYS apart) */
static inline void values_tile(const float *p, const float *alpha, const float *vc, int64_t n16, int64_t DP,
                               float *acc) {
    __m256 o[TILE_ROWS][2];
    for (int i = 0; i < TILE_ROWS; i++) {
        const __m256 a = _mm256_broadcast_ss(alpha + i);
        o[i][0] = _mm256_mul_ps(a, _mm256_loadu_ps(acc + i * DP));
        o[i][1] = _mm256_mul_ps(a, _mm256_loadu_ps(acc + i * DP + 8));
    }
    for (int64_t t = 0; t < n16; t++) {
        const __m256 v0 = _mm256_loadu_ps(vc + t * DP), v1 = _mm256_loadu_ps(vc + t * DP + 8);
        for (int i = 0; i < TILE_ROWS; i++) {
            const __m256 pt = _mm256_broadcast_ss(p + i * EXT_KEYS + t);
            o[i][0] = _mm256_fmadd_ps(pt, v0, o[i][0]);
            o[i][1] = _mm256_fmadd_ps(pt, v1, o[i][1]);
        }
    }
    for (int i = 0; i < TILE_ROWS; i++) {
        _mm256_storeu_ps(acc + i * DP, o[i][0]);
        _mm256_storeu_ps(acc + i * DP + 8, o[i][1]);
    }
}

/* One row's online-softmax step over a chunk's scores s[0..n), n a multiple of 8, of which
 * s[from..seen) are visible to it (soft-capped first when softcap > 0): s becomes e^(s - m') (0
 * where unseen), l and m move to the new max m', and alpha = e^(m - m') is what the row's
 * earlier sums are scaled by. */
static inline void softmax_step(float *s, int64_t n, int64_t from, int64_t seen, float softcap, float *m, float *l,
                                float *alpha) {
    if (seen <= from) {  /* the chunk lies wholly past this row's position or before its window: it adds nothing */
        for (int64_t t = 0; t < n; t += 8) _mm256_storeu_ps(s + t, _mm256_setzero_ps());
        *alpha = 1.0f;
        return;
    }
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (int64_t t = 0; t < n; t += 8) {
        __m256 x = _mm256_loadu_ps(s + t);
        if (softcap > 0.0f) _mm256_storeu_ps(s + t, x = soft_cap8(x, softcap));
        const __m256 visible = _mm256_andnot_ps(lanes_below(from - t), lanes_below(seen - t));
        vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), x, visible));
    }
    const float mx = fmaxf(*m, hmax(vmax));
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; t += 8) {
        const __m256 visible = _mm256_andnot_ps(lanes_below(from - t), lanes_below(seen - t));
        const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), vmx)), visible);
        _mm256_storeu_ps(s + t, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    *alpha = expf(*m - mx);  /* 0 on the first chunk, where m = -inf */
    *l = *l * *alpha + hsum(vsum);
    *m = mx;
}

typedef struct {
    float *qs, *s, *acc, *kt, *vc, *m, *l, *alpha;
} ExtScratch;

/* the floats of one thread's ExtScratch, each part 64-byte aligned */
static int64_t ext_scratch_floats(int64_t rows, int64_t D) {
    const int64_t DP = round_up(D, 16);
    return round_up(rows * D, 16) + TILE_ROWS * EXT_KEYS + round_up(rows * DP, 16) +
           round_up(D * EXT_KEYS, 16) + round_up(EXT_KEYS * DP, 16) + 3 * round_up(rows, 16);
}

static ExtScratch ext_scratch(float *base, int64_t rows, int64_t D) {
    const int64_t DP = round_up(D, 16);
    ExtScratch w;
    w.qs = base, base += round_up(rows * D, 16);
    w.s = base, base += TILE_ROWS * EXT_KEYS;
    w.acc = base, base += round_up(rows * DP, 16);
    w.kt = base, base += round_up(D * EXT_KEYS, 16);
    w.vc = base, base += round_up(EXT_KEYS * DP, 16);
    w.m = base, base += round_up(rows, 16);
    w.l = base, base += round_up(rows, 16);
    w.alpha = base;
    return w;
}

/* Queries i0 .. i0 + nq of one request (q at its first new token, out likewise) for kv head h.
 * Row r is query i0 + r / G, head h * G + r % G; the rows are padded to whole tiles with zero
 * queries at the last query's position, whose results are dropped. The keys from the first
 * query's window on go in chunks; each chunk is widened once and every tile of rows takes the
 * part of it its positions and windows see (to 16 keys). */
static inline __attribute__((always_inline)) void extend_item(const float *q, int64_t q_stride, const KvRows *r,
                                                              int64_t q_len, int64_t kv_len, int64_t i0, int64_t nq,
                                                              int64_t h, int64_t G, int64_t D, float scale,
                                                              int64_t window, float softcap, float *out,
                                                              int64_t out_stride, const ExtScratch *w, int dtype) {
    const int64_t R = nq * G, RP = round_up(R, TILE_ROWS), DP = round_up(D, 16);
    const int64_t pos0 = kv_len - q_len + i0;  /* the first query's position */
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t i = 0; i < RP; i++) {
        float *qs = w->qs + i * D;
        const float *qi = q + (i0 + i / G) * q_stride + (h * G + i % G) * D;
        /* a query's G * D floats, then a jump over the other heads: the hardware prefetchers
         * lose the stream at each jump, so the rows ahead are asked for (a small gain in an A/B:
         * docs/perf-notes.md) */
        if (i % G == 0 && i / G + EXT_AHEAD < nq)
            for (int64_t x = 0; x < G * D; x += 16) _mm_prefetch((const char *)(qi + EXT_AHEAD * q_stride + x), _MM_HINT_T0);
        for (int64_t x = 0; x < D; x += 8)
            _mm256_storeu_ps(qs + x, i < R ? _mm256_mul_ps(_mm256_loadu_ps(qi + x), vscale) : _mm256_setzero_ps());
        for (int64_t x = 0; x < DP; x += 8) _mm256_storeu_ps(w->acc + i * DP + x, _mm256_setzero_ps());
        w->m[i] = -INFINITY;
        w->l[i] = 0.0f;
    }
    const int64_t last = pos0 + nq - 1;  /* the last query's position: no key past it is seen */
    for (int64_t j0 = window_start(pos0, window); j0 <= last; j0 += EXT_KEYS) {
        const int64_t n = last + 1 - j0 < EXT_KEYS ? last + 1 - j0 : EXT_KEYS;
        widen_chunk(r, j0, n, round_up(n, 16), h * D, D, DP, w->kt, w->vc, dtype);
        for (int64_t i = RP - TILE_ROWS; i >= 0; i -= TILE_ROWS) {  /* from the last tile, which sees the most */
            const int64_t tile_pos = pos0 + (i + TILE_ROWS - 1 < R ? i + TILE_ROWS - 1 : R - 1) / G;
            const int64_t tile_seen = tile_pos + 1 - j0 < n ? tile_pos + 1 - j0 : n, n16 = round_up(tile_seen, 16);
            if (tile_seen <= 0) break;  /* nor do the tiles before it */
            /* the tile's first row's window starts first: the keys before it (by 16s) are skipped */
            const int64_t tile_from = window_start(pos0 + i / G, window) - j0;
            if (tile_from >= tile_seen) continue;  /* the chunk ends before its windows: earlier tiles may see it */
            const int64_t t0 = tile_from > 0 ? tile_from / 16 * 16 : 0;
            for (int64_t t = t0; t < n16; t += 16) scores_tile(w->qs + i * D, w->kt + t, D, w->s + t);
            for (int64_t x = 0; x < TILE_ROWS; x++) {
                const int64_t pos = pos0 + (i + x < R ? i + x : R - 1) / G;
                const int64_t seen = pos + 1 - j0 < n ? pos + 1 - j0 : n, from = window_start(pos, window) - j0;
                softmax_step(w->s + x * EXT_KEYS + t0, n16 - t0, from - t0, seen - t0, softcap, w->m + i + x,
                             w->l + i + x, w->alpha + i + x);
            }
            for (int64_t c = 0; c < DP; c += 16)
                values_tile(w->s + t0, w->alpha + i, w->vc + t0 * DP + c, n16 - t0, DP, w->acc + i * DP + c);
        }
    }
    for (int64_t i = 0; i < R; i++) {
        float *o = out + (i0 + i / G) * out_stride + (h * G + i % G) * D;
        if (i % G == 0 && i / G + EXT_AHEAD < nq)
            for (int64_t x = 0; x < G * D; x += 16) _mm_prefetch((const char *)(o + EXT_AHEAD * out_stride + x), _MM_HINT_T0);
        const __m256 inv = _mm256_set1_ps(1.0f / w->l[i]);
        for (int64_t x = 0; x < D; x += 8) _mm256_storeu_ps(o + x, _mm256_mul_ps(_mm256_loadu_ps(w->acc + i * DP + x), inv));
    }
}

static void extend_item_as(int dtype, const float *q, int64_t q_stride, const KvRows *r, int64_t q_len,
                           int64_t kv_len, int64_t i0, int64_t nq, int64_t h, int64_t G, int64_t D, float scale,
                           int64_t window, float softcap, float *out, int64_t out_stride, const ExtScratch *w) {
#define EXTEND_ITEM(DT) \
    extend_item(q, q_stride, r, q_len, kv_len, i0, nq, h, G, D, scale, window, softcap, out, out_stride, w, DT)
    switch (dtype) {
    case KV_F16: EXTEND_ITEM(KV_F16); break;
    case KV_BF16: EXTEND_ITEM(KV_BF16); break;
    case KV_F8E5M2: EXTEND_ITEM(KV_F8E5M2); break;
    default: EXTEND_ITEM(KV_F32);
    }
#undef EXTEND_ITEM
}

/* Item `it` of paged_extend_attention: request b's queries i0 .. i0 + nq for kv head h; first[b]
 * .. first[b + 1] are request b's items, its last (costliest) blocks first. */
typedef struct {
    int64_t b, h, i0, nq;
} ExtItem;

static ExtItem ext_item(const int64_t *first, int64_t B, int64_t Hkv, int64_t block, const int32_t *q_lens, int64_t it) {
    int64_t lo = 0, hi = B;
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (first[mid] <= it) lo = mid; else hi = mid;
    }
    const int64_t local = it - first[lo], blocks = (first[lo + 1] - first[lo]) / Hkv;
    const int64_t i0 = (blocks - 1 - local / Hkv) * block;
    return (ExtItem){lo, local % Hkv, i0, q_lens[lo] - i0 < block ? q_lens[lo] - i0 : block};
}

/* Request b's new tokens are q rows q_starts[b] .. q_starts[b] + q_lens[b] (token t's heads at
 * q + t * q_stride), its outputs the same rows of out (token t at out + t * out_stride), its
 * pages page_table row b. Returns 0, or -1 when D is out of range or scratch could not be
 * allocated. */
int paged_extend_attention(const float *q, int64_t q_stride, const void *k, const void *v, int kv_dtype,
                           const int32_t *page_table, int64_t pt_stride, const int32_t *q_starts,
                           const int32_t *q_lens, const int32_t *kv_lens, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                           int64_t page_size, float scale, int64_t window, float softcap, float *out,
                           int64_t out_stride, int threads) {
    if (D % 8 || D > 8 * MAX_VECS || threads < 1) return -1;
    const int64_t G = Hq / Hkv, block = EXT_ROWS / G > 0 ? EXT_ROWS / G : 1;  /* queries per item */
    const int64_t rows = round_up(block * G, TILE_ROWS), per_thread = ext_scratch_floats(rows, D);
    static __thread int64_t *first_buf = NULL, first_cap = 0, scratch_cap = 0;  /* kept, as the decode's */
    static __thread float *scratch_buf = NULL;
    if (B + 1 > first_cap) {
        int64_t *grown = realloc(first_buf, sizeof(int64_t) * (B + 1));
        if (grown == NULL) return -1;
        first_buf = grown;
        first_cap = B + 1;
    }
    if (threads * per_thread > scratch_cap) {
        free(scratch_buf);
        scratch_cap = 0;
        if (posix_memalign((void **)&scratch_buf, 64, sizeof(float) * threads * per_thread) != 0) {
            scratch_buf = NULL;
            return -1;
        }
        scratch_cap = threads * per_thread;
    }
    int64_t *const first = first_buf;
    first[0] = 0;
    for (int64_t b = 0; b < B; b++) first[b + 1] = first[b] + Hkv * ((q_lens[b] + block - 1) / block);
    const int64_t items = first[B];
    const int64_t elem = kv_elem_bytes(kv_dtype);
    float *const scratch = scratch_buf;
    _Pragma("omp parallel num_threads(threads)")
    {
        const ExtScratch w = ext_scratch(scratch + omp_get_thread_num() * per_thread, rows, D);
        /* requests differ in length and a block's cost grows with its position: the items go to
         * the threads one at a time (a thread the other processes preempt holds up one item) */
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t it = 0; it < items; it++) {
            const ExtItem e = ext_item(first, B, Hkv, block, q_lens, it);
            const KvRows r = {k, v, page_table + e.b * pt_stride, page_size, Hkv * D, elem};
            extend_item_as(kv_dtype, q + q_starts[e.b] * q_stride, q_stride, &r, q_lens[e.b], kv_lens[e.b], e.i0, e.nq,
                           e.h, G, D, scale, window, softcap, out + q_starts[e.b] * out_stride, out_stride, &w);
        }
    }
    return 0;
}
