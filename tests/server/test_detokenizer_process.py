"""The detokenizer process for real: spawned, channels from its unix socket, a "scheduler" and
two "HTTP workers" (this test process) streaming through it, clean stop on SIGTERM with
nothing left in /dev/shm; the same loop over the ZMQ transport; stop when the parent exits."""

import multiprocessing
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from ipc import ChannelSpec, get_transport
from ipc.peers import PeerServer
from ipc.shm import our_segments
from protocol.payloads import PayloadBuilder, encode_strings
from protocol.record_bytes import pack_open
from protocol.records import REQUEST, TOKEN_OUT, Finish, OpenFlags, RequestKind, TextKind, TokenKind
from runtime.config import ServerArgs
from runtime.detokenizer.main import PROCESS_TITLE, run_detokenizer
from runtime.detokenizer.process import DetokenizerProcess, connect_detokenizer

TEXTS = ["Hello there, how are you? 😀", "世界 and café", "short"]


def start(tmp_path: Path):
    path = str(tmp_path / "detok.sock")
    proc = multiprocessing.get_context("spawn").Process(
        target=run_detokenizer, args=(ServerArgs(log_level="warning"), path)
    )
    proc.start()
    return proc, path


def records(items) -> tuple[np.ndarray, bytes]:
    recs = np.zeros(len(items), TOKEN_OUT.dtype)
    payload = PayloadBuilder()
    for i, item in enumerate(items):
        if item["kind"] == TokenKind.OPEN:  # OPEN records in their own layout
            recs[i : i + 1] = np.frombuffer(
                pack_open(
                    worker=item["worker"],
                    slot=item["slot"],
                    gen=item["gen"],
                    prompt_tokens=0,
                    min_new_tokens=0,
                    top_logprobs=0,
                    flags=item["flags"],
                    **dict(zip(("stop_off", "stop_len"), payload.add(encode_strings(item["stop"])))),
                ),
                TOKEN_OUT.dtype,
            )
            continue
        for k, v in item.items():
            recs[i][k] = v
    return recs, payload.blob()


def stream(tokenizer, path: str, transport: str) -> None:
    """Worker w owns request (w, slot 1, gen 5); request 2 of worker 0 has a stop string."""
    t = get_transport(transport)
    wakers = [t.make_waker() for _ in range(3)]
    sched = connect_detokenizer(path, wakers[0])
    outs = [connect_detokenizer(path, wakers[1 + w], worker=w) for w in range(2)]
    flags = OpenFlags.SKIP_SPECIAL_TOKENS
    reqs = [(0, 1, TEXTS[0], ()), (1, 1, TEXTS[1], ()), (0, 2, TEXTS[2] + " and more", ("and",))]
    ids = [tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id] for _, _, text, _ in reqs]
    steps = [[dict(kind=TokenKind.OPEN, worker=w, slot=s, gen=5, flags=flags, stop=stop) for w, s, _, stop in reqs]]
    for k in range(max(map(len, ids))):
        steps.append(
            [
                dict(
                    kind=TokenKind.TOKEN,
                    worker=w,
                    slot=s,
                    gen=5,
                    token=seq[k],
                    completion_tokens=k + 1,
                    finish=Finish.STOP if k == len(seq) - 1 else Finish.NONE,
                )
                for (w, s, _, _), seq in zip(reqs, ids)
                if k < len(seq)
            ]
        )
    for step in steps:
        sched.push_all(*records(step), timeout=10)

    got = {(w, s): b"" for w, s, _, _ in reqs}
    finish = {}
    deadline = time.monotonic() + 60
    while len(finish) < len(reqs):
        assert time.monotonic() < deadline, f"finished only {finish}"
        for w, ch in enumerate(outs):
            wakers[1 + w].wait_readable([ch], timeout=0.05)
            batch = ch.pop()
            if batch is None:
                continue
            for r in batch.records:
                assert r["worker"] == w and r["gen"] == 5 and r["kind"] == TextKind.TEXT
                got[w, int(r["slot"])] += batch.payload[r["text_off"] : r["text_off"] + r["text_len"]].tobytes()
                if r["finish"]:
                    finish[w, int(r["slot"])] = (int(r["finish"]), int(r["stop_index"]), int(r["stop_token"]))
    assert got == {(0, 1): TEXTS[0].encode(), (1, 1): TEXTS[1].encode(), (0, 2): b"short "}
    eos = tokenizer.eos_token_id
    assert finish == {(0, 1): (Finish.STOP, -1, eos), (1, 1): (Finish.STOP, -1, eos), (0, 2): (Finish.STOP, 0, -1)}
    assert outs[0].heartbeat_ns() > 0, "the detokenizer beats its text channels"
    for ch in [sched, *outs]:
        ch.close()
    for waker in wakers:
        waker.close()


