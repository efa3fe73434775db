"""fd handoff between two unrelated processes (siblings, neither forked from the other),
shaped like the server: an asyncio "worker" sends requests to a sync "engine" that
answers with text records. And: nothing in /dev/shm after a clean close, after a
kill -9 of either side, or after a kill inside the segment-creation window."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import posix_ipc
import pytest

from ipc import Channel, ChannelSpec, Waker
from ipc.handoff import recv_channels, recv_waker, send_channels, send_waker
from ipc.shm import PREFIX, our_segments, sweep_orphans
from protocol.records import REQUEST, TEXT_OUT, RequestKind
from protocol.request_records import pack_request, unpack_request
from protocol.sampling_params import SamplingParams

PEER_GONE = 3  # exit status of a peer whose other side stopped answering
TIMEOUT = 30.0


def engine(path: str, total: int, stall_timeout: float) -> int:
    """Consumer of requests, producer of answers: text = str(sum(prompt)) per request."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(1)
        listener.settimeout(TIMEOUT)
        conn, _ = listener.accept()
    meta, peer_fd = recv_waker(conn)
    waker = Waker()
    requests = Channel.create(ChannelSpec(REQUEST, 16, 1 << 16), "consumer", waker, peer_fd)
    answers = Channel.create(ChannelSpec(TEXT_OUT, 16, 1 << 12), "producer", waker, peer_fd)
    os.close(peer_fd)
    send_channels(conn, [requests, answers], {"engine_pid": os.getpid()})
    conn.close()
    answered = 0
    while answered < total:
        requests.beat()
        batch = requests.pop()
        if batch is None:
            if not waker.wait_readable([requests], spin_us=50, timeout=stall_timeout):
                return PEER_GONE
            continue
        if answered == 0:
            print("flowing", flush=True)
        for rec in batch.records:
            assert rec["kind"] == RequestKind.NEW
            params, prompt = unpack_request(rec, batch.payload)
            text = f"{int(prompt.sum())}:{params.max_new_tokens}".encode()
            out = np.zeros(1, TEXT_OUT.dtype)
            out["worker"], out["slot"], out["gen"] = rec["worker"], rec["slot"], rec["gen"]
            out["text_len"], out["n_tokens"] = len(text), 1
            try:
                answers.push_all(out, text, timeout=stall_timeout)
            except TimeoutError:
                return PEER_GONE
            answered += 1
    requests.close()
    answers.close()
    return 0


async def worker(path: str, total: int, stall_timeout: float) -> int:
    """Producer of requests (asyncio, like an HTTP worker), consumer of answers."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + TIMEOUT
    while True:
        try:
            sock.connect(path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            assert time.monotonic() < deadline, "engine never listened"
            time.sleep(0.01)
    waker = Waker()
    send_waker(sock, waker, {"worker": 7})
    (requests, answers), meta = recv_channels(sock, waker)
    sock.close()
    assert (requests.role, answers.role) == ("producer", "consumer") and meta["engine_pid"] != os.getppid()
    expected: dict[int, bytes] = {}
    rng = np.random.default_rng(0)

    async def send() -> None:
        for slot in range(total):
            prompt = rng.integers(0, 49152, int(rng.integers(1, 2000)))
            params = SamplingParams(max_new_tokens=slot % 100 + 1)
            expected[slot] = f"{int(prompt.sum())}:{params.max_new_tokens}".encode()
            rec, blob = pack_request(7, slot, slot + 1, params, prompt, time.monotonic_ns())
            await requests.push_all_async(rec, blob, timeout=stall_timeout)

    sender = asyncio.create_task(send())
    got = 0
    while got < total:
        batch = answers.pop()
        if batch is None:
            if not await waker.wait_readable_async([answers], timeout=stall_timeout):
                sender.cancel()
                return PEER_GONE
            continue
        for rec in batch.records:
            assert rec["worker"] == 7 and rec["gen"] == rec["slot"] + 1
            text = batch.payload[rec["text_off"] : rec["text_off"] + rec["text_len"]].tobytes()
            assert text == expected[int(rec["slot"])], f"slot {rec['slot']}"
            got += 1
    await sender
    assert requests.heartbeat_ns() > 0, "the engine's heartbeat is not visible to the worker"
    requests.close()
    answers.close()
    return 0


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def wait(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return proc.returncode, err


def test_handoff_between_unrelated_processes(tmp_path: Path) -> None:
    path = str(tmp_path / "engine.sock")
    eng = spawn("engine", path, "300", str(TIMEOUT))
    wrk = spawn("worker", path, "300", str(TIMEOUT))
    rc_w, err_w = wait(wrk)
    rc_e, err_e = wait(eng)
    assert (rc_e, rc_w) == (0, 0), f"engine:\n{err_e}\nworker:\n{err_w}"
    assert our_segments() == []


@pytest.mark.parametrize("victim", ["engine", "worker"])
def test_kill_9_of_either_side_leaves_nothing(tmp_path: Path, victim: str) -> None:
    path = str(tmp_path / "engine.sock")
    procs = {"engine": spawn("engine", path, "1000000000", "2"), "worker": spawn("worker", path, "1000000000", "2")}
    try:
        line = procs["engine"].stdout.readline()  # blocks until requests flow through the rings
        assert line.strip() == "flowing", procs["engine"].stderr.read() if procs["engine"].poll() else line
        os.kill(procs[victim].pid, signal.SIGKILL)
        survivor = "worker" if victim == "engine" else "engine"
        rc, err = wait(procs[survivor])
        assert rc == PEER_GONE, f"{survivor} exited {rc}:\n{err}"
        assert wait(procs[victim])[0] == -signal.SIGKILL
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert our_segments() == []


def test_sweep_removes_names_left_by_a_kill_inside_create() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = f"{PREFIX}{dead.pid}.0123456789abcdef"
    live = f"{PREFIX}{os.getppid()}.0123456789abcdef"
    for name in (left, live):
        posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600, size=4096).close_fd()
    try:
        assert sweep_orphans() == [left]
        assert our_segments() == [live]
    finally:
        for name in (left, live):
            try:
                posix_ipc.unlink_shared_memory("/" + name)
            except posix_ipc.ExistentialError:
                pass
    assert our_segments() == []


def test_segments_are_private_and_unnamed() -> None:
    waker = Waker()
    ch = Channel.create(ChannelSpec(REQUEST, 4, 64), "producer", waker, waker.fd)
    try:
        assert our_segments() == []  # unlinked before create() returned
        _, (segment_fd, _) = ch.describe()
        assert os.fstat(segment_fd).st_mode & 0o777 == 0o600
    finally:
        ch.close()
        waker.close()


if __name__ == "__main__":
    role, sock_path, count, stall = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    sys.exit(engine(sock_path, count, stall) if role == "engine" else asyncio.run(worker(sock_path, count, stall)))
