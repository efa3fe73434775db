"""The cpu attention backend's sliding windows and soft-capped scores (Gemma 2 / 3, SmolLM3)
against the torch backend, the reference pinned to transformers: mixed decode and extend steps
with windows smaller than, equal to and larger than the contexts, crossing pages, the decode's
chunks of 32 keys and the extend's of 64, prompts after cached prefixes, with and without the
cap, over the KV cache types and Gemma's GQA shapes; the keys before a window are not read; the
kernels' tanh against torch's in float64."""

import numpy as np
import pytest
import torch

from gpu.attention import create_backend, default_backend
from gpu.forward_batch import SeqInput, build_forward_batch
from gpu.kernels import cpu_kernels_available
from gpu.kvcache.kv_cache import KVCache

pytestmark = pytest.mark.skipif(
    not cpu_kernels_available(), reason="the cpu backend needs an AVX2 CPU and a C compiler"
)

# (cached prefix, new tokens) per request: decode requests among prompts, chunks after a prefix,
# prompts of more than one block of queries (48 at GQA 4, 64 at GQA 3) and a long decode
SHAPES = [(0, 85), (40, 1), (30, 50), (0, 2), (100, 20), (199, 1), (200, 3), (999, 1), (1, 64), (63, 1)]
LAYERS = 2


def _step(page_size: int, hq: int, hkv: int, d: int, dtype: torch.dtype):
    """A KV cache of random entries (its pages scattered through the pool), the step's metadata,
    each request's pages, and each layer's q, k, v."""
    gen = torch.Generator().manual_seed(0)
    counts = [-(-(start + n) // page_size) for start, n in SHAPES]
    num_pages = sum(counts) + 4
    kv = KVCache(LAYERS, num_pages, page_size, hkv, d, dtype, torch.device("cpu"))
    kv.buffer.copy_(torch.randn(kv.buffer.shape, generator=gen))
    order = torch.randperm(num_pages, generator=gen).numpy().astype(np.int32)
    pages = np.split(order[: sum(counts)], np.cumsum(counts)[:-1])
    seqs = [SeqInput(b, np.zeros(n, np.int32), start, pages[b], True) for b, (start, n) in enumerate(SHAPES)]
    meta = build_forward_batch(seqs, page_size, context_length=1024, device=torch.device("cpu")).meta
    T = meta.num_tokens
    qkv = [
        (
            torch.randn(T, hq + 2 * hkv, d, generator=gen)[:, :hq] * 2,  # a slice, as of the fused qkv; wide scores
            torch.randn(T, hkv, d, generator=gen),
            torch.randn(T, hkv, d, generator=gen),
        )
        for _ in range(LAYERS)
    ]
    return kv, meta, pages, qkv


def _attend(name, kv, hq, meta, qkv, windows, softcap):
    backend = create_backend(name, kv, hq)
    backend.configure(kv.head_dim**-0.5, windows, softcap)
    backend.plan(meta)
    return [backend.forward(q, k, v, layer) for layer, (q, k, v) in enumerate(qkv)]


def _poison_before_windows(kv, pages, window):
    """NaN into every cached key and value of layer 0 (the windowed one) before the first new
    token's window: a kernel that read one would return NaN."""
    for (start, _), p in zip(SHAPES, pages):
        j = np.arange(max(0, start - window + 1))
        slots = torch.from_numpy(p[j // kv.page_size].astype(np.int64) * kv.page_size + j % kv.page_size)
        kv.k_slots(0)[slots] = kv.v_slots(0)[slots] = float("nan")


# windows: one key; 7; the decode's chunk of keys; across the extend's chunk and many pages;
# equal to the 200-key request's context; larger than every context; none
@pytest.mark.parametrize(
    "window, softcap", [(1, None), (7, 3.0), (32, None), (77, 3.0), (200, None), (4096, 3.0), (None, 3.0)]
)
# Gemma 3 270M (4 q heads, 1 kv head, head_dim 256); GQA 3 at a small head dim, pages of 5
@pytest.mark.parametrize(
    "hq, hkv, d, dtype, page_size", [(4, 1, 256, torch.float32, 16), (6, 2, 64, torch.bfloat16, 5)]
)
def test_windows_and_softcap_equal_torch(window, softcap, hq, hkv, d, dtype, page_size):
    kv, meta, pages, qkv = _step(page_size, hq, hkv, d, dtype)
    windows = (window, None)  # the second layer attends to every key: the window is per layer
    want = _attend("torch", kv, hq, meta, qkv, windows, softcap)  # stores k, v; the cpu backend stores the same
    if window is not None:
        _poison_before_windows(kv, pages, window)
    got = _attend("cpu", kv, hq, meta, qkv, windows, softcap)
    for layer in range(LAYERS):
        torch.testing.assert_close(got[layer], want[layer], rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e5m2])
def test_windows_and_softcap_on_the_other_cache_types(dtype):
    hq, hkv, d = 8, 4, 256  # Gemma 2 2B's heads
    kv, meta, pages, qkv = _step(16, hq, hkv, d, dtype)
    want = _attend("torch", kv, hq, meta, qkv, (50, None), 50.0)  # Gemma 2's cap
    _poison_before_windows(kv, pages, 50)
    got = _attend("cpu", kv, hq, meta, qkv, (50, None), 50.0)
    for layer in range(LAYERS):
        torch.testing.assert_close(got[layer], want[layer], rtol=1e-5, atol=2e-5)


def test_soft_cap_is_tanh_to_two_epsilons():
    from gpu.attention.cpu import _library

    lib = _library()
    # every float magnitude a score takes, either sign: tiny, around the formula's switch at
    # |x / cap| = 0.625, and where tanh is 1 in float
    mags = torch.cat([torch.logspace(-30, 2, 20001), torch.linspace(0.6, 0.65, 1001) * 50])
    x = torch.cat([mags, -mags]).float().contiguous()
    cap = 50.0
    got = torch.empty_like(x)
    lib.soft_cap(x.data_ptr(), len(x), cap, got.data_ptr())
    want = torch.tanh(x.double() / cap) * cap
    # relative error in float32 epsilons: measured 1.54 (torch's own float32 tanh: 1.20)
    eps = ((got.double() - want).abs() / want.abs()).max() / torch.finfo(torch.float32).eps
    assert eps <= 2, f"{float(eps)} epsilons"


def test_gemma_runs_on_the_cpu_kernels_by_default():
    assert default_backend(torch.device("cpu"), plain_attention=False) == "cpu"
    # on CUDA only the torch backend has windows and soft-capping
    assert default_backend(torch.device("cuda"), plain_attention=False) == "torch"
