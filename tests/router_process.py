"""The real sglang-router in front of test servers, on loopback: started with the intervals a
test needs (a /health probe and a worker check every second), held until it reports every
server healthy, and stopped with SIGTERM (then kill) when the test is done."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
from conftest import free_port, wait_until

START_TIMEOUT_S = 60


@dataclass
class Router:
    proc: subprocess.Popen
    base: str
    metrics_url: str


@contextmanager
def running_router(worker_urls: list[str], *flags: str, log_level: str = "warn") -> Iterator[Router]:
    """sglang-router with round_robin over `worker_urls` and `flags` beside its test intervals."""
    port, metrics_port = free_port(), free_port()
    argv = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        *worker_urls,
        "--policy",
        "round_robin",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        "--worker-startup-check-interval",
        "1",
        "--health-check-interval-secs",
        "1",
        "--shutdown-grace-period-secs",
        "1",
        "--log-level",
        log_level,
        *flags,
    ]
    proc = subprocess.Popen(argv, start_new_session=True)
    router = Router(proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics")
    try:
        want = set(worker_urls)
        assert wait_until(lambda: healthy(router.base) == want or proc.poll() is not None, START_TIMEOUT_S, 0.2)
        assert proc.poll() is None, f"the router exited with status {proc.returncode}"
        yield router
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def healthy(base: str, model: str | None = None) -> set[str]:
    """The URLs of the servers the router holds healthy (that serve `model`, when given)."""
    try:
        workers = httpx.get(base + "/workers", timeout=5).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return set()
    return {w["url"] for w in workers if w["is_healthy"] and (model is None or w["model_id"] == model)}
