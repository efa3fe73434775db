"""gpu/kernels/ggml_cpu.c, the repacked Q4_1 product of --quantization gguf-q8 (the embedded
SmolLM2's projections): against the in-place Q4_1 kernel (gguf_q32.c, the same int8
arithmetic), at decode and prefill token counts, an even and an odd number of 8-row groups;
and its 16-row AVX512-VNNI products and its AVX-VNNI ones against the AVX2 build's, bit for bit."""

import ctypes

import numpy as np
import pytest
import torch
from kernel_variants import avx_vnni_library, built_with

from gpu import kernels
from gpu.quant.blocks import repack_q4_1
from gpu.quant.gguf_types import type_kernels
from gpu.quant.gguf_weight import GGUFWeight, WeightPart

pytestmark = pytest.mark.skipif(not kernels.cpu_kernels_available(), reason="needs an AVX2 CPU and a C compiler")

TOKENS = (1, 5, 16, 17, 29, 40)
SHAPES = ((48, 96), (40, 640))  # (N, K): 6 groups of 8 rows; 5 (the last one alone)


def q4_1_weight(N: int, K: int, seed: int) -> GGUFWeight:
    """Random Q4_1 blocks (moderate fp16 d and m, every nibble) as the in-place kernels take them."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (N, K // 32, 20), dtype=np.uint8)
    for offset in (0, 2):
        scales = (rng.uniform(0.001, 0.1, (N, K // 32)) * rng.choice((-1, 1), (N, K // 32))).astype(np.float16)
        blocks[..., offset : offset + 2] = scales[..., None].view(np.uint8)
    data = blocks.reshape(N, -1)
    part = WeightPart("w", "Q4_1", N, 0, data, data.ctypes.data, None, type_kernels("w", "Q4_1"))
    return GGUFWeight.of_parts((part,), (N, K), "q8")


def gemm_of(lib: ctypes.CDLL):
    """lib's gemm_q4_1_repacked_q8"""
    gemm = lib.gemm_q4_1_repacked_q8
    gemm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    gemm.argtypes += [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    gemm.restype = ctypes.c_int
    return gemm


@pytest.fixture(scope="module")
def avx2_gemm():
    return gemm_of(built_with("ggml_cpu", "GGML_CPU_AVX2_ONLY"))


@pytest.fixture(scope="module")
def avx_vnni_gemm():
    """The products as on a CPU with AVX-VNNI and no AVX-512"""
    return gemm_of(avx_vnni_library("ggml_cpu"))


@pytest.mark.parametrize("N, K", SHAPES)
@pytest.mark.parametrize("T", TOKENS)
def test_repacked_is_the_in_place_product(N, K, T):
    in_place = q4_1_weight(N, K, seed=N + K)
    repacked = repack_q4_1(in_place)
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(T))
    want = in_place.matmul(x)
    torch.testing.assert_close(repacked.matmul(x), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("N, K", SHAPES)
@pytest.mark.parametrize("T", TOKENS)
def test_avx512_vnni_products_are_the_avx2_ones_bit_for_bit(avx2_gemm, N, K, T):
    repacked = repack_q4_1(q4_1_weight(N, K, seed=2 * N + K))
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(100 + T))
    y = torch.full((T, N), float("nan"))
    part = repacked.parts[0]
    assert avx2_gemm(x.data_ptr(), T, K, part.address, N, y.data_ptr(), N, 2) == 0
    assert torch.equal(repacked.matmul(x), y)


@pytest.mark.parametrize("N, K", SHAPES)
@pytest.mark.parametrize("T", TOKENS)
def test_avx_vnni_products_are_the_avx2_ones_bit_for_bit(avx2_gemm, avx_vnni_gemm, N, K, T):
    """vpdpbusd's int32 sums of 4 are maddubs' int16 pairs summed (which never saturate here)"""
    part = repack_q4_1(q4_1_weight(N, K, seed=3 * N + K)).parts[0]
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(200 + T))
    y, want = torch.full((T, N), float("nan")), torch.full((T, N), float("nan"))
    assert avx_vnni_gemm(x.data_ptr(), T, K, part.address, N, y.data_ptr(), N, 2) == 0
    assert avx2_gemm(x.data_ptr(), T, K, part.address, N, want.data_ptr(), N, 2) == 0
    assert torch.equal(y, want)
