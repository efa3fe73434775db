"""A frozen HTTP worker found and replaced.

A granian worker whose event loop stops (SIGSTOP, a loop stuck in synchronous work) keeps its
own listening socket (granian binds one a worker with SO_REUSEPORT), so the kernel goes on
giving it its share of the new connections, which then wait for ever. Each worker therefore
stamps a heartbeat from a task on its event loop (WorkerBeat: a stopped loop stops beating)
into its worker-index file, and a thread of the engine's detokenizer process (WorkerWatch)
reads them: a worker that has not beaten for --worker-stall-timeout is killed (SIGKILL: its
listening socket and connections close, and the engine aborts its requests as for any worker
that dies), and granian's --respawn-failed-workers starts a new one, which `serve` passes.
Without that flag granian stops the whole server when a worker dies, so a frozen worker is
then only reported (and the worker says so at start). Whether granian has it is known in the
worker, a fork of granian's main process with its argv and environment (granian's process
title hides them from /proc), so the beat carries it.

    worker side   beat = WorkerBeat(files.worker_lock(index), stall_s, replaceable); beat.start()
                  beat.close()                              a worker stopping is judged no more
    engine side   WorkerWatch(files, stall_s).start()       a thread

The beat is BEAT's five int64 at the start of engine-<pid>.worker-<k> (the file whose flock
the worker holds for its life): its pid, its start time (clock ticks since boot: a reused pid
is not mistaken for it), whether granian replaces it, when it began beating and its last beat
(CLOCK_MONOTONIC ns, the same in every process; 0: not judged).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import stat
import struct
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from runtime.supervise.files import ServerFiles, process_start_time

logger = logging.getLogger("ringserve.worker_watch")

BEAT = struct.Struct("<qqqqq")  # pid, start time (ticks), replaceable (0/1), first beat (ns), last beat (ns)
# granian stops the server when a worker it respawned less than 5.5 s ago dies again (its crash
# loop check): a worker younger than this is not killed, whatever its beat says
RESPAWN_GUARD_S = 6.0
MAX_PID = 1 << 22  # the kernel's ceiling for pid_max
RESPAWN_FLAG = "--respawn-failed-workers"
TRUE_WORDS = ("1", "true", "t", "yes", "y", "on")  # click's words for a true boolean
_WORKER_FILE = re.compile(r"engine-([0-9]+)\.worker-([0-9]{1,6})", re.ASCII)


def beat_interval(stall_timeout_s: float) -> float:
    """How often a worker beats and the watch looks: often enough that one late beat is no stall."""
    return min(1.0, stall_timeout_s / 4)


class WorkerBeat:
    """An HTTP worker's heartbeat, stamped by a task on its event loop."""

    def __init__(self, path: Path, stall_timeout_s: float, replaceable: bool) -> None:
        """replaceable: granian starts a new worker when this one dies (respawns_failed_workers)."""
        self._fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        self._interval = beat_interval(stall_timeout_s)
        pid = os.getpid()
        self._head = (pid, process_start_time(pid) or 0, int(replaceable), time.monotonic_ns())
        self._task: asyncio.Task | None = None
        self._failed = False

    def start(self) -> None:
        if not self._head[2]:
            logger.warning(
                "granian runs without %s: if this worker freezes it cannot be replaced (granian would stop the "
                "whole server when it is killed), only reported; `python -m runtime serve` passes it",
                RESPAWN_FLAG,
            )
        self._stamp()
        self._task = asyncio.create_task(self._run(), name="worker-beat")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            self._stamp()

    def _stamp(self) -> None:
        try:
            os.pwrite(self._fd, BEAT.pack(*self._head, time.monotonic_ns()), 0)
        except OSError as e:  # the watch will see a stale beat: say why here
            if not self._failed:
                logger.error("this worker's heartbeat cannot be written (%s): it will be taken for frozen", e)
                self._failed = True

    def close(self) -> None:
        """A worker stopping (granian's reload or stop waits for its streams) is not frozen: the
        beat is cleared. A cancelled task stamps no more."""
        if self._task is not None:
            self._task.cancel()
        try:
            os.pwrite(self._fd, bytes(BEAT.size), 0)
        except OSError:
            pass  # the watch skips a worker whose process has exited
        os.close(self._fd)


@dataclass(frozen=True)
class Beat:
    index: int  # the worker index
    pid: int
    start_ticks: int
    replaceable: bool
    first_ns: int
    last_ns: int