def test_streams_and_stops_on_sigterm(tokenizer, tmp_path):
    proc, path = start(tmp_path)
    try:
        stream(tokenizer, path, "ring")
        assert PROCESS_TITLE in Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode(errors="replace")
    finally:
        proc.terminate()
        proc.join(10)
    assert proc.exitcode == 0
    assert not os.path.exists(path)
    assert not [n for n in our_segments() if n.startswith(f"ringserve.{proc.pid}.")]


def test_zmq_transport(tokenizer, tmp_path):
    """The same loop over the ZMQ baseline transport, run in a thread of this process."""
    detok = DetokenizerProcess(ServerArgs(transport="zmq"), str(tmp_path / "detok.sock"))
    loop = threading.Thread(target=detok.serve)
    try:
        detok.load(max_open=64)
        loop.start()
        stream(tokenizer, detok.socket_path, "zmq")
    finally:
        detok.stop()
        if loop.is_alive():
            loop.join(5)
        detok.close()
    assert not loop.is_alive()
    assert not os.path.exists(detok.socket_path)


def test_a_dead_workers_channel_is_closed(tmp_path):
    """kill -9 of a worker that no new process replaces: the detokenizer sees its pidfd fire
    and closes its channel, so a ring nobody reads can never block the other workers."""
    detok = DetokenizerProcess(ServerArgs(), str(tmp_path / "detok.sock"))
    code = (
        "import sys, time; from ipc import Waker; from runtime.detokenizer.process import connect_detokenizer; "
        "connect_detokenizer(sys.argv[1], Waker(), worker=1, timeout=60); time.sleep(600)"
    )
    worker = subprocess.Popen([sys.executable, "-c", code, detok.socket_path])
    try:
        detok.load(max_open=64)
        loop = threading.Thread(target=detok.serve)
        loop.start()
        deadline = time.monotonic() + 60
        while detok.worker_pids.get(1) != worker.pid:
            assert time.monotonic() < deadline and worker.poll() is None
            time.sleep(0.02)
        worker.kill()
        worker.wait()
        deadline = time.monotonic() + 5
        while 1 in detok.outputs:
            assert time.monotonic() < deadline, "the dead worker's channel is still open"
            time.sleep(0.02)
        assert 1 not in detok.worker_pids
        detok.stop()
        loop.join(5)
    finally:
        worker.kill()
        detok.stop()
        detok.close()


