"""The attention backend interface: the model calls plan() once per step and forward() once
per layer; everything a backend derives from the batch layout belongs in plan().

A backend lives in gpu/attention/<module>.py and is registered by name in
gpu/attention/__init__.py (torch -> torch_native.TorchNativeBackend, triton ->
triton.TritonBackend, flashinfer -> flashinfer.FlashInferBackend). Its constructor takes
(kv_cache: KVCache, num_q_heads: int).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from gpu.kvcache.kv_cache import KVCache


@dataclass(frozen=True)
class AttentionMetadata:
    """The layout of one step's batch, built once per step by the ModelRunner.

    Request b's new tokens are q[qo_indptr[b]:qo_indptr[b+1]]; they are the last
    q_len = qo_indptr[b+1] - qo_indptr[b] of its kv_lens[b] positions, so a query at
    position p sees keys 0..p (causal, bottom-right aligned). Device tensors are on the
    cache's device; the *_host arrays are the same values in numpy, for planning without a
    device sync.
    """

    qo_indptr: torch.Tensor  # int32 [B+1]
    kv_lens: torch.Tensor  # int32 [B], tokens in the cache after this step
    page_table: torch.Tensor  # int32 [B, max_pages], row b's first ceil(kv_lens[b]/page_size) entries valid, rest 0
    out_cache_loc: torch.Tensor  # int64 [T], flat slot page * page_size + offset of each new token
    positions: torch.Tensor  # int64 [T]
    kv_page_indptr: torch.Tensor  # int32 [B+1], offsets into kv_page_ids
    kv_page_ids: torch.Tensor  # int32 [sum of pages], row b's valid pages, concatenated
    qo_indptr_host: np.ndarray  # int32 [B+1]
    kv_lens_host: np.ndarray  # int32 [B]
    page_table_host: np.ndarray  # int32 [B, max_pages]
    max_q_len: int
    max_kv_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.kv_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr_host[-1])

    @property
    def is_decode(self) -> bool:
        """Every request has exactly one new token."""
        return self.max_q_len == 1


class AttentionBackend(ABC):
    def __init__(self, kv_cache: KVCache, num_q_heads: int) -> None:
        self.kv_cache = kv_cache
        self.num_q_heads = num_q_heads
        self.num_kv_heads = kv_cache.num_kv_heads
        self.head_dim = kv_cache.head_dim
        self.scale = kv_cache.head_dim**-0.5

    # whether forward() applies configure()'s per-layer sliding windows and score soft-capping
    WINDOWS_AND_SOFTCAP = False

    def configure(
        self, scale: float, sliding_windows: tuple[int | None, ...] = (), softcap: float | None = None
    ) -> None:
        """The model's attention, where it is not plain causal softmax(q k^T / sqrt(D)) v:
        scale: of q k^T; sliding_windows: per layer, None or w: a query at position p sees keys
        p - w + 1 .. p; softcap: scores -> softcap * tanh(scores / softcap) before the mask.
        A backend without WINDOWS_AND_SOFTCAP raises ValueError for either."""
        self.scale = scale
        if not self.WINDOWS_AND_SOFTCAP and (softcap is not None or any(w is not None for w in sliding_windows)):
            raise ValueError(
                f"the {type(self).__name__} attention has no sliding-window or soft-capped attention, "
                "which this model needs: use --attention-backend torch"
            )

    @abstractmethod
    def plan(self, meta: AttentionMetadata) -> None:
        """Called once per step before the first layer."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        """q: [T, Hq, D], k, v: [T, Hkv, D] -> o: [T, Hq, D].
        Stores k, v into layer_id's cache at out_cache_loc, then attends causally."""

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, layer_id: int, out_cache_loc: torch.Tensor) -> None:
        """k, v: [T, Hkv, D] in the model's dtype, rounded (to nearest even) to the cache's."""
        dtype = self.kv_cache.dtype
        for slots, x in ((self.kv_cache.k_slots(layer_id), k), (self.kv_cache.v_slots(layer_id), v)):
            if dtype.itemsize == 1:  # torch has no index_copy_ of fp8 on the CPU: copy the bytes
                slots.view(torch.uint8).index_copy_(0, out_cache_loc, x.to(dtype).view(torch.uint8))
            else:
                slots.index_copy_(0, out_cache_loc, x.to(dtype))
