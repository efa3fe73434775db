"""gpu/quant/blocks.py's pack (the 32-element block types of gpu/kernels/gguf_q32.c, Q4_K and
Q6_K of gguf_kquants.c, packed once at load) against the in-place blocks: the same rows bit for
bit, the same products (bit for bit where the in-place kernels pack the rows at each call with
the same arithmetic: from 8 tokens, from 49 for the K-quants; below, within the rounding of the
sums' order), and the packed bytes."""

import dataclasses

import numpy as np
import pytest
import torch

from gpu import kernels
from gpu.quant.blocks import IN_PLACE_BELOW, PACKED_TYPES, pack, packs, repack_where_faster
from gpu.quant.gguf_quantize import quantize
from gpu.quant.gguf_types import BLOCK_TYPES, type_kernels
from gpu.quant.gguf_weight import GGUFWeight, WeightPart


def random_weight(type_name: str, N: int, K: int, seed: int, activations: str = "q8") -> GGUFWeight:
    """Random blocks of `type_name` in place. The 32-element types' bytes at random (every code
    and fifth bit, Q8_0's -128 too) with moderate fp16 scales and mins of both signs; the
    K-quants' from this project's quantizer of random values (their scales lie in many places)."""
    rng = np.random.default_rng(seed)
    block = BLOCK_TYPES[type_name]
    if block.block_elements == 256:
        data = quantize(rng.standard_normal((N, K)).astype(np.float32), type_name).reshape(N, -1)
    else:
        blocks = rng.integers(0, 256, (N, K // 32, block.block_bytes), dtype=np.uint8)
        halves = 2 if type_name in ("Q4_1", "Q5_1") else 1  # d, and m
        for h in range(halves):
            v = (rng.uniform(0.001, 0.1, (N, K // 32)) * rng.choice((-1, 1), (N, K // 32))).astype(np.float16)
            blocks[..., 2 * h : 2 * h + 2] = v[..., None].view(np.uint8)
        data = blocks.reshape(N, -1)
    part = WeightPart("w", type_name, N, 0, data, data.ctypes.data, None, type_kernels("w", type_name))
    return GGUFWeight.of_parts((part,), (N, K), activations)


# bytes a packed chunk of 16 rows holds a row's block: the blocks' own for the 32-element types;
# Q4_K's nibbles and float scales and mins of its 8 blocks of 32; Q6_K's codes a byte each and
# float scales of its 16 groups of 16
PACKED_BLOCK_BYTES = {**{t: BLOCK_TYPES[t].block_bytes for t in PACKED_TYPES}, "Q4_K": 128 + 64, "Q6_K": 256 + 64}
# tokens from which the in-place kernels pack the rows at each call: products bit for bit
PACKED_FROM = {**{t: 8 for t in PACKED_TYPES}, "Q4_K": 49, "Q6_K": 49}


def has_packed_kernels() -> bool:
    return kernels.cpu_kernels_available() and packs(random_weight("Q8_0", 16, 32, 0))


pytestmark = pytest.mark.skipif(not has_packed_kernels(), reason="packed weights need an AVX512-VNNI CPU")

# (N, K): the last chunk of 16 rows short; whole chunks; one block (a superblock for the K-quants)
SHAPES = ((37, 512), (48, 768), (16, 256))


@pytest.mark.parametrize("type_name", PACKED_TYPES)
@pytest.mark.parametrize("N, K", SHAPES)
def test_packed_rows_are_the_blocks_rows_bit_for_bit(type_name, N, K):
    in_place = random_weight(type_name, N, K, seed=N + K)
    packed = pack(in_place)
    ids = torch.tensor([0, N - 1, 5 % N, 5 % N, (N // 2)], dtype=torch.int64)
    assert torch.equal(packed.rows(ids), in_place.rows(ids))
    assert torch.equal(packed.dequantize(), in_place.dequantize())
    chunk_rows = -(-N // 16) * 16  # the last chunk whole
    blocks = K // BLOCK_TYPES[type_name].block_elements
    kept = in_place.nbytes if type_name in IN_PLACE_BELOW else 0  # the blocks read below IN_PLACE_BELOW tokens
    assert packed.nbytes == chunk_rows * blocks * PACKED_BLOCK_BYTES[type_name] + kept


@pytest.mark.parametrize("type_name", PACKED_TYPES)
@pytest.mark.parametrize("N, K", SHAPES)
@pytest.mark.parametrize("T", (1, 3, 7, 8, 9, 17, 29, 40, 60, 600))
def test_packed_products_are_the_in_place_ones(type_name, N, K, T):
    in_place = random_weight(type_name, N, K, seed=2 * N + K)
    packed = pack(in_place)
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(T))
    x[0, :32] = 0  # a block of zeros: scale 0
    want, got = in_place.matmul(x), packed.matmul(x)
    if T >= PACKED_FROM[type_name]:
        assert torch.equal(got, want)
    else:
        magnitude = x.abs() @ in_place.dequantize().abs().t()
        assert ((got - want).abs() <= 1e-5 * magnitude + 1e-30).all()


@pytest.mark.parametrize("type_name", ("Q4_K", "Q6_K"))
def test_a_packed_k_quant_reads_its_blocks_for_few_tokens(type_name):
    """Below IN_PLACE_BELOW tokens a K-quant's product reads the blocks it was packed from (the
    in-place kernel's result exactly), from there its packed copy (the packed kernel's)."""
    in_place = random_weight(type_name, 48, 768, seed=11)
    packed = pack(in_place)
    part = packed.parts[0]
    below = IN_PLACE_BELOW[type_name]
    assert part.in_place is in_place.parts[0] and part.in_place_below == below
    copy_only = GGUFWeight.of_parts((dataclasses.replace(part, in_place=None, in_place_below=0),), (48, 768), "q8")
    for T in range(1, below + 2):
        x = torch.randn(T, 768, generator=torch.Generator().manual_seed(T))
        want = in_place.matmul(x) if T < below else copy_only.matmul(x)
        assert torch.equal(packed.matmul(x), want), T
    if below > 1:  # the two kernels differ where the blocks are read (sums in another order)
        x = torch.randn(1, 768, generator=torch.Generator().manual_seed(1))
        assert not torch.equal(copy_only.matmul(x), in_place.matmul(x))


def test_the_32_block_types_drop_their_blocks_once_packed():
    """Their packed copy is the blocks' size and faster at every count: nothing kept in place."""
    for type_name in PACKED_TYPES:
        if type_name not in IN_PLACE_BELOW:
            part = pack(random_weight(type_name, 16, 256, seed=3)).parts[0]
            assert part.in_place is None and part.in_place_below == 0


def test_a_packed_product_writes_its_column_slice_only():
    """A packed part of a fused output: y's row stride past N, its other columns untouched."""
    packed = pack(random_weight("Q5_0", 37, 320, seed=7))
    part = packed.parts[0]
    x = torch.randn(9, 320, generator=torch.Generator().manual_seed(3))
    y = torch.full((9, 40), float("nan"))
    assert part.kernels.gemm["q8"](x.data_ptr(), 9, 320, part.address, 37, y.data_ptr(), 40, 2) == 0
    assert torch.isnan(y[:, 37:]).all()
    assert torch.equal(y[:, :37], packed.matmul(x))


@pytest.mark.parametrize("type_name", ("Q8_0", "Q5_0", "Q4_K", "Q6_K"))  # the two files' packed products
def test_an_output_past_the_caches_is_the_same_streamed(type_name):
    """A product whose output and weight reach simd_math.h's STREAM_OUTPUT_BYTES (a
    vocabulary's logits for a batch) writes its 64-byte aligned rows with non-temporal stores:
    the same values bit for bit as the same tokens' products written in pieces below it, into
    an aligned output and into one whose rows are not (a column slice)."""
    N, K, T = 65536, 512, 128  # 32 MiB of output, a quarter of the tokens 8 MiB; 18-50 MiB of weight
    packed = pack(random_weight(type_name, N, K, seed=5))
    part = packed.parts[0]
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(5))
    pieces = torch.cat([packed.matmul(x[t : t + T // 4]) for t in range(0, T, T // 4)])
    assert torch.equal(packed.matmul(x), pieces)
    y = torch.full((T, N + 3), float("nan"))
    assert part.kernels.gemm["q8"](x.data_ptr(), T, K, part.address, N, y.data_ptr(), N + 3, 2) == 0
    assert torch.equal(y[:, :N], pieces) and torch.isnan(y[:, N:]).all()


def fused(*weights: GGUFWeight) -> GGUFWeight:
    """The weights' single parts as one weight's, their rows one after another."""
    parts, offset = [], 0
    for w in weights:
        p = w.parts[0]
        parts.append(WeightPart(p.name, p.type_name, p.rows, offset, p.data, p.address, None, p.kernels))
        offset += p.rows
    return GGUFWeight.of_parts(tuple(parts), (offset, weights[0].shape[1]), "q8")


def test_a_fused_weight_packs_the_parts_of_packed_types_and_keeps_the_others():
    """Gemma 3's qkv mixes Q5_0 and Q8_0 parts; a part of a type with no packed kernels stays in place."""
    q, k = random_weight("Q5_0", 32, 256, seed=1), random_weight("Q8_0", 16, 256, seed=2)
    v = GGUFWeight.of_parts((random_weight("Q5_K", 16, 256, seed=3).parts[0],), (16, 256), "q8")
    weight = fused(q, k, v)
    packed = pack(weight)
    assert [p.kernels is weight.parts[i].kernels for i, p in enumerate(packed.parts)] == [False, False, True]
    x = torch.randn(12, 256, generator=torch.Generator().manual_seed(5))
    assert torch.equal(packed.matmul(x), weight.matmul(x))
    assert torch.equal(packed.dequantize(), weight.dequantize())


def test_consecutive_parts_of_one_type_pack_into_one_part(monkeypatch):
    """Gemma 3's q and k (Q5_0, its v Q8_0 in half the layers), its gate and up: one packed part
    of a type, one product for both (x quantized once), whose values are the separate parts'
    bit for bit at every count of tokens. A part whose rows end inside a chunk of 16 is not
    joined by the next, nor is a K-quant, whose blocks are kept in place for few tokens."""
    q, k, v = (
        random_weight("Q5_0", 32, 256, seed=1),
        random_weight("Q5_0", 16, 256, seed=2),
        random_weight("Q8_0", 16, 256, seed=3),
    )
    weight = fused(q, k, v)
    packed = pack(weight)
    assert [(p.type_name, p.rows, p.offset) for p in packed.parts] == [("Q5_0", 48, 0), ("Q8_0", 16, 48)]
    monkeypatch.setattr("gpu.quant.blocks._joins", lambda *args: False)
    apart = pack(weight)
    assert len(apart.parts) == 3
    for T in (1, 3, 12, 40):
        x = torch.randn(T, 256, generator=torch.Generator().manual_seed(T))
        assert torch.equal(packed.matmul(x), apart.matmul(x)), T
    monkeypatch.undo()
    assert torch.equal(packed.dequantize(), weight.dequantize())
    ragged = fused(random_weight("Q5_0", 37, 256, seed=4), random_weight("Q5_0", 16, 256, seed=5))
    assert [p.rows for p in pack(ragged).parts] == [37, 16]
    k_quants = fused(random_weight("Q4_K", 16, 256, seed=6), random_weight("Q4_K", 16, 256, seed=7))
    assert [p.rows for p in pack(k_quants).parts] == [16, 16]


@pytest.mark.parametrize("type_name", ("Q4_0", "Q5_0", "Q8_0", "IQ4_NL"))
def test_a_gated_product_is_the_product_then_the_glue(type_name):
    """GGUFWeight.gated of an MLP's packed gate and up (one part: pack joins them) is the C glue's
    act(gate) * up of their product, bit for bit, at every count of tokens and both activations,
    into new storage and into given storage; None where there is no such product: halves that
    are not whole chunks of 16 rows, parts apart, a K-quant."""
    from gpu.models.llama import CpuLayerOps

    ops = CpuLayerOps(torch.ones(1, 1), torch.zeros(1, 1))  # its glue only: no rope here
    I, K = 48, 256
    weight = pack(fused(random_weight(type_name, I, K, seed=1), random_weight(type_name, I, K, seed=2)))
    assert len(weight.parts) == 1
    for T in (1, 3, 12, 40, 300):
        x = torch.randn(T, K, generator=torch.Generator().manual_seed(T))
        gate_up = weight.matmul(x)
        assert torch.equal(weight.gated(x, True), ops.gelu_tanh_mul(gate_up)), T
        out = torch.full((T, I), float("nan"))
        assert weight.gated(x, False, out=out) is out
        assert torch.equal(out, ops.silu_mul(gate_up)), T
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(0))
    assert (
        pack(fused(random_weight("Q8_0", 24, K, seed=3), random_weight("Q8_0", 24, K, seed=4))).gated(x, True) is None
    )
    apart = fused(
        random_weight(type_name, I, K, seed=1), random_weight("Q8_0" if type_name != "Q8_0" else "Q5_0", I, K, seed=2)
    )
    assert pack(apart).gated(x, True) is None
    assert pack(random_weight("Q4_K", 2 * I, K, seed=5)).gated(x, True) is None
    with pytest.raises(ValueError, match="out"):
        weight.gated(x, True, out=torch.empty(4, 2 * I))


def test_load_packs_q8_weights_the_embedding_too():
    weights = {"embed": random_weight("Q8_0", 48, 64, seed=1), "layers.0.o": random_weight("Q5_0", 32, 64, seed=2)}
    weights["layers.0.down"] = f32 = random_weight("Q8_0", 32, 64, seed=3, activations="f32")  # the exact mode
    repack_where_faster(weights)
    assert weights["embed"].parts[0].kernels is not type_kernels("w", "Q8_0")
    assert weights["layers.0.o"].parts[0].kernels is not type_kernels("w", "Q5_0")
    assert weights["layers.0.down"] is f32
