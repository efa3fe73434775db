"""The CPU backend: decode attention by gpu/kernels/attention_cpu.c, which reads each
request's keys and values in place from its pages (AVX2 + FMA, OpenMP over chunks of
requests), fp32 queries against a fp32, fp16 or bf16 cache (--kv-cache-dtype);
prefill and chunks run through the torch backend's SDPA, which is efficient when there are
many queries per request, as do the decode queries of a model that is not fp32.

Against the torch backend's decode (copy every request's pages into a padded batch, then a
masked SDPA reads the copy) it reads each K and V row once and skips the padding; the
results agree to fp32 rounding (tests/test_gpu_attention.py, perf/attention_bench.py)."""
from __future__ import annotations

import ctypes

import numpy as np
import torch

from gpu import kernels
from gpu.attention.base import AttentionMetadata
from gpu.attention.torch_native import TorchNativeBackend, _Group
from gpu.kv_cache import KVCache

MAX_HEAD_DIM = 256  # the kernel's limit (attention_cpu.c)
KV_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # gpu/kernels/kv_dtype.h


def _library() -> ctypes.CDLL:
    lib = kernels.load("attention_cpu")
    fn = lib.paged_decode_attention
    fn.restype = ctypes.c_int
    # q, q_stride, k, v, kv_dtype, page_table, pt_stride, kv_lens, B, Hq, Hkv, D, page_size, scale, out, threads
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    return lib


class CpuBackend(TorchNativeBackend):
    def __init__(self, kv_cache: KVCache, num_q_heads: int) -> None:
        super().__init__(kv_cache, num_q_heads)
        if kv_cache.device.type != "cpu" or kv_cache.dtype not in KV_DTYPE_CODES:
            raise ValueError("--attention-backend cpu runs on the CPU with a float32, float16 or bfloat16 KV cache")
        if self.head_dim % 8 or self.head_dim > MAX_HEAD_DIM:
            raise ValueError(f"--attention-backend cpu takes a head_dim that is a multiple of 8 up to {MAX_HEAD_DIM} "
                             f"(this model: {self.head_dim}); use --attention-backend torch")
        try:
            self._kernel = _library().paged_decode_attention
        except kernels.KernelBuildError as e:
            raise ValueError(f"--attention-backend cpu: {e}") from None

    def plan(self, meta: AttentionMetadata) -> None:
        super().plan(meta)
        decode = np.flatnonzero(np.diff(meta.qo_indptr_host) == 1)  # the decode group's requests, in its order
        self._page_table = torch.from_numpy(np.ascontiguousarray(meta.page_table_host[decode], dtype=np.int32))
        self._kv_lens = torch.from_numpy(np.ascontiguousarray(meta.kv_lens_host[decode], dtype=np.int32))

    def _attend(self, g: _Group, qg: torch.Tensor, layer_id: int) -> torch.Tensor:
        G, Q = g.q_index.shape
        if Q > 1 or qg.dtype != torch.float32:
            return super()._attend(g, qg, layer_id)
        # qg: [G, 1, Hq, D], each request's heads contiguous (a slice of the fused qkv rows)
        out = torch.empty(G, 1, self.num_q_heads, self.head_dim)
        pt = self._page_table
        rc = self._kernel(qg.data_ptr(), qg.stride(0), self.kv_cache.k[layer_id].data_ptr(),
                          self.kv_cache.v[layer_id].data_ptr(), KV_DTYPE_CODES[self.kv_cache.dtype],
                          pt.data_ptr(), pt.shape[1], self._kv_lens.data_ptr(), G, self.num_q_heads,
                          self.num_kv_heads, self.head_dim, self.kv_cache.page_size, self.scale, out.data_ptr(),
                          torch.get_num_threads())
        if rc != 0:
            raise MemoryError("attention_cpu: no memory for the scores")
        return out
