"""The engine loops: a record the detokenizer cannot handle fails its own request and
nothing else, and the memo of stop strings is bounded by bytes (runtime/detokenizer/core.py,
with the real tokenizer); a stopped HTTP worker does not stop the other worker's streams (a real
server, two workers, the null model). The processes alone: tests/server/test_scheduler_process.py
(OPEN payloads past the TOKEN_OUT arena) and tests/server/test_detokenizer_process.py (a stalled worker)."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from ipc.ring import Batch
from protocol.payloads import PayloadBuilder, encode_strings
from protocol.records import OPEN_RECORD, TOKEN_OUT, ErrorCode, Finish, OpenFlags, TextKind, TokenKind
from runtime.detokenizer import core as detokenizer_core
from runtime.detokenizer.core import Detokenizer
from runtime.supervise.files import ServerFiles


@pytest.fixture
def detokenizer(tokenizer):
    return Detokenizer(tokenizer, max_open=64)


def batch(*items) -> Batch:
    """TOKEN_OUT records from dicts; an OPEN's `stop` is raw payload bytes."""
    recs = np.zeros(len(items), TOKEN_OUT.dtype)
    payload = PayloadBuilder()
    for i, item in enumerate(items):
        item = dict(item)
        if item["kind"] == TokenKind.OPEN:
            rec = recs[i : i + 1].view(OPEN_RECORD)[0]
            rec["stop_off"], rec["stop_len"] = payload.add(item.pop("stop", encode_strings(())))
        else:
            rec = recs[i]
        for k, v in item.items():
            rec[k] = v
    return Batch(recs, np.frombuffer(payload.blob(), np.uint8))


def opened(slot, stop=None):
    item = dict(kind=TokenKind.OPEN, worker=0, slot=slot, gen=1, flags=OpenFlags.SKIP_SPECIAL_TOKENS)
    return item if stop is None else item | {"stop": stop}


def token(slot, tok, finish=Finish.NONE):
    return dict(kind=TokenKind.TOKEN, worker=0, slot=slot, gen=1, token=tok, finish=finish, completion_tokens=1)


def by_slot(out):
    records, blob = out
    return {
        int(r["slot"]): (int(r["kind"]), int(r["error"]), blob[r["text_off"] : r["text_off"] + r["text_len"]].tobytes())
        for r in records
    }


def test_an_open_that_cannot_be_read_fails_its_request_only(tokenizer, detokenizer):
    """Stop strings that are not UTF-8, that claim more bytes than they have, or an empty one:
    each such OPEN raised out of handle() (the detokenizer process died). Now each fails its
    own request (ERROR, INTERNAL) and the batch's other requests stream."""
    word = tokenizer.encode(" hello", add_special_tokens=False)[0]
    bad_utf8 = np.array([1, 2], np.uint32).tobytes() + b"\xff\xfe"
    empty = np.array([1, 0], np.uint32).tobytes()
    out = by_slot(
        detokenizer.handle(
            batch(
                opened(1),
                opened(2, bad_utf8),
                opened(3, empty),
                opened(4),
                token(1, word),
                token(2, word),
                token(3, word),
                token(4, word, Finish.LENGTH),
            )
        )
    )
    assert out[1] == (TextKind.TEXT, 0, b" hello") and out[4] == (TextKind.TEXT, 0, b" hello")
    for slot in (2, 3):
        assert out[slot][:2] == (TextKind.ERROR, ErrorCode.INTERNAL)
    assert detokenizer.num_open == 1  # slot 1; the failed ones hold nothing


def test_a_batch_that_raises_is_handled_one_record_at_a_time(tokenizer, detokenizer, monkeypatch):
    """A bug that one request's tokens meet in the batched pass: handle() raises, and
    handle_isolated (what the process's loop calls then) fails that request alone."""
    word = tokenizer.encode(" hello", add_special_tokens=False)[0]
    detokenizer.handle(batch(opened(1), opened(2), opened(3)))
    poisoned = int(detokenizer._index[0, 2])
    real_step = detokenizer.incremental.step

    def step(req, tok, finished):
        if poisoned in np.asarray(req).tolist():
            raise RuntimeError("a bug")
        return real_step(req, tok, finished)

    monkeypatch.setattr(detokenizer.incremental, "step", step)
    records = batch(token(1, word), token(2, word), token(3, word, Finish.LENGTH))
    with pytest.raises(RuntimeError):
        detokenizer.handle(records)
    out = by_slot(detokenizer.handle_isolated(records))
    assert out[1] == (TextKind.TEXT, 0, b" hello") and out[3] == (TextKind.TEXT, 0, b" hello")
    assert out[2][:2] == (TextKind.ERROR, ErrorCode.INTERNAL)
    assert detokenizer.num_open == 1  # slot 1 runs on; 2 failed, 3 finished


def test_stop_string_options_are_bounded_by_bytes(detokenizer):
    """60 requests with distinct 300 kB stop strings: the options kept for them stay under
    the memo's byte bound (an lru_cache of 1024 entries kept all ~36 MB)."""
    memo = detokenizer_core._OPTIONS
    memo.clear()
    for k in range(60):
        stop = encode_strings([chr(ord("a") + k % 26) * 150_000 + str(k)])
        detokenizer.handle(batch(opened(10, stop), token(10, 0, Finish.LENGTH)))
    assert 0 < memo.bytes <= memo.max_bytes <= 16 << 20
    assert len(memo) < 60


