"""The scheduler's published stats: running and queued requests, KV pages, the prefix cache,
the scheduler-to-detokenizer ring, and the time of the last publish (its heartbeat).

One small record the scheduler rewrites every step in a file-backed shared mapping of the
server's private runtime dir: no syscall per step, a plain store of one numpy record. HTTP
workers read it for /metrics and /health. A read may interleave with a write; metrics
tolerate that.
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

ENGINE_STATS = np.dtype(
    [
        ("updated_ns", np.int64),  # CLOCK_MONOTONIC of the last publish
        ("running", np.uint32),
        ("queued", np.uint32),
        ("kv_pages_total", np.uint32),
        ("kv_pages_free", np.uint32),
        ("kv_pages_cached", np.uint32),  # held only by the radix cache (evictable)
        ("page_size", np.uint32),
        ("token_out_depth", np.uint32),  # records waiting in the scheduler -> detokenizer ring
        ("max_running_requests", np.uint32),
        ("prefill_tokens", np.uint64),  # prompt tokens computed (cache hits excluded)
        ("cached_tokens", np.uint64),  # prompt tokens served from the prefix cache
        ("generated_tokens", np.uint64),
        ("steps", np.uint64),
        ("retractions", np.uint64),
    ]
)


class EngineStats:
    """The scheduler's published stats: `create` (the scheduler, writer) or `open` (a worker)."""

    def __init__(self, path: Path, writable: bool) -> None:
        fd = os.open(path, (os.O_RDWR | os.O_CREAT) if writable else os.O_RDONLY, 0o600)
        try:
            if writable:
                os.ftruncate(fd, ENGINE_STATS.itemsize)
            self._map = mmap.mmap(fd, ENGINE_STATS.itemsize, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
        finally:
            os.close(fd)
        self.record = np.ndarray(1, ENGINE_STATS, buffer=self._map)

    @classmethod
    def create(cls, path: str | Path) -> EngineStats:
        return cls(Path(path), writable=True)

    @classmethod
    def open(cls, path: str | Path) -> EngineStats | None:
        """None when the engine publishes none (yet)."""
        try:
            return cls(Path(path), writable=False)
        except (FileNotFoundError, ValueError):
            return None

    def publish(self, scheduler: Any, token_out_depth: int) -> None:
        """One store of the whole record from a runtime.scheduler.core.Scheduler (once per step)."""
        s, pool = scheduler.stats, scheduler.pool
        self.record[0] = (
            time.monotonic_ns(),
            scheduler.num_running,
            len(scheduler.queue),
            pool.num_pages,
            pool.num_free,
            scheduler.cache.evictable_pages,
            pool.page_size,
            token_out_depth,
            scheduler.config.max_running_requests,
            s.prefill_tokens,
            s.cached_tokens,
            s.generated_tokens,
            s.steps,
            s.retractions,
        )

    def read(self) -> dict[str, int]:
        rec = self.record[0].copy()
        return {name: int(rec[name]) for name in ENGINE_STATS.names}

    def close(self) -> None:
        self.record = None
        self._map.close()
