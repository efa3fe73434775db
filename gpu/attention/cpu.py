"""The CPU backend: attention by gpu/kernels/attention_cpu.c, which reads each request's keys
and values in place from its pages (AVX2 + FMA, OpenMP), fp32 queries against a fp32, fp16,
bf16 or fp8 e5m2 cache (--kv-cache-dtype). Decode requests (one new token) go to
paged_decode_attention_windowed (each request's keys in chunks over the threads, merged), extend
requests (a prompt, a chunk of one, new tokens after a cached prefix) to paged_extend_attention
(blocks of queries x the query heads of a kv head against chunks of keys, online softmax). Both
take each layer's sliding window (the keys before it are not read) and the soft-cap of the
scores (configure(): Gemma 2 / 3, SmolLM3). A model that is not fp32 runs through the torch
backend.

Against the torch backend (copy every request's pages into a padded batch, then a masked
SDPA reads the copy) it reads each K and V row once per block of queries and skips the
padding; the results agree to fp32 rounding (tests/unit/test_gpu_attention.py,
tests/unit/test_attention_cpu_windows.py, perf/attention_bench.py,
perf/attention_windows_bench.py)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from gpu import kernels
from gpu.attention.base import AttentionMetadata
from gpu.attention.torch_native import TorchNativeBackend
from gpu.kvcache.kv_cache import KVCache

MAX_HEAD_DIM = 256  # the kernel's limit (attention_cpu.c)
KV_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e5m2: 3}  # kv_dtype.h

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


def _library() -> ctypes.CDLL:
    lib = kernels.load("attention_cpu")
    # q, q_stride, k, v, kv_dtype, page_table, pt_stride, kv_lens, B, Hq, Hkv, D, page_size, scale, window, softcap,
    # out, threads
    lib.paged_decode_attention_windowed.argtypes = [
        _ptr,
        _i64,
        _ptr,
        _ptr,
        _int,
        _ptr,
        _i64,
        _ptr,
        _i64,
        _i64,
        _i64,
        _i64,
        _i64,
        ctypes.c_float,
        _i64,
        ctypes.c_float,
        _ptr,
        _int,
    ]
    # q, q_stride, k, v, kv_dtype, page_table, pt_stride, q_starts, q_lens, kv_lens, B, Hq, Hkv, D, page_size,
    # scale, window, softcap, out, out_stride, threads
    lib.paged_extend_attention.argtypes = [
        _ptr,
        _i64,
        _ptr,
        _ptr,
        _int,
        _ptr,
        _i64,
        _ptr,
        _ptr,
        _ptr,
        _i64,
        _i64,
        _i64,
        _i64,
        _i64,
        ctypes.c_float,
        _i64,
        ctypes.c_float,
        _ptr,
        _i64,
        _int,
    ]
    lib.paged_decode_attention_windowed.restype = lib.paged_extend_attention.restype = ctypes.c_int
    lib.soft_cap.argtypes = [_ptr, _i64, ctypes.c_float, _ptr]  # x, n, cap, out
    return lib


@dataclass(frozen=True)
class _Requests:
    """One kernel's requests in a step (each array int32, one entry or row per request)."""

    tokens: torch.Tensor  # [n], the flat token of each decode request; for extend, its first new token
    q_lens: torch.Tensor  # [n]
    kv_lens: torch.Tensor  # [n]
    page_table: torch.Tensor  # [n, max_pages]


def _requests(seqs: np.ndarray, meta: AttentionMetadata) -> _Requests | None:
    if not len(seqs):
        return None
    c = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))
    q_starts = meta.qo_indptr_host[seqs]
    return _Requests(
        c(q_starts),
        c(meta.qo_indptr_host[seqs + 1] - q_starts),
        c(meta.kv_lens_host[seqs]),
        c(meta.page_table_host[seqs]),
    )


