/* A whole decode step's layers in one call, for a model whose projections are GGUF blocks
 * (--quantization gguf / gguf-q8) on an x86-64 CPU with AVX2 + FMA (gpu/models/cpu_decode.py builds
 * this file together with the kernels it runs: layer_cpu.c, attention_cpu.c; the block products
 * are the GGUF kernels' (gguf_q32.c, gguf_kquants.c), called through the pointers it is given).
 *
 * The Python forward (gpu/models/llama.py) makes ~10 calls a layer into these same kernels, each
 * with its ctypes conversion, tensor allocations and views, a large share of a batch-1 step
 * (docs/perf-notes.md). Here the layer loop is C and runs the same kernels in the same order
 * on the same values, so the result is bit for bit the Python forward's
 * (tests/server/test_cpu_decode.py).
 *
 * Decode only: every request has one new token, its K and V are stored at out_cache_loc (in
 * the cache's element type, rounded as torch rounds: kv_dtype.h) and it attends to kv_lens[b]
 * cached tokens (itself included).
 *
 * LoRA adapters (gpu/lora.py): a token of an adapter gets each adapted projection's delta
 * (x @ A^T) @ B^T added to its output row, as the Python forward's LoraBatch adds it (the same
 * values, summed in another order: equal to about 1e-6, not bit for bit).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kv_dtype.h"
#include "simd_math.h"

/* layer_cpu.c */
void rms_norm(float *x, const float *residual, const float *w, int64_t T, int64_t H, float eps, float *out,
              int threads);
void rope(float *x, int64_t row_stride, int64_t T, int64_t n_heads, int64_t D, const int64_t *positions,
          const float *cos_table, const float *sin_table, int pairs, int threads);
void silu_mul(const float *gate_up, int64_t T, int64_t I, float *out, int threads);
/* attention_cpu.c */
int paged_decode_attention(const float *q, int64_t q_stride, const void *k, const void *v, int kv_dtype,
                           const int32_t *page_table, int64_t pt_stride, const int32_t *kv_lens, int64_t B, int64_t Hq,
                           int64_t Hkv, int64_t D, int64_t page_size, float scale, float *out, int threads);

/* a GGUF kernel, gguf_gemm_TYPE_{f32,q8}: y[t, :N] (row t at y + t * ldy) = x[t] @ W^T; 0 or -1 (no memory) */
typedef int (*Gemm)(const float *x, int64_t T, int64_t K, const uint8_t *w, int64_t N, float *y, int64_t ldy,
                    int threads);

#define MAX_PARTS 3  /* q, k, v */

typedef struct {  /* rows of a projection in one GGUF tensor: its blocks in the mapping */
    Gemm gemm;
    const uint8_t *w;
    int64_t n;
} Part;

typedef struct {  /* y [T, n] = x [T, k] @ W^T, W the parts' rows one after another */
    Part parts[MAX_PARTS];
    int64_t n_parts, n, k;
} Projection;

typedef struct {
    const float *input_norm, *post_norm;
    const float *qkv_bias;  /* [(Hq + 2 Hkv) D] or NULL */
    Projection qkv, o, gate_up, down;
    void *k_cache, *v_cache;  /* this layer's pages: [num_pages, page_size, Hkv, D] in Dims.kv_dtype */
} Layer;

typedef struct {
    int64_t hidden, intermediate, q_heads, kv_heads, head_dim, page_size;
    int64_t kv_dtype;  /* KV_F32 | KV_F16 | KV_BF16 | KV_F8E5M2 */
    int64_t rope_pairs;  /* rope's pairs are dims (2j, 2j + 1), not (j, j + D/2): layer_cpu.c rope */
    float eps, scale;
} Dims;

typedef struct {  /* an adapter's pair of one projection (gpu/lora.py stacks a fused one's parts) */
    const float *a;   /* [r, k] */
    const float *bt;  /* [r, n]: B transposed (its columns contiguous), the scaling folded in */
    int64_t r;       /* 0: the adapter leaves the projection as it is */
} LoraPair;

enum { LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN, LORA_PROJECTIONS };  /* cpu_decode.py's LORA_PROJECTIONS */

static float dot(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Row t of y [T, n] += its adapter's delta for row t of x [T, k]: loras[t] is token t's
 * adapter's pairs, [n_layers][LORA_PROJECTIONS], or NULL (the base model's token); tmp holds
 * max_r floats a token. */
static void lora_add(const LoraPair *const *loras, int64_t l, int which, const float *x, int64_t T, int64_t k,
                     float *y, int64_t n, float *tmp, int64_t max_r, int threads) {
    if (loras == NULL) return;
    #pragma omp parallel for schedule(static) num_threads(threads) if (T >= 4)
    for (int64_t t = 0; t < T; t++) {
        if (loras[t] == NULL) continue;
        const LoraPair *p = loras[t] + l * LORA_PROJECTIONS + which;
        float *xa = tmp + t * max_r, *yt = y + t * n;
        for (int64_t i = 0; i < p->r; i++) xa[i] = dot(p->a + i * k, x + t * k, k);
        for (int64_t i = 0; i < p->r; i++) {  /* yt += xa[i] * B[:, i], a column at a time */
            const float *col = p->bt + i * n;
            const __m256 s = _mm256_set1_ps(xa[i]);
            int64_t j = 0;
            for (; j + 8 <= n; j += 8)
                _mm256_storeu_ps(yt + j, _mm256_fmadd_ps(s, _mm256_loadu_ps(col + j), _mm256_loadu_ps(yt + j)));
            for (; j < n; j++) yt[j] += xa[i] * col[j];
        }
    }
}

