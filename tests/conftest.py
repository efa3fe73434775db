"""A real server for the server tests: `granian --interface asgi runtime.app:app` (or
`python -m runtime serve`) in a subprocess on a free port, with its settings in
RINGSERVE_* variables; stopped with SIGINT, and every process it started accounted for."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

# Without CUDA, triton kernels can only run interpreted, and triton reads TRITON_INTERPRET
# when it is first imported, which torch or transformers may do before any triton test runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ipc.shm import our_segments, segment_pid

START_TIMEOUT_S = 300.0  # three processes load a tokenizer and one the model, on 2 busy CPUs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """Every thread's children (a process started from a worker thread is that thread's)."""
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(p) for p in (task / "children").read_text().split()]
        except FileNotFoundError:
            pass
    return kids


def descendants(pid: int) -> list[int]:
    kids = children(pid)
    return kids + [d for k in kids for d in descendants(k)]


def alive(pid: int) -> bool:
    """Running (a zombie has exited: only its parent's wait is missing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def wait_until(condition, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


class Server:
    """One server process tree. `argv`: the command; `env`: RINGSERVE_* settings."""

    def __init__(self, argv: list[str], env: dict[str, str], port: int) -> None:
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("RINGSERVE_")}
        full_env.update(env)
        self.proc = subprocess.Popen(argv, env=full_env, start_new_session=True)
        self.pid = self.proc.pid  # granian's main process (`serve` execs it: the same pid)
        self.engine: dict[str, int] = {}  # role -> pid, once started
        self.workers: list[int] = []
        self.start_times: dict[int, int | None] = {}

    @classmethod
    def granian(
        cls, workers: int = 1, granian_flags: tuple[str, ...] = (), port: int | None = None, **settings
    ) -> Server:
        """`port`: another server's, once it stopped (a restart in place); else a free one."""
        port = port or free_port()
        argv = [
            sys.executable,
            "-m",
            "granian",
            "--interface",
            "asgi",
            "--port",
            str(port),
            "--workers",
            str(workers),
            "--log-level",
            "warning",
            *granian_flags,
            "runtime.app:app",
        ]
        env = {"RINGSERVE_" + k.upper(): str(v) for k, v in settings.items()}
        return cls(argv, env, port)

    @classmethod
    def serve(cls, *flags: str) -> Server:
        port = free_port()
        return cls([sys.executable, "-m", "runtime", "serve", "--port", str(port), *flags], {}, port)

    def url(self, path: str) -> str:
        return self.base + path

    def openai_client(self, api_key: str = "none", timeout: float = 60) -> openai.OpenAI:
        """The official client on this server, without retries: a retry would hide a failure."""
        return openai.OpenAI(base_url=self.url("/v1"), api_key=api_key, max_retries=0, timeout=timeout)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode} during start-up")
            try:
                if httpx.get(self.url("/health"), timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        else:
            raise TimeoutError(f"the server on port {self.port} was not healthy within {timeout} s")
        self.refresh()

    def refresh(self) -> None:
        """Learns the server's processes: granian's workers (again, after a respawn), the engine's."""
        from runtime.supervise.files import ServerFiles, process_start_time

        info = ServerFiles.of(self.pid).info
        self.engine = {p["role"]: p["pid"] for p in json.loads(info.read_text())}
        # serve starts the engine before it becomes granian: its processes are children too
        self.workers = [c for c in children(self.pid) if c not in self.engine.values()]
        self.start_times.update({pid: process_start_time(pid) for pid in self.processes()})

    alive = staticmethod(alive)
    wait_until = staticmethod(wait_until)
    descendants = staticmethod(descendants)

    def processes(self) -> list[int]:
        return [self.pid, *self.workers, *self.engine.values()]

    def worker_pid(self, index: int) -> int | None:
        """The pid of the HTTP worker holding worker index `index` (its flock, in /proc/locks)."""
        from runtime.supervise.files import ServerFiles

        inode = os.stat(ServerFiles.of(self.pid).worker_lock(index)).st_ino
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if fields[1] == "FLOCK" and int(fields[5].rsplit(":", 1)[1]) == inode:
                return int(fields[4])
        return None

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60.0) -> None:
        """Stops the server with `sig` and waits for every process it had to be gone."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        wait_until(lambda: not any(alive(p) for p in self.processes()), 15)

    def kill(self) -> None:
        """Last resort (a failed test): SIGKILL to every process of the tree still running
        (the same process: its start time is the one seen at start-up)."""
        from runtime.supervise.files import process_start_time

        for pid, started in self.start_times.items():
            if process_start_time(pid) == started:
                os.kill(pid, signal.SIGKILL)
        self.proc.kill()
        self.proc.wait()

    def leftovers(self) -> tuple[list[int], list[str]]:
        """(processes still running, shared-memory names any of them created)."""
        pids = self.processes()
        running = [p for p in pids if alive(p)]
        segments = [n for n in our_segments() if segment_pid(n) in pids]
        return running, segments


def dead_pid() -> int:
    """A pid within the kernel's limit that no process has now."""
    pid = 4_000_000
    while Path(f"/proc/{pid}").exists():
        pid -= 1
    return pid


