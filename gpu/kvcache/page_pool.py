"""The free list of KV pages. Pages are small integers into the KV cache; the pool only
hands them out and takes them back (sharing between requests is the radix cache's job).

Plain Python structures, not numpy: a request's alloc or free moves a handful of pages,
where each numpy call costs more than the whole Python loop (and a free as numpy is several
calls)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class PagePool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"a page pool needs num_pages >= 1 and page_size >= 1, not {num_pages} and {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: low ids are handed out first
        self._is_free = bytearray(b"\x01") * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> np.ndarray | None:
        """n page ids (int32), or None when fewer than n are free."""
        if n > len(self._free):
            return None
        ids = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        is_free = self._is_free
        for page in ids:
            is_free[page] = 0
        return np.array(ids, dtype=np.int32)

    def free(self, ids: np.ndarray | Sequence[int]) -> None:
        pages = ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
        if not pages:
            return
        if min(pages) < 0 or max(pages) >= self.num_pages:
            raise ValueError(f"page ids must be in [0, {self.num_pages}), got {min(pages)}..{max(pages)}")
        is_free = self._is_free
        if any(is_free[page] for page in pages) or len(set(pages)) != len(pages):
            raise ValueError("freeing a page that is already free (double free)")
        for page in pages:
            is_free[page] = 1
        self._free.extend(reversed(pages))

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)
