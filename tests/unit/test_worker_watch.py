"""The frozen-worker watch on real processes, without a server: a child beating with WorkerBeat
on its event loop is left alone; stopped (SIGSTOP), it is killed once its beat is older than the
stall timeout, or only reported when granian would not replace it; a cleared beat, a pid that
now names another process and files that are not a worker's regular file are never acted on;
`serve` gives granian the flag the watch needs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from runtime.supervise import worker_watch
from runtime.supervise.files import ServerFiles
from runtime.supervise.worker_watch import BEAT, WorkerWatch, read_beats, respawns_failed_workers

STALL_S = 0.5

BEATING_CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from runtime.supervise.worker_watch import WorkerBeat

    async def main():
        beat = WorkerBeat(Path(sys.argv[1]), float(sys.argv[2]), replaceable=sys.argv[3] == "1")
        beat.start()
        print("beating", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


@pytest.fixture()
def files(tmp_path: Path) -> ServerFiles:
    return ServerFiles(os.getpid(), tmp_path)  # this test process plays granian's main process


def beating_child(files: ServerFiles, replaceable: bool) -> subprocess.Popen:
    """A worker-like child beating into worker file 0."""
    path = files.worker_lock(0)
    path.touch(mode=0o600)
    root = Path(__file__).resolve().parents[2]
    argv = [sys.executable, "-c", BEATING_CHILD, str(path), str(STALL_S), str(int(replaceable))]
    proc = subprocess.Popen(argv, cwd=root, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "beating\n"
    return proc


@pytest.fixture()
def child(files: ServerFiles):
    """A beating child that granian would replace; killed after the test if still there."""
    proc = beating_child(files, replaceable=True)
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


@pytest.fixture()
def lone_child(files: ServerFiles):
    """A beating child that granian would not replace."""
    proc = beating_child(files, replaceable=False)
    yield proc
    proc.kill()
    proc.wait(10)


@pytest.fixture(autouse=True)
def no_respawn_guard(monkeypatch):
    monkeypatch.setattr(worker_watch, "RESPAWN_GUARD_S", 0.0)  # granian's crash-loop guard: not here


def watch_for(watch: WorkerWatch, seconds: float) -> list[int]:
    """Looks as the watch's thread does, for `seconds` or until it kills; the pids killed."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(watch.interval / 2)
        killed = watch.look(time.monotonic_ns())
        if killed:
            return killed
    return []


def test_a_stopped_worker_is_killed_and_a_beating_one_is_not(files, child):
    watch = WorkerWatch(files, STALL_S)
    assert watch_for(watch, 4 * STALL_S) == []  # beating: left alone
    (beat,) = read_beats(files)
    assert (beat.index, beat.pid) == (0, child.pid)
    os.kill(child.pid, signal.SIGSTOP)
    (beat,) = read_beats(files)  # its last: a stopped worker beats no more
    assert watch_for(watch, 20 * STALL_S + 10) == [child.pid]  # generous: a loaded machine
    assert child.wait(10) == -signal.SIGKILL
    # judged by its last beat, which on a loaded machine may precede the stop by most of a stall
    assert time.monotonic_ns() - beat.last_ns >= STALL_S * 1e9


def test_without_respawn_a_stopped_worker_is_only_reported(files, lone_child, caplog):
    watch = WorkerWatch(files, STALL_S)
    watch_for(watch, STALL_S)
    os.kill(lone_child.pid, signal.SIGSTOP)
    assert watch_for(watch, 6 * STALL_S) == []
    assert lone_child.poll() is None
    assert "frozen, and not replaced" in caplog.text
    assert caplog.text.count("frozen, and not replaced") == 1  # once, not every look


def test_a_late_look_judges_nothing(files, child):
    """The watch itself stopped (or the machine): the workers get the time to beat again."""
    watch = WorkerWatch(files, STALL_S)
    os.kill(child.pid, signal.SIGSTOP)
    time.sleep(3 * STALL_S)
    assert watch.look(time.monotonic_ns()) == []
    assert child.poll() is None


def test_cleared_reused_and_foreign_entries_are_left_alone(files, tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        old = 1  # as old as a beat can be (an hour back is before boot on a machine up for less)
        files.worker_lock(1).write_bytes(BEAT.pack(sleeper.pid, 12345, 1, old, old))  # not its start time
        files.worker_lock(2).write_bytes(bytes(BEAT.size))  # a worker stopping: cleared
        files.worker_lock(3).write_bytes(BEAT.pack(sleeper.pid, 0, 1, old, old)[:20])  # short
        files.worker_lock(4).write_bytes(BEAT.pack(-1, 0, 1, old, old))
        files.worker_lock(5).mkdir()
        files.worker_lock(6).symlink_to(files.worker_lock(1))
        os.mkfifo(files.worker_lock(7))
        (tmp_path / f"engine-{os.getpid() + 1}.worker-8").write_bytes(BEAT.pack(sleeper.pid, 0, 1, old, old))
        watch = WorkerWatch(files, STALL_S)
        assert [b.index for b in read_beats(files)] == [1]
        assert watch_for(watch, 2 * STALL_S) == []
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait(10)


def test_serve_makes_granian_respawn_workers():
    from runtime.__main__ import granian_command
    from runtime.config import ServerArgs

    assert respawns_failed_workers(granian_command(ServerArgs()), {})
    assert not respawns_failed_workers(["granian", "runtime.app:app"], {})
    assert respawns_failed_workers(["granian"], {"GRANIAN_RESPAWN_FAILED_WORKERS": "true"})
    assert not respawns_failed_workers(
        ["granian", "--no-respawn-failed-workers"], {"GRANIAN_RESPAWN_FAILED_WORKERS": "1"}
    )
