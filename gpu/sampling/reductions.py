"""The sampler's row reductions of a CPU float32 tensor by gpu/kernels/sampling_cpu.c; torch's
own elsewhere. torch's index reductions run a scalar loop on the CPU (a greedy step's argmax
over Gemma 3's 262k-token vocabulary cost more than its attention), and a token's logprob needs
only its row's log-softmax normaliser, not the [S, V] log_softmax torch writes. The same
indices as torch.argmax(x, dim=-1), ties and NaNs included; logprobs within float rounding of
torch.log_softmax's (tests/unit/test_sampling_reductions.py)."""

from __future__ import annotations

import ctypes
import functools

import torch

from gpu import kernels


@functools.cache
def _library() -> ctypes.CDLL | None:
    if not kernels.cpu_kernels_available():
        return None
    try:
        lib = kernels.load("sampling_cpu")
    except kernels.KernelBuildError:
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.argmax_rows.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_int]  # x, rows, V, ld, out, threads
    lib.argmax_rows.restype = None
    # x, rows, V, ld, argmax, top, log_sum, threads
    lib.log_softmax_parts.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ctypes.c_int]
    lib.log_softmax_parts.restype = None
    return lib


def _c_rows(x: torch.Tensor) -> ctypes.CDLL | None:
    """The library, where x is rows the C kernels read: float32 [S, V > 0], rows contiguous."""
    lib = _library() if x.device.type == "cpu" else None
    if lib is None or x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] == 0:
        return None
    return lib


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of a 2-D tensor x [S, V] (int64 [S])."""
    lib = _c_rows(x)
    if lib is None:
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(), torch.get_num_threads())
    return out


def log_softmax_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [S, V] -> (argmax int64 [S], top: x at it [S], log_sum [S]): log_softmax(x)[r, j] is
    (x[r, j] - top[r]) - log_sum[r], its argmax argmax[r] (NaN log_sum where top is not finite)."""
    lib = _c_rows(x)
    if lib is None:
        argmax = x.argmax(dim=-1)
        top = x.gather(1, argmax[:, None])[:, 0]
        return argmax, top, torch.logsumexp(x - top[:, None], dim=-1)
    S = x.shape[0]
    argmax, top, log_sum = torch.empty(S, dtype=torch.int64), torch.empty(S), torch.empty(S)
    lib.log_softmax_parts(
        x.data_ptr(),
        S,
        x.shape[1],
        x.stride(0),
        argmax.data_ptr(),
        top.data_ptr(),
        log_sum.data_ptr(),
        torch.get_num_threads(),
    )
    return argmax, top, log_sum
