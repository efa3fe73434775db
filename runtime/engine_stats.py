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

from protocol.records import PAUSE_MODES, fields_of

GEN_WINDOW_NS = 1_000_000_000  # gen_throughput and cache_hit_rate: over the last window this long
PAUSE_CODES = {mode: i + 1 for i, mode in enumerate(PAUSE_MODES)}  # the `paused` field; 0: running

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
        ("spec_verifies", np.uint64),  # speculative decoding: drafts verified (one a request a step)
        ("spec_draft_tokens", np.uint64),  # tokens drafted
        ("spec_accepted_tokens", np.uint64),  # of those, the tokens the model chose too
        ("gen_throughput", np.float64),  # tokens generated per second over the last window
        ("cache_hit_rate", np.float64),  # prompt tokens from the prefix cache / all, last window with any
        ("paused", np.uint8),  # /pause_generation: PAUSE_CODES[mode], 0 running
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
        self._window = (0, 0, 0, 0)  # writer: (start ns, generated, cached, prefill tokens) at the window's start
        self._rates = (0.0, 0.0)  # writer: (gen_throughput, cache_hit_rate) of the last complete window

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
        s, pool, spec = scheduler.stats, scheduler.pool, scheduler.speculator.stats
        now = time.monotonic_ns()
        if now - self._window[0] >= GEN_WINDOW_NS:
            self._roll(now, s)
        self.record[0] = (
            now,
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
            spec.verifies,
            spec.draft_tokens,
            spec.accepted_tokens,
            *self._rates,
            PAUSE_CODES.get(scheduler.paused, 0),
        )

    def _roll(self, now: int, s: Any) -> None:
        """The rates of the window ending now; a new window starts."""
        start, generated, cached, prefill = self._window
        throughput, hit_rate = self._rates
        if start:
            throughput = (s.generated_tokens - generated) * 1e9 / (now - start)
            prompt = (s.cached_tokens - cached) + (s.prefill_tokens - prefill)
            if prompt:  # a window without prompts keeps the last rate
                hit_rate = (s.cached_tokens - cached) / prompt
        self._window = (now, s.generated_tokens, s.cached_tokens, s.prefill_tokens)
        self._rates = (throughput, hit_rate)

    def read(self) -> dict[str, int | float]:
        rec = self.record[0].copy()
        return {name: rec[name].item() for name in fields_of(ENGINE_STATS)}

    def close(self) -> None:
        self.record = None
        self._map.close()


def used_kv_pages(stats: dict[str, int | float]) -> int:
    """KV pages held by requests in read()'s stats: neither free nor held only by the prefix
    cache (times page_size: SGLang's num_used_tokens, and the load sglang-router compares)."""
    return int(stats["kv_pages_total"] - stats["kv_pages_free"] - stats["kv_pages_cached"])
