"""Giving the C heap's freed memory back to the system, once loading is done and after each
burst of work, and not during one.

glibc keeps what a process freed for mallocs that may come: what loading left (a tokenizer's
parse frees tens of MB), and in the scheduler what a burst's steps allocated (torch's
temporaries, numpy arrays, the requests' objects: +40 MB over two bursts of 32 requests
on SmolLM2, docs/perf-notes.md). malloc_trim returns the free pages to the system. Other C
libraries: nothing to do.

Within a burst the scheduler's steps allocate and free the same large buffers again and again
(a step's logits: 32 rows of a 262k vocabulary are 33.5 MB). glibc serves a block past its mmap
threshold (at most 32 MB) with a fresh mapping and unmaps it on free, and trims the heap's top
past its trim threshold: each step then page-faults its buffers in anew (~9k faults a step, a
tenth of the CPU in the kernel at 32 streams of Gemma 3 270M). hold_freed_memory raises both
thresholds, so that a burst reuses its buffers; IdleTrim's malloc_trim returns them after it."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable


def _malloc_trim() -> Callable[[], None]:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    trim.argtypes = [ctypes.c_size_t]
    return lambda: trim(0)


return_freed_memory = _malloc_trim()

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
HELD_BLOCK_BYTES = 1 << 30  # blocks up to this come from the heap, and free() trims nothing below it


def hold_freed_memory() -> None:
    """Call once, at a process's start: large blocks from the heap, kept when freed (glibc; other
    C libraries: nothing)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mallopt(M_MMAP_THRESHOLD, HELD_BLOCK_BYTES)
    mallopt(M_TRIM_THRESHOLD, HELD_BLOCK_BYTES)


class IdleTrim:
    """Calls return_freed_memory once a loop has been idle for `after_s` since its last work:
    never between the steps of a burst (a trim walks the heap: milliseconds), nor while
    requests come one after another."""

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        self._busy_at: float | None = None  # the last work's time, until the trim after it

    def worked(self) -> None:
        self._busy_at = time.monotonic()

    def idle(self) -> bool:
        """Call when the loop is about to sleep; True when it trimmed now."""
        if self._busy_at is None or time.monotonic() - self._busy_at < self.after_s:
            return False
        self._busy_at = None
        return_freed_memory()
        return True
