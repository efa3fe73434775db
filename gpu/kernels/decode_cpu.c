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
 * The Llama layer and the variations of gpu/models/llama.py's forward: q/k norms per head (Qwen3,
 * Gemma 3), Gemma's norms of the attention and MLP outputs, GELU-tanh, per-layer rope tables or
 * none (Gemma 3's sliding layers, SmolLM3's NoPE layers), per-layer sliding windows and
 * soft-capped scores (attention_cpu.c).
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
void gelu_tanh_mul(const float *gate_up, int64_t T, int64_t I, float *out, int threads);
/* attention_cpu.c */
int paged_decode_attention_windowed(const float *q, int64_t q_stride, const void *k, const void *v, int kv_dtype,
                                    const int32_t *page_table, int64_t pt_stride, const int32_t *kv_lens, int64_t B,
                                    int64_t Hq, int64_t Hkv, int64_t D, int64_t page_size, float scale, int64_t window,
                                    float softcap, float *out, int threads);

/* a GGUF kernel, gguf_gemm_TYPE_{f32,q8}: y[t, :N] (row t at y + t * ldy) = x[t] @ W^T; 0 or -1 (no memory) */
typedef int (*Gemm)(const float *x, int64_t T, int64_t K, const uint8_t *w, int64_t N, float *y, int64_t ldy,
                    int threads);

#define MAX_PARTS 3  /* q, k, v */

/* a packed product of an MLP's act(gate) * up (gguf_gemm_TYPE_packed_q8_gated): y [T, N / 2] (rows ldy
 * apart) from x [T, K] and the gate and up rows w [N, K]; 0, -1 (no memory) or -2 (not this weight) */
typedef int (*GatedGemm)(const float *x, int64_t T, int64_t K, const uint8_t *w, int64_t N, float *y, int64_t ldy,
                         int gelu, int threads);

typedef struct {  /* rows of a projection in one GGUF tensor: its blocks in the mapping, or a packed copy */
    Gemm gemm;
    const uint8_t *w;
    int64_t n;
    Gemm few_gemm;      /* for fewer than few_below tokens: the blocks the packed copy was made */
    const uint8_t *few_w;  /* from (gpu/quant/gguf_weight.py's WeightPart.in_place); few_below 0: none */
    int64_t few_below;
} Part;

typedef struct {  /* y [T, n] = x [T, k] @ W^T, W the parts' rows one after another */
    Part parts[MAX_PARTS];
    int64_t n_parts, n, k;
} Projection;

typedef struct {
    const float *input_norm, *post_norm;
    const float *qkv_bias;  /* [(Hq + 2 Hkv) D] or NULL */
    const float *q_norm, *k_norm;  /* [D], each q and k head's, before rope; or NULL */
    const float *attn_out_norm, *mlp_out_norm;  /* [H] (Gemma: of the attention's and the MLP's outputs) or NULL */
    const float *cos_table, *sin_table;  /* this layer's rope [P, D/2], or NULL: no rope */
    int64_t window;  /* a query at position p sees keys p - window + 1 .. p; 0: every key */
    Projection qkv, o, gate_up, down;
    void *k_cache, *v_cache;  /* this layer's pages: [num_pages, page_size, Hkv, D] in Dims.kv_dtype */
    GatedGemm gated;  /* gate_up's act(gate) * up in one product (its one part's), or NULL */
} Layer;

typedef struct {
    int64_t hidden, intermediate, q_heads, kv_heads, head_dim, page_size;
    int64_t kv_dtype;  /* KV_F32 | KV_F16 | KV_BF16 | KV_F8E5M2 */
    int64_t rope_pairs;  /* rope's pairs are dims (2j, 2j + 1), not (j, j + D/2): layer_cpu.c rope */
    int64_t gelu;  /* the MLP's activation: GELU-tanh (Gemma), else SiLU */
    float eps, scale;
    float softcap;  /* scores -> softcap tanh(scores / softcap) (Gemma 2); 0: none */
} Dims;

