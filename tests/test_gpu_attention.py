"""The torch and cpu attention backends against a per-request softmax(q k^T) v written out
longhand, on ragged batches mixing decode, prefill and chunked prefill with pages scattered in
the pool."""
import numpy as np
import pytest
import torch

from gpu.attention import create_backend
from gpu.forward_batch import SeqInput, build_forward_batch
from gpu.kernels import cpu_kernels_available
from gpu.kv_cache import KVCache
from gpu.page_pool import PagePool

HQ, HKV, D, PS = 6, 2, 16, 4


def _reference(q, keys, vals, q_pos):
    # q: [n, Hq, D], keys/vals: [L, Hkv, D], q_pos: [n] -> [n, Hq, D]
    keys = keys.repeat_interleave(HQ // HKV, dim=1)
    vals = vals.repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, keys) * D ** -0.5
    visible = torch.arange(len(keys))[None, :] <= torch.as_tensor(q_pos)[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hnl,lhd->nhd", probs, vals)


@pytest.mark.parametrize("shape", [
    [(0, 1), (5, 1), (12, 1)],            # decode only
    [(0, 7), (0, 1), (3, 9), (13, 1)],    # prefill, decode, chunk after a cached prefix
    [(0, 16)],                            # one prompt filling whole pages
    [(0, 11)],                            # one prompt ending mid-page: SDPA's own causal mask
    [(0, 9), (0, 14)],                    # two prompts
    [(3, 5), (10, 5)],                    # equal chunks after different prefixes: no query padding
    [(0, 1), (37, 1), (5, 1), (58, 1)],   # decode: lengths under, over and between 8-wide vectors
])
@pytest.mark.parametrize("name", ["torch", "cpu"])
def test_backend_matches_longhand_attention(name, shape):
    if name == "cpu" and not cpu_kernels_available():
        pytest.skip("the cpu backend needs an AVX2 CPU and a C compiler")
    gen = torch.Generator().manual_seed(0)
    pool = PagePool(num_pages=40, page_size=PS)
    kv = KVCache(num_layers=2, num_pages=40, page_size=PS, num_kv_heads=HKV, head_dim=D,
                 dtype=torch.float32, device=torch.device("cpu"))
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
        k = torch.cat([h[0][s.start:] for h, s in zip(history, seqs)])
        v = torch.cat([h[1][s.start:] for h, s in zip(history, seqs)])
        o = backend.forward(q, k, v, layer)
        indptr = batch.meta.qo_indptr_host
        for b, (s, (k_all, v_all)) in enumerate(zip(seqs, history)):
            sl = slice(indptr[b], indptr[b + 1])
            want = _reference(q[sl], k_all, v_all, np.arange(s.start, s.start + len(s.token_ids)))
            torch.testing.assert_close(o[sl], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("start, n, pages, message", [
    (0, 5, 1, "need >= 1 token, 2 pages \\(has 1\\)"),
    (60, 5, 17, "at most context_length=64"),
    (0, 0, 1, "need >= 1 token"),
])
def test_bad_seq_inputs_name_the_row(start, n, pages, message):
    seqs = [SeqInput(0, np.zeros(1, np.int32), 0, np.zeros(1, np.int32), True),
            SeqInput(7, np.zeros(n, np.int32), start, np.arange(pages, dtype=np.int32), True)]
    with pytest.raises(ValueError, match="SeqInput of row 7: .*" + message):
        build_forward_batch(seqs, PS, context_length=64, device=torch.device("cpu"))
