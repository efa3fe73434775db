"""`python -m runtime serve`: a bad model is one line and a non-zero exit before anything
starts; with the null model it serves (flags reach the workers: the API key, the served
model name), and SIGTERM stops every process it started and leaves no shared memory."""
from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest

KEY = "serve-test-key"


def test_bad_model_path_is_one_line(tmp_path):
    missing = tmp_path / "no-such-model"
    run = subprocess.run([sys.executable, "-m", "runtime", "serve", "--model-path", str(missing)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines() == [f"ringserve: model path {missing} does not exist"]


def test_bad_flag_names_the_flag():
    run = subprocess.run([sys.executable, "-m", "runtime", "serve", "--schedule-policy", "random"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "schedule-policy" in run.stderr and "Traceback" not in run.stderr


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(start_server.Server.serve, "--null-model", "--api-key", KEY, "--served-model-name", "nully",
                        "--max-total-tokens", "8192", "--max-running-requests", "8", "--log-level", "warning")


def test_serve_serves(server):
    auth = {"authorization": f"Bearer {KEY}"}
    assert httpx.get(server.url("/v1/models"), headers=auth).json()["data"][0]["id"] == "nully"
    resp = httpx.post(server.url("/v1/completions"), headers=auth, timeout=60,
                      json={"model": "nully", "prompt": "Hello", "max_tokens": 5, "temperature": 0})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 5
    assert httpx.post(server.url("/v1/completions"), json={"prompt": "Hello"}).status_code == 401


def test_sigterm_stops_everything(server):
    server.stop(signal.SIGTERM)
    assert server.leftovers() == ([], [])