# ---------------------------------------------------------------- a real server, two workers


def _chunks(resp):
    """The JSON events of an SSE stream."""
    pending = b""
    for data in resp.iter_bytes():
        *events, pending = (pending + data).split(b"\n\n")
        yield from (json.loads(e[6:]) for e in events if e.startswith(b"data: {"))


def _worker_pid(server, index: int) -> int:
    """The pid of the HTTP worker holding worker index `index` (its flock, in /proc/locks)."""
    inode = os.stat(ServerFiles.of(server.pid).worker_lock(index)).st_ino
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if fields[1] == "FLOCK" and int(fields[5].rsplit(":", 1)[1]) == inode:
            return int(fields[4])
    raise LookupError(index)


def _running(server, http: httpx.Client | None = None) -> float:
    """The scheduler's running requests, asked of `http`'s worker (any worker when None)."""
    text = (http or httpx).get(server.url("/metrics"), timeout=30).text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith("sglang:num_running_reqs{")))


def test_a_stopped_worker_does_not_stop_the_other_workers_streams(start_server):
    """A stalled HTTP worker, on a server with --workers 2 and the null model: SIGSTOP of the worker
    holding 12 long streams (their text soon overflows its ring) stopped every completion of the
    other worker for the whole stall. Now the other worker serves on at once; past
    --worker-stall-timeout its requests fail, and once it runs again (SIGCONT) its streams end
    with an error and their requests leave the scheduler."""
    stall_s = 8.0
    server = start_server(
        start_server.Server.granian,
        workers=2,
        null_model=True,
        log_level="error",
        worker_stall_timeout=stall_s,
        max_total_tokens=1 << 20,
        max_running_requests=128,
    )
    # streams on the worker that stops, 8 choices of 8000 tokens with 5 logprobs each: ~40 MB of text
    # records against its ring's 8 MB. The null model makes them in a few seconds, so the stop must
    # find most of it still to come whatever the delay before it (24 such choices were done in 1 s)
    n = 12
    body = {"prompt": "Hi", "n": 8, "max_tokens": 8000, "ignore_eos": True, "stream": True, "logprobs": 5}

    def client_of(want) -> httpx.Client:
        """A connection held by a worker `want` accepts (a keep-alive connection stays with it)."""
        for _ in range(64):
            http = httpx.Client(timeout=120)
            if want(http.get(server.url("/v1/models")).headers["x-ringserve-worker"]):
                return http
            http.close()
        pytest.fail("no connection to the worker wanted")

    first = client_of(lambda w: True)
    owner = first.get(server.url("/v1/models")).headers["x-ringserve-worker"]
    holders = [first] + [client_of(lambda w: w == owner) for _ in range(n - 1)]
    ends: dict[int, list] = {}
    started = threading.Semaphore(0)

    def stream(k: int) -> None:
        with holders[k].stream("POST", server.url("/v1/completions"), json=body) as resp:
            chunks = _chunks(resp)
            last = [next(chunks)]
            started.release()
            for last[0] in chunks:
                pass
            ends[k] = last

    stopped = _worker_pid(server, int(owner))
    threads = [threading.Thread(target=stream, args=(k,)) for k in range(n)]
    other = client_of(lambda w: w != owner)
    other.timeout = httpx.Timeout(10)
    try:
        for t in threads:
            t.start()
        for _ in range(n):
            assert started.acquire(timeout=30)
        os.kill(stopped, signal.SIGSTOP)
        time.sleep(2)  # its ring fills
        t0 = time.monotonic()
        for _ in range(3):
            r = other.post(server.url("/v1/completions"), json={"prompt": "Hi", "max_tokens": 50})
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        with other.stream("POST", server.url("/v1/completions"), json=body | {"max_tokens": 200}) as resp:
            assert list(_chunks(resp))[-1]["choices"][0]["finish_reason"] == "length"
        assert time.monotonic() - t0 < 4, "the other worker waited for the stopped one"
        # the stall clock starts when its text first waits, which a loaded machine delays past
        # the stop: wait until the scheduler holds none of its requests (ended, or given up on),
        # then a whole stall more, so that the give-up has come whatever the load
        assert server.wait_until(lambda: _running(server, other) == 0, 120)  # not the stopped worker
        time.sleep(stall_s + 2)
        os.kill(stopped, signal.SIGCONT)
        for t in threads:
            t.join(60)
        # a stream whose whole text was in its ring before the stop ends normally; the others fail
        failed = [k for k in range(n) if "error" in ends[k][0]]
        assert failed, "no stream of the stopped worker was failed"
        assert all(k in failed or ends[k][0]["choices"][0]["finish_reason"] == "length" for k in range(n)), ends
        assert server.wait_until(lambda: _running(server) == 0, 30)
    finally:
        os.kill(stopped, signal.SIGCONT)
        for http in [*holders, other]:
            http.close()