typedef struct {  /* an adapter's pair of one projection (gpu/lora.py stacks a fused one's parts) */
    const float *a;   /* [r, k] */
    const float *bt;  /* [r, n]: B transposed (its columns contiguous), the scaling folded in */
    int64_t r;       /* 0: the adapter leaves the projection as it is */
} LoraPair;

enum { LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN, LORA_PROJECTIONS };  /* cpu_decode.py's LORA_PROJECTIONS */

#define LORA_TILE 4  /* consecutive tokens of one adapter that share each load of its A and B */

/* y rows [M] += (x rows [M] @ A^T) @ B^T for M consecutive tokens of one adapter's pair p,
 * xa [M, r] scratch: each row of A and each block of B^T is loaded once for the M tokens (a
 * prefill chunk or a verify's tokens), and a lone decode token (M = 1) does no wasted rows.
 * Always inlined with M a constant: its loops over the tokens unroll into registers. */
static inline __attribute__((always_inline)) void lora_tile(const LoraPair *p, const float *x, int64_t k, float *y,
                                                            int64_t n, float *xa, const int M) {
    const int64_t r = p->r;
    for (int64_t i = 0; i < r; i++) {
        const float *ai = p->a + i * k;
        __m256 acc[LORA_TILE];
        for (int j = 0; j < M; j++) acc[j] = _mm256_setzero_ps();
        int64_t c = 0;
        for (; c + 8 <= k; c += 8) {
            const __m256 av = _mm256_loadu_ps(ai + c);
            for (int j = 0; j < M; j++) acc[j] = _mm256_fmadd_ps(av, _mm256_loadu_ps(x + j * k + c), acc[j]);
        }
        for (int j = 0; j < M; j++) {
            float s = hsum(acc[j]);
            for (int64_t cc = c; cc < k; cc++) s += ai[cc] * x[j * k + cc];
            xa[j * r + i] = s;
        }
    }
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) {  /* the delta of 8 columns in registers, then added to y */
        __m256 acc[LORA_TILE];
        for (int j = 0; j < M; j++) acc[j] = _mm256_setzero_ps();
        for (int64_t i = 0; i < r; i++) {
            const __m256 b = _mm256_loadu_ps(p->bt + i * n + c);
            for (int j = 0; j < M; j++) acc[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(xa + j * r + i), b, acc[j]);
        }
        for (int j = 0; j < M; j++) _mm256_storeu_ps(y + j * n + c, _mm256_add_ps(_mm256_loadu_ps(y + j * n + c), acc[j]));
    }
    for (; c < n; c++)
        for (int j = 0; j < M; j++) {
            float s = 0.0f;
            for (int64_t i = 0; i < r; i++) s += xa[j * r + i] * p->bt[i * n + c];
            y[j * n + c] += s;
        }
}

/* Row t of y [T, n] += its adapter's delta for row t of x [T, k]: loras[t] is token t's
 * adapter's pairs, [n_layers][LORA_PROJECTIONS], or NULL (the base model's token); tmp holds
 * max_r floats a token. The tokens go in pieces: runs of one adapter (a sequence's tokens are
 * consecutive), cut every LORA_TILE tokens. Returns 0, or -1 without memory for the pieces. */
