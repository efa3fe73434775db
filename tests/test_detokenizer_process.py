"""The Detokenizer process for real: spawned, channels from its unix socket, a "scheduler" and
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
import pytest
from transformers import AutoTokenizer

from gpu.model_files import resolve_model_dir
from ipc import get_transport
from ipc.shm import our_segments
from protocol.records import (
    TOKEN_OUT,
    Finish,
    OpenFlags,
    PayloadBuilder,
    TextKind,
    TokenKind,
    encode_strings,
    pack_open,
)
from runtime.config import ServerArgs
from runtime.detokenizer.process import PROCESS_TITLE, Detokenizer, connect_detokenizer, run_detokenizer

TEXTS = ["Hello there, how are you? 😀", "世界 and café", "short"]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


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
    detok = Detokenizer(ServerArgs(transport="zmq"), str(tmp_path / "detok.sock"))
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
    detok = Detokenizer(ServerArgs(), str(tmp_path / "detok.sock"))
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
