"""gpu/kernels/gguf_kquants.c (the K-quants and IQ4_XS multiplied in the file's own blocks)
against gguf-py: get_rows equals gguf.quants.dequantize exactly, gemm_f32 is
dequantize-then-matmul, gemm_q8 is llama.cpp's integer arithmetic with x in blocks of 32
(Q8_0's scales, not Q8_K's one per 256) computed here in numpy. The
weights are random superblocks (random bytes, moderate fp16 scales) in read-only pages, as a
GGUF file's mapping, that end where an inaccessible page begins (so mostly unaligned)."""

import ctypes
import mmap
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from kernel_variants import avx_vnni_library

from gpu import kernels

pytestmark = pytest.mark.skipif(not kernels.cpu_kernels_available(), reason="needs an AVX2 CPU and a C compiler")

QK = 256
QX = 32  # values of x that share a scale in the q8 products
# type -> byte offsets of its fp16 d and dmin (None: no mins) in a superblock
SCALES = {
    "q2_k": (80, 82),
    "q3_k": (108, None),
    "q4_k": (0, 2),
    "q5_k": (0, 2),
    "q6_k": (208, None),
    "iq4_xs": (0, None),
}
TYPES = tuple(SCALES)
# (T, K, N, extra columns of y beyond N, threads): decode on a Gemma-3-270M product, one
# superblock, odd N, y a column slice of a wider output, and token counts that leave every
# tile size (1-4 in AVX2, 1-8 in AVX-512VL) for the last tile
SHAPES = (
    (1, 2048, 640, 0, 2),
    (20, 2048, 40, 0, 2),
    (13, 256, 13, 5, 2),
    (7, 512, 37, 0, 1),
    (14, 768, 9, 2, 2),
    (11, 1024, 24, 7, 2),
    (2, 512, 16, 0, 2),
    (37, 512, 19, 3, 2),  # tiles of 16, 4 and 1 tokens
    (53, 512, 21, 2, 2),  # AVX512-VNNI's packed rows: 6 groups of 8 tokens and 5, 16 rows and 5
)


