"""Storage for a step's largest products, kept from one step to the next.

A step's logits ([rows, V] float32: 33.5 MB at 32 rows of a 262k vocabulary) and a prompt
chunk's MLP input ([T, 2I]: 33.5 MB at 2048 tokens of Gemma 3 270M) are past glibc's mmap
threshold (32 MB at most). Allocated afresh, such a block is a new mapping every time,
page-faulted in and zeroed by the kernel page by page (8k faults a block), and unmapped when
freed; a prompt chunk makes one a layer. Kept, it is resident once. Raising glibc's thresholds
instead does not hold: torch allocates with posix_memalign, whose split-off tail lands in the
thread cache between the freed block and the heap's top, so the next block of the same size
fits neither and the heap grows by one a step.

Written into by GGUF weights' products (GGUFWeight.matmul's `out`); torch weights make their
own tensors. A buffer grows to a burst's widest step, in multiples of GROWTH_ROWS rows so that
a burst's ramp reallocates it a few times only (and holds at most that many rows more than
asked), and is given back by release() once the burst is over."""

from __future__ import annotations

import torch

GROWTH_ROWS = 32  # a buffer's rows are a multiple of this: one allocation for a ramp up to 32 streams


class RowBuffer:
    """float32 [rows, width] storage, reused by every step until release()."""

    def __init__(self, width: int, device: torch.device) -> None:
        self.width = width
        self.device = device
        self._storage: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        """The rows the kept storage holds (0: none kept)."""
        return 0 if self._storage is None else self._storage.shape[0]

    def rows(self, n: int) -> torch.Tensor:
        """A contiguous [n, width] view of the storage: valid until the next call, whose
        product overwrites it."""
        if self._storage is None or n > self._storage.shape[0]:
            rows = -(-n // GROWTH_ROWS) * GROWTH_ROWS
            self._storage = torch.empty(rows, self.width, device=self.device)
        return self._storage[:n]

    def release(self) -> None:
        """Drops the storage (a burst is over); the next step allocates it again."""
        self._storage = None
