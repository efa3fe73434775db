"""Which C kernels multiply a GGUF tensor of each ggml type in place: the block kernels of
gpu/kernels/gguf_q32.c (32-element blocks) and gguf_kquants.c (256-element superblocks), one
gguf_gemm_<suffix>_{f32,q8} and gguf_get_rows_<suffix> per type. F32 / F16 / BF16 tensors
need no kernel (torch multiplies them as they are)."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass

from gpu.models.model_files import ModelLoadError

FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class BlockType:
    block_elements: int  # values a block holds (a row is K / block_elements blocks)
    block_bytes: int
    library: str  # the kernel file's stem: gpu/kernels/<library>.c
    suffix: str  # the C names' type part: gguf_gemm_<suffix>_q8


# sizes as gguf.constants.GGML_QUANT_SIZES (tests check they agree)
BLOCK_TYPES: dict[str, BlockType] = {
    "Q4_0": BlockType(32, 18, "gguf_q32", "q4_0"),
    "Q4_1": BlockType(32, 20, "gguf_q32", "q4_1"),
    "Q5_0": BlockType(32, 22, "gguf_q32", "q5_0"),
    "Q5_1": BlockType(32, 24, "gguf_q32", "q5_1"),
    "Q8_0": BlockType(32, 34, "gguf_q32", "q8_0"),
    "IQ4_NL": BlockType(32, 18, "gguf_q32", "iq4_nl"),
    "Q2_K": BlockType(256, 84, "gguf_kquants", "q2_k"),
    "Q3_K": BlockType(256, 110, "gguf_kquants", "q3_k"),
    "Q4_K": BlockType(256, 144, "gguf_kquants", "q4_k"),
    "Q5_K": BlockType(256, 176, "gguf_kquants", "q5_k"),
    "Q6_K": BlockType(256, 210, "gguf_kquants", "q6_k"),
    "IQ4_XS": BlockType(256, 136, "gguf_kquants", "iq4_xs"),
}

ACTIVATIONS = ("f32", "q8")  # the kernels' two ways of taking x: as it is | quantized to int8 as llama.cpp


@dataclass(frozen=True)
class TypeKernels:
    """One block type's C functions (ctypes, argtypes set)."""

    gemm: dict[str, Callable[..., int]]  # activations -> gguf_gemm_<suffix>_<activations>
    gemm_addresses: dict[str, int]  # the same functions' addresses, for C callers (decode_cpu.c)
    get_rows: Callable[..., None]
    # packed 32-block types: gguf_gemm_<suffix>_packed_q8_gated (x, T, K, w, N, y, ldy, gelu, threads), an
    # MLP's act(gate) * up from its gate and up in one product; and its address; else None, 0
    gated: Callable[..., int] | None = None
    gated_address: int = 0


@functools.cache
def _library(stem: str) -> ctypes.CDLL:
    from gpu import kernels  # torch: imported by a load, not by a check of a file's types (block_type)

    try:
        return kernels.load(stem)
    except kernels.KernelBuildError as e:
        raise ModelLoadError(f"GGUF kernels {stem}: {e}") from None


def type_kernels(tensor_name: str, type_name: str) -> TypeKernels:
    """The kernels for a tensor of `type_name`; ModelLoadError naming the tensor and the type
    when no kernel takes it (never a silent fp32 fallback)."""
    block = block_type(tensor_name, type_name)
    found = _kernels_of(type_name)
    if found is None:
        raise ModelLoadError(
            f"GGUF tensor {tensor_name} is {type_name}: gpu/kernels/{block.library}.c has no kernels for it"
        )
    return found


def block_type(tensor_name: str, type_name: str) -> BlockType:
    """The block layout of `type_name`; ModelLoadError naming the tensor and the type when no
    kernel takes it."""
    block = BLOCK_TYPES.get(type_name)
    if block is None:
        raise ModelLoadError(
            f"GGUF tensor {tensor_name} is {type_name}: no kernel takes it "
            f"(these do: {', '.join((*FLOAT_TYPES, *BLOCK_TYPES))})"
        )
    return block


@functools.cache
def _kernels_of(type_name: str) -> TypeKernels | None:
    block = BLOCK_TYPES[type_name]
    lib = _library(block.library)
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    try:
        gemm = {a: getattr(lib, f"gguf_gemm_{block.suffix}_{a}") for a in ACTIVATIONS}
        get_rows = getattr(lib, f"gguf_get_rows_{block.suffix}")
    except AttributeError:
        return None
    for fn in gemm.values():  # x, T, K, w, N, y, ldy, threads -> 0 | -1 (no memory)
        fn.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64, ctypes.c_int]
        fn.restype = ctypes.c_int
    get_rows.argtypes = [ptr, i64, ptr, i64, ptr]  # w, K, ids, n_ids, out
    get_rows.restype = None
    addresses = {a: ctypes.cast(fn, ctypes.c_void_p).value or 0 for a, fn in gemm.items()}
    return TypeKernels(gemm, addresses, get_rows)
