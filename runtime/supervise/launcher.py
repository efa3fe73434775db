"""One engine (Scheduler+Worker process, Detokenizer process) per server, started by
whichever HTTP worker comes first and attached to by the others.

The engine of a server is keyed by the pid of granian's main process (`os.getppid()`
in a worker; `python -m runtime serve` is that process itself); its files are
runtime/supervise/files.py's.

Engine processes are started with `python -m runtime.supervise.launcher <role>` in a session of
their own, so they survive the worker that started them (granian may respawn it).
Each watches the granian main process and its peer with pidfds (runtime/supervise/watchdog.py)
and stops when either exits, kill -9 included. The starting worker hands them their
settings (the server's arguments, the API key among them: never on a command line, which
every local user can read in /proc) and then the pids to watch on stdin, one JSON line
each: a starter that dies before that leaves them an EOF, and they exit.

A stale engine (its processes gone, or the pid reused) is recognised by the process
start times in engine-<pid>.json and replaced; files of servers whose main process is
gone are swept at every start.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.config import ServerArgs
from runtime.supervise.files import EngineProcess, EngineStartError, ServerFiles, process_start_time
from runtime.supervise.watchdog import stop_when_any_exits

logger = logging.getLogger("ringserve.launcher")

ROLES = ("scheduler", "detokenizer")
START_TIMEOUT_S = 600.0  # model conversion (first GGUF start) and loading on a slow CPU
STOP_GRACE_S = 10.0  # an engine process asked to stop is killed after this long
PROGRESS_EVERY_S = 10.0  # how often a worker waiting for the engine says so


# ---------------------------------------------------------------- worker side


def ensure_engine(args: ServerArgs, files: ServerFiles) -> list[EngineProcess]:
    """The server's running engine processes: found, or started by this call. Blocks
    (run it off the event loop) while another worker holds the lock."""
    fd = os.open(files.lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        procs = _read_engine(files)
        if procs and all(p.alive() for p in procs):
            return procs
        _sweep_stale(files.root)
        for p in procs:  # half an engine: its survivor is on its way out; don't wait for it
            if p.alive():
                os.kill(p.pid, signal.SIGKILL)
        procs = _spawn_engine(args, files)
        _write_private(files.info, json.dumps([dataclasses.asdict(p) for p in procs]))
        return procs
    finally:
        os.close(fd)  # releases the flock


def _read_engine(files: ServerFiles) -> list[EngineProcess]:
    try:
        return [EngineProcess(**p) for p in json.loads(files.info.read_text())]
    except (FileNotFoundError, ValueError, TypeError):
        return []


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _spawn_engine(args: ServerArgs, files: ServerFiles) -> list[EngineProcess]:
    for role in ROLES:  # a socket left by a killed engine must not be mistaken for a live one
        files.socket(role).unlink(missing_ok=True)
    files.metrics_dir.mkdir(mode=0o700, exist_ok=True)
    spec = json.dumps(
        {"server_args": dataclasses.asdict(args), "server_pid": files.server_pid, "root": str(files.root)}
    )
    popens = {}
    for role in ROLES:
        popens[role] = popen = subprocess.Popen(
            [sys.executable, "-m", "runtime.supervise.launcher", role],
            stdin=subprocess.PIPE,
            start_new_session=True,
            close_fds=True,
        )
        try:  # a pipe holds 64 KiB unread: the write does not wait for the process
            popen.stdin.write(spec.encode() + b"\n")
            popen.stdin.flush()
        except BrokenPipeError:
            pass  # it died already; the wait for its socket reports it
    procs = []
    for role, popen in popens.items():
        start = process_start_time(popen.pid)
        procs.append(EngineProcess(role, popen.pid, start if start is not None else -1))
    watch = {"server": files.server_pid, **{p.role: p.pid for p in procs}}
    for role, popen in popens.items():
        try:
            popen.stdin.write(json.dumps({k: v for k, v in watch.items() if k != role}).encode() + b"\n")
            popen.stdin.close()
        except BrokenPipeError:
            pass  # it died already; the wait for its socket reports it
    logger.info(
        "engine started: scheduler pid %d, detokenizer pid %d", popens["scheduler"].pid, popens["detokenizer"].pid
    )
    return procs


def wait_for_sockets(files: ServerFiles, procs: list[EngineProcess], timeout: float = START_TIMEOUT_S) -> None:
    """Blocks until every engine process listens on its socket; raises EngineStartError
    at once if one of them exits meanwhile (a bad model, say: its own log says why)."""
    start = time.monotonic()
    deadline, report = start + timeout, start + PROGRESS_EVERY_S
    pending = {p.role: p for p in procs}
    while pending:
        if time.monotonic() > report:
            logger.info(
                "waiting for the engine's %s to load the model: %.0f s", " and ".join(pending), time.monotonic() - start
            )
            report += PROGRESS_EVERY_S
        for role, proc in list(pending.items()):
            if _listening(files.socket(role)):
                del pending[role]
            elif not proc.alive():
                raise EngineStartError(
                    f"the engine's {role} process (pid {proc.pid}) exited during start-up; its log above says why"
                )
        if pending and time.monotonic() > deadline:
            raise EngineStartError(f"the engine's {', '.join(pending)} did not start within {timeout:.0f} s")
        if pending:
            time.sleep(0.05)


@dataclass
class EngineLink:
    """One HTTP worker's connection to the engine."""

    procs: list[EngineProcess]
    worker: int  # this worker's index in the (worker, slot, gen) addresses
    worker_lock_fd: int  # holds the index; closing it frees the index
    waker: Any
    request_ch: Any  # REQUEST channel, producer side
    text_ch: Any  # TEXT_OUT channel, consumer side
    meta: dict  # what the scheduler said about the model and the KV cache

    def close(self, files: ServerFiles) -> None:
        """Detaches; the last worker of a server whose engine is gone removes its files."""
        self.request_ch.close()
        self.text_ch.close()
        self.waker.close()
        os.close(self.worker_lock_fd)
        remove_if_abandoned(files, self.procs)