def read_beats(files: ServerFiles) -> Iterator[Beat]:
    """The beats in the server's worker files: regular files only, never followed; files that
    hold no beat (a worker starting or stopping) are skipped."""
    try:
        names = os.listdir(files.root)
    except OSError:
        return
    for name in names:
        match = _WORKER_FILE.fullmatch(name)
        if match is None or int(match.group(1)) != files.server_pid:
            continue
        try:
            fd = os.open(files.root / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            data = os.pread(fd, BEAT.size, 0) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
        except OSError:
            data = b""
        finally:
            os.close(fd)
        if len(data) == BEAT.size:
            pid, start_ticks, replaceable, first_ns, last_ns = BEAT.unpack(data)
            if last_ns > 0 and 0 < pid < MAX_PID:
                yield Beat(int(match.group(2)), pid, start_ticks, replaceable == 1, first_ns, last_ns)


def respawns_failed_workers(argv: list[str], environ: Mapping[str, str]) -> bool:
    """Whether granian, started with `argv` in `environ`, replaces a worker that dies (its
    command line decides over its environment, as click reads them)."""
    flags = [a for a in argv if a in (RESPAWN_FLAG, "--no-respawn-failed-workers")]
    if flags:
        return flags[-1] == RESPAWN_FLAG
    return environ.get("GRANIAN_RESPAWN_FAILED_WORKERS", "").strip().lower() in TRUE_WORDS


def granian_replaces_workers() -> bool:
    """Whether the granian this worker was forked from (its argv and environment, which a
    worker inherits) replaces a worker that dies."""
    return respawns_failed_workers(sys.argv, os.environ)


class WorkerWatch:
    """Kills (or, when granian would not replace it, reports) the HTTP workers whose beat is
    older than the stall timeout."""

    def __init__(self, files: ServerFiles, stall_timeout_s: float) -> None:
        self.files = files
        self.stall_ns = int(stall_timeout_s * 1e9)
        self.interval = beat_interval(stall_timeout_s)
        self._judged: set[tuple[int, int]] = set()  # (pid, start time) of the workers killed or reported
        self._last_look_ns = time.monotonic_ns()

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name="worker-watch", daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        while True:
            time.sleep(self.interval)
            try:
                self.look(time.monotonic_ns())
            except Exception:  # a bug here must not take the detokenizer down
                logger.exception("the frozen-worker watch failed; it looks again")

    def look(self, now_ns: int) -> list[int]:
        """Judges every worker's beat once; returns the pids killed. A look long after the last
        one (this process, or the whole machine, was stopped meanwhile) judges nothing: the
        workers get the time to beat again."""
        late = now_ns - self._last_look_ns > self.stall_ns / 2
        self._last_look_ns = now_ns
        if late:
            return []
        killed = []
        for beat in read_beats(self.files):
            age_s = (now_ns - beat.last_ns) * 1e-9
            if now_ns - beat.last_ns <= self.stall_ns or now_ns - beat.first_ns < RESPAWN_GUARD_S * 1e9:
                continue
            if (beat.pid, beat.start_ticks) in self._judged:
                continue
            if self._judge(beat, age_s):
                killed.append(beat.pid)
        return killed

    def _judge(self, beat: Beat, age_s: float) -> bool:
        try:
            pidfd = os.pidfd_open(beat.pid)  # pins the process: the checks below hold for the kill
        except OSError:
            return False  # gone
        try:
            if process_start_time(beat.pid) != beat.start_ticks:
                return False  # exited, its pid now another process's
            self._judged.add((beat.pid, beat.start_ticks))
            stall_s = self.stall_ns * 1e-9
            if not beat.replaceable:
                logger.error(
                    "HTTP worker %d (pid %d) has not run its event loop for %.0f s (--worker-stall-timeout %g): "
                    "frozen, and not replaced: granian runs without %s",
                    beat.index,
                    beat.pid,
                    age_s,
                    stall_s,
                    RESPAWN_FLAG,
                )
                return False
            logger.warning(
                "HTTP worker %d (pid %d) has not run its event loop for %.0f s (--worker-stall-timeout %g): "
                "killing it; granian starts a new one",
                beat.index,
                beat.pid,
                age_s,
                stall_s,
            )
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            return True
        finally:
            os.close(pidfd)
