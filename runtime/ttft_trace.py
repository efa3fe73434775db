"""The first-token trace a process's traced variant keeps when RINGSERVE_TRACE_TTFT names a directory."""

from __future__ import annotations

import os
from pathlib import Path

TRACE_TTFT_ENV = "RINGSERVE_TRACE_TTFT"  # a directory: each process appends its first-token stamps there


class TtftTrace:
    """CLOCK_MONOTONIC stamps (system-wide on Linux, so comparable across processes) of one
    request's first-token path through one process, one line a request in
    `<dir>/<role>-<pid>.tsv`: `worker slot gen stage=ns ...`. perf/ttft_breakdown.py joins the
    processes' lines by (worker, slot, gen). Only the processes' traced variants (chosen at
    start when RINGSERVE_TRACE_TTFT names a directory) hold one: the plain ones stamp nothing."""

    def __init__(self, directory: str, role: str) -> None:
        self._file = open(Path(directory) / f"{role}-{os.getpid()}.tsv", "a", buffering=1)

    @staticmethod
    def directory() -> str | None:
        """The trace directory RINGSERVE_TRACE_TTFT names; None: no tracing."""
        return os.environ.get(TRACE_TTFT_ENV) or None

    def write(self, key: tuple[int, int, int], stamps: dict[str, int]) -> None:
        self._file.write(" ".join([*map(str, key), *(f"{k}={v}" for k, v in stamps.items())]) + "\n")

    def close(self) -> None:
        self._file.close()