FOREIGN_UID = 65534  # nobody: the owner of what "another user" leaves in /dev/shm


@contextlib.contextmanager
def hostile_names(directory: Path, prefix: str, pid: int) -> Iterator[dict[str, Path]]:
    """What any local user can put in a shared directory under names shaped like ours
    (`<prefix><pid>.<random>`): {shape: path}. Every name is new (O_EXCL, mkdir, mkfifo:
    never one someone else made) and only these are removed afterwards. The foreign-owned
    shapes need root (chown) and are left out without it."""
    token = secrets.token_hex(8)
    made: dict[str, Path] = {}
    outside = Path(tempfile.mkdtemp(prefix="ringserve-hostile-"))

    def regular(shape: str, name: str, mode: int = 0o600, uid: int | None = None) -> None:
        path = directory / name
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode))
        made[shape] = path
        if uid is not None:
            os.chown(path, uid, uid)
        path.chmod(mode)

    try:
        made["directory"] = directory / f"{prefix}{pid}.{token}"
        made["directory"].mkdir()
        made["directory, short name"] = directory / f"{prefix}{pid}.d{token}"
        made["directory, short name"].mkdir()
        (outside / "target").write_text("not to be touched")
        made["symlink"] = directory / f"{prefix}{pid}.{token[::-1]}"
        made["symlink"].symlink_to(outside / "target")
        made["fifo"] = directory / f"{prefix}{pid}.{token[1:]}0"
        os.mkfifo(made["fifo"], 0o600)
        regular("huge pid", f"{prefix}{'9' * 20}.{token}")
        regular("huge pid, short name", f"{prefix}{'9' * 20}.x{token}")
        if os.geteuid() == 0:
            regular("foreign owner", f"{prefix}{pid}.{token[2:]}00", 0o644, FOREIGN_UID)
            regular("unreadable", f"{prefix}{pid}.{token[3:]}000", 0o000, FOREIGN_UID)
        yield made
    finally:
        for path in made.values():
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISDIR(path.lstat().st_mode):
                    path.rmdir()
                else:
                    path.unlink()
        (outside / "target").unlink(missing_ok=True)
        outside.rmdir()


def shapes_of(paths: dict[str, Path]) -> dict[str, tuple[int, int] | None]:
    """Each path's (file type, owner), never followed: None where it is gone."""
    shapes: dict[str, tuple[int, int] | None] = {}
    for shape, path in paths.items():
        try:
            st = path.lstat()
            shapes[shape] = (stat.S_IFMT(st.st_mode), st.st_uid)
        except FileNotFoundError:
            shapes[shape] = None
    return shapes


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "torch_threads(n): torch runs the module's tests on at most n threads")


@pytest.fixture(scope="module", autouse=True)
def torch_threads(request: pytest.FixtureRequest):
    """A module marked `pytestmark = pytest.mark.torch_threads(n)` runs torch on at most n threads:
    on 2 cores shared with other tests' processes, fewer threads time more steadily."""
    mark = request.node.get_closest_marker("torch_threads")
    if mark is None:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(min(threads, mark.args[0]))
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def start_server():
    """`start_server(Server.granian, workers=2, api_key=...)` -> a healthy Server; every
    server a module started is stopped (and, failing that, killed) after the module."""
    servers: list[Server] = []

    def start(how, *args, **kwargs) -> Server:
        server = how(*args, **kwargs)
        servers.append(server)
        server.wait_ready()
        return server

    start.Server = Server
    yield start
    for server in servers:
        if server.proc.poll() is None or any(alive(p) for p in server.processes()):
            try:
                server.stop()
            except subprocess.TimeoutExpired:
                server.kill()


@pytest.fixture()
def tm_rings():
    """A TokenizerManager's two rings in this process, the test on the engine's side of both:
    (the TM side's waker, REQUEST producer, REQUEST consumer, TEXT_OUT producer, TEXT_OUT consumer)."""
    from ipc.channel import Channel, ChannelSpec
    from ipc.wakeup import Waker
    from protocol.records import REQUEST, TEXT_OUT

    tm_waker, engine_waker = Waker(), Waker()
    made = []

    def pair(layout, producer_waker, consumer_waker):
        prod = Channel.create(ChannelSpec(layout, 64, 1 << 16), "producer", producer_waker, consumer_waker.fd)
        cons = Channel.attach(*prod.describe(), consumer_waker)
        made.extend((prod, cons))
        return prod, cons

    yield (tm_waker, *pair(REQUEST, tm_waker, engine_waker), *pair(TEXT_OUT, engine_waker, tm_waker))
    for ch in made:
        ch.close()
    tm_waker.close()
    engine_waker.close()


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer, loaded once: no test changes it."""
    from transformers import AutoTokenizer

    from gpu.models.model_files import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


@pytest.fixture(scope="session")
def offline_engine():
    """The OfflineEngine on the default model: the reference the servers' outputs must equal."""
    from runtime.offline import OfflineEngine

    return OfflineEngine(max_total_tokens=8192, max_running_requests=8)
