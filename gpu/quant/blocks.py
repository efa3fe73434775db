"""The exceptions to using a GGUF's blocks in place, both for weights multiplied with int8
activations (--quantization gguf-q8), copied once at load into the layout their kernels read:
- Q4_1 projections (the embedded SmolLM2's) into gpu/kernels/ggml_cpu.c's layout of 8
  interleaved rows, whose kernel took ~2x less CPU per decode step's products than the in-place
  one (perf/results/gguf_repack.md). Goes once gguf_q32.c's Q4_1 kernel is as fast.
- every other part of a 32-element block type (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 IQ4_NL), the embedding /
  LM head included (Gemma 3's Q8_0), on an AVX512-VNNI CPU, into gguf_q32.c's packed chunks of
  16 rows: as many bytes as the blocks, which its products otherwise unpack into that layout at
  every call of 8 tokens or more (docs/perf-notes.md), consecutive parts of one such type of a
  fused weight (q and k, gate and up) in one buffer, one product for them all; Q4_K and Q6_K
  parts likewise into gguf_kquants.c's (Q4_K's nibbles as they are, 1.33x its blocks; Q6_K's
  codes as bytes, 1.5x), a part a buffer, their blocks kept beside for products of fewer than
  IN_PLACE_BELOW tokens, which stream the weight from memory and read fewer bytes in place."""

from __future__ import annotations

import ctypes
import functools
import mmap
from collections.abc import Callable

import numpy as np
import torch

from gpu import kernels
from gpu.models.model_files import ModelLoadError
from gpu.quant.gguf_types import BLOCK_TYPES, TypeKernels
from gpu.quant.gguf_weight import GGUFWeight, WeightPart

ROW_GROUP = 8  # rows ggml_cpu.c interleaves (ROWS)
Q4_1_BLOCK = 20  # bytes: d, m (fp16), 16 bytes of nibbles


