"""A frozen HTTP worker is found and replaced: `serve --workers 2`, one worker stopped with
SIGSTOP. A request already sent on a connection the stopped worker holds ends with its
connection closed (not a hang) once the engine's watch kills the worker; granian starts a new
worker in its place, and new connections are all served again (none black-holed)."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from runtime.supervise.files import process_start_time

STALL_S = 5  # --worker-stall-timeout
SLACK_S = 60  # a loaded 2-core machine: generous, and still far from a hang
BODY = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(
        start_server.Server.serve, "--workers", "2", "--worker-stall-timeout", str(STALL_S), "--log-level", "warning"
    )


def connection_to(server, index: str) -> httpx.Client:
    """A client whose keep-alive connection worker `index` holds."""
    for _ in range(64):
        client = httpx.Client(timeout=SLACK_S)
        if client.get(server.url("/v1/models")).headers["x-ringserve-worker"] == index:
            return client
        client.close()
    raise AssertionError(f"no connection reached worker {index}")


def test_a_stopped_worker_is_killed_and_replaced(server):
    held = connection_to(server, "0")
    victim = server.worker_pid(0)
    assert victim is not None
    os.kill(victim, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        with pytest.raises(httpx.TransportError) as failed:
            held.post(server.url("/v1/completions"), json=BODY, timeout=STALL_S + SLACK_S)
    finally:
        held.close()
    assert not isinstance(failed.value, httpx.TimeoutException), "the stopped worker's connection hung"
    assert time.monotonic() - t0 >= STALL_S - 1  # the watch waited for the stall timeout
    assert server.wait_until(lambda: process_start_time(victim) is None, SLACK_S)
    assert server.wait_until(lambda: server.worker_pid(0) not in (None, victim), SLACK_S, interval=0.5)
    answered = []
    for _ in range(8):
        with httpx.Client(timeout=SLACK_S) as client:  # a new connection each: either worker may take it
            resp = client.post(server.url("/v1/completions"), json=BODY)
            assert resp.status_code == 200, resp.text
            answered.append(resp.headers["x-ringserve-worker"])
    assert set(answered) <= {"0", "1"}
    server.refresh()
