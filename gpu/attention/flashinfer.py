"""Attention through FlashInfer's paged wrappers (CUDA only): the decode wrapper for
decode-only steps, the prefill wrapper (causal, bottom-right aligned, so it serves cached
prefixes and chunks) for any step with a multi-token request. Planned once per step,
run once per layer on the NHD cache [num_pages, page_size, Hkv, D]."""

from __future__ import annotations

import flashinfer
import numpy as np
import torch

from gpu.attention.base import AttentionBackend, AttentionMetadata
from gpu.kvcache.kv_cache import KVCache

WORKSPACE_BYTES = 256 << 20


class FlashInferBackend(AttentionBackend):
    def __init__(self, kv_cache: KVCache, num_q_heads: int) -> None:
        super().__init__(kv_cache, num_q_heads)
        if kv_cache.device.type != "cuda":
            raise ValueError("--attention-backend flashinfer needs a CUDA device")
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=kv_cache.device)
        # tensor cores serve any GQA group size (SmolLM2's is 3)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
        # fa2 for prefill too: the tensor-core decode wrapper runs fa2's prefill kernels, so both
        # wrappers load one module per dtype, which flashinfer JIT-compiles on first use; the
        # default (auto) would pick fa3 on Hopper, a second, slower-to-compile module
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")

    def plan(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        ps = self.kv_cache.page_size
        kv_lens = meta.kv_lens_host.astype(np.int64)
        pages = -(-kv_lens // ps)
        kv_indptr = np.zeros(len(pages) + 1, np.int32)
        np.cumsum(pages, out=kv_indptr[1:])
        last_page_len = torch.from_numpy(((kv_lens - 1) % ps + 1).astype(np.int32))
        # indptr arrays go in as host tensors: the wrappers plan on the CPU without a device sync
        kv_indptr_t = torch.from_numpy(kv_indptr)
        common = dict(
            num_kv_heads=self.num_kv_heads,
            page_size=ps,
            sm_scale=self.scale,
            q_data_type=self.kv_cache.dtype,
            kv_data_type=self.kv_cache.dtype,
        )
        self.wrapper = self.decode if meta.is_decode else self.prefill
        if meta.is_decode:
            self.decode.plan(
                kv_indptr_t,
                meta.kv_page_ids,
                last_page_len,
                num_qo_heads=self.num_q_heads,
                head_dim=self.head_dim,
                **common,
            )
        else:
            self.prefill.plan(
                torch.from_numpy(meta.qo_indptr_host),
                kv_indptr_t,
                meta.kv_page_ids,
                last_page_len,
                num_qo_heads=self.num_q_heads,
                head_dim_qk=self.head_dim,
                causal=True,
                **common,
            )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        self.store_kv(k, v, layer_id, self.meta.out_cache_loc)
        return self.wrapper.run(q.contiguous(), (self.kv_cache.k[layer_id], self.kv_cache.v[layer_id]))