@functools.cache
def _kernels() -> TypeKernels:
    try:
        lib = kernels.load("ggml_cpu")
    except kernels.KernelBuildError as e:
        raise ModelLoadError(f"--quantization gguf-q8: {e}") from None
    gemm = lib.gemm_q4_1_repacked_q8  # x, T, K, w, N, y, ldy, threads -> 0 | -1 (no memory)
    gemm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    gemm.argtypes += [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    gemm.restype = ctypes.c_int

    def no_rows(*args: object) -> None:
        raise TypeError("a repacked Q4_1 weight is a projection: it has no rows to read")

    return TypeKernels({"q8": gemm}, {"q8": ctypes.cast(gemm, ctypes.c_void_p).value or 0}, no_rows)


def repacks(weight: GGUFWeight) -> bool:
    """Whether repack_q4_1 takes `weight`: Q4_1 parts only, multiplied with q8 activations,
    rows in whole groups of 8."""
    return (
        weight.activations == "q8" and all(t == "Q4_1" for t in weight.type_names) and weight.shape[0] % ROW_GROUP == 0
    )


def repack_q4_1(weight: GGUFWeight) -> GGUFWeight:
    """The same [N, K] weight (its parts' rows in order) as one buffer in ggml_cpu.c's layout:
    nibbles [N/8, K/32, 4, 8, 4] (4 bytes of each of 8 rows in turn), then d and m as float32
    [N/8, K/32, 8]."""
    N, K = weight.shape
    nb, g = K // 32, ROW_GROUP
    blocks = np.concatenate([np.asarray(p.data).reshape(p.rows, nb, Q4_1_BLOCK) for p in weight.parts])
    d, m = (blocks[..., i : i + 2].copy().view(np.float16)[..., 0].astype(np.float32) for i in (0, 2))
    qs = blocks[..., 4:].reshape(N // g, g, nb, 4, 4).transpose(0, 2, 3, 1, 4)
    d, m = (v.reshape(N // g, g, nb).transpose(0, 2, 1) for v in (d, m))
    buffer = np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in (qs, d, m)])
    part = WeightPart(
        "+".join(p.name for p in weight.parts), "Q4_1", N, 0, buffer, buffer.ctypes.data, None, _kernels()
    )
    for p in weight.parts:
        unmap_resident(p.data)
    return GGUFWeight.of_parts((part,), weight.shape, "q8")


def unmap_resident(data: np.ndarray) -> None:
    """The file's pages wholly inside `data`, read by the copy above and not again, leave this
    process's resident set (the copy would otherwise be held twice: ~60 MB of SmolLM2's); a
    later read maps them again from the page cache. Only a view of a file mapping: on memory
    of the process's own, MADV_DONTNEED would zero it."""
    base = data.base
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None)
    if base is None:
        return
    start = -(-data.ctypes.data // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (data.ctypes.data + data.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_DONTNEED)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


# the types with a gguf_pack_<type> in their kernel file: Q2_K Q3_K Q5_K IQ4_XS have none (their codes as
# bytes would be 2-4.5x the blocks, and a product at one token reads every byte)
PACKED_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q4_K", "Q6_K")
# Products of fewer tokens than this read a packed K-quant's blocks in place (mapped from the
# file), not its packed copy: the copy is larger than the blocks (Q4_K 1.33x, Q6_K 1.5x), and a
# product of few tokens streams its weight from memory once a model outgrows the caches. 24 Q4_K
# weights of 8192 x 2048, in place against packed: 1 token 0.67x the time, 4 tokens 0.67x, 6
# 1.2x; 16 Q6_K of 2048 x 8192: 1 token 0.62x, 2 even (docs/perf-notes.md).
IN_PLACE_BELOW = {"Q4_K": 5, "Q6_K": 2}


@functools.cache
def _packed(type_name: str) -> tuple[TypeKernels, Callable[..., int]] | None:
    """The kernels of a packed `type_name` (gpu/kernels/<library>.c's gguf_pack_<type> and its
    products) and its packer; None where the CPU has no AVX512-VNNI or the type no packed
    kernels."""
    if type_name not in PACKED_TYPES:
        return None
    block = BLOCK_TYPES[type_name]
    try:
        lib = kernels.load(block.library)
    except kernels.KernelBuildError as e:
        raise ModelLoadError(f"--quantization gguf-q8: {e}") from None
    if not getattr(lib, f"{block.library}_packs")():
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    gemm = getattr(lib, f"gguf_gemm_{block.suffix}_packed_q8")  # x, T, K, w, N, y, ldy, threads -> 0 | -1
    gemm.argtypes, gemm.restype = [p, i64, i64, p, i64, p, i64, ctypes.c_int], ctypes.c_int
    get_rows = getattr(lib, f"gguf_get_rows_{block.suffix}_packed")  # w, K, ids, n_ids, out
    get_rows.argtypes, get_rows.restype = [p, i64, p, i64, p], None
    pack = getattr(lib, f"gguf_pack_{block.suffix}")  # w, N, K, out (NULL: the bytes it needs), threads
    pack.argtypes, pack.restype = [p, i64, i64, p, ctypes.c_int], i64
    addresses = {"q8": ctypes.cast(gemm, ctypes.c_void_p).value or 0}
    gated = getattr(lib, f"gguf_gemm_{block.suffix}_packed_q8_gated", None)  # gguf_q32.c's types
    if gated is None:
        return TypeKernels({"q8": gemm}, addresses, get_rows), pack
    gated.argtypes, gated.restype = [p, i64, i64, p, i64, p, i64, ctypes.c_int, ctypes.c_int], ctypes.c_int
    gated_address = ctypes.cast(gated, ctypes.c_void_p).value or 0
    return TypeKernels({"q8": gemm}, addresses, get_rows, gated, gated_address), pack


def packs(weight: GGUFWeight) -> bool:
    """Whether pack takes `weight`: multiplied with q8 activations, on a CPU with the packed
    kernels, with a part of a type they take."""
    return weight.activations == "q8" and any(_packed(t) is not None for t in weight.type_names)


def _joins(run: list[WeightPart], part: WeightPart, K: int) -> bool:
    """Whether `part` packs into one buffer with the run of parts before it: the same type,
    packed with no blocks kept in place, and the run's last chunk of rows full (one more row
    would take a chunk of its own), so that the part's chunks follow the run's as its rows do."""
    found = _packed(part.type_name)
    if found is None or part.type_name != run[0].type_name or IN_PLACE_BELOW.get(part.type_name, 0):
        return False
    size, rows = found[1], sum(p.rows for p in run)
    return size(None, rows + 1, K, None, 0) > size(None, rows, K, None, 0)


def _pack_run(run: list[WeightPart], K: int) -> WeightPart:
    """The run's rows, one part after another, as one packed part (a fused weight's q and k, or
    gate and up, of one type: one product a step, x quantized once for them); a part of a type
    with no packed kernels as it is."""
    first = run[0]
    found = _packed(first.type_name)
    if found is None:
        return first
    type_kernels, pack = found
    sizes = [pack(None, p.rows, K, None, 0) for p in run]
    buffer = np.empty(sum(sizes), np.uint8)
    at = buffer.ctypes.data
    for p, size in zip(run, sizes):
        pack(p.address, p.rows, K, at, torch.get_num_threads())
        at += size
    below = IN_PLACE_BELOW.get(first.type_name, 0)  # a run of such a type is one part (_joins)
    if not below:
        for p in run:
            unmap_resident(p.data)
    return WeightPart(
        "+".join(p.name for p in run),
        first.type_name,
        sum(p.rows for p in run),
        first.offset,
        buffer,
        buffer.ctypes.data,
        None,
        type_kernels,
        first if below else None,
        below,
    )


def pack(weight: GGUFWeight) -> GGUFWeight:
    """The same [N, K] weight with each part of a type in PACKED_TYPES in its kernel file's
    packed chunks (its rows still readable: rows()), consecutive parts of one type in one
    buffer where they join (_joins); the other parts in place."""
    if weight.activations != "q8":
        raise ValueError("only products with q8 activations read packed weights")
    K = weight.shape[1]
    runs: list[list[WeightPart]] = []
    for p in weight.parts:
        if runs and _joins(runs[-1], p, K):
            runs[-1].append(p)
        else:
            runs.append([p])
    return GGUFWeight.of_parts(tuple(_pack_run(run, K) for run in runs), weight.shape, "q8")


def repack_where_faster(weights: dict[str, torch.Tensor | GGUFWeight]) -> None:
    """In place: every projection repack_q4_1 takes (not the embedding, whose rows it cannot
    read), then every weight pack takes."""
    for name, w in weights.items():
        if not isinstance(w, GGUFWeight):
            continue
        if name != "embed" and repacks(w):
            weights[name] = repack_q4_1(w)
        elif packs(w):
            weights[name] = pack(w)
