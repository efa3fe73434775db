"""The torch and cpu attention backends against a per-request softmax(q k^T) v written out
longhand, on ragged batches mixing decode, prefill and chunked prefill with pages scattered in
the pool; the cpu backend against the torch backend on mixed steps over page sizes, KV cache
types, GQA ratios and head dims, and the same whatever its thread count."""

import numpy as np
import pytest
import torch

from gpu.attention import create_backend
from gpu.forward_batch import SeqInput, build_forward_batch
from gpu.kernels import cpu_kernels_available
from gpu.kvcache.kv_cache import KVCache
from gpu.kvcache.page_pool import PagePool

HQ, HKV, D, PS = 6, 2, 16, 4


def _reference(q, keys, vals, q_pos):
    # q: [n, Hq, D], keys/vals: [L, Hkv, D], q_pos: [n] -> [n, Hq, D]
    keys = keys.repeat_interleave(HQ // HKV, dim=1)
    vals = vals.repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, keys) * D**-0.5
    visible = torch.arange(len(keys))[None, :] <= torch.as_tensor(q_pos)[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hnl,lhd->nhd", probs, vals)


@pytest.mark.parametrize(
    "shape",
    [
        [(0, 1), (5, 1), (12, 1)],  # decode only
        [(0, 7), (0, 1), (3, 9), (13, 1)],  # prefill, decode, chunk after a cached prefix
        [(0, 16)],  # one prompt filling whole pages
        [(0, 11)],  # one prompt ending mid-page: SDPA's own causal mask
        [(0, 9), (0, 14)],  # two prompts
        [(3, 5), (10, 5)],  # equal chunks after different prefixes: no query padding
        [(0, 1), (37, 1), (5, 1), (58, 1)],  # decode: lengths under, over and between 8-wide vectors
    ],
)
@pytest.mark.parametrize("name", ["torch", "cpu"])
def test_backend_matches_longhand_attention(name, shape):
    if name == "cpu" and not cpu_kernels_available():
        pytest.skip("the cpu backend needs an AVX2 CPU and a C compiler")
    gen = torch.Generator().manual_seed(0)
    pool = PagePool(num_pages=40, page_size=PS)
    kv = KVCache(
        num_layers=2,
        num_pages=40,
        page_size=PS,
        num_kv_heads=HKV,
        head_dim=D,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    backend = create_backend(name, kv, HQ)
    pool.alloc(3)  # so requests' pages do not start at 0
    seqs, history = [], []
    for row, (start, n) in enumerate(shape):
        pages = pool.alloc(pool.pages_for(start + n))
        pool.alloc(1)  # a gap between requests' pages
        # the cached prefix: write it straight into the cache
        k_all = torch.randn(start + n, HKV, D, generator=gen)
        v_all = torch.randn(start + n, HKV, D, generator=gen)
        for layer in range(2):
            for p in range(start):
                slot = pages[p // PS] * PS + p % PS
                kv.k_slots(layer)[slot], kv.v_slots(layer)[slot] = k_all[p], v_all[p]
        seqs.append(SeqInput(row, np.zeros(n, np.int32), start, pages, True))
        history.append((k_all, v_all))
    batch = build_forward_batch(seqs, PS, context_length=64, device=torch.device("cpu"))
    T = batch.meta.num_tokens
    backend.plan(batch.meta)
    for layer in range(2):
        q = torch.randn(T, HQ + 2 * HKV, D, generator=gen)[:, :HQ]  # a slice, as of the model's fused qkv
        k = torch.cat([h[0][s.start :] for h, s in zip(history, seqs)])
        v = torch.cat([h[1][s.start :] for h, s in zip(history, seqs)])
        o = backend.forward(q, k, v, layer)
        indptr = batch.meta.qo_indptr_host
        for b, (s, (k_all, v_all)) in enumerate(zip(seqs, history)):
            sl = slice(indptr[b], indptr[b + 1])
            want = _reference(q[sl], k_all, v_all, np.arange(s.start, s.start + len(s.token_ids)))
            torch.testing.assert_close(o[sl], want, rtol=1e-5, atol=1e-5)


# One mixed step: decode requests among extend ones of many shapes: prompts with no cached
# prefix, new tokens after a prefix, a middle chunk, q_len over a query block (48 rows: 16
# queries of 3 heads) and over a key chunk (64), and not a multiple of either.
MIXED = [(0, 85), (40, 1), (30, 85), (0, 2), (100, 20), (7, 1), (0, 130), (200, 3), (63, 1), (1, 64)]


def _mixed_step(page_size, hq, hkv, d, dtype, seed=0):
    """A KV cache of random (finite) entries, one layer's q, k, v and the step's metadata, each
    request's pages scattered through the pool."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-(start + n) // page_size) for start, n in MIXED]
    num_pages = sum(counts) + 8
    kv = KVCache(
        num_layers=1,
        num_pages=num_pages,
        page_size=page_size,
        num_kv_heads=hkv,
        head_dim=d,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    kv.buffer.copy_(torch.randn(kv.buffer.shape, generator=gen))
    order = torch.randperm(num_pages, generator=gen).numpy().astype(np.int32)
    pages = np.split(order[: sum(counts)], np.cumsum(counts)[:-1])
    seqs = [SeqInput(b, np.zeros(n, np.int32), start, pages[b], True) for b, (start, n) in enumerate(MIXED)]
    meta = build_forward_batch(seqs, page_size, context_length=512, device=torch.device("cpu")).meta
    T = meta.num_tokens
    q = torch.randn(T, hq + 2 * hkv, d, generator=gen)[:, :hq]  # a slice, as of the model's fused qkv
    return kv, meta, q, torch.randn(T, hkv, d, generator=gen), torch.randn(T, hkv, d, generator=gen)


def _attend(name, kv, hq, meta, q, k, v):
    backend = create_backend(name, kv, hq)
    backend.plan(meta)
    return backend.forward(q, k, v, 0)


@pytest.mark.skipif(not cpu_kernels_available(), reason="the cpu backend needs an AVX2 CPU and a C compiler")
# GQA 3 (SmolLM2); GQA 1 with D not a multiple of 16; GQA 4 at the largest D; GQA 7 (Qwen2's 14 / 2:
# a kv head's query heads in two blocks, 4 and 3)
@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (4, 4, 40), (8, 2, 256), (14, 2, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e5m2])
@pytest.mark.parametrize("page_size", [1, 16, 5])
def test_cpu_backend_equals_torch_on_mixed_steps(page_size, dtype, hq, hkv, d):
    kv, meta, q, k, v = _mixed_step(page_size, hq, hkv, d, dtype)
    want = _attend("torch", kv, hq, meta, q, k, v)  # stores k, v; the cpu backend stores the same again
    got = _attend("cpu", kv, hq, meta, q, k, v)
    # both compute in fp32 from the same (widened) cache entries; only the sums' order differs:
    # |out| is up to ~3.5 here and the differences measured stay under 2.1e-6 (1.1e-6 but at D 256)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_kernels_available(), reason="the cpu backend needs an AVX2 CPU and a C compiler")
def test_cpu_backend_result_does_not_depend_on_the_thread_count():
    kv, meta, q, k, v = _mixed_step(16, 9, 3, 64, torch.float32)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(_attend("cpu", kv, 9, meta, q, k, v))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.skipif(not cpu_kernels_available(), reason="the cpu backend needs an AVX2 CPU and a C compiler")
def test_cpu_backend_runs_a_bf16_model_through_the_torch_backend():
    kv, meta, q, k, v = _mixed_step(16, 9, 3, 64, torch.bfloat16)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()  # the kernels take fp32 queries only
    assert torch.equal(_attend("cpu", kv, 9, meta, q, k, v), _attend("torch", kv, 9, meta, q, k, v))


@pytest.mark.parametrize(
    "start, n, pages, message",
    [
        (0, 5, 1, "need >= 1 token, 2 pages \\(has 1\\)"),
        (60, 5, 17, "at most context_length=64"),
        (0, 0, 1, "need >= 1 token"),
    ],
)
def test_bad_seq_inputs_name_the_row(start, n, pages, message):
    seqs = [
        SeqInput(0, np.zeros(1, np.int32), 0, np.zeros(1, np.int32), True),
        SeqInput(7, np.zeros(n, np.int32), start, np.arange(pages, dtype=np.int32), True),
    ]
    with pytest.raises(ValueError, match="the sequence of row 7: .*" + message):
        build_forward_batch(seqs, PS, context_length=64, device=torch.device("cpu"))
