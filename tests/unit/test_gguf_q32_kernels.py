"""gpu/kernels/gguf_q32.c (the 32-element GGUF block types, read in place) against gguf-py:
get_rows equals gguf.quants.dequantize bit for bit, the _f32 products equal
dequantize-then-matmul up to the order of the sums, the _q8 products equal a numpy model of
llama.cpp's arithmetic (x quantized per 32-block to int8, integer dot products per block)."""

import ctypes
import mmap
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize
from kernel_variants import avx_vnni_library, built_with, cpu_has_avx512_vnni

from gpu import kernels

pytestmark = pytest.mark.skipif(not kernels.cpu_kernels_available(), reason="needs an AVX2 CPU and a C compiler")

TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl")
WITH_MIN = ("q4_1", "q5_1")  # a block's fp16 min m follows its fp16 scale d
QUANTIZABLE = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")  # gguf.quants.quantize makes their blocks
# (T, K, N, ldy - N): a Gemma 3 270M product at decode, a long row, then odd ones: one block, N not a
# multiple of the kernel's 4 rows or 16-row chunks, y a column slice of a wider output; the q8
# products' token layouts: one token, pairs (3, 5, 7: the last one padded), tiles of 16 (29 =
# 16 + 13, 17 = 16 + 1); on AVX512-VNNI from 8 tokens the packed rows
SHAPES = (
    (1, 640, 2048, 0),
    (7, 2048, 96, 0),
    (3, 32, 13, 5),
    (5, 96, 37, 0),
    (29, 576, 67, 3),
    (17, 64, 9, 1),
    (1, 64, 1, 2),
    (8, 96, 21, 2),  # AVX512-VNNI's packed rows from 8 tokens: 16 rows and 5
)
THREADS = 2

p = ctypes.c_void_p
i64 = ctypes.c_int64


