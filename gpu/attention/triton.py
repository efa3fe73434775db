"""Attention through the triton kernels of gpu/kernels/triton_attention.py.

Decode-only steps use the split-K decode kernel (one program per kv head and split, the query
heads of a group sharing each K/V load); any step with a multi-token request runs every row,
decode rows included, through the extend kernel in one launch.
"""

from __future__ import annotations

import torch

from gpu.attention.base import AttentionBackend, AttentionMetadata
from gpu.kernels.triton_attention import INTERPRETED, decode_attention, extend_attention
from gpu.kvcache.kv_cache import KVCache

# A split shorter than this costs more in the merge than it wins in parallelism.
_MIN_TOKENS_PER_SPLIT = 256
_MAX_KV_SPLITS = 16


class TritonBackend(AttentionBackend):
    def __init__(self, kv_cache: KVCache, num_q_heads: int) -> None:
        super().__init__(kv_cache, num_q_heads)
        if kv_cache.device.type != "cuda" and not INTERPRETED:
            raise ValueError(
                "--attention-backend triton needs a CUDA device (its kernels run on the CPU "
                "only interpreted, with TRITON_INTERPRET=1, for tests)"
            )
        self.num_sms = (
            torch.cuda.get_device_properties(kv_cache.device).multi_processor_count
            if kv_cache.device.type == "cuda"
            else 1
        )

    def plan(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        if meta.is_decode:
            self.num_kv_splits = self._num_kv_splits(meta.num_seqs, meta.max_kv_len)

    def _num_kv_splits(self, num_seqs: int, max_kv_len: int) -> int:
        """Enough (request, kv head, split) programs to fill the SMs twice over, a power of two
        so few kernel variants are compiled."""
        want = min(
            _MAX_KV_SPLITS, max_kv_len // _MIN_TOKENS_PER_SPLIT, 2 * self.num_sms // (num_seqs * self.num_kv_heads)
        )
        return 1 << (max(want, 1).bit_length() - 1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        meta = self.meta
        self.store_kv(k, v, layer_id, meta.out_cache_loc)
        k_cache, v_cache = self.kv_cache.k[layer_id], self.kv_cache.v[layer_id]
        if meta.is_decode:
            return decode_attention(
                q, k_cache, v_cache, meta.page_table, meta.kv_lens, self.scale, num_kv_splits=self.num_kv_splits
            )
        return extend_attention(
            q, k_cache, v_cache, meta.qo_indptr, meta.page_table, meta.kv_lens, meta.max_q_len, self.scale
        )
