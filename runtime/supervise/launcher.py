"""One engine (Scheduler+Worker process, Detokenizer process) per server, started by
`python -m runtime serve` before its exec into granian (start_engine_early: its imports run
beside serve's checks of the model), else by whichever HTTP worker comes first, and attached
to by the HTTP workers.

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
import importlib
import json
import logging
import os
import select
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.config import ServerArgs
from runtime.supervise.files import (
    EngineProcess,
    EngineStartError,
    ServerFiles,
    process_start_time,
    sweep_stale_servers,
)
from runtime.supervise.watchdog import stop_when_any_exits
from runtime.supervise.worker_watch import WorkerWatch

logger = logging.getLogger("ringserve.launcher")

ROLES = ("scheduler", "detokenizer")
START_TIMEOUT_S = 600.0  # model conversion (first GGUF start) and loading on a slow CPU
STOP_GRACE_S = 10.0  # an engine process asked to stop is killed after this long
PROGRESS_EVERY_S = 10.0  # how often a worker waiting for the engine says so
RESTART_WINDOW_S = 600.0  # --engine-max-restarts counts the replacements of this long
RESTART_BACKOFF_S = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # the wait before the k-th replacement in the window


# ---------------------------------------------------------------- worker side


def ensure_engine(
    args: ServerArgs, files: ServerFiles, cancel: threading.Event | None = None, healing: bool = False
) -> list[EngineProcess]:
    """The server's running engine processes: found, or started by this call. Blocks
    (run it off the event loop) while another worker holds the lock.

    An engine listed but gone (a process died, or was killed as hung) is replaced. `healing`
    (a worker whose engine died, not one starting: granian's start, reload or respawn): after
    a wait that grows with the replacements of the last RESTART_WINDOW_S, and past
    --engine-max-restarts of them this raises EngineGaveUp instead (for every worker alike:
    the count is a file of the server's)."""
    fd = os.open(files.lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        procs = _read_engine(files)
        if procs and all(p.alive() for p in procs):
            return procs
        if process_start_time(files.server_pid) is None:  # an engine would stop at once (and remove the files)
            raise EngineGaveUp(f"granian's main process (pid {files.server_pid}) is gone: the server is stopping")
        if procs and healing:
            _before_restart(args, files, procs, cancel or threading.Event())
        sweep_stale_servers(files.root)
        for p in procs:  # half an engine: its survivor is on its way out; don't wait for its grace
            kill_and_wait(p)
        pending = _spawn_engine(args, files)
        pending.hand_over()
        return pending.procs
    finally:
        os.close(fd)  # releases the flock


def start_engine_early(args: ServerArgs, env: dict[str, str]) -> PendingEngine:
    """The engine of the server this process becomes (`python -m runtime serve`, before its
    exec into granian: the same pid), started before serve's checks of the model, so that its
    imports (torch, transformers: seconds) run beside them instead of after granian's start.
    Its processes import and wait: PendingEngine.hand_over() lets them load, cancel() stops
    them. The first HTTP worker finds it running and attaches."""
    files = ServerFiles.of(os.getpid())
    fd = os.open(files.lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        sweep_stale_servers(files.root)
        return _spawn_engine(args, files, env)
    finally:
        os.close(fd)


class EngineGaveUp(EngineStartError):
    """The engine failed too often (--engine-max-restarts): nobody starts it again."""


def _before_restart(args: ServerArgs, files: ServerFiles, dead: list[EngineProcess], cancel: threading.Event) -> None:
    """Counts a replacement of the engine `dead`, after its back-off; raises EngineGaveUp past the limit."""
    now = time.monotonic()  # CLOCK_MONOTONIC: the same in every process
    try:
        history = [t for t in json.loads(files.restarts.read_text()) if now - t < RESTART_WINDOW_S]
    except (FileNotFoundError, ValueError, TypeError):
        history = []
    gone = ", ".join(f"{p.role} (pid {p.pid})" for p in dead if not p.alive()) or "processes"
    if len(history) >= args.engine_max_restarts:
        done = (
            f"after {len(history)} restarts in the last {RESTART_WINDOW_S / 60:.0f} minutes"
            if history
            else "and restarts are off"
        )
        raise EngineGaveUp(
            f"The engine's {gone} failed {done} (--engine-max-restarts {args.engine_max_restarts}): not "
            "restarted; its log says why. Restart the server."
        )
    wait = RESTART_BACKOFF_S[min(len(history), len(RESTART_BACKOFF_S) - 1)] - (now - history[-1] if history else 0)
    logger.warning(
        "the engine's %s is gone: starting a new engine%s (restart %d of %d allowed in %.0f minutes)",
        gone,
        f" in {wait:.1f} s" if wait > 0 else "",
        len(history) + 1,
        args.engine_max_restarts,
        RESTART_WINDOW_S / 60,
    )
    if wait > 0 and cancel.wait(wait):
        raise EngineStartError("the worker stopped while waiting to start a new engine")
    _write_private(files.restarts, json.dumps([*history, time.monotonic()]))


def kill_and_wait(proc: EngineProcess, timeout: float = STOP_GRACE_S) -> None:
    """SIGKILL to `proc` if it still runs (the same process: its start time), then waits for
    it to be gone, so that nothing it would still do (remove its socket file) can touch
    the files of the engine that replaces it."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except ProcessLookupError:
        return
    try:
        if proc.alive():
            os.kill(proc.pid, signal.SIGKILL)
            select.select([pidfd], [], [], timeout)
    except ProcessLookupError:
        pass
    finally:
        os.close(pidfd)


def _read_engine(files: ServerFiles) -> list[EngineProcess]:
    try:
        return [EngineProcess(**p) for p in json.loads(files.info.read_text())]
    except (FileNotFoundError, ValueError, TypeError):
        return []


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


@dataclass
class PendingEngine:
    """Engine processes started and listed, waiting for the pids to watch (their go)."""

    files: ServerFiles
    procs: list[EngineProcess]
    pipes: dict[str, Any]  # role -> its stdin

    def hand_over(self) -> None:
        """The pids each process watches (the server's and its peer's), on its stdin: it loads."""
        watch = {"server": self.files.server_pid, **{p.role: p.pid for p in self.procs}}
        for role, pipe in self.pipes.items():
            try:
                pipe.write(json.dumps({k: v for k, v in watch.items() if k != role}).encode() + b"\n")
                pipe.close()
            except BrokenPipeError:
                pass  # it died already; the wait for its socket reports it
        logger.info("engine started: %s", ", ".join(f"{p.role} pid {p.pid}" for p in self.procs))

    def cancel(self) -> None:
        """Stops the processes (they loaded nothing, printed nothing) and removes the server's files."""
        for p in self.procs:  # killed before their stdin closes: an EOF would make them say so
            kill_and_wait(p)
        for pipe in self.pipes.values():
            pipe.close()
        self.files.remove()


def _spawn_engine(args: ServerArgs, files: ServerFiles, env: dict[str, str] | None = None) -> PendingEngine:
    """Starts the engine's processes with their settings (`env`: their environment, else this
    one) and lists them in the server's files; they import, then wait for hand_over()."""
    for role in ROLES:  # a socket left by a killed engine must not be mistaken for a live one
        files.socket(role).unlink(missing_ok=True)
    files.metrics_dir.mkdir(mode=0o700, exist_ok=True)
    spec = json.dumps(
        {"server_args": dataclasses.asdict(args), "server_pid": files.server_pid, "root": str(files.root)}
    )
    procs, pipes = [], {}
    for role in ROLES:
        popen = subprocess.Popen(
            [sys.executable, "-m", "runtime.supervise.launcher", role],
            stdin=subprocess.PIPE,
            start_new_session=True,
            close_fds=True,
            env=env,
        )
        if popen.stdin is None:  # never, with stdin=PIPE
            raise EngineStartError(f"the {role} process got no stdin pipe")
        pipes[role] = pipe = popen.stdin
        try:  # a pipe holds 64 KiB unread: the write does not wait for the process
            pipe.write(spec.encode() + b"\n")
            pipe.flush()
        except BrokenPipeError:
            pass  # it died already; the wait for its socket reports it
        start = process_start_time(popen.pid)
        procs.append(EngineProcess(role, popen.pid, start if start is not None else -1))
    _write_private(files.info, json.dumps([dataclasses.asdict(p) for p in procs]))
    return PendingEngine(files, procs, pipes)


def wait_for_sockets(
    files: ServerFiles,
    procs: list[EngineProcess],
    timeout: float = START_TIMEOUT_S,
    cancel: threading.Event | None = None,
) -> None:
    """Blocks until every engine process listens on its socket; raises EngineStartError
    at once if one of them exits meanwhile (a bad model, say: its own log says why), or
    `cancel` is set."""
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
        if cancel is not None and cancel.is_set():
            raise EngineStartError("the worker stopped while waiting for the engine")
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
        self.close_channels()
        os.close(self.worker_lock_fd)
        remove_if_abandoned(files, self.procs)

    def close_channels(self) -> None:
        """Closes the channels and the waker, keeping the worker index (to attach again)."""
        self.request_ch.close()
        self.text_ch.close()
        self.waker.close()


def remove_if_abandoned(files: ServerFiles, procs: list[EngineProcess]) -> None:
    """Removes the server's files when its engine is gone and no worker is attached (a
    live engine removes them itself when the server exits). `procs` is the engine the caller
    knew; the files are kept while the engine they list now runs: a newer one (granian's
    reload starts new workers, which may start one, while the old ones stop)."""
    if any(p.alive() for p in procs):
        return
    fd = os.open(files.lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if not any(p.alive() for p in _read_engine(files)) and not _workers_attached(files):
            files.remove()
    finally:
        os.close(fd)


def attach_engine(
    args: ServerArgs,
    files: ServerFiles,
    claimed: tuple[int, int] | None = None,
    cancel: threading.Event | None = None,
) -> EngineLink:
    """Starts or finds the server's engine, takes a worker index (or keeps `claimed`, the
    (index, lock fd) of this worker's previous link: attaching to a new engine) and connects
    this worker's channels. Blocking: run it off the event loop."""
    from ipc import get_transport
    from runtime.detokenizer.process import connect_detokenizer
    from runtime.scheduler.connect import connect_scheduler

    procs = ensure_engine(args, files, cancel, healing=claimed is not None)
    try:
        wait_for_sockets(files, procs, cancel=cancel)
    except EngineStartError:
        remove_if_abandoned(files, procs)
        raise
    index, lock_fd = claimed if claimed is not None else claim_worker_index(files)
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
        if claimed is None:
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
    """Whether an HTTP worker holds a worker index of this server (a name there that is not a
    regular file, which no worker made, is skipped: never followed, never blocked on)."""
    for path in files.root.glob(f"engine-{files.server_pid}.worker-*"):
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
    return False


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
    # what loading needs is imported while the starter may still be checking the model (serve)
    from gpu.models.model_files import ModelLoadError

    if role == "scheduler":
        from runtime.scheduler.main import run_scheduler

        importlib.import_module("runtime.scheduler.runner")  # torch and the model's code
    else:
        from runtime.detokenizer.main import run_detokenizer

        importlib.import_module("transformers.tokenization_utils_tokenizers")  # the tokenizers library
    line = sys.stdin.readline()
    if not line:
        logger.error("the worker starting the engine exited before handing over the pids to watch")
        return 1
    stop_when_any_exits(json.loads(line), grace_s=STOP_GRACE_S)
    try:
        if role == "scheduler":
            run_scheduler(args, str(files.socket("scheduler")), str(files.socket("detokenizer")), str(files.stats))
        else:
            # the frozen-worker watch runs beside the detokenizer, the engine's lighter process
            WorkerWatch(files, args.worker_stall_timeout).start()
            run_detokenizer(args, str(files.socket("detokenizer")), str(files.socket("scheduler")))
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