def with_argtypes(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name in TYPES:
        getattr(lib, f"gguf_get_rows_{name}").argtypes = [p, i64, p, i64, p]
        getattr(lib, f"gguf_get_rows_{name}").restype = None
        for activations in ("f32", "q8"):
            gemm = getattr(lib, f"gguf_gemm_{name}_{activations}")
            gemm.argtypes = [p, i64, i64, p, i64, p, i64, ctypes.c_int]
            gemm.restype = ctypes.c_int
    return lib


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    """As the server loads it: the q8 products through AVX512-VNNI where the CPU has it."""
    return with_argtypes(kernels.load("gguf_q32"))


@pytest.fixture(scope="module")
def avx2_lib() -> ctypes.CDLL:
    """The q8 products without AVX-512, whatever the CPU has."""
    return with_argtypes(built_with("gguf_q32", "GGUF_Q32_AVX2_ONLY"))


@pytest.fixture(scope="module")
def avx_vnni_lib() -> ctypes.CDLL:
    """The q8 products as on a CPU with AVX-VNNI and no AVX-512 (Intel's client cores)."""
    return with_argtypes(avx_vnni_library("gguf_q32"))


@pytest.fixture(scope="module", params=("as loaded", "AVX2 only", "AVX-VNNI"))
def q8_lib(request: pytest.FixtureRequest, lib: ctypes.CDLL, avx2_lib: ctypes.CDLL) -> ctypes.CDLL:
    """Every path of the q8 products, whichever the CPU would pick."""
    if request.param == "AVX-VNNI":
        return request.getfixturevalue("avx_vnni_lib")
    return lib if request.param == "as loaded" else avx2_lib


def qtype(name: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[name.upper()]


def random_bytes_weight(name: str, N: int, K: int, rng: np.random.Generator) -> np.ndarray:
    """Every quantized value possible (Q8_0's -128 too), scales and mins finite and moderate."""
    _, block_bytes = GGML_QUANT_SIZES[qtype(name)]
    blocks = rng.integers(0, 256, (N, K // 32, block_bytes), dtype=np.uint8)
    for offset in (0, 2) if name in WITH_MIN else (0,):
        scales = (rng.uniform(0.001, 0.1, (N, K // 32)) * rng.choice((-1, 1), (N, K // 32))).astype(np.float16)
        blocks[..., offset : offset + 2] = scales[..., None].view(np.uint8)
    return blocks.reshape(N, -1)


def weight(name: str, N: int, K: int, rng: np.random.Generator) -> np.ndarray:
    """[N, K / 32 * block bytes] uint8: gguf-py's quantization of random floats where it has one."""
    if name not in QUANTIZABLE:
        return random_bytes_weight(name, N, K, rng)
    return quantize(rng.standard_normal((N, K)).astype(np.float32) * 0.05, qtype(name))


def scales(name: str, w: np.ndarray, K: int) -> tuple[np.ndarray, np.ndarray]:
    """Each block's d and m (0 for the types without a min) as float32, [N, K / 32]."""
    blocks = w.reshape(w.shape[0], K // 32, -1)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if name in WITH_MIN else np.zeros_like(d)
    return d, m


@contextmanager
def mapped(w: np.ndarray) -> Iterator[int]:
    """The address of a copy of w in read-only pages that end where an inaccessible one begins,
    as a GGUF's last tensor may: a kernel that writes to its weights or reads past them crashes."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = p
    libc.mmap.argtypes = [p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes, libc.munmap.argtypes = [p, ctypes.c_size_t, ctypes.c_int], [p, ctypes.c_size_t]
    data = -(-w.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    base = libc.mmap(
        None, data + mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0
    )
    assert base not in (None, ctypes.c_void_p(-1).value), f"mmap: errno {ctypes.get_errno()}"
    start = base + data - w.nbytes
    ctypes.memmove(start, w.ctypes.data, w.nbytes)
    assert libc.mprotect(base, data, mmap.PROT_READ) == 0 and libc.mprotect(base + data, mmap.PAGESIZE, 0) == 0
    try:
        yield start
    finally:
        libc.munmap(base, data + mmap.PAGESIZE)


def gemm(lib: ctypes.CDLL, name: str, activations: str, x: np.ndarray, w: np.ndarray, N: int, ldy: int) -> np.ndarray:
    T, K = x.shape
    y = np.full((T, ldy), np.nan, dtype=np.float32)
    with mapped(w) as address:
        rc = getattr(lib, f"gguf_gemm_{name}_{activations}")(
            x.ctypes.data, T, K, address, N, y.ctypes.data, ldy, THREADS
        )
    assert rc == 0
    assert np.isnan(y[:, N:]).all(), "wrote past column N"
    return y[:, :N]


def assert_within(got: np.ndarray, want: np.ndarray, magnitude: np.ndarray, rtol: float) -> None:
    """|got - want| within rtol of the sum of the terms' magnitudes (what float rounding scales with)."""
    err = np.abs(got.astype(np.float64) - want) / (magnitude + 1e-30)
    assert float(err.max()) <= rtol, f"max error {float(err.max()):.2e} of the terms' magnitude > {rtol:.0e}"


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("make", (weight, random_bytes_weight))
def test_get_rows_is_gguf_py_dequantize(
    lib: ctypes.CDLL, name: str, make: Callable[[str, int, int, np.random.Generator], np.ndarray]
) -> None:
    rng = np.random.default_rng(1)
    N, K = 37, 320
    w = make(name, N, K, rng)
    ids = np.array([0, 36, 5, 5, 17], dtype=np.int64)  # 36: the last row
    out = np.full((len(ids), K), np.nan, dtype=np.float32)
    with mapped(w) as address:
        getattr(lib, f"gguf_get_rows_{name}")(address, K, ids.ctypes.data, len(ids), out.ctypes.data)
    assert np.array_equal(out, dequantize(w, qtype(name))[ids])


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("T, K, N, pad", SHAPES)
def test_gemm_f32_is_dequantize_then_matmul(lib: ctypes.CDLL, name: str, T: int, K: int, N: int, pad: int) -> None:
    rng = np.random.default_rng(2)
    w, x = weight(name, N, K, rng), rng.standard_normal((T, K)).astype(np.float32)
    dense = dequantize(w, qtype(name)).astype(np.float64)
    got = gemm(lib, name, "f32", x, w, N, N + pad)
    assert_within(got, x.astype(np.float64) @ dense.T, np.abs(x.astype(np.float64)) @ np.abs(dense).T, 1e-5)


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [T, K] -> int8 values [T, K / 32, 32], scales d and xs = d * sum(q) [T, K / 32], as the
    kernel (llama.cpp's AVX2 quantize_row_q8_0): float32 throughout, rounded half to even."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=-1)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inverse[..., None]).astype(np.int64)
    d = amax / np.float32(127)
    return q, d, d * q.sum(axis=-1).astype(np.float32)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("T, K, N, pad", SHAPES)
def test_gemm_q8_is_llama_cpp_integer_arithmetic(
    q8_lib: ctypes.CDLL, name: str, T: int, K: int, N: int, pad: int
) -> None:
    rng = np.random.default_rng(3)
    w, x = random_bytes_weight(name, N, K, rng), rng.standard_normal((T, K)).astype(np.float32)
    x[0, :32] = 0  # a block of zeros: scale 0, values 0
    d, m = scales(name, w, K)
    # each weight's integer value v (w = d * v + m): recovered from gguf-py's dequantization
    v_real = (dequantize(w, qtype(name)).reshape(N, K // 32, 32) - m[..., None]) / d[..., None]
    v = np.rint(v_real).astype(np.int64)
    assert np.abs(v_real - v).max() < 1e-3
    xq, xd, xs = quantize_activations(x)
    dot = np.einsum("tbj,nbj->tnb", xq, v).astype(np.float64)  # [T, N, K / 32]
    terms = (d[None] * xd[:, None, :]).astype(np.float64) * dot
    min_terms = m[None].astype(np.float64) * xs[:, None, :]
    want = terms.sum(-1) + min_terms.sum(-1)
    got = gemm(q8_lib, name, "q8", x, w, N, N + pad)
    assert_within(got, want, np.abs(terms).sum(-1) + np.abs(min_terms).sum(-1), 1e-5)


@pytest.mark.skipif(not cpu_has_avx512_vnni(), reason="the packed product runs on AVX512-VNNI CPUs only")
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize(
    "T, K, N, pad", ((29, 576, 67, 3), (17, 64, 9, 1), (40, 640, 48, 0), (64, 96, 16, 0), (12, 640, 40, 0))
)
def test_gemm_q8_packed_rows_are_the_tiles_bit_for_bit(
    lib: ctypes.CDLL, avx2_lib: ctypes.CDLL, name: str, T: int, K: int, N: int, pad: int
) -> None:
    """Past 8 tokens (where the AVX2 build takes x in tiles: rows_tile) the AVX-512 build repacks
    the rows (rows_packed): the same integer sums and float steps in the same order."""
    rng = np.random.default_rng(5)
    w, x = random_bytes_weight(name, N, K, rng), rng.standard_normal((T, K)).astype(np.float32)
    np.testing.assert_array_equal(gemm(lib, name, "q8", x, w, N, N + pad), gemm(avx2_lib, name, "q8", x, w, N, N + pad))


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("T, K, N, pad", SHAPES)
def test_gemm_q8_avx_vnni_is_avx2_bit_for_bit(
    avx2_lib: ctypes.CDLL, avx_vnni_lib: ctypes.CDLL, name: str, T: int, K: int, N: int, pad: int
) -> None:
    """AVX-VNNI's vpdpbusd takes the codes with their offset corrected (no int16 pairs to
    saturate) where AVX2 takes magnitudes and signs: the same integer sums, the same float steps."""
    rng = np.random.default_rng(6)
    w, x = random_bytes_weight(name, N, K, rng), rng.standard_normal((T, K)).astype(np.float32)
    np.testing.assert_array_equal(
        gemm(avx_vnni_lib, name, "q8", x, w, N, N + pad), gemm(avx2_lib, name, "q8", x, w, N, N + pad)
    )
