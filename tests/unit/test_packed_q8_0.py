"""gpu/quant/blocks.py's pack_q8_0 (gpu/kernels/gguf_q32.c's Q8_0 packed once, at load) against
the in-place blocks: the same rows bit for bit, the same products (bit for bit from 8 tokens,
where the in-place kernels pack the rows at each call with the same arithmetic; below, within
the rounding of the sums' order: the in-place one-token and pair products sum in lanes)."""

import numpy as np
import pytest
import torch

from gpu import kernels
from gpu.quant.blocks import pack_q8_0, packs_q8_0, repack_where_faster
from gpu.quant.gguf_types import type_kernels
from gpu.quant.gguf_weight import GGUFWeight, WeightPart


def q8_0_weight(N: int, K: int, seed: int) -> GGUFWeight:
    """Random Q8_0 blocks (every value, -128 too; moderate fp16 scales of both signs) in place."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (N, K // 32, 34), dtype=np.uint8)
    scales = (rng.uniform(0.001, 0.1, (N, K // 32)) * rng.choice((-1, 1), (N, K // 32))).astype(np.float16)
    blocks[..., 0:2] = scales[..., None].view(np.uint8)
    data = blocks.reshape(N, -1)
    part = WeightPart("w", "Q8_0", N, 0, data, data.ctypes.data, None, type_kernels("w", "Q8_0"))
    return GGUFWeight.of_parts((part,), (N, K), "q8")


def has_packed_kernels() -> bool:
    return kernels.cpu_kernels_available() and packs_q8_0(q8_0_weight(16, 32, 0))


pytestmark = pytest.mark.skipif(not has_packed_kernels(), reason="packed Q8_0 needs an AVX512-VNNI CPU")

SHAPES = ((37, 320), (48, 640), (16, 32))  # (N, K): the last chunk of 16 rows short; whole chunks; one block


@pytest.mark.parametrize("N, K", SHAPES)
def test_packed_rows_are_the_blocks_rows_bit_for_bit(N, K):
    in_place = q8_0_weight(N, K, seed=N + K)
    packed = pack_q8_0(in_place)
    ids = torch.tensor([0, N - 1, 5 % N, 5 % N, (N // 2)], dtype=torch.int64)
    assert torch.equal(packed.rows(ids), in_place.rows(ids))
    assert torch.equal(packed.dequantize(), in_place.dequantize())
    assert packed.nbytes == -(-N // 16) * 16 * (K // 32) * 34  # the blocks' bytes, the last chunk whole


@pytest.mark.parametrize("N, K", SHAPES)
@pytest.mark.parametrize("T", (1, 3, 7, 8, 9, 17, 29, 40))
def test_packed_products_are_the_in_place_ones(N, K, T):
    in_place = q8_0_weight(N, K, seed=2 * N + K)
    packed = pack_q8_0(in_place)
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(T))
    x[0, :32] = 0  # a block of zeros: scale 0
    want, got = in_place.matmul(x), packed.matmul(x)
    if T >= 8:
        assert torch.equal(got, want)
    else:
        magnitude = x.abs() @ in_place.dequantize().abs().t()
        assert ((got - want).abs() <= 1e-5 * magnitude + 1e-30).all()


def test_a_packed_product_writes_its_column_slice_only():
    """A packed part of a fused output: y's row stride past N, its other columns untouched."""
    packed = pack_q8_0(q8_0_weight(37, 320, seed=7))
    part = packed.parts[0]
    x = torch.randn(9, 320, generator=torch.Generator().manual_seed(3))
    y = torch.full((9, 40), float("nan"))
    assert part.kernels.gemm["q8"](x.data_ptr(), 9, 320, part.address, 37, y.data_ptr(), 40, 2) == 0
    assert torch.isnan(y[:, 37:]).all()
    assert torch.equal(y[:, :37], packed.matmul(x))


def test_load_packs_single_q8_0_weights_the_embedding_too():
    weights = {"embed": q8_0_weight(48, 64, seed=1), "layers.0.o": q8_0_weight(32, 64, seed=2)}
    f32 = GGUFWeight.of_parts(q8_0_weight(32, 64, seed=3).parts, (32, 64), "f32")  # the exact mode: in place
    weights["layers.0.down"] = f32
    repack_where_faster(weights)
    assert weights["embed"].parts[0].kernels is not type_kernels("w", "Q8_0")
    assert weights["layers.0.o"].parts[0].kernels is not type_kernels("w", "Q8_0")
    assert weights["layers.0.down"] is f32
