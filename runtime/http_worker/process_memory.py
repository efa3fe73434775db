"""The resident memory of each of the server's processes, read from /proc when /metrics is
scraped: granian's main process, its HTTP workers (its children) and the engine's scheduler
and detokenizer (the engine this worker is attached to)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from runtime.supervise.files import EngineProcess

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def server_processes(server_pid: int, engine: Iterable[EngineProcess]) -> list[tuple[str, int]]:
    """(role, pid) of every process of the server: "server", "http_worker", then the engine's roles."""
    engine_roles = [(p.role, p.pid) for p in engine]
    engine_pids = {pid for _, pid in engine_roles}
    workers = sorted(pid for pid in _children(server_pid) if pid not in engine_pids)
    return [("server", server_pid), *(("http_worker", pid) for pid in workers), *engine_roles]


def resident_bytes(pid: int) -> int | None:
    """The process's resident set size, None once it is gone."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return None


def _children(pid: int) -> list[int]:
    """Every thread's children (granian starts its workers from several threads)."""
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(p) for p in (task / "children").read_text().split()]
        except (OSError, ValueError):
            pass
    return kids