def test_a_stalled_worker_does_not_stop_the_others(tokenizer, tmp_path):
    """A stalled HTTP worker: worker 1 never reads its TEXT_OUT ring (SIGSTOPped, say) while it has
    more text than the ring holds; worker 0's stream still completes, long before the stall
    deadline (the detokenizer used to wait on worker 1's full ring forever). Past the deadline
    worker 1's requests fail: when it reads again it finds the text its ring held, then an
    ERROR record for each of its requests, and the scheduler is asked to abort them at once
    (this test plays the scheduler's socket). The process then serves worker 0 as before."""
    stall_s = 10.0
    path = str(tmp_path / "detok.sock")
    t = get_transport("ring")
    wakers = [t.make_waker() for _ in range(4)]
    scheduler_side = PeerServer(
        str(tmp_path / "sched.sock"),
        lambda hello, fd: t.create_channel(ChannelSpec(REQUEST, 4096), "consumer", wakers[3], fd),
        {"pid": os.getpid()},
    )
    scheduler_side.start()
    proc = multiprocessing.get_context("spawn").Process(
        target=run_detokenizer,
        args=(ServerArgs(log_level="warning", worker_stall_timeout=stall_s), path, scheduler_side.socket_path),
    )
    proc.start()
    try:
        sched = connect_detokenizer(path, wakers[0])
        outs = [connect_detokenizer(path, wakers[1 + w], worker=w) for w in range(2)]
        word = tokenizer.encode(" the", add_special_tokens=False)[0]
        flags = OpenFlags.SKIP_SPECIAL_TOKENS
        stalled = 600  # requests of worker 1; 20 tokens each: 12000 text records, its ring holds 8192

        def step(w, slots, k, last=False):
            return [
                dict(kind=TokenKind.TOKEN, worker=w, slot=s, gen=5, token=word, completion_tokens=k + 1)
                | ({"finish": Finish.LENGTH} if last else {})
                for s in slots
            ]

        def read(ch, waker, until, timeout):
            got, deadline = [], time.monotonic() + timeout
            while not until(got):
                assert time.monotonic() < deadline, f"{len(got)} records"
                waker.wait_readable([ch], timeout=0.05)
                batch = ch.pop()
                if batch is not None:
                    got.extend(
                        (r, batch.payload[r["text_off"] : r["text_off"] + r["text_len"]].tobytes())
                        for r in batch.records
                    )
            return got

        # ready (its tokenizer loaded) before the steps below, which must each be a batch of their own
        sched.push_all(*records([dict(kind=TokenKind.OPEN, worker=0, slot=9, gen=1, flags=flags, stop=())]), timeout=10)
        sched.push_all(*records([dict(step(0, [9], 0, last=True)[0], gen=1)]), timeout=10)
        read(outs[0], wakers[1], lambda g: any(r["finish"] for r, _ in g), 120)
        t0 = time.monotonic()
        opens = [dict(kind=TokenKind.OPEN, worker=1, slot=s, gen=5, flags=flags, stop=()) for s in range(stalled)]
        opens.append(dict(kind=TokenKind.OPEN, worker=0, slot=0, gen=5, flags=flags, stop=()))
        sched.push_all(*records(opens), timeout=10)
        for k in range(20):  # one step a batch (the detokenizer has popped the last): a record a request a step
            sched.push_all(*records(step(1, range(stalled), k)), timeout=10)
            while len(sched) and time.monotonic() < t0 + 5:
                time.sleep(0.001)
        t_full = time.monotonic()  # worker 1's ring is full, its backlog began before
        for k in range(30):
            sched.push_all(*records(step(0, [0], k, last=k == 29)), timeout=10)

        got = read(outs[0], wakers[1], lambda g: any(r["finish"] for r, _ in g), stall_s)
        assert time.monotonic() - t0 < stall_s, "worker 0 waited for worker 1's deadline"
        print(f"worker 0's stream done {time.monotonic() - t_full:.2f} s after worker 1's ring was full")
        assert b"".join(text for _, text in got) == tokenizer.decode([word] * 30).encode()
        assert proc.is_alive()
        time.sleep(max(0.0, t_full + stall_s + 1 - time.monotonic()))  # past the deadline, still not reading
        got = read(
            outs[1],
            wakers[2],
            lambda g: len({int(r["slot"]) for r, _ in g if r["kind"] == TextKind.ERROR}) == stalled,
            30,
        )
        kinds = [int(r["kind"]) for r, _ in got]
        first_error = kinds.index(TextKind.ERROR)
        assert first_error >= 8192 - stalled and all(k == TextKind.ERROR for k in kinds[first_error:])
        err, message = got[-1]
        assert err["finish"] == Finish.ERROR and b"worker-stall-timeout" in message
        events = list(scheduler_side.events())
        assert [(e.kind, e.hello["role"]) for e in events] == [("attached", "detokenizer")]
        aborts = events[0].channel.pop().records
        assert set(aborts["kind"].tolist()) == {RequestKind.ABORT}
        assert sorted(zip(aborts["worker"].tolist(), aborts["slot"].tolist(), aborts["gen"].tolist())) == [
            (1, s, 5) for s in range(stalled)
        ]
        events[0].channel.close()
        # the process goes on: a new request of worker 0 streams
        sched.push_all(*records([dict(kind=TokenKind.OPEN, worker=0, slot=1, gen=6, flags=flags, stop=())]), timeout=10)
        sched.push_all(*records([dict(step(0, [1], 0, last=True)[0], gen=6)]), timeout=10)
        got = read(outs[0], wakers[1], lambda g: any(r["finish"] for r, _ in g), 10)
        assert got[-1][0]["slot"] == 1 and got[-1][0]["finish"] == Finish.LENGTH
        for ch in [sched, *outs]:
            ch.close()
    finally:
        proc.terminate()
        proc.join(10)
        scheduler_side.close()
        for waker in wakers:
            waker.close()
