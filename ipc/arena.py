"""The payload arena of a channel: a byte ring of variable-length blobs, reclaimed in order.

Positions are monotonic u64 byte counters (never wrap, so no ABA); the byte at
position p lives at index p % size. A blob is placed 8-byte aligned and never
straddles the end of the arena: when it would, the producer skips to the next
lap and the skipped bytes are padding, reclaimed with the blob after them. So
every blob is one contiguous numpy slice, written and read with one copy.

The arena keeps no counters itself: the producer places blobs after its own
tail, the ring records each record's blob bounds, and the consumer frees up to
the first blob still referenced (ipc/ring.py).
"""

from __future__ import annotations

import numpy as np

ALIGN = 8


def align_up(pos: int) -> int:
    return (pos + ALIGN - 1) & ~(ALIGN - 1)


class Arena:
    def __init__(self, data: np.ndarray) -> None:
        # data: [size] uint8 inside the shared segment
        if data.size % ALIGN:
            raise ValueError(f"arena size must be a multiple of {ALIGN}, not {data.size}")
        self.data = data
        self.size = data.size

    def place(self, tail: int, nbytes: int) -> int:
        """Where a blob of `nbytes` goes if the producer's tail is `tail` (aligned)."""
        index = tail % self.size
        if nbytes and index + nbytes > self.size:
            return tail + self.size - index
        return tail

    def write(self, pos: int, blob: np.ndarray) -> None:
        index = pos % self.size
        self.data[index : index + blob.size] = blob

    def read(self, start: int, end: int) -> np.ndarray:
        """A private copy of positions [start, end); at most one wrap (end - start <= size)."""
        n = end - start
        out = np.empty(n, np.uint8)
        index = start % self.size
        first = min(n, self.size - index)
        out[:first] = self.data[index : index + first]
        if first < n:
            out[first:] = self.data[: n - first]
        return out