static int lora_add(const LoraPair *const *loras, int64_t l, int which, const float *x, int64_t T, int64_t k,
                    float *y, int64_t n, float *tmp, int64_t max_r, int threads) {
    if (loras == NULL) return 0;
    int64_t *start = malloc(sizeof(int64_t) * (size_t)(T + 1)), pieces = 0;
    if (start == NULL) return -1;
    for (int64_t t = 0, run = 0; t < T; t++) {
        if (t == 0 || loras[t] != loras[t - 1]) run = t;
        if ((t - run) % LORA_TILE == 0) start[pieces++] = t;
    }
    start[pieces] = T;
    #pragma omp parallel for schedule(static) num_threads(threads) if (pieces >= 2)
    for (int64_t i = 0; i < pieces; i++) {
        const int64_t t = start[i], m = start[i + 1] - t;
        if (loras[t] == NULL) continue;
        const LoraPair *p = loras[t] + l * LORA_PROJECTIONS + which;
        if (p->r == 0) continue;
        const float *xt = x + t * k;
        float *yt = y + t * n, *xa = tmp + t * max_r;  /* m rows of xa: the piece's own tokens' */
        switch (m) {
            case 1: lora_tile(p, xt, k, yt, n, xa, 1); break;
            case 2: lora_tile(p, xt, k, yt, n, xa, 2); break;
            case 3: lora_tile(p, xt, k, yt, n, xa, 3); break;
            default: lora_tile(p, xt, k, yt, n, xa, 4); break;
        }
    }
    free(start);
    return 0;
}

/* lora_add for a step of the Python forward (prefill chunks, speculative verifies: any number
 * of tokens a sequence), one projection of one layer at a time: y [T, n] += each token's delta.
 * Returns 0, or -1 when scratch memory could not be allocated. */
int lora_apply(const LoraPair *const *loras, int64_t l, int which, const float *x, int64_t T, int64_t k, float *y,
               int64_t n, int64_t max_r, int threads) {
    float *xa = malloc(sizeof(float) * (size_t)(T * max_r + 1));
    if (xa == NULL) return -1;
    const int failed = lora_add(loras, l, which, x, T, k, y, n, xa, max_r, threads);
    free(xa);
    return failed;
}

/* each part's product into its column slice of y [T, p->n] */
static int project(const Projection *p, const float *x, int64_t T, float *y, int threads) {
    int64_t column = 0;
    for (int64_t i = 0; i < p->n_parts; i++) {
        const Part *part = p->parts + i;
        const int few = T < part->few_below;
        if ((few ? part->few_gemm : part->gemm)(x, T, p->k, few ? part->few_w : part->w, part->n, y + column, p->n,
                                                threads))
            return -1;
        column += part->n;
    }
    return 0;
}

/* rows from which attention_inputs splits its rows over the threads */
#define ATTENTION_INPUT_ROWS_PARALLEL 4

/* Each row of qkv [T, qkv_width] ready for the attention, in one pass over the rows (a row's
 * q and k heads normed and rotated, its k and v stored in the cache at out_cache_loc[t]): the
 * same calls on the same values as one pass a step each, so the same bits. The cache's rows lie
 * anywhere in the pool, so the stores mostly miss: each row asks for its lines first, while its
 * norms and rope run, and the threads share the rows (one thread storing them all, in turn,
 * took ~1.5% of a 32-row step). */
static void attention_inputs(const Layer *L, const Dims *dims, float *qkv, int64_t T, const int64_t *positions,
                             const int64_t *out_cache_loc, int threads) {
    const int64_t Hq = dims->q_heads, Hkv = dims->kv_heads, D = dims->head_dim;
    const int64_t qkv_width = (Hq + 2 * Hkv) * D, kv_width = Hkv * D;
    const int kv_dtype = (int)dims->kv_dtype;
    const int64_t kv_row_bytes = kv_width * kv_elem_bytes(kv_dtype);
    #pragma omp parallel for schedule(static) num_threads(threads) if (T >= ATTENTION_INPUT_ROWS_PARALLEL)
    for (int64_t t = 0; t < T; t++) {
        char *k_dst = (char *)L->k_cache + out_cache_loc[t] * kv_row_bytes;
        char *v_dst = (char *)L->v_cache + out_cache_loc[t] * kv_row_bytes;
        for (int64_t line = 0; line < kv_row_bytes; line += 64) {
            __builtin_prefetch(k_dst + line, 1);
            __builtin_prefetch(v_dst + line, 1);
        }
        float *row = qkv + t * qkv_width;
        if (L->q_norm) rms_norm(row, NULL, L->q_norm, Hq, D, dims->eps, row, 1);
        if (L->k_norm) rms_norm(row + Hq * D, NULL, L->k_norm, Hkv, D, dims->eps, row + Hq * D, 1);
        if (L->cos_table)
            rope(row, qkv_width, 1, Hq + Hkv, D, positions + t, L->cos_table, L->sin_table, (int)dims->rope_pairs, 1);
        kv_store_row(k_dst, row + Hq * D, kv_width, kv_dtype);
        kv_store_row(v_dst, row + (Hq + Hkv) * D, kv_width, kv_dtype);
    }
}

