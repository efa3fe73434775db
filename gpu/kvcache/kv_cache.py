"""The paged KV cache tensors: one allocation holding every layer's K and V pages."""

from __future__ import annotations

import math
import mmap

import torch


class KVCache:
    """dtype is the cache's element type (--kv-cache-dtype), which may be narrower than the
    model's: the backends convert on store and on read."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        # buffer: [L, 2, num_pages, page_size, Hkv, D], zero-filled so that slots a backend reads
        # but masks (padding, the unwritten tail of a last page) are finite. On the CPU it is an
        # anonymous mapping: zeroed by the kernel and resident only once touched, so a pool sized
        # for the worst case costs nothing until it is used.
        shape = (num_layers, 2, num_pages, page_size, num_kv_heads, head_dim)
        if device.type == "cpu":
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            self._mapping = mmap.mmap(-1, nbytes)
            self.buffer = torch.frombuffer(self._mapping, dtype=dtype).view(shape)
        else:
            self.buffer = torch.zeros(shape, dtype=dtype, device=device)
        self.k = [self.buffer[i, 0] for i in range(num_layers)]  # each [num_pages, page_size, Hkv, D]
        self.v = [self.buffer[i, 1] for i in range(num_layers)]
        self._k_slots = [t.view(num_pages * page_size, num_kv_heads, head_dim) for t in self.k]
        self._v_slots = [t.view(num_pages * page_size, num_kv_heads, head_dim) for t in self.v]

    def k_pages(self, layer_id: int) -> torch.Tensor:
        """[num_pages, page_size * Hkv * D], one row per page."""
        return self.k[layer_id].view(self.num_pages, -1)

    def v_pages(self, layer_id: int) -> torch.Tensor:
        return self.v[layer_id].view(self.num_pages, -1)

    def k_slots(self, layer_id: int) -> torch.Tensor:
        """[num_pages * page_size, Hkv, D], indexed by flat slot."""
        return self._k_slots[layer_id]

    def v_slots(self, layer_id: int) -> torch.Tensor:
        return self._v_slots[layer_id]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
