"""A GGUF file's tensors used in place (gpu/quant/gguf_weight.py): a fused weight of parts of
different types dequantizes to gguf-py's values, its f32 product is the product of those
values, its q8 product stays within the int8 rounding of x, its rows are an embedding
lookup; nothing is copied and torch's warning about the read-only mapping never shows. A type
no kernel takes is one ModelLoadError naming the tensor and its type. The rope of a Llama-
architecture GGUF's q/k rows (llama.cpp's adjacent pairs) gives rotate-half's q.k."""

from __future__ import annotations

import warnings

import gguf
import numpy as np
import pytest
import torch
from gguf_blocks import add_tensor, dequantize

from gpu.kernels import cpu_kernels_available
from gpu.models.llama import CpuLayerOps, TorchLayerOps, linear
from gpu.models.model_files import ModelLoadError
from gpu.quant.gguf_types import BLOCK_TYPES, type_kernels

needs_kernels = pytest.mark.skipif(not cpu_kernels_available(), reason="the kernels need an AVX2 CPU and a C compiler")

K = 512  # two 256-superblocks, sixteen 32-blocks
# a fused weight's parts: each type the loader meets in llama.cpp's Q4_K_M files, an odd row count
PARTS = {"Q8_0": 40, "Q4_K": 24, "F32": 8, "Q6_K": 13, "Q5_0": 16}


def test_block_types_are_gguf_py_s():
    for name, block in BLOCK_TYPES.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]] == (block.block_elements, block.block_bytes)


def test_a_type_no_kernel_takes_is_a_load_error_naming_tensor_and_type():
    with pytest.raises(ModelLoadError, match=r"blk\.3\.ffn_down\.weight is IQ2_XXS"):
        type_kernels("blk.3.ffn_down.weight", "IQ2_XXS")


@pytest.fixture(scope="module")
def mapped(tmp_path_factory):
    """(the GGUFFile, the float32 matrices written into it by name)"""
    from gpu.models.gguf_file import GGUFFile

    path = tmp_path_factory.mktemp("gguf") / "parts.gguf"
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    matrices = {}
    for type_name, rows in {**PARTS, "F16": 7}.items():
        matrices[type_name] = rng.standard_normal((rows, K)).astype(np.float32) * 0.1
        add_tensor(writer, type_name, matrices[type_name], type_name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile(path), matrices


def fused(mapped, activations: str):
    from gpu.quant.gguf_weight import GGUFWeight

    file, matrices = mapped
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "not writable" warning is silenced, nothing else
        weight = GGUFWeight([file.tensors[name] for name in PARTS], activations)
    reference = np.concatenate([dequantize(matrices[name], name) for name in PARTS])
    return weight, torch.from_numpy(reference)


@needs_kernels
def test_a_fused_weight_dequantizes_to_gguf_py_s_values(mapped):
    weight, reference = fused(mapped, "f32")
    assert weight.shape == (sum(PARTS.values()), K) and weight.type_names == tuple(PARTS)
    assert torch.equal(weight.dequantize(), reference)


@needs_kernels
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_f32_products_are_products_of_the_dequantized_values(mapped, tokens):
    weight, reference = fused(mapped, "f32")
    x = torch.randn(tokens, K, generator=torch.Generator().manual_seed(tokens))
    want = (x.double() @ reference.double().T).float()
    torch.testing.assert_close(weight.matmul(x), want, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_a_product_is_written_into_out_when_given(mapped):
    weight, _ = fused(mapped, "q8")
    x = torch.randn(6, K, generator=torch.Generator().manual_seed(6))
    storage = torch.full((8, weight.shape[0]), float("nan"))  # a RowBuffer's: more rows than the step's
    out = storage[:6]
    assert weight.matmul(x, out).data_ptr() == out.data_ptr()
    assert torch.equal(out, weight.matmul(x)) and storage[6:].isnan().all()
    for bad in (storage[:5], storage[:6].double(), torch.empty(weight.shape[0], 6).t()):
        with pytest.raises(ValueError, match="out: expected contiguous float32"):
            weight.matmul(x, bad)
    with pytest.raises(ValueError, match="out: only a GGUF weight's product"):  # torch's make their own
        linear(x, weight.dequantize(), out=out)


@needs_kernels
@pytest.mark.parametrize("tokens", [1, 5])
def test_q8_products_stay_within_the_rounding_of_x(mapped, tokens):
    weight, reference = fused(mapped, "q8")
    x = torch.randn(tokens, K, generator=torch.Generator().manual_seed(tokens))
    exact = x.double() @ reference.double().T
    # x rounded to int8 per 32-block: each value off by at most amax / 254 of its block
    amax = x.view(tokens, K // 32, 32).abs().amax(-1).repeat_interleave(32, dim=1).double()
    bound = (amax / 254) @ reference.double().abs().T
    error = (weight.matmul(x).double() - exact).abs()
    assert (error <= bound * 1.01 + 1e-4).all()
    assert error.max() > 0  # x was rounded: not the f32 product


@needs_kernels
@pytest.mark.parametrize("type_name", ["Q8_0", "Q6_K", "F16"])
def test_rows_are_an_embedding_lookup(mapped, type_name):
    from gpu.quant.gguf_weight import GGUFWeight

    file, matrices = mapped
    weight = GGUFWeight([file.tensors[type_name]], "q8")
    ids = torch.tensor([3, 0, 3, len(matrices[type_name]) - 1])
    assert torch.equal(weight.rows(ids), torch.from_numpy(dequantize(matrices[type_name], type_name)[ids.numpy()]))
    with pytest.raises(IndexError):
        weight.rows(torch.tensor([len(matrices[type_name])]))


def rope_tables(P: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    freqs = torch.arange(P, dtype=torch.float32)[:, None] * inv[None, :]
    return freqs.cos(), freqs.sin()


@pytest.mark.parametrize("ops", [TorchLayerOps, pytest.param(CpuLayerOps, marks=needs_kernels)])
def test_rope_on_pairs_is_rotate_half_on_llama_cpp_s_permuted_rows(ops):
    T, Hq, Hkv, D = 5, 4, 2, 16
    cos, sin = rope_tables(64, D)
    positions = torch.tensor([0, 7, 1, 63, 30])
    qk = torch.randn(T, Hq + Hkv, D, generator=torch.Generator().manual_seed(0))
    # llama.cpp's converter: row 2j of a head holds row j, row 2j + 1 row j + D/2
    permuted = qk.view(T, Hq + Hkv, 2, D // 2).transpose(2, 3).reshape(T, Hq + Hkv, D).contiguous()
    halves = ops(cos, sin).rope_at(positions)(qk.clone())
    pairs = ops(cos, sin, "pairs").rope_at(positions)(permuted)
    unpermuted = pairs.view(T, Hq + Hkv, D // 2, 2).transpose(2, 3).reshape(T, Hq + Hkv, D)
    torch.testing.assert_close(unpermuted, halves, rtol=0, atol=1e-6)
