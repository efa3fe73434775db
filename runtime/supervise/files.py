"""The files of one server's engine, in a private runtime directory (runtime_dir(), mode 0700),
keyed by the pid of granian's main process:

    engine-<pid>.lock            flock held only for the check-or-start critical section
    engine-<pid>.json            the running engine: each process's pid and start time
    engine-<pid>.restarts        when the engine was replaced (CLOCK_MONOTONIC s): the crash-loop limit
    engine-<pid>.scheduler       the scheduler's unix socket (REQUEST channels)
    engine-<pid>.detokenizer     the detokenizer's unix socket (TEXT_OUT channels)
    engine-<pid>.stats           the scheduler's published stats (runtime/engine_stats.py)
    engine-<pid>.loras           the LoRA adapters' names and ids (runtime/lora_registry.py)
    engine-<pid>.lora-loads      the adapters loaded at run time, for a replacing engine (runtime/scheduler/lora.py)
    engine-<pid>.worker-<k>      flock held by HTTP worker k for its whole life
    engine-<pid>.metrics/        prometheus_client's multiprocess files
    engine-<pid>.responses       the Responses API's stored responses (SQLite; runtime/http_worker/response_store.py)

The directory is this user's alone, yet its names are parsed as strictly as /dev/shm's
(ipc/shm.py): a name that does not parse, or is not a regular file of this user where one is
expected, is skipped, never followed and never raised on.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("ringserve.files")

PID_MAX_LIMIT = 4_194_304  # the kernel's ceiling for pid_max: no process has a larger pid
_LOCK_NAME = re.compile(r"engine-([1-9][0-9]{0,6})\.lock", re.ASCII)


class EngineStartError(RuntimeError):
    """The engine could not be started or attached; the message is one line for the user."""


def runtime_dir() -> Path:
    """$XDG_RUNTIME_DIR/ringserve, else <tmp>/ringserve-<uid>, else (that one taken: another
    user may create it first in the shared /tmp) <cache>/run under this user's cache directory;
    created 0700. A directory another user could have prepared is never used. Every worker
    of a server calls this and must get the same answer: no random fallback."""
    candidates = []
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base) and os.access(base, os.W_OK):
        candidates.append(Path(base) / "ringserve")
    tmp = Path(tempfile.gettempdir()) / f"ringserve-{os.getuid()}"
    candidates += [tmp, _cache_root() / "run"]
    problems: list[str] = []
    for path in candidates:
        problem = _private_dir(path)
        if problem is None:
            if problems:
                logger.warning("%s; using %s instead", problems[0], path)
            return path
        problems.append(problem)
    raise EngineStartError(
        f"no private runtime directory: {'; '.join(problems)}. Remove {tmp} (as its owner or root), "
        f"or set XDG_RUNTIME_DIR to a directory of this user with mode 0700"
    )


def _cache_root() -> Path:
    """cbuild.cache_root()'s directory (the C builds' cache): this user's."""
    base = os.environ.get("RINGSERVE_CACHE_DIR") or os.environ.get("XDG_CACHE_HOME")
    return Path(base) / "ringserve" if base else Path.home() / ".cache" / "ringserve"


def _private_dir(path: Path) -> str | None:
    """Creates `path` (mode 0700) if needed; why it cannot serve as this user's private
    directory, or None."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
        st = path.lstat()
    except OSError as e:
        return f"{path}: {e.strerror}"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != os.getuid():
        return f"{path} belongs to uid {st.st_uid}, not this user (uid {os.getuid()})"
    if st.st_mode & 0o077:
        return f"{path} has mode {st.st_mode & 0o777:o}, not 0700"
    return None


@dataclass(frozen=True)
class ServerFiles:
    """The paths of one server's engine (see the module docstring)."""

    server_pid: int
    root: Path

    @classmethod
    def of(cls, server_pid: int) -> ServerFiles:
        return cls(server_pid, runtime_dir())

    def _path(self, suffix: str) -> Path:
        return self.root / f"engine-{self.server_pid}.{suffix}"

    @property
    def lock(self) -> Path:
        return self._path("lock")

    @property
    def info(self) -> Path:
        return self._path("json")

    @property
    def restarts(self) -> Path:
        return self._path("restarts")

    @property
    def stats(self) -> Path:
        return self._path("stats")

    @property
    def responses(self) -> Path:
        return self._path("responses")

    @property
    def metrics_dir(self) -> Path:
        return self._path("metrics")

    def socket(self, role: str) -> Path:
        return self._path(role)

    def worker_lock(self, index: int) -> Path:
        return self._path(f"worker-{index}")

    def remove(self) -> None:
        """Every file of this server (its engine is gone); a symlink is removed, never followed."""
        for path in self.root.glob(f"engine-{self.server_pid}.*"):
            try:
                if stat.S_ISDIR(path.lstat().st_mode):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
            except OSError:
                pass  # gone meanwhile, or not removable: nothing else depends on it


def sweep_stale_servers(root: Path) -> list[int]:
    """Removes the files of servers whose main process is gone: those with an engine-<pid>.lock
    that is a regular file of this user; returns their pids. Never raises."""
    swept = []
    try:
        names = os.listdir(root)
    except OSError:
        return []
    for name in names:
        match = _LOCK_NAME.fullmatch(name)
        if match is None or int(match.group(1)) > PID_MAX_LIMIT:
            continue
        try:
            st = os.lstat(root / name)
        except OSError:
            continue
        pid = int(match.group(1))
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and process_start_time(pid) is None:
            ServerFiles(pid, root).remove()
            swept.append(pid)
    return swept


@dataclass(frozen=True)
class EngineProcess:
    role: str
    pid: int
    start_time: int  # /proc/<pid>/stat field 22: tells a reused pid apart

    def alive(self) -> bool:
        return process_start_time(self.pid) == self.start_time


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot; None when it is gone or a zombie."""
    try:
        line = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return None
    fields = line[line.rindex(")") + 2 :].split()  # the command name may hold spaces
    return None if fields[0] in ("Z", "X") else int(fields[19])
