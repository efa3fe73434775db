"""Each row's argmax of a CPU float32 tensor by gpu/kernels/sampling_cpu.c (torch's index
reductions run a scalar loop on the CPU: a greedy step's argmax over Gemma 3's 262k-token
vocabulary cost more than its attention); torch's own elsewhere. The same indices as
torch.argmax(x, dim=-1), ties and NaNs included (tests/unit/test_sampling_argmax.py)."""

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
    return lib


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of a 2-D tensor x [S, V] (int64 [S])."""
    lib = _library() if x.device.type == "cpu" else None
    if lib is None or x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] == 0:
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(), torch.get_num_threads())
    return out
