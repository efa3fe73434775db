"""Process-death watching with pidfds (Linux >= 5.3): a pidfd becomes readable the
moment its process exits, kill -9 included, whoever its parent is.

    engine side   stop_when_any_exits({"server": pid, "detokenizer": pid}, grace_s)
                  a thread: SIGTERM to this process when a watched one exits, then a
                  hard exit if the graceful stop takes longer than grace_s
    worker side   EngineWatchdog(procs, server_pid, on_engine_exit).start(loop)
                  the pidfds on the worker's event loop (loop.add_reader): the callback
                  runs on the loop as soon as an engine process dies; the worker stops
                  itself when granian's main process is gone
                  stalled_heartbeats({"scheduler": request_ch, "detokenizer": text_ch}, ns):
                  the hung ones (the HTTP worker kills and replaces them)
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Mapping

from runtime.supervise.files import EngineProcess

logger = logging.getLogger("ringserve.watchdog")

# A scheduler whose heartbeat is older than this is reported hung by /health. The scheduler
# beats between a forward's layers too, so this bounds one layer's time (or one step's
# bookkeeping), not a whole prefill: a busy engine stays healthy, a stopped one is seen.
HEARTBEAT_STALE_S = 30.0


def _pidfd(pid: int) -> int | None:
    """A pidfd for `pid`, or None when the process is already gone."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


def stop_when_any_exits(pids: Mapping[str, int], grace_s: float) -> threading.Thread:
    """Starts a daemon thread that stops this process when any of `pids` exits."""
    fds = {}
    gone = []
    for name, pid in pids.items():
        fd = _pidfd(pid)
        if fd is None:
            gone.append(name)
        else:
            fds[fd] = name

    def watch() -> None:
        if gone:
            name = gone[0]
        else:
            ready, _, _ = select.select(list(fds), [], [])
            name = fds[ready[0]]
        logger.info("the %s process exited: stopping", name)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        logger.error("still running %.0f s after the %s exited: exiting now", grace_s, name)
        os._exit(1)

    thread = threading.Thread(target=watch, name="stop-when-any-exits", daemon=True)
    thread.start()
    return thread


def stalled_heartbeats(channels: Mapping[str, object], timeout_ns: int) -> dict[str, float]:
    """{role: seconds since its last beat} of the channels whose peer has not stamped the
    heartbeat for longer than `timeout_ns` (one that never beat yet, or a transport without
    heartbeats, is not judged)."""
    now = time.monotonic_ns()
    stalled = {}
    for role, ch in channels.items():
        beat = getattr(ch, "heartbeat_ns", None)
        last = beat() if beat is not None else 0
        if last and now - last > timeout_ns:
            stalled[role] = (now - last) * 1e-9
    return stalled


class EngineWatchdog:
    def __init__(self, procs: list[EngineProcess], server_pid: int, on_engine_exit: Callable[[str], None]) -> None:
        self.procs = procs
        self.server_pid = server_pid
        self.on_engine_exit = on_engine_exit
        self.dead: str | None = None  # role of the first engine process seen to exit
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fds: list[int] = []

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        for proc in self.procs:
            fd = _pidfd(proc.pid)
            if fd is None or not proc.alive():  # gone, or the pid already belongs to another process
                if fd is not None:
                    os.close(fd)
                loop.call_soon(self._engine_exited, proc.role)
                continue
            self._fds.append(fd)
            loop.add_reader(fd, self._fired, loop, fd, self._engine_exited, proc.role)
        fd = _pidfd(self.server_pid)
        if fd is not None:
            self._fds.append(fd)
            loop.add_reader(fd, self._fired, loop, fd, self._server_exited)

    def _fired(self, loop: asyncio.AbstractEventLoop, fd: int, callback: Callable[..., None], *args) -> None:
        loop.remove_reader(fd)  # an exited process's pidfd stays readable
        callback(*args)

    def _engine_exited(self, role: str) -> None:
        for proc in self.procs:  # the worker that started the engine reaps it (no zombie)
            try:
                os.waitpid(proc.pid, os.WNOHANG)
            except ChildProcessError:
                pass
        if self.dead is None:
            self.dead = role
            logger.error("the engine's %s process exited: failing every request", role)
            self.on_engine_exit(role)

    def _server_exited(self) -> None:
        logger.error("granian's main process exited: stopping this worker")
        self.close()
        os.kill(os.getpid(), signal.SIGTERM)

    def close(self) -> None:
        for fd in self._fds:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(fd)
            os.close(fd)
        self._fds = []