class CpuBackend(TorchNativeBackend):
    WINDOWS_AND_SOFTCAP = True

    def __init__(self, kv_cache: KVCache, num_q_heads: int) -> None:
        super().__init__(kv_cache, num_q_heads)
        if kv_cache.device.type != "cpu" or kv_cache.dtype not in KV_DTYPE_CODES:
            raise ValueError(
                "--attention-backend cpu runs on the CPU with a float32, float16, bfloat16 or fp8_e5m2 KV cache"
            )
        if self.head_dim % 8 or self.head_dim > MAX_HEAD_DIM:
            raise ValueError(
                f"--attention-backend cpu takes a head_dim that is a multiple of 8 up to {MAX_HEAD_DIM} "
                f"(this model: {self.head_dim}); use --attention-backend torch"
            )
        try:
            self._lib = _library()
        except kernels.KernelBuildError as e:
            raise ValueError(f"--attention-backend cpu: {e}") from None

    def plan(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        self.groups = []  # the torch backend's padded groups, planned only if a non-fp32 model needs them
        q_lens = np.diff(meta.qo_indptr_host)
        self._decode = _requests(np.flatnonzero(q_lens == 1), meta)
        self._extend = _requests(np.flatnonzero(q_lens > 1), meta)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        if q.dtype != torch.float32:
            if not self.groups:
                super().plan(self.meta)
            return super().forward(q, k, v, layer_id)
        self.store_kv(k, v, layer_id, self.meta.out_cache_loc)
        T, Hq, D = q.shape  # q: a slice of the fused qkv rows, each token's heads contiguous
        o = torch.empty(T, Hq, D)
        dec, ext = self._decode, self._extend
        if ext is None:  # decode only
            if dec is not None:
                self._attend_decode(dec, q, o, layer_id)
            return o
        self._check(
            self._lib.paged_extend_attention(
                q.data_ptr(),
                q.stride(0),
                *self._cache_args(layer_id),
                ext.page_table.data_ptr(),
                ext.page_table.shape[1],
                ext.tokens.data_ptr(),
                ext.q_lens.data_ptr(),
                ext.kv_lens.data_ptr(),
                len(ext.tokens),
                Hq,
                self.num_kv_heads,
                D,
                self.kv_cache.page_size,
                self.scale,
                *self._window_and_softcap(layer_id),
                o.data_ptr(),
                Hq * D,
                torch.get_num_threads(),
            )
        )
        if dec is not None:
            # the decode tokens sit among the extend ones: their rows gathered, attended, put back
            tokens = dec.tokens.long()
            od = torch.empty(len(tokens), Hq, D)
            self._attend_decode(dec, q[tokens], od, layer_id)
            o[tokens] = od
        return o

    def _attend_decode(self, dec: _Requests, q: torch.Tensor, o: torch.Tensor, layer_id: int) -> None:
        """q: [n, Hq, D], request b's query at row b -> o: [n, Hq, D] contiguous"""
        self._check(
            self._lib.paged_decode_attention_windowed(
                q.data_ptr(),
                q.stride(0),
                *self._cache_args(layer_id),
                dec.page_table.data_ptr(),
                dec.page_table.shape[1],
                dec.kv_lens.data_ptr(),
                len(dec.kv_lens),
                self.num_q_heads,
                self.num_kv_heads,
                self.head_dim,
                self.kv_cache.page_size,
                self.scale,
                *self._window_and_softcap(layer_id),
                o.data_ptr(),
                torch.get_num_threads(),
            )
        )

    def _cache_args(self, layer_id: int) -> tuple[int, int, int]:
        return (
            self.kv_cache.k[layer_id].data_ptr(),
            self.kv_cache.v[layer_id].data_ptr(),
            KV_DTYPE_CODES[self.kv_cache.dtype],
        )

    def _window_and_softcap(self, layer_id: int) -> tuple[int, float]:
        """The kernels' window and softcap arguments for layer_id: 0 for none."""
        window = self.windows[layer_id] if self.windows else None
        return window or 0, self.softcap or 0.0

    @staticmethod
    def _check(rc: int) -> None:
        if rc != 0:
            raise MemoryError("attention_cpu: no memory for the kernel's scratch")
