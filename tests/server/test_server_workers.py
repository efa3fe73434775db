"""Two granian workers, one engine: exactly one scheduler and one detokenizer process exist
for the server; a worker killed with kill -9 is respawned by granian under the same worker
index, its dead predecessor's requests are aborted (their KV pages freed) and its records
never reach the new one; both workers serve (the x-ringserve-worker header says which
answered) and give the OfflineEngine's greedy output, stream and not; kill -9 of granian's
main process takes every process of the server with it and leaves nothing behind."""

from __future__ import annotations

import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from protocol.sampling_params import SamplingParams
from runtime.supervise.files import ServerFiles

PROMPT = "The capital of France is"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(
        start_server.Server.granian,
        workers=2,
        granian_flags=("--respawn-failed-workers",),
        log_level="warning",
        max_total_tokens=32768,
        max_running_requests=16,
    )


def title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def test_one_engine_for_two_workers(server):
    titles = [title(p) for p in server.descendants(server.pid)]
    assert sum("ringserve::scheduler" in t for t in titles) == 1, titles
    assert sum("ringserve::detokenizer" in t for t in titles) == 1, titles
    assert len(server.workers) == 2
    for pid in server.engine.values():
        assert pid in server.descendants(server.pid)


def running_requests(server) -> float:
    text = httpx.get(server.url("/metrics"), timeout=30).text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith("sglang:num_running_reqs{")))


def test_respawned_worker_takes_the_dead_ones_place(server):
    body = {"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    opened, release = [], threading.Event()
    lock = threading.Lock()

    def stream() -> None:
        with httpx.Client(timeout=120) as http:
            try:
                with http.stream("POST", server.url("/v1/completions"), json=body) as resp:
                    lines = resp.iter_lines()
                    while not next(lines).startswith("data: {"):
                        pass
                    with lock:
                        opened.append(resp.headers["x-ringserve-worker"])
                    release.wait(120)
            except httpx.HTTPError:
                pass  # the killed worker's streams break

    threads = []
    while len(set(opened)) < 2 and len(threads) < 16:  # until both workers hold streams
        batch = [threading.Thread(target=stream) for _ in range(2)]
        for t in batch:
            t.start()
        threads += batch
        assert server.wait_until(lambda: len(opened) == len(threads), 120)
    assert sorted(set(opened)) == ["0", "1"]
    victim_index = opened[0]
    survivors = sum(1 for w in opened if w != victim_index)
    victim = server.worker_pid(int(victim_index))
    os.kill(victim, signal.SIGKILL)
    respawned = lambda: server.worker_pid(int(victim_index)) not in (None, victim)
    assert server.wait_until(respawned, 240, interval=0.5)
    # the new worker's attach made the scheduler abort every request of the dead one
    assert server.wait_until(lambda: running_requests(server) == survivors, 30), running_requests(server)
    release.set()
    for t in threads:
        t.join(60)
    assert server.wait_until(lambda: running_requests(server) == 0, 30)
    server.refresh()


def test_both_workers_serve_the_engine_output(server, offline_engine):
    (want,) = offline_engine.generate([PROMPT], SamplingParams(temperature=0.0, max_new_tokens=MAX_TOKENS))
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}

    def complete(stream: bool) -> tuple[str, str]:
        with httpx.Client(timeout=120) as http:  # a connection of its own: either worker may take it
            if not stream:
                resp = http.post(server.url("/v1/completions"), json=body)
                return resp.headers["x-ringserve-worker"], resp.json()["choices"][0]["text"]
            text = ""
            with http.stream("POST", server.url("/v1/completions"), json={**body, "stream": True}) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        text += httpx.Response(200, content=line[6:]).json()["choices"][0]["text"]
                return resp.headers["x-ringserve-worker"], text

    answered: dict[str, set[str]] = {}
    for _ in range(6):
        with ThreadPoolExecutor(8) as pool:
            for worker, text in pool.map(complete, [False, True] * 4):
                answered.setdefault(worker, set()).add(text)
        if len(answered) == 2:
            break
    assert sorted(answered) == ["0", "1"]
    assert all(texts == {want.text} for texts in answered.values()), answered


def other_worker(server, owner: str) -> httpx.Client:
    """A connection the other worker holds (a keep-alive connection stays with its worker)."""
    for _ in range(64):
        http = httpx.Client(timeout=30)
        if http.get(server.url("/v1/models")).headers["x-ringserve-worker"] != owner:
            return http
        http.close()
    pytest.fail("every connection went to the worker holding the stream")


def chunks(resp: httpx.Response):
    """The JSON chunks of an SSE stream, split on blank lines only (the text may hold
    characters str.splitlines() splits on, such as U+2028)."""
    pending = b""
    for data in resp.iter_bytes():
        *events, pending = (pending + data).split(b"\n\n")
        yield from (json.loads(e[6:]) for e in events if e.startswith(b"data: {"))


def test_abort_request_reaches_the_worker_holding_the_request(server):
    """POST /abort_request {"rid": ...} answered by the other worker: the abort goes through
    the scheduler and the stream ends with finish_reason "abort"; abort_all ends every
    worker's streams."""
    body = {"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}

    def ends_aborted(http: httpx.Client, abort: dict) -> None:
        with http.stream("POST", server.url("/v1/completions"), json=body) as resp:
            owner, stream = resp.headers["x-ringserve-worker"], chunks(resp)
            rid = next(stream)["id"]
            other = other_worker(server, owner)
            try:
                r = other.post(server.url("/abort_request"), json=abort or {"rid": rid})
            finally:
                other.close()
            assert r.status_code == 200 and r.headers["x-ringserve-worker"] != owner, r.text
            finish = [chunk["choices"][0]["finish_reason"] for chunk in stream]
            assert finish[-1] == "abort", finish[-5:]

    with httpx.Client(timeout=120) as http:
        ends_aborted(http, {})
        ends_aborted(http, {"abort_all": True})
    assert server.wait_until(lambda: running_requests(server) == 0, 30)


def test_abort_request_ends_the_rid_on_every_worker(server):
    """Two /generate streams with one rid, one on each worker (a worker refuses a rid it holds
    in flight, but cannot see the other's): /abort_request of the rid ends both, whichever
    worker answers it."""
    body = {
        "text": PROMPT,
        "rid": "twice",
        "stream": True,
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
    }
    with httpx.Client(timeout=120) as http, http.stream("POST", server.url("/generate"), json=body) as first:
        owner, first_chunks = first.headers["x-ringserve-worker"], chunks(first)
        next(first_chunks)
        other = other_worker(server, owner)
        try:
            with other.stream("POST", server.url("/generate"), json=body) as second:
                second_chunks = chunks(second)
                next(second_chunks)
                assert http.post(server.url("/abort_request"), json={"rid": "twice"}).status_code == 200
                for stream in (first_chunks, second_chunks):
                    assert [c["meta_info"]["finish_reason"] for c in stream][-1]["type"] == "abort"
        finally:
            other.close()
    assert server.wait_until(lambda: running_requests(server) == 0, 30)


def test_kill9_of_granian_takes_the_server_down(server):
    files = ServerFiles.of(server.pid)
    os.kill(server.pid, signal.SIGKILL)
    server.proc.wait(10)
    assert server.wait_until(lambda: not any(server.alive(p) for p in server.processes()), 20), [
        (p, title(p)) for p in server.processes() if server.alive(p)
    ]
    assert server.leftovers() == ([], [])
    assert server.wait_until(lambda: not list(files.root.glob(f"engine-{server.pid}.*")), 10)