def qtype(name: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[name.upper()]


def block_bytes(name: str) -> int:
    return GGML_QUANT_SIZES[qtype(name)][1]


def with_argtypes(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    for name in TYPES:
        get_rows = getattr(lib, f"gguf_get_rows_{name}")
        get_rows.argtypes = [ptr, i64, ptr, i64, ptr]  # w, K, ids, n_ids, out
        get_rows.restype = None
        for mode in ("f32", "q8"):
            gemm = getattr(lib, f"gguf_gemm_{name}_{mode}")
            gemm.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64, ctypes.c_int]  # x, T, K, w, N, y, ldy, threads
            gemm.restype = ctypes.c_int
    return lib


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    return with_argtypes(kernels.load("gguf_kquants"))


PATHS = ("avx2", "avx512", "avx512-vnni", "avx-vnni")  # the values of gguf_kquants_path, in order


@pytest.fixture(scope="module")
def path_detected(lib: ctypes.CDLL) -> int:
    """The q8 products' instructions the library chose for this CPU when it loaded (an index of PATHS)"""
    return ctypes.c_int.in_dll(lib, "gguf_kquants_path").value


@pytest.fixture(scope="module")
def avx_vnni_lib() -> ctypes.CDLL:
    """The library that takes the AVX-VNNI path on this CPU (gguf_kquants_path 3)."""
    return with_argtypes(avx_vnni_library("gguf_kquants"))


@pytest.fixture(params=PATHS)
def q8_lib(request: pytest.FixtureRequest, lib: ctypes.CDLL, path_detected: int) -> Iterator[ctypes.CDLL]:
    """Each q8 test on every path the CPU has (AVX-512VL, AVX512-VNNI, AVX-VNNI): the library
    whose gguf_kquants_path is set to it, restored after"""
    detected = PATHS[path_detected]
    if request.param == "avx-vnni":
        chosen = request.getfixturevalue("avx_vnni_lib")
    elif request.param == "avx2" or detected == request.param or (detected, request.param) == ("avx512-vnni", "avx512"):
        chosen = lib
    else:
        pytest.skip(f"the CPU lacks {request.param}")
    flag = ctypes.c_int.in_dll(chosen, "gguf_kquants_path")
    before, flag.value = flag.value, PATHS.index(request.param)
    yield chosen
    flag.value = before


def random_blocks(name: str, N: int, K: int, seed: int) -> np.ndarray:
    """uint8 [N, K / 256 * block bytes]: random quants and scale bytes, finite fp16 d (either
    sign) and dmin of moderate size"""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (N, K // QK, block_bytes(name)), dtype=np.uint8)
    for offset in SCALES[name]:
        if offset is not None:
            scale = (rng.uniform(1e-3, 1e-2, (N, K // QK)) * rng.choice([-1, 1], (N, K // QK))).astype(np.float16)
            blocks[:, :, offset : offset + 2] = scale[..., None].view(np.uint8)
    return blocks.reshape(N, -1)


def with_scales(blocks: np.ndarray, name: str, d: float, dmin: float) -> np.ndarray:
    """The same blocks with every d and dmin replaced"""
    out = blocks.reshape(blocks.shape[0], -1, block_bytes(name)).copy()
    for offset, value in zip(SCALES[name], (d, dmin)):
        if offset is not None:
            out[:, :, offset : offset + 2] = np.array([value], np.float16).view(np.uint8)
    return out.reshape(blocks.shape)


def fp16_field(blocks: np.ndarray, name: str, which: int) -> np.ndarray:
    """float32 [N, K / 256]: each superblock's d (which 0) or dmin (1; 0 where there is none)"""
    offset = SCALES[name][which]
    b = blocks.reshape(blocks.shape[0], -1, block_bytes(name))
    if offset is None:
        return np.zeros(b.shape[:2], np.float32)
    return b[:, :, offset : offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


@contextmanager
def read_only(blocks: np.ndarray) -> Iterator[int]:
    """The address of a copy of the blocks in read-only pages, ending where an inaccessible page
    begins: a kernel that writes to its weights, or reads past their end, crashes the test"""
    libc = ctypes.CDLL(None, use_errno=True)
    ptr, size, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    libc.mmap.restype, libc.mmap.argtypes = ptr, [ptr, size, i32, i32, i32, ctypes.c_long]
    libc.mprotect.argtypes, libc.munmap.argtypes = [ptr, size, i32], [ptr, size]
    data, page = -(-blocks.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE, mmap.PAGESIZE
    base = libc.mmap(None, data + page, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert base not in (None, ctypes.c_void_p(-1).value), f"mmap: errno {ctypes.get_errno()}"
    start = base + data - blocks.nbytes
    ctypes.memmove(start, blocks.ctypes.data, blocks.nbytes)
    assert libc.mprotect(base, data, mmap.PROT_READ) == 0 and libc.mprotect(base + data, page, 0) == 0  # 0: PROT_NONE
    try:
        yield start
    finally:
        libc.munmap(base, data + page)


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's AVX2 quantize_row_q8_0 in float32: x [T, K] -> (q as float64 [T, K / 32, 32],
    d float32 [T, K / 32]): d = amax / 127, q = x * (127 / amax) rounded to nearest even"""
    b = x.reshape(x.shape[0], -1, QX)
    amax = np.abs(b).max(-1)
    inverse = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax != 0)
    q = np.rint(b * inverse[..., None])
    return q.astype(np.float64), amax / np.float32(127)


def gemm_q8_reference(x: np.ndarray, blocks: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(y [T, N], the sum of its products' magnitudes): per block of 32 (d_w d_x) * sum(sc q xq)
    + (dmin_w d_x) * sum(-m xq), the integer sums exact in float64. sc * q and -m come from
    gguf-py itself: its dequantization of the blocks with d = 1, dmin = 0 and d = 0, dmin = 1."""
    N = blocks.shape[0]
    xq, xd = quantize_q8_0(x)
    y, magnitude = np.zeros((x.shape[0], N)), np.zeros((x.shape[0], N))
    for which, (d, dmin) in enumerate(((1.0, 0.0), (0.0, 1.0))):
        ints = dequantize(with_scales(blocks, name, d, dmin), qtype(name)).reshape(N, -1, QX).astype(np.float64)
        w_scale = np.repeat(fp16_field(blocks, name, which), QK // QX, axis=1)  # [N, K / 32]
        scale = w_scale.T[:, None, :].astype(np.float64) * xd.T[:, :, None]
        # [K / 32, T, N], exact
        y += (scale * np.matmul(xq.transpose(1, 0, 2), ints.transpose(1, 2, 0))).sum(0)
        magnitude += (np.abs(scale) * np.matmul(np.abs(xq).transpose(1, 0, 2), np.abs(ints).transpose(1, 2, 0))).sum(0)
    return y, magnitude


def run_gemm(
    lib: ctypes.CDLL, name: str, mode: str, x: np.ndarray, w: int, N: int, extra: int, threads: int
) -> np.ndarray:
    T, K = x.shape
    y = np.full((T, N + extra), np.nan, np.float32)
    gemm = getattr(lib, f"gguf_gemm_{name}_{mode}")
    assert gemm(x.ctypes.data, T, K, w, N, y.ctypes.data, N + extra, threads) == 0
    assert np.isnan(y[:, N:]).all()  # only columns [0, N) are written
    return y[:, :N]


def tokens(T: int, K: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((T, K)).astype(np.float32)
    x[0, :QK] = 0  # a superblock of zeros: x's d = 0
    return x


@pytest.mark.parametrize("name", TYPES)
def test_get_rows_equal_gguf_dequantize(lib: ctypes.CDLL, name: str) -> None:
    N, K = 11, 768
    blocks = random_blocks(name, N, K, seed=1)
    ids = np.array([3, 0, 10, 3, 7], np.int64)
    out = np.full((len(ids), K), np.nan, np.float32)
    with read_only(blocks) as w:
        getattr(lib, f"gguf_get_rows_{name}")(w, K, ids.ctypes.data, len(ids), out.ctypes.data)
    want = dequantize(blocks, qtype(name)).reshape(N, K)[ids]
    assert np.array_equal(out, want)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-K{}-N{}-ldy+{}-threads{}".format(*s))
@pytest.mark.parametrize("name", TYPES)
def test_gemm_f32_is_dequantize_then_matmul(lib: ctypes.CDLL, name: str, shape: tuple) -> None:
    T, K, N, extra, threads = shape
    blocks, x = random_blocks(name, N, K, seed=2), tokens(T, K, seed=3)
    with read_only(blocks) as w:
        y = run_gemm(lib, name, "f32", x, w, N, extra, threads)
    W = dequantize(blocks, qtype(name)).reshape(N, K).astype(np.float64)
    want, magnitude = x.astype(np.float64) @ W.T, np.abs(x.astype(np.float64)) @ np.abs(W).T
    assert (np.abs(y - want) <= 1e-6 * magnitude + 1e-30).all()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-K{}-N{}-ldy+{}-threads{}".format(*s))
@pytest.mark.parametrize("name", TYPES)
def test_gemm_q8_is_llama_cpp_integer_arithmetic(q8_lib: ctypes.CDLL, name: str, shape: tuple) -> None:
    T, K, N, extra, threads = shape
    blocks, x = random_blocks(name, N, K, seed=4), tokens(T, K, seed=5)
    with read_only(blocks) as w:
        y = run_gemm(q8_lib, name, "q8", x, w, N, extra, threads)
    want, magnitude = gemm_q8_reference(x, blocks, name)
    assert (np.abs(y - want) <= 1e-6 * magnitude + 1e-30).all()


@pytest.mark.parametrize("name", TYPES)
def test_gemm_q8_is_close_to_the_float_product(q8_lib: ctypes.CDLL, name: str) -> None:
    """x's rounding to int8 moves the product by well under 1% of its scale"""
    T, K, N = 3, 1024, 32
    blocks, x = random_blocks(name, N, K, seed=6), tokens(T, K, seed=7)
    with read_only(blocks) as w:
        y = run_gemm(q8_lib, name, "q8", x, w, N, 0, 2)
    W = dequantize(blocks, qtype(name)).reshape(N, K).astype(np.float64)
    want, magnitude = x.astype(np.float64) @ W.T, np.abs(x.astype(np.float64)) @ np.abs(W).T
    assert (np.abs(y - want) <= 0.01 * magnitude).all()


@pytest.mark.parametrize("name", TYPES)
def test_gemm_q8_outliers_round_only_their_block(q8_lib: ctypes.CDLL, name: str) -> None:
    """A huge value alone in its block of 32 (as the down projection's act(gate) * up holds)
    leaves the rest of its superblock rounded by their own scales: the product stays within 1%
    of the rest's magnitude (Q8_K's one scale per 256 would round the rest to 0)"""
    T, K, N = 5, 1024, 24
    blocks, x = random_blocks(name, N, K, seed=8), tokens(T, K, seed=9)
    blocks_of_x = x.reshape(T, K // QK, QK // QX, QX)
    blocks_of_x[:, :, 1] = 0  # block 1 of every superblock: zeros and the outlier
    blocks_of_x[:, :, 1, 7] = np.where(np.arange(K // QK) % 2, 1e4, -3e4)
    with read_only(blocks) as w:
        y = run_gemm(q8_lib, name, "q8", x, w, N, 0, 2)
    W = dequantize(blocks, qtype(name)).reshape(N, K).astype(np.float64)
    outliers = np.zeros(K, bool)
    outliers[39::256] = True
    want = x.astype(np.float64) @ W.T
    rest = np.abs(np.where(outliers, 0, x).astype(np.float64)) @ np.abs(W).T
    float_sums = gemm_q8_reference(x, blocks, name)[1]  # the float sums' rounding: of the terms, scales and mins apart
    assert (np.abs(y - want) <= 0.01 * rest + 1e-6 * float_sums).all()
