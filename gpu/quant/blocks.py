"""A projection kept in a GGUF file's own Q4_1 / Q8_0 blocks and multiplied by
gpu/kernels/ggml_cpu.c (AVX2 + FMA, built once with the system C compiler into the cache
directory by gpu/kernels/__init__.py), instead of the fp32 copy the converter writes.

`gguf` (activations "fp32"): the values are the same (the kernel dequantizes exactly as
gguf-py does); only the order of each dot product's sums differs from fp32. A decode step then
reads ~5x fewer bytes of weights, which is what bounds it on a CPU at small batches.

`gguf-q8` (activations "q8"): as llama.cpp does, x is quantized per 32-block to int8 with a
scale once per product and each block's dot product is integer, the weights' rows interleaved
in groups of 8 for the kernel (with_activations); far fewer instructions per block, and the
numerics change by x's rounding (at most amax / 254 per value of a block of x). Faster than
MKL's fp32 at every size, so every product goes through it and no fp32 copy is kept.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from dataclasses import dataclass

import torch

from gpu import kernels
from gpu.models.model_files import ModelLoadError

BLOCK = 32
# (block type, activations) -> the kernel; all take (x, T, K, qs, d, m, N, y, threads)
GEMMS = {
    ("Q4_1", "fp32"): "gemm_q4_1",
    ("Q8_0", "fp32"): "gemm_q8_0",
    ("Q4_1", "q8"): "gemm_q4_1_q8",
    ("Q8_0", "q8"): "gemm_q8_0_q8",
}

# Up to this many tokens a product reads the blocks; beyond, the dense fp32 copy through MKL.
# fp32 activations: memory bound at few tokens (~5x fewer bytes than fp32), compute bound
# beyond, where MKL is as fast or faster: against gpu/models/llama.py's fp32 path the blocks' lead
# shrinks as tokens grow and is gone at this limit (docs/perf-notes.md). q8 activations: no
# limit, and no dense copy is kept: the integer kernel beat MKL at every size measured
# (perf/forward_bench.py --products), up to the default chunked prefill.
QUANTIZED_MAX_TOKENS: dict[str, int | None] = {"fp32": 32, "q8": None}
ROW_GROUP = 8  # rows the q8 kernels interleave (gpu/kernels/ggml_cpu.c ROWS)


@dataclass(frozen=True)
class QuantizedWeight:
    """A [N, K] weight as N rows of K / 32 blocks: value = d * q + m (m = 0 for Q8_0). With
    activations "q8", qs, d and m hold the same values in the q8 kernels' order (with_activations)."""

    kind: str  # "Q4_1" | "Q8_0"
    qs: torch.Tensor  # uint8 [N, K / 32, 16 (two nibbles a byte) or 32 (int8)]
    d: torch.Tensor  # float32 [N, K / 32]
    m: torch.Tensor  # float32 [N, K / 32]
    dense: torch.Tensor | None = None  # float32 [N, K], the same values, for products of > max_tokens
    activations: str = "fp32"  # "fp32": x as it is | "q8": x quantized per 32-block (quantize_q8)

    def with_activations(self, activations: str) -> QuantizedWeight:
        """The same weight for the other kernels. For "q8" each group of 8 rows is interleaved 4
        bytes at a time, qs as [N/8, nb, bytes/4, 8, 4] and d, m as [N/8, nb, 8], so that one
        32-byte load holds the same 4 bytes of 8 rows; for "fp32" rows are one after another."""
        if activations not in QUANTIZED_MAX_TOKENS:
            raise ValueError(f"activations must be one of {list(QUANTIZED_MAX_TOKENS)}, not {activations!r}")
        if activations == self.activations:
            return self
        (N, nb, q_bytes), g = self.qs.shape, ROW_GROUP
        if N % g:
            raise ModelLoadError(f"--quantization gguf-q8: its kernels take weights of a multiple of {g} rows, not {N}")
        if activations == "q8":
            qs = self.qs.view(N // g, g, nb, q_bytes // 4, 4).permute(0, 2, 3, 1, 4)
            d, m = (t.view(N // g, g, nb).transpose(1, 2) for t in (self.d, self.m))
        else:
            qs = self.qs.view(N // g, nb, q_bytes // 4, g, 4).permute(0, 3, 1, 2, 4)
            d, m = (t.view(N // g, nb, g).transpose(1, 2) for t in (self.d, self.m))
        return dataclasses.replace(
            self, qs=qs.reshape(N, nb, q_bytes), d=d.reshape(N, nb), m=m.reshape(N, nb), activations=activations
        )

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * BLOCK

    @property
    def max_tokens(self) -> int | None:
        """The most tokens a product takes through the blocks, more through `dense`; None: all."""
        return QUANTIZED_MAX_TOKENS[self.activations]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: float32 [T, K] -> [T, N] = x @ W^T."""
        N, K = self.shape
        x = x.contiguous()
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != K:
            raise ValueError(f"x: expected float32 [T, {K}], got {x.dtype} {tuple(x.shape)}")
        y = torch.empty(x.shape[0], N, dtype=torch.float32)
        gemm = getattr(ggml_cpu(), GEMMS[self.kind, self.activations])
        if gemm(
            x.data_ptr(),
            x.shape[0],
            K,
            self.qs.data_ptr(),
            self.d.data_ptr(),
            self.m.data_ptr(),
            N,
            y.data_ptr(),
            torch.get_num_threads(),
        ):
            raise MemoryError(f"no memory for the int8 copy of x {tuple(x.shape)}")
        return y

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], as gguf-py computes it."""
        if self.activations != "fp32":
            return self.with_activations("fp32").dequantize()
        q = self.qs.to(torch.int32) if self.kind == "Q4_1" else self.qs.view(torch.int8).to(torch.int32)
        if self.kind == "Q4_1":
            q = torch.cat([q & 0x0F, q >> 4], dim=-1)  # [N, nb, 32]: low nibbles are elements 0..15
        w = q.to(torch.float32) * self.d[..., None] + self.m[..., None]
        return w.reshape(self.shape)


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: float32 [T, K] -> (q int8 [T, K], d float32 [T, K/32], s float32 [T, K/32]): per
    32-block, d = amax / 127, q = x * (127 / amax) rounded to nearest (even), s = d * sum(q),
    as llama.cpp's Q8_1; a block of zeros gives d = s = 0, q = 0."""
    T, K = x.shape
    if x.dtype != torch.float32 or not x.is_contiguous() or K % BLOCK:
        raise ValueError(
            f"x: expected contiguous float32 [T, K] with K a multiple of {BLOCK}, got {x.dtype} {tuple(x.shape)}"
        )
    q = torch.empty(T, K, dtype=torch.int8)
    d, s = torch.empty(T, K // BLOCK), torch.empty(T, K // BLOCK)
    ggml_cpu().quantize_q8(x.data_ptr(), T, K, q.data_ptr(), d.data_ptr(), s.data_ptr())
    return q, d, s


@functools.cache
def ggml_cpu() -> ctypes.CDLL:
    """gpu/kernels/ggml_cpu.c, built on first use (a failed build is not cached: it raises)."""
    try:
        lib = kernels.load("ggml_cpu")
    except kernels.KernelBuildError as e:
        raise ModelLoadError(f"--quantization gguf: {e}") from None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    for name in GEMMS.values():  # x, T, K, qs, d, m, N, y, threads -> the q8 ones: 0 or -1 (no memory)
        gemm = getattr(lib, name)
        gemm.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ctypes.c_int]
        gemm.restype = ctypes.c_int if name.endswith("_q8") else None
    lib.quantize_q8.argtypes = [ptr, i64, i64, ptr, ptr, ptr]  # x, T, K, q, d, s
    lib.quantize_q8.restype = None
    return lib
