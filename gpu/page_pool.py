"""The free list of KV pages. Pages are small integers into the KV cache; the pool only
hands them out and takes them back (sharing between requests is the radix cache's job)."""
from __future__ import annotations

import numpy as np


class PagePool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"a page pool needs num_pages >= 1 and page_size >= 1, "
                             f"not {num_pages} and {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        # free[:num_free] are the free pages; taken from the end so low ids are handed out first
        self._free = np.arange(num_pages - 1, -1, -1, dtype=np.int32)
        self._is_free = np.ones(num_pages, dtype=bool)
        self.num_free = num_pages

    def alloc(self, n: int) -> np.ndarray | None:
        """n page ids (int32), or None when fewer than n are free."""
        if n > self.num_free:
            return None
        self.num_free -= n
        ids = self._free[self.num_free:self.num_free + n][::-1].copy()
        self._is_free[ids] = False
        return ids

    def free(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids, dtype=np.int32)
        if len(ids) == 0:
            return
        if ids.min() < 0 or ids.max() >= self.num_pages:
            raise ValueError(f"page ids must be in [0, {self.num_pages}), got {ids.min()}..{ids.max()}")
        if not self._is_free[ids].any() and (len(ids) == 1 or len(set(ids.tolist())) == len(ids)):
            self._is_free[ids] = True
            self._free[self.num_free:self.num_free + len(ids)] = ids[::-1]
            self.num_free += len(ids)
            return
        raise ValueError("freeing a page that is already free (double free)")

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)
