"""Triton paged attention kernels equal a plain torch reference (CPU, TRITON_INTERPRET=1).

triton decides between interpreted and compiled kernels when a @triton.jit function is defined (and
imports parts of itself lazily at the first launch), so TRITON_INTERPRET=1 is set by a fixture for
this module's tests only, around a fresh import of the kernels; the import is dropped again after
them. The CUDA test runs this file as a script in a child process without TRITON_INTERPRET, which
gets the compiled kernels.
"""

import importlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from gpu.attention import create_backend
from gpu.forward_batch import SeqInput, build_forward_batch
from gpu.kvcache.kv_cache import KVCache

KERNELS = "gpu.kernels.triton_attention"
TRITON_MODULES = (KERNELS, "gpu.attention.triton")


@pytest.fixture(scope="module")
def kernels():
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRITON_INTERPRET", "1")
        for name in TRITON_MODULES:
            sys.modules.pop(name, None)
        yield importlib.import_module(KERNELS)
        for name in TRITON_MODULES:
            sys.modules.pop(name, None)


def reference_attention(q, k_cache, v_cache, qo_indptr, page_table, kv_lens, sm_scale):
    """Per request: gather its kv positions through the page table, causal softmax, in fp32."""
    page_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    k_flat, v_flat = k_cache.flatten(0, 1).float(), v_cache.flatten(0, 1).float()
    out = []
    for b in range(len(kv_lens)):
        q_start, q_end, kv_len = int(qo_indptr[b]), int(qo_indptr[b + 1]), int(kv_lens[b])
        pos = torch.arange(kv_len, device=q.device)
        slots = page_table[b, pos // page_size].long() * page_size + pos % page_size
        k = k_flat[slots].repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v_flat[slots].repeat_interleave(group, dim=1)
        s = torch.einsum("thd,lhd->htl", q[q_start:q_end].float(), k) * sm_scale
        q_pos = kv_len - (q_end - q_start) + torch.arange(q_end - q_start, device=q.device)
        s = s.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out.append(torch.einsum("htl,lhd->thd", s.softmax(-1), v))
    return torch.cat(out)


def make_batch(q_lens, prefix_lens, page_size, num_q_heads, num_kv_heads, head_dim, dtype, device, seed=0):
    """A ragged batch over a cache whose pages are handed out in a random order, with spare pages."""
    gen = torch.Generator().manual_seed(seed)
    kv_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    pages_per_req = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(pages_per_req) + 3
    k_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_pages, generator=gen).to(torch.int32)
    page_table = torch.zeros(len(q_lens), max(pages_per_req), dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per_req):
        page_table[b, :n] = order[used : used + n]
        used += n
    qo_indptr = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen)
    to = dict(device=device)
    return dict(
        q=q.to(dtype=dtype, **to),
        k_cache=k_cache.to(dtype=dtype, **to),
        v_cache=v_cache.to(dtype=dtype, **to),
        qo_indptr=qo_indptr.to(**to),
        page_table=page_table.to(**to),
        kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
        max_q_len=max(q_lens),
    )


# Decode rows inside an extend batch, prefixes 0 and > 0, one request longer than a 64-token kv block
# and one with more new tokens than a 64-row query block.
EXTEND_Q_LENS = [1, 9, 1, 17, 70]
EXTEND_PREFIX_LENS = [12, 0, 0, 50, 3]
# A context shorter than the number of splits leaves splits empty.
DECODE_KV_LENS = [1, 2, 17, 80, 33]


def check_extend(kernels, head_dim, page_size, dtype, device, atol):
    batch = make_batch(EXTEND_Q_LENS, EXTEND_PREFIX_LENS, page_size, 6, 2, head_dim, dtype, device)
    scale = head_dim**-0.5
    # q as the model hands it over: a strided view into a fused qkv projection output
    qkv = torch.cat([batch["q"], torch.zeros_like(batch["q"][:, :4])], dim=1)
    out = kernels.extend_attention(
        qkv[:, :6],
        batch["k_cache"],
        batch["v_cache"],
        batch["qo_indptr"],
        batch["page_table"],
        batch["kv_lens"],
        batch["max_q_len"],
        scale,
    )
    ref = reference_attention(
        batch["q"],
        batch["k_cache"],
        batch["v_cache"],
        batch["qo_indptr"].tolist(),
        batch["page_table"],
        batch["kv_lens"].tolist(),
        scale,
    )
    assert out.dtype == dtype and out.shape == batch["q"].shape
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=0)


def check_decode(kernels, head_dim, page_size, num_kv_splits, dtype, device, atol):
    q_lens = [1] * len(DECODE_KV_LENS)
    prefix_lens = [n - 1 for n in DECODE_KV_LENS]
    batch = make_batch(q_lens, prefix_lens, page_size, 6, 2, head_dim, dtype, device, seed=1)
    scale = head_dim**-0.5
    out = kernels.decode_attention(
        batch["q"],
        batch["k_cache"],
        batch["v_cache"],
        batch["page_table"],
        batch["kv_lens"],
        scale,
        num_kv_splits=num_kv_splits,
    )
    ref = reference_attention(
        batch["q"],
        batch["k_cache"],
        batch["v_cache"],
        batch["qo_indptr"].tolist(),
        batch["page_table"],
        batch["kv_lens"].tolist(),
        scale,
    )
    assert out.dtype == dtype and out.shape == batch["q"].shape
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=0)


SHAPES = [(64, 1), (64, 5), (128, 8), (128, 16)]


@pytest.mark.parametrize("head_dim,page_size", SHAPES)
def test_extend_matches_reference(kernels, head_dim, page_size):
    check_extend(kernels, head_dim, page_size, torch.float32, "cpu", atol=1e-5)