/* each part's product into its column slice of y [T, p->n] */
static int project(const Projection *p, const float *x, int64_t T, float *y, int threads) {
    int64_t column = 0;
    for (int64_t i = 0; i < p->n_parts; i++) {
        const Part *part = p->parts + i;
        if (part->gemm(x, T, p->k, part->w, part->n, y + column, p->n, threads)) return -1;
        column += part->n;
    }
    return 0;
}

/* x [T, H]: the embeddings in; out, the residual stream before the last layer's MLP output is
 * added, which is left in residual [T, H] (the Python forward's x and residual after its loop).
 * positions, out_cache_loc int64 [T]; page_table int32 [T, pt_stride]; kv_lens int32 [T].
 * loras: NULL (no adapter in the step), or each token's adapter's pairs (lora_add), none of
 * rank above lora_max_r. Returns 0, or -1 when scratch memory could not be allocated. */
int decode_layers(const Layer *layers, int64_t n_layers, const Dims *dims, int64_t T, float *x, float *residual,
                  const int64_t *positions, const float *cos_table, const float *sin_table,
                  const int64_t *out_cache_loc, const int32_t *page_table, int64_t pt_stride, const int32_t *kv_lens,
                  const LoraPair *const *loras, int64_t lora_max_r, int threads) {
    const int64_t H = dims->hidden, I = dims->intermediate, Hq = dims->q_heads, Hkv = dims->kv_heads;
    const int64_t D = dims->head_dim, qkv_width = (Hq + 2 * Hkv) * D, kv_width = Hkv * D;
    const int kv_dtype = (int)dims->kv_dtype;
    const int64_t kv_row_bytes = kv_width * kv_elem_bytes(kv_dtype);
    /* h [T, H], qkv [T, qkv_width], attn [T, Hq D], proj [T, H], gate_up [T, 2I], act [T, I],
     * xa [T, lora_max_r] */
    const int64_t need = T * (H + qkv_width + Hq * D + H + 3 * I + lora_max_r);
    static __thread float *scratch_buf = NULL;  /* kept between calls, as attention_cpu.c's */
    static __thread int64_t scratch_cap = 0;
    if (need > scratch_cap) {
        float *grown = realloc(scratch_buf, sizeof(float) * need);
        if (grown == NULL) return -1;
        scratch_buf = grown;
        scratch_cap = need;
    }
    float *h = scratch_buf, *qkv = h + T * H, *attn = qkv + T * qkv_width, *proj = attn + T * Hq * D;
    float *gate_up = proj + T * H, *act = gate_up + T * 2 * I, *xa = act + T * I;
    for (int64_t l = 0; l < n_layers; l++) {
        const Layer *L = layers + l;
        rms_norm(x, l == 0 ? NULL : residual, L->input_norm, T, H, dims->eps, h, threads);
        if (project(&L->qkv, h, T, qkv, threads)) return -1;
        if (L->qkv_bias)
            for (int64_t t = 0; t < T; t++)
                for (int64_t j = 0; j < qkv_width; j++) qkv[t * qkv_width + j] += L->qkv_bias[j];
        lora_add(loras, l, LORA_QKV, h, T, H, qkv, qkv_width, xa, lora_max_r, threads);
        rope(qkv, qkv_width, T, Hq + Hkv, D, positions, cos_table, sin_table, (int)dims->rope_pairs, threads);
        for (int64_t t = 0; t < T; t++) {
            const float *row = qkv + t * qkv_width;
            kv_store_row((char *)L->k_cache + out_cache_loc[t] * kv_row_bytes, row + Hq * D, kv_width, kv_dtype);
            kv_store_row((char *)L->v_cache + out_cache_loc[t] * kv_row_bytes, row + (Hq + Hkv) * D, kv_width, kv_dtype);
        }
        if (paged_decode_attention(qkv, qkv_width, L->k_cache, L->v_cache, kv_dtype, page_table, pt_stride, kv_lens, T,
                                   Hq, Hkv, D, dims->page_size, dims->scale, attn, threads))
            return -1;
        if (project(&L->o, attn, T, proj, threads)) return -1;
        lora_add(loras, l, LORA_O, attn, T, Hq * D, proj, H, xa, lora_max_r, threads);
        rms_norm(x, proj, L->post_norm, T, H, dims->eps, h, threads);
        if (project(&L->gate_up, h, T, gate_up, threads)) return -1;
        lora_add(loras, l, LORA_GATE_UP, h, T, H, gate_up, 2 * I, xa, lora_max_r, threads);
        silu_mul(gate_up, T, I, act, threads);
        if (project(&L->down, act, T, residual, threads)) return -1;
        lora_add(loras, l, LORA_DOWN, act, T, I, residual, H, xa, lora_max_r, threads);
    }
    return 0;
}
