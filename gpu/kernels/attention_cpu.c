/* Decode attention straight from the paged KV cache on an x86-64 CPU with AVX2 + FMA
 * (gpu/attention/cpu.py builds and loads this file).
 *
 * One query token per request attends to its kv_lens[b] cached tokens, read in place from
 * their pages: no gathered copy of K and V, no padding to the longest request, which is
 * what the torch backend pays for (index_select + a masked SDPA over the padded batch).
 *
 * Layouts: q [B, Hq, D] fp32 with request b's heads at q + b * q_stride (q can be a slice of
 * the fused qkv projection); out [B, Hq, D] fp32; k, v one layer's pages [num_pages, page_size,
 * Hkv, D] in kv_dtype (kv_dtype.h: fp32, fp16 or bf16, widened to fp32 as they are read);
 * page_table int32 [B, pt_stride]. D is a multiple of 8, at most 256. Softmax in fp32 as SDPA
 * computes it, but in chunks (below), so its sums run in another order.
 */
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include "simd_math.h"
#include "kv_dtype.h"


static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
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

/* Pages sit anywhere in the pool and a head reads a third of each row: the hardware
 * prefetchers miss most of it, so the next chunk's rows are fetched into L2 while this one
 * is computed (without it, batch 32 with its pages out of cache took ~15% longer, measured). */
static void prefetch_chunk(const KvRows *r, int64_t j0, int64_t n) {
    const int64_t bytes = r->token_stride * r->elem_bytes;
    for (int64_t t = 0; t < n; t++) {
        const char *kr = (const char *)row(r, r->k, j0 + t), *vr = (const char *)row(r, r->v, j0 + t);
        for (int64_t x = 0; x < bytes; x += 64) {
            _mm_prefetch(kr + x, _MM_HINT_T1);
            _mm_prefetch(vr + x, _MM_HINT_T1);
        }
    }
}

/* One chunk [j0, j0 + n) of one request, all Hq heads: acc[i] = sum_j e^(s_ij - m_i) v_j,
 * l[i] = sum_j e^(s_ij - m_i), m[i] = max_j s_ij, s_ij = q_i . k_j * scale. Inlined into
 * attend_chunk_as with a constant dtype: one copy of the loops per KV element type, each with
 * its row load and no branch on the type inside them. */
static inline __attribute__((always_inline)) void attend_chunk(const float *q, const KvRows *r, int64_t j0, int64_t n,
                                                               int64_t Hq, int64_t G, int64_t D, float scale,
                                                               float *acc, float *m, float *l, int dtype) {
    const int64_t nv = D / 8;
    const void *krow[CHUNK], *vrow[CHUNK];
    for (int64_t t = 0; t < CHUNK; t++) {  /* past n: the last row again, its score dropped */
        const int64_t j = j0 + (t < n ? t : n - 1);
        krow[t] = row(r, r->k, j);
        vrow[t] = row(r, r->v, j);
    }
    float s[CHUNK];
    for (int64_t i = 0; i < Hq; i++) {
        const float *qi = q + i * D;
        const int64_t off = i / G * D;  /* kv head i / G's slice of a row */
        for (int64_t t0 = 0; t0 < n; t0 += 8) {
            __m256 a[8];
            for (int t = 0; t < 8; t++) a[t] = _mm256_setzero_ps();
            for (int64_t c = 0; c < nv; c++) {
                const __m256 qc = _mm256_loadu_ps(qi + 8 * c);
                for (int t = 0; t < 8; t++)
                    a[t] = _mm256_fmadd_ps(qc, kv_load8(krow[t0 + t], off + 8 * c, dtype), a[t]);
            }
            _mm256_storeu_ps(s + t0, _mm256_mul_ps(sum8x8(a), _mm256_set1_ps(scale)));
        }
        float mx = s[0];
        for (int64_t t = 1; t < n; t++) mx = s[t] > mx ? s[t] : mx;
        const __m256 vmx = _mm256_set1_ps(mx);
        __m256 vsum = _mm256_setzero_ps();
        for (int64_t t0 = 0; t0 < n; t0 += 8) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t0), vmx));
            if (n - t0 < 8) {  /* zero the lanes past n */
                const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - t0)), lane)));
            }
            _mm256_storeu_ps(s + t0, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        m[i] = mx;
        l[i] = hsum(vsum);
        for (int64_t c0 = 0; c0 < nv; c0 += 8) {  /* 8 vectors of the output at a time, in registers */
            const int64_t nc = nv - c0 < 8 ? nv - c0 : 8;
            __m256 o[8];
            for (int c = 0; c < 8; c++) o[c] = _mm256_setzero_ps();
            for (int64_t t = 0; t < n; t++) {
                const __m256 p = _mm256_set1_ps(s[t]);
                for (int c = 0; c < 8; c++)
                    if (c < nc) o[c] = _mm256_fmadd_ps(p, kv_load8(vrow[t], off + 8 * (c0 + c), dtype), o[c]);
            }
            for (int c = 0; c < 8; c++)
                if (c < nc) _mm256_storeu_ps(acc + i * D + 8 * (c0 + c), o[c]);
        }
    }
}

static void attend_chunk_as(int dtype, const float *q, const KvRows *r, int64_t j0, int64_t n, int64_t Hq, int64_t G,
                            int64_t D, float scale, float *acc, float *m, float *l) {
    switch (dtype) {
    case KV_F16: attend_chunk(q, r, j0, n, Hq, G, D, scale, acc, m, l, KV_F16); break;
    case KV_BF16: attend_chunk(q, r, j0, n, Hq, G, D, scale, acc, m, l, KV_BF16); break;
    default: attend_chunk(q, r, j0, n, Hq, G, D, scale, acc, m, l, KV_F32);
    }
}

/* Returns 0, or -1 when a scratch buffer could not be allocated. */
int paged_decode_attention(const float *q, int64_t q_stride, const void *k, const void *v, int kv_dtype,
                           const int32_t *page_table, int64_t pt_stride, const int32_t *kv_lens, int64_t B, int64_t Hq,
                           int64_t Hkv, int64_t D, int64_t page_size, float scale, float *out, int threads) {
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
    for (int64_t b = 0; b < B; b++) first[b + 1] = first[b] + (kv_lens[b] + CHUNK - 1) / CHUNK;
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
            const int64_t j0 = (it - first[b]) * CHUNK, n = kv_lens[b] - j0 < CHUNK ? kv_lens[b] - j0 : CHUNK;
            if (it + 1 < items) {  /* the next item: this request's next chunk or the next request's first */
                const int64_t nb = first[b + 1] == it + 1 ? b + 1 : b, nj0 = (it + 1 - first[nb]) * CHUNK;
                const KvRows nr = {k, v, page_table + nb * pt_stride, page_size, Hkv * D, kv_elem_bytes(kv_dtype)};
                prefetch_chunk(&nr, nj0, kv_lens[nb] - nj0 < CHUNK ? kv_lens[nb] - nj0 : CHUNK);
            }
            float *pc = parts + it * part;
            attend_chunk_as(kv_dtype, q + b * q_stride, &r, j0, n, Hq, G, D, scale, pc, pc + Hq * D, pc + Hq * D + Hq);
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