/* x [T, H]: the embeddings in; out, the residual stream before the last layer's MLP output is
 * added, which is left in residual [T, H] (the Python forward's x and residual after its loop).
 * positions, out_cache_loc int64 [T]; page_table int32 [T, pt_stride]; kv_lens int32 [T].
 * loras: NULL (no adapter in the step), or each token's adapter's pairs (lora_add), none of
 * rank above lora_max_r. Returns 0, or -1 when scratch memory could not be allocated. */
int decode_layers(const Layer *layers, int64_t n_layers, const Dims *dims, int64_t T, float *x, float *residual,
                  const int64_t *positions, const int64_t *out_cache_loc, const int32_t *page_table, int64_t pt_stride,
                  const int32_t *kv_lens,
                  const LoraPair *const *loras, int64_t lora_max_r, int threads) {
    const int64_t H = dims->hidden, I = dims->intermediate, Hq = dims->q_heads, Hkv = dims->kv_heads;
    const int64_t D = dims->head_dim, qkv_width = (Hq + 2 * Hkv) * D;
    const int kv_dtype = (int)dims->kv_dtype;
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
        if (lora_add(loras, l, LORA_QKV, h, T, H, qkv, qkv_width, xa, lora_max_r, threads)) return -1;
        attention_inputs(L, dims, qkv, T, positions, out_cache_loc, threads);
        if (paged_decode_attention_windowed(qkv, qkv_width, L->k_cache, L->v_cache, kv_dtype, page_table, pt_stride,
                                            kv_lens, T, Hq, Hkv, D, dims->page_size, dims->scale, L->window,
                                            dims->softcap, attn, threads))
            return -1;
        if (project(&L->o, attn, T, proj, threads)) return -1;
        if (lora_add(loras, l, LORA_O, attn, T, Hq * D, proj, H, xa, lora_max_r, threads)) return -1;
        if (L->attn_out_norm) rms_norm(proj, NULL, L->attn_out_norm, T, H, dims->eps, proj, threads);
        rms_norm(x, proj, L->post_norm, T, H, dims->eps, h, threads);
        /* act in one product where gate_up has one (the Python forward's GGUFWeight.gated) and no
         * adapter adds to gate_up's output in between */
        const int gated = L->gated != NULL && loras == NULL
                              ? L->gated(h, T, H, L->gate_up.parts[0].w, 2 * I, act, I, (int)dims->gelu, threads)
                              : -2;
        if (gated == -1) return -1;
        if (gated == -2) {
            if (project(&L->gate_up, h, T, gate_up, threads)) return -1;
            if (lora_add(loras, l, LORA_GATE_UP, h, T, H, gate_up, 2 * I, xa, lora_max_r, threads)) return -1;
            (dims->gelu ? gelu_tanh_mul : silu_mul)(gate_up, T, I, act, threads);
        }
        if (project(&L->down, act, T, residual, threads)) return -1;
        if (lora_add(loras, l, LORA_DOWN, act, T, I, residual, H, xa, lora_max_r, threads)) return -1;
        if (L->mlp_out_norm) rms_norm(residual, NULL, L->mlp_out_norm, T, H, dims->eps, residual, threads);
    }
    return 0;
}