def remove_if_abandoned(files: ServerFiles, procs: list[EngineProcess]) -> None:
    """Removes the server's files when its engine is gone and no worker is attached (a
    live engine removes them itself when the server exits)."""
    if any(p.alive() for p in procs):
        return
    fd = os.open(files.lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if not _workers_attached(files):
            files.remove()
    finally:
        os.close(fd)


def attach_engine(args: ServerArgs, files: ServerFiles) -> EngineLink:
    """Starts or finds the server's engine, takes a worker index and connects this
    worker's channels. Blocking: run it off the event loop."""
    from ipc import get_transport
    from runtime.detokenizer.process import connect_detokenizer
    from runtime.scheduler.process import connect_scheduler

    procs = ensure_engine(args, files)
    try:
        wait_for_sockets(files, procs)
    except EngineStartError:
        remove_if_abandoned(files, procs)
        raise
    index, lock_fd = claim_worker_index(files)
    waker = get_transport(args.transport).make_waker()
    opened = []
    try:
        request_ch, meta = connect_scheduler(str(files.socket("scheduler")), waker, worker=index)
        opened.append(request_ch)
        text_ch = connect_detokenizer(str(files.socket("detokenizer")), waker, worker=index)
    except BaseException:
        for ch in opened:
            ch.close()
        waker.close()
        os.close(lock_fd)
        raise
    return EngineLink(procs, index, lock_fd, waker, request_ch, text_ch, meta)


def _listening(path: Path) -> bool:
    """The socket file exists and is bound. Binding creates it, and the engine processes
    bind it only when they are ready to hand out channels."""
    return path.is_socket()


def claim_worker_index(files: ServerFiles) -> tuple[int, int]:
    """The lowest worker index no live HTTP worker holds: (index, fd of its flock). Keep
    the fd open for the worker's life; the kernel frees the index when it dies."""
    index = 0
    while True:
        fd = os.open(files.worker_lock(index), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return index, fd
        except BlockingIOError:
            os.close(fd)
            index += 1


def _workers_attached(files: ServerFiles) -> bool:
    """Whether an HTTP worker holds a worker index of this server."""
    for path in files.root.glob(f"engine-{files.server_pid}.worker-*"):
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
    return False


def _sweep_stale(root: Path) -> None:
    """Removes the files of servers whose main process is gone."""
    for lock in root.glob("engine-*.lock"):
        try:
            pid = int(lock.name.split("-", 1)[1].split(".", 1)[0])
        except ValueError:
            continue
        if process_start_time(pid) is None:
            ServerFiles(pid, root).remove()


# ---------------------------------------------------------------- engine side


def engine_process_main(role: str) -> int:
    """`python -m runtime.supervise.launcher <role>`: reads its settings and then the pids to watch
    from stdin, then runs the scheduler or the detokenizer until it is told to stop or a
    watched process exits."""

    # until run_scheduler / run_detokenizer install their own handlers, a stop request
    # unwinds (finally blocks run) instead of killing the process where it stands
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    spec_line = sys.stdin.readline()
    if not spec_line:
        print(
            f"ringserve {role}: the worker starting the engine exited before handing over its settings", file=sys.stderr
        )
        return 1
    spec = json.loads(spec_line)
    args = ServerArgs(**spec["server_args"])
    files = ServerFiles(spec["server_pid"], Path(spec["root"]))
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s %(levelname)s {role}: %(message)s")
    line = sys.stdin.readline()
    if not line:
        logger.error("the worker starting the engine exited before handing over the pids to watch")
        return 1
    stop_when_any_exits(json.loads(line), grace_s=STOP_GRACE_S)
    from gpu.model_files import ModelLoadError

    try:
        if role == "scheduler":
            from runtime.scheduler.process import run_scheduler

            run_scheduler(args, str(files.socket("scheduler")), str(files.socket("detokenizer")), str(files.stats))
        else:
            from runtime.detokenizer.process import run_detokenizer

            run_detokenizer(args, str(files.socket("detokenizer")))
    except ModelLoadError as e:
        logger.error("cannot load the model: %s", e)
        return 3
    except KeyboardInterrupt:
        pass
    finally:
        files.socket(role).unlink(missing_ok=True)
        if process_start_time(files.server_pid) is None:
            files.remove()  # the server is gone: nobody else will clean up
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ROLES:
        print(
            f"usage: python -m runtime.supervise.launcher {{{'|'.join(ROLES)}}} (started by the server: "
            "its settings and the pids to watch come on stdin)",
            file=sys.stderr,
        )
        sys.exit(2)
    sys.exit(engine_process_main(sys.argv[1]))
