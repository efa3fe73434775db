"""The LoRA adapters the engine serves, as the scheduler publishes them for the HTTP workers:
each adapter's name and id, and the pool's counters (resident, loads, evictions).

The scheduler assigns every adapter's id (runtime/scheduler/lora.py), so an adapter loaded at
run time through one worker is known to all of them by the same id. The table lives in a
file-backed shared mapping of the server's private runtime dir, beside EngineStats
(`engine-<pid>.loras`), written only by the scheduler and only between steps. A worker reads
one integer per lookup (`seq`) and rebuilds its name -> id dict only when it changed: a
seqlock, whose writer makes `seq` odd while it writes, so that a reader never takes a half
written table. The scheduler writes the table before it answers a load or an unload, so a
request any worker takes after that answer sees it.
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import numpy as np

from protocol.lora import MAX_ADAPTER_NAME

HEADER = np.dtype(
    [
        ("seq", np.uint64),  # odd while the table is written; changes with every write
        ("count", np.uint32),  # adapters registered (rows of the table in use)
        ("resident", np.uint32),  # of them, with their weights in memory (the counters below are outside the seqlock)
        ("loads", np.uint64),  # adapters read into memory, registrations and reloads after an eviction
        ("evictions", np.uint64),
    ]
)
ENTRY = np.dtype([("id", np.uint16), ("name_len", np.uint8), ("name", f"S{MAX_ADAPTER_NAME}")])
READ_TRIES = 1000  # a reader meeting a write this many times in a row takes the last table it read


def registry_path(stats_path: str | Path) -> Path:
    """The table's file, beside the engine's stats file (engine-<pid>.stats -> engine-<pid>.loras)."""
    return Path(stats_path).with_suffix(".loras")


def loads_path(stats_path: str | Path) -> Path:
    """The adapters loaded at run time, kept for an engine that replaces this one
    (runtime/scheduler/lora.py): engine-<pid>.stats -> engine-<pid>.lora-loads."""
    return Path(stats_path).with_suffix(".lora-loads")


class LoraRegistry:
    """The published table: `create` (the scheduler, writer) or `open` (a worker, reader)."""

    def __init__(self, path: Path, capacity: int, writable: bool) -> None:
        size = HEADER.itemsize + capacity * ENTRY.itemsize
        fd = os.open(path, (os.O_RDWR | os.O_CREAT) if writable else os.O_RDONLY, 0o600)
        try:
            if writable:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size < size:
                raise ValueError(f"{path}: shorter than a table of {capacity} adapters")
            self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
        finally:
            os.close(fd)
        self.header = np.ndarray(1, HEADER, buffer=self._map)
        self.entries = np.ndarray(capacity, ENTRY, buffer=self._map, offset=HEADER.itemsize)
        self._seen = -1  # reader: the seq its dict was built at
        self._names: dict[str, int] = {}
        self._by_id: dict[int, str] = {}
        if writable:  # a fresh start, never equal to a previous engine's: workers that kept the file rebuild
            self.header["seq"] = time.monotonic_ns() & ~1

    @classmethod
    def create(cls, stats_path: str | Path, capacity: int) -> LoraRegistry:
        return cls(registry_path(stats_path), capacity, writable=True)

    @classmethod
    def open(cls, stats_path: str | Path, capacity: int) -> LoraRegistry | None:
        """None while the engine has published none (yet)."""
        try:
            return cls(registry_path(stats_path), capacity, writable=False)
        except (FileNotFoundError, ValueError):
            return None

    # ---------------------------------------------------------------- the scheduler
    def publish(self, adapters: dict[str, int]) -> None:
        """The whole table: name -> id of every adapter requests may name now."""
        h = self.header
        seq = int(h["seq"][0])
        h["seq"] = seq + 1
        for i, (name, lid) in enumerate(adapters.items()):
            raw = name.encode()
            self.entries[i] = (lid, len(raw), raw)
        h["count"] = len(adapters)
        h["seq"] = seq + 2

    def count(self, resident: int, loads: int, evictions: int) -> None:
        h = self.header
        h["resident"], h["loads"], h["evictions"] = resident, loads, evictions

    # ---------------------------------------------------------------- a worker
    def names(self) -> dict[str, int]:
        """name -> id of every adapter served now (rebuilt only when the scheduler wrote)."""
        h = self.header
        for _ in range(READ_TRIES):
            seq = int(h["seq"][0])
            if seq == self._seen:
                return self._names
            if seq & 1:
                continue
            rows = self.entries[: int(h["count"][0])].copy()
            if int(h["seq"][0]) != seq:
                continue
            self._names = {bytes(r["name"])[: int(r["name_len"])].decode(): int(r["id"]) for r in rows}
            self._by_id = {lid: name for name, lid in self._names.items()}
            self._seen = seq
            break
        return self._names

    def name_of(self, lid: int) -> str:
        """The name of adapter `lid` as names() last read it (a request just resolved it)."""
        return self._by_id.get(lid, str(lid))

    def counters(self) -> dict[str, int]:
        rec = self.header[0]
        return {"count": int(rec["count"]), **{k: int(rec[k]) for k in ("resident", "loads", "evictions")}}

    def close(self) -> None:
        self.header = self.entries = None  # type: ignore[assignment]
        self._map.close()