@pytest.mark.parametrize("head_dim,page_size", SHAPES)
def test_decode_matches_reference(kernels, head_dim, page_size):
    check_decode(kernels, head_dim, page_size, 1, torch.float32, "cpu", atol=1e-5)


@pytest.mark.parametrize("head_dim,page_size", [(64, 5), (128, 16)])
def test_decode_split_kv_matches_reference(kernels, head_dim, page_size):
    check_decode(kernels, head_dim, page_size, 3, torch.float32, "cpu", atol=1e-5)


def test_bad_inputs_name_the_parameter(kernels):
    batch = make_batch([2], [3], 4, 6, 2, 64, torch.float32, "cpu")
    args = (
        batch["q"],
        batch["k_cache"],
        batch["v_cache"],
        batch["qo_indptr"],
        batch["page_table"],
        batch["kv_lens"],
        batch["max_q_len"],
        0.125,
    )
    with pytest.raises(ValueError, match="kv_lens"):
        kernels.extend_attention(*args[:5], batch["kv_lens"].long(), *args[6:])
    with pytest.raises(ValueError, match="q:"):
        kernels.extend_attention(batch["q"][:, :5], *args[1:])
    with pytest.raises(ValueError, match="k_cache"):
        kernels.extend_attention(batch["q"], batch["k_cache"][:, :, :1], *args[2:])
    with pytest.raises(ValueError, match="num_kv_splits"):
        kernels.decode_attention(
            batch["q"][:1],
            batch["k_cache"],
            batch["v_cache"],
            batch["page_table"],
            batch["kv_lens"],
            0.125,
            num_kv_splits=0,
        )


def check_backend_matches_torch(page_size, dtype, device, atol):
    """Two layers of a mixed step (prefixes, decode rows, page boundaries), then a decode-only step
    continuing every request, through both backends on caches that start out identical."""
    num_layers, num_q_heads, num_kv_heads, head_dim = 2, 6, 2, 64
    q_lens, starts = [1, 9, 1, 17, 4], [12, 0, 30, 5, 0]
    kv_lens = [s + n for s, n in zip(starts, q_lens)]
    pages_needed = [-(-(n + 1) // page_size) for n in kv_lens]  # room for the decode step's token
    num_pages = sum(pages_needed) + 3
    rng = np.random.default_rng(page_size)
    order = rng.permutation(num_pages).astype(np.int32)
    pages = np.split(order[: sum(pages_needed)], np.cumsum(pages_needed)[:-1])
    mixed = [
        SeqInput(row=b, token_ids=np.zeros(n, np.int32), start=s, page_ids=p, sample=True)
        for b, (n, s, p) in enumerate(zip(q_lens, starts, pages))
    ]
    decode = [
        SeqInput(row=b, token_ids=np.zeros(1, np.int32), start=n, page_ids=p, sample=True)
        for b, (n, p) in enumerate(zip(kv_lens, pages))
    ]

    gen = torch.Generator().manual_seed(page_size)
    init = torch.randn(num_layers, 2, num_pages, page_size, num_kv_heads, head_dim, generator=gen)
    steps = []
    for seqs in (mixed, decode):
        meta = build_forward_batch(seqs, page_size, 4096, torch.device(device)).meta
        T = meta.num_tokens
        qkv = [
            (
                torch.randn(T, num_q_heads, head_dim, generator=gen).to(device, dtype),
                torch.randn(T, num_kv_heads, head_dim, generator=gen).to(device, dtype),
                torch.randn(T, num_kv_heads, head_dim, generator=gen).to(device, dtype),
            )
            for _ in range(num_layers)
        ]
        steps.append((meta, qkv))

    results = {}
    for name in ("torch", "triton"):
        cache = KVCache(num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, torch.device(device))
        cache.buffer.copy_(init)
        backend = create_backend(name, cache, num_q_heads)
        outs = []
        for meta, qkv in steps:
            backend.plan(meta)
            outs += [backend.forward(q, k, v, layer) for layer, (q, k, v) in enumerate(qkv)]
        results[name] = outs, cache.buffer
    (ref_outs, ref_cache), (outs, cache) = results["torch"], results["triton"]
    assert torch.equal(cache, ref_cache)
    for out, ref in zip(outs, ref_outs):
        torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("page_size", [5, 16])
def test_backend_matches_torch_backend(kernels, page_size):
    check_backend_matches_torch(page_size, torch.float32, "cpu", atol=1e-5)


def test_backend_on_cpu_without_interpreter_is_a_clear_error():
    code = (
        "import torch\n"
        "from gpu.attention import create_backend\n"
        "from gpu.kvcache.kv_cache import KVCache\n"
        "create_backend('triton', KVCache(1, 4, 16, 2, 64, torch.float32, torch.device('cpu')), 6)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert child.returncode != 0
    assert "ValueError: --attention-backend triton needs a CUDA device" in child.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for the compiled kernels")
def test_compiled_kernels_on_cuda():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, __file__], env=env, check=True, timeout=600)


def run_cuda_checks():
    kernels = importlib.import_module(KERNELS)
    for dtype, atol in [(torch.float32, 1e-4), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)]:
        for head_dim, page_size in SHAPES:
            check_extend(kernels, head_dim, page_size, dtype, "cuda", atol)
            for num_kv_splits in (1, 4):
                check_decode(kernels, head_dim, page_size, num_kv_splits, dtype, "cuda", atol)
        for page_size in (1, 5, 16):
            check_backend_matches_torch(page_size, dtype, "cuda", atol)
    print("compiled triton attention kernels match the reference on CUDA")


if __name__ == "__main__":
    run_cuda_checks()
