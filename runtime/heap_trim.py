"""Giving the C heap's freed memory back to the system, once loading is done and after each
burst of work, and not during one.

glibc keeps what a process freed for mallocs that may come: what loading left (a tokenizer's
parse frees tens of MB), and in the scheduler what a burst's steps allocated (torch's
temporaries, numpy arrays, the requests' objects: +40 MB over two bursts of 32 requests
on SmolLM2, docs/perf-notes.md). malloc_trim returns the free pages to the system. Other C
libraries: nothing to do."""

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


class IdleTrim:
    """Calls `release` (what the loop keeps between the steps of a burst) and then
    return_freed_memory once a loop has been idle for `after_s` since its last work: never
    between the steps of a burst (a trim walks the heap: milliseconds), nor while requests come
    one after another."""

    def __init__(self, after_s: float, release: Callable[[], None] = lambda: None) -> None:
        self.after_s = after_s
        self.release = release
        self._busy_at: float | None = None  # the last work's time, until the trim after it

    def worked(self) -> None:
        self._busy_at = time.monotonic()

    def idle(self) -> bool:
        """Call when the loop is about to sleep; True when it trimmed now."""
        if self._busy_at is None or time.monotonic() - self._busy_at < self.after_s:
            return False
        self._busy_at = None
        self.release()
        return_freed_memory()
        return True
