"""The scheduler process on real rings with the null model: this test plays the HTTP
worker (pushes REQUEST records) and the detokenizer (pops TOKEN_OUT records)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ipc import ChannelSpec, Waker
from ipc.channel import Channel
from ipc.handoff import recv_waker, send_channels
from protocol.payloads import decode_strings
from protocol.record_bytes import unpack_open
from protocol.records import REQUEST, TOKEN_OUT, ErrorCode, Finish, OpenFlags, RequestKind, TokenKind
from protocol.request_records import pack_control, pack_request
from protocol.sampling_params import MAX_STOP_BYTES, SamplingParams
from runtime.config import ServerArgs
from runtime.scheduler.process import connect_scheduler

NO_TOKEN = 0xFFFFFFFF


class FakeDetokenizerSocket:
    """Listens where the detokenizer would and hands the scheduler a TOKEN_OUT channel,
    consumed here: the same exchange as runtime/detokenizer/process.py, done by the test."""

    def __init__(self, path: str, waker: Waker) -> None:
        self.path, self.waker, self.channel = path, waker, None
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(1)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            meta, fd = recv_waker(conn)
            assert meta == {"role": "scheduler"}
            self.channel = Channel.create(ChannelSpec(TOKEN_OUT, 4096, 1 << 20), "consumer", self.waker, fd)
            os.close(fd)
            send_channels(conn, [self.channel], {})

    def close(self) -> None:
        self.sock.close()
        if self.channel is not None:
            self.channel.close()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("sched")
    sched_sock, detok_sock, stats = str(d / "scheduler"), str(d / "detokenizer"), str(d / "stats")
    waker = Waker()
    detok = FakeDetokenizerSocket(detok_sock, waker)
    args = ServerArgs(null_model=True, max_total_tokens=8192, max_running_requests=8, log_level="warning")
    code = (
        "import sys; from runtime.config import ServerArgs; from runtime.scheduler.main import run_scheduler; "
        f"run_scheduler(ServerArgs.from_env(), {sched_sock!r}, {detok_sock!r}, {stats!r})"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **args.to_env()})
    try:
        request_ch, meta = connect_scheduler(sched_sock, waker, worker=3, timeout=120)
        detok.thread.join(10)
        yield proc, request_ch, detok.channel, waker, meta, Path(sched_sock), Path(stats)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        detok.close()
        waker.close()


def push(ch, records, blob=None):
    ch.push_all(records, blob, timeout=10)


def new_request(ch, slot, gen, prompt, params):
    push(ch, *pack_request(3, slot, gen, params, np.asarray(prompt, np.uint32), time.monotonic_ns()))


def collect(ch, waker, until, got=None, timeout=60.0) -> list:
    """(record, batch) of TOKEN_OUT records popped until `until(records so far)` holds."""
    got = [] if got is None else got
    deadline = time.monotonic() + timeout
    while not until(got):
        assert time.monotonic() < deadline, f"timed out with {len(got)} records"
        waker.wait_readable([ch], spin_us=0, timeout=0.5)
        batch = ch.pop()
        if batch is not None:
            got.extend((r, batch) for r in batch.records)
    return got


def ended(keys):
    def check(got):
        done = {(int(r["slot"]), int(r["gen"])) for r, _ in got if r["finish"] != Finish.NONE}
        return set(keys) <= done

    return check


def test_requests_stream_tokens_with_open_and_finish_records(engine):
    proc, req_ch, out_ch, waker, meta, sock, _ = engine
    assert meta["page_size"] == 16 and meta["max_total_tokens"] == 8192 and meta["context_length"] > 0
    assert b"ringserve::scheduler" in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    params = SamplingParams(max_new_tokens=5, stop=("fox", "dog"), logprobs=True, top_logprobs=2)
    for slot in range(4):
        new_request(req_ch, slot, 7, np.arange(3 + slot) + 100, params)
    got = collect(out_ch, waker, ended([(s, 7) for s in range(4)]))
    for slot in range(4):
        mine = [(r, b) for r, b in got if r["slot"] == slot and r["gen"] == 7]
        assert all(r["worker"] == 3 for r, _ in mine)
        first, batch = mine[0]
        assert first["kind"] == TokenKind.OPEN
        opened = unpack_open(first.tobytes())
        assert opened.prompt_tokens == 3 + slot and opened.top_logprobs == 2 and opened.min_new_tokens == 0
        assert OpenFlags(opened.flags) & OpenFlags.LOGPROBS
        assert decode_strings(batch.view(opened.stop_off, opened.stop_len)) == ("fox", "dog")
        tokens = [r for r, _ in mine[1:]]
        assert [r["kind"] for r in tokens] == [TokenKind.TOKEN] * 5
        assert [int(r["completion_tokens"]) for r in tokens] == [1, 2, 3, 4, 5]
        assert [int(r["finish"]) for r in tokens] == [Finish.NONE] * 4 + [Finish.LENGTH]
        assert all(r["token"] != NO_TOKEN and r["n_top"] == 2 for r in tokens)
    # every request got the same tokens (the null model's cycle)
    streams = {
        s: [int(r["token"]) for r, _ in got if r["slot"] == s and r["kind"] == TokenKind.TOKEN] for s in range(4)
    }
    assert len({tuple(v) for v in streams.values()}) == 1


def test_errors_aborts_stale_records_and_flush(engine):
    proc, req_ch, out_ch, waker, meta, _, stats_path = engine
    ctx = meta["context_length"]
    long = SamplingParams(max_new_tokens=ctx - 100, ignore_eos=True)  # thousands of steps: aborted before
    new_request(req_ch, 10, 1, np.arange(ctx) % 1000, SamplingParams())  # no room left to generate
    new_request(req_ch, 11, 1, [5, meta["vocab_size"] + 1], SamplingParams())  # not in the vocabulary
    new_request(req_ch, 12, 1, np.arange(20) + 100, long)
    new_request(req_ch, 13, 1, np.arange(20) + 100, SamplingParams(max_new_tokens=3))
    push(req_ch, pack_control(RequestKind.ABORT, 3, 13, 0))  # stale generation: ignored
    got = collect(out_ch, waker, lambda g: any(r["slot"] == 12 and r["kind"] == TokenKind.TOKEN for r, _ in g))
    push(req_ch, pack_control(RequestKind.ABORT, 3, 12, 1))
    collect(out_ch, waker, ended([(10, 1), (11, 1), (12, 1), (13, 1)]), got)
    by = lambda slot: [(r, b) for r, b in got if r["slot"] == slot]
    (open10, _), (err10, b10) = by(10)
    assert err10["kind"] == TokenKind.ERROR and err10["error"] == ErrorCode.PROMPT_TOO_LONG
    assert b"context" in b10.view(err10["payload_off"], err10["payload_len"]).tobytes()
    assert by(11)[-1][0]["error"] == ErrorCode.INVALID_REQUEST
    last12 = by(12)[-1][0]
    assert last12["finish"] == Finish.ABORT and last12["token"] == NO_TOKEN and last12["completion_tokens"] < ctx - 100
    assert [int(r["finish"]) for r, _ in by(13)][-1] == Finish.LENGTH
    # the aborted request's pages are back: after a flush every page is free
    push(req_ch, pack_control(RequestKind.FLUSH_CACHE, 3))
    from runtime.engine_stats import EngineStats

    stats = EngineStats.open(stats_path)
    deadline = time.monotonic() + 10
    while True:
        s = stats.read()
        if s["kv_pages_free"] == s["kv_pages_total"] and s["running"] == 0:
            break
        assert time.monotonic() < deadline, s
        time.sleep(0.05)
    # idle, the heartbeat still advances
    beat = s["updated_ns"]
    time.sleep(0.3)
    assert stats.read()["updated_ns"] > beat and out_ch.heartbeat_ns() > 0
    stats.close()


def one_push(requests) -> tuple[np.ndarray, bytes]:
    """Several pack_request (records, blob) as one push: blobs back to back, offsets shifted."""
    recs, parts, size = [], [], 0
    for rec, blob in requests:
        rec = rec.copy()
        for ref in REQUEST.payloads:
            rec[ref.off] += size
        recs.append(rec)
        parts.append(blob + bytes(-len(blob) % 8))
        size += len(parts[-1])
    return np.concatenate(recs), b"".join(parts)


def test_open_payloads_past_the_token_out_arena_split_or_fail_their_request(engine):
    """Requests whose stop strings together exceed what the TOKEN_OUT ring
    (here a 1 MiB arena) takes in one push arrive in one step. The scheduler splits the step's
    push; a request whose stop strings are past the limits (which no HTTP worker sends, but a
    record may hold) fails alone (INVALID_REQUEST); the process lives on and the next request
    runs."""
    proc, req_ch, out_ch, waker, _, _, _ = engine
    n = 150  # 8 KiB of stop strings each (the most a request may have): 1.2 MB, more than the arena
    big = SamplingParams(max_new_tokens=3, stop=tuple(c * (MAX_STOP_BYTES // 4) for c in "abcd"))
    huge = SamplingParams(max_new_tokens=3, stop=("z" * 700_000,))  # more than half the arena
    now = time.monotonic_ns()
    reqs = [pack_request(3, 40 + k, 2, big, np.arange(4, dtype=np.uint32) + 100, now) for k in range(n)]
    reqs.insert(3, pack_request(3, 250, 2, huge, np.arange(4, dtype=np.uint32) + 100, now))
    push(req_ch, *one_push(reqs))
    keys = [(40 + k, 2) for k in range(n)] + [(250, 2)]
    got = collect(out_ch, waker, ended(keys))
    assert proc.poll() is None, "the scheduler died"
    for k in range(n):
        mine = [(r, b) for r, b in got if r["slot"] == 40 + k and r["gen"] == 2]
        first, batch = mine[0]
        assert first["kind"] == TokenKind.OPEN
        opened = unpack_open(first.tobytes())
        assert decode_strings(batch.view(opened.stop_off, opened.stop_len)) == big.stop
        assert [int(r["finish"]) for r, _ in mine][-1] == Finish.LENGTH
    failed = [(r, b) for r, b in got if r["slot"] == 250]
    assert all(unpack_open(r.tobytes()).stop_len == 0 for r, _ in failed if r["kind"] == TokenKind.OPEN)
    (err, b), *_ = [(r, b) for r, b in failed if r["kind"] == TokenKind.ERROR]
    assert err["error"] == ErrorCode.INVALID_REQUEST and err["finish"] == Finish.ERROR
    assert b"stop strings" in b.view(err["payload_off"], err["payload_len"]).tobytes()
    new_request(req_ch, 251, 2, np.arange(4) + 100, SamplingParams(max_new_tokens=2))
    got = collect(out_ch, waker, ended([(251, 2)]))
    assert [int(r["finish"]) for r, _ in got if r["slot"] == 251][-1] == Finish.LENGTH


WORKER_THAT_DIES = """
import sys, time
import numpy as np
from ipc import Waker
from protocol.request_records import pack_request
from protocol.sampling_params import SamplingParams
from runtime.scheduler.process import connect_scheduler
ch, meta = connect_scheduler(sys.argv[1], Waker(), worker=5, timeout=120)
params = SamplingParams(max_new_tokens=meta["max_total_tokens"] - 64, ignore_eos=True)
ch.push_all(*pack_request(5, 0, 1, params, np.arange(8, dtype=np.uint32) + 100, time.monotonic_ns()), timeout=10)
time.sleep(600)
"""


def test_a_dead_workers_requests_are_aborted_without_a_successor(engine):
    """kill -9 of a worker that no new process replaces (granian without
    --respawn-failed-workers, or before the respawned one attaches): the scheduler sees its
    pidfd fire and aborts its requests at once, instead of running them to max_tokens."""
    _, _, out_ch, waker, _, sock, _ = engine
    worker = subprocess.Popen([sys.executable, "-c", WORKER_THAT_DIES, str(sock)])
    try:
        mine = lambda got: [r for r, _ in got if r["worker"] == 5]
        got = collect(out_ch, waker, lambda got: any(r["kind"] == TokenKind.TOKEN for r in mine(got)), timeout=120)
        worker.kill()
        worker.wait(10)
        got = collect(out_ch, waker, lambda got: any(r["finish"] != Finish.NONE for r in mine(got)), got, timeout=30)
        (last,) = [r for r in mine(got) if r["finish"] != Finish.NONE]
        assert last["finish"] == Finish.ABORT, Finish(int(last["finish"]))
        assert sum(r["kind"] == TokenKind.TOKEN for r in mine(got)) < 4000  # long before max_new_tokens
    finally:
        worker.kill()
        worker.wait(10)


def test_sigterm_stops_cleanly(tmp_path):
    sched_sock, detok_sock = str(tmp_path / "s"), str(tmp_path / "d")
    waker = Waker()
    detok = FakeDetokenizerSocket(detok_sock, waker)
    args = ServerArgs(null_model=True, max_total_tokens=256, max_running_requests=4, log_level="warning")
    code = (
        "from runtime.config import ServerArgs; from runtime.scheduler.main import run_scheduler; "
        f"run_scheduler(ServerArgs.from_env(), {sched_sock!r}, {detok_sock!r})"
    )
    before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **args.to_env()})
    try:
        ch, _ = connect_scheduler(sched_sock, waker, worker=0, timeout=120)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not Path(sched_sock).exists()
        ch.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        detok.close()
        waker.close()
    assert not set(os.listdir("/dev/shm")) - before
