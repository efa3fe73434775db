"""The flashinfer backend against the torch backend on CUDA (skipped without CUDA/flashinfer):
same ragged batches of decodes, prompts and chunks after cached prefixes."""

import numpy as np
import pytest
import torch

pytest.importorskip("flashinfer")
if not torch.cuda.is_available():
    pytest.skip("flashinfer needs CUDA", allow_module_level=True)

from gpu.attention import create_backend
from gpu.forward_batch import SeqInput, build_forward_batch
from gpu.kvcache.kv_cache import KVCache
from gpu.kvcache.page_pool import PagePool

HQ, HKV, D, PS = 9, 3, 64, 16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [[(0, 1), (40, 1), (100, 1)], [(0, 37), (33, 1), (20, 50), (5, 1)]])
def test_flashinfer_matches_torch(dtype, shape):
    cuda = torch.device("cuda")
    gen = torch.Generator(device=cuda).manual_seed(0)
    pool = PagePool(num_pages=64, page_size=PS)
    kv = KVCache(num_layers=1, num_pages=64, page_size=PS, num_kv_heads=HKV, head_dim=D, dtype=dtype, device=cuda)
    kv.buffer.normal_(generator=gen)  # the cached prefixes
    seqs = [
        SeqInput(row, np.zeros(n, np.int32), start, pool.alloc(pool.pages_for(start + n)), True)
        for row, (start, n) in enumerate(shape)
    ]
    batch = build_forward_batch(seqs, PS, context_length=4096, device=cuda)
    T = batch.meta.num_tokens
    q = torch.randn(T, HQ, D, device=cuda, dtype=dtype, generator=gen)
    k = torch.randn(T, HKV, D, device=cuda, dtype=dtype, generator=gen)
    v = torch.randn(T, HKV, D, device=cuda, dtype=dtype, generator=gen)
    outs = []
    for name in ("torch", "flashinfer"):
        backend = create_backend(name, kv, HQ)
        backend.plan(batch.meta)
        outs.append(backend.forward(q, k, v, 0).float())
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-2, atol=2e-2)
