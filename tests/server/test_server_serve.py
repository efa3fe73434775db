"""`python -m runtime serve`: a bad model is one line and a non-zero exit before anything
starts; with the null model it serves (flags reach the workers: the API key, the served
model name, the request timeout, which ends what a stopped scheduler holds up), and SIGTERM
stops every process it started and leaves no shared memory."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

KEY = "serve-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}
TIMEOUT_S = 3
CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}>>"


def test_bad_model_path_is_one_line(tmp_path):
    missing = tmp_path / "no-such-model"
    run = subprocess.run(
        [sys.executable, "-m", "runtime", "serve", "--model-path", str(missing)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1
    assert run.stderr.strip().splitlines() == [f"ringserve: model path {missing} does not exist"]


def test_bad_chat_template_is_one_line(tmp_path):
    template = tmp_path / "broken.jinja"
    template.write_text("{% for m in messages %}{{ m.content }{% endfor %}")
    run = subprocess.run(
        [sys.executable, "-m", "runtime", "serve", "--chat-template", str(template)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1
    assert run.stderr.strip().splitlines() == ["ringserve: --chat-template does not compile: unexpected '}'"]


def test_bad_flag_names_the_flag():
    run = subprocess.run(
        [sys.executable, "-m", "runtime", "serve", "--schedule-policy", "random"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "schedule-policy" in run.stderr and "Traceback" not in run.stderr


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(
        start_server.Server.serve,
        "--null-model",
        "--api-key",
        KEY,
        "--served-model-name",
        "nully",
        "--max-total-tokens",
        "8192",
        "--max-running-requests",
        "8",
        "--log-level",
        "warning",
        "--request-timeout",
        str(TIMEOUT_S),
        "--chat-template",
        CHAT_TEMPLATE,
    )


def test_serve_serves(server):
    auth = AUTH
    assert httpx.get(server.url("/v1/models"), headers=auth).json()["data"][0]["id"] == "nully"
    resp = httpx.post(
        server.url("/v1/completions"),
        headers=auth,
        timeout=60,
        json={"model": "nully", "prompt": "Hello", "max_tokens": 5, "temperature": 0},
    )
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 5
    assert httpx.post(server.url("/v1/completions"), json={"prompt": "Hello"}).status_code == 401


def test_chat_template_flag(server):
    """Chat prompts are rendered with --chat-template's template, not the tokenizer's."""
    resp = httpx.post(
        server.url("/v1/chat/completions"),
        headers=AUTH,
        timeout=60,
        json={"model": "nully", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 1},
    )
    rendered = httpx.post(
        server.url("/tokenize"), headers=AUTH, json={"prompt": "[user] Hello there\n>>", "add_special_tokens": False}
    ).json()["count"]
    assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens"] == rendered < 12


def test_request_timeout(server):
    """While the scheduler is stopped (SIGSTOP: a hung engine), requests end at the timeout."""
    body = {"prompt": "Hello", "max_tokens": 16}
    os.kill(server.engine["scheduler"], signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        resp = httpx.post(server.url("/v1/completions"), headers=AUTH, json=body, timeout=60)
        assert resp.status_code == 504 and resp.json()["error"]["code"] == "timeout"
        assert TIMEOUT_S <= time.monotonic() - t0 < TIMEOUT_S + 5
        with httpx.stream(
            "POST", server.url("/v1/completions"), headers=AUTH, json={**body, "stream": True}, timeout=60
        ) as resp:
            events = [line for line in resp.iter_lines() if line.startswith("data: ")]
        assert '"code":"timeout"' in events[-2] and events[-1] == "data: [DONE]"
    finally:
        os.kill(server.engine["scheduler"], signal.SIGCONT)
    assert server.wait_until(  # both were aborted in the scheduler too, once it ran again
        lambda: re.search(
            r"^sglang:num_running_reqs\{.*\} 0\.0$", httpx.get(server.url("/metrics"), headers=AUTH).text, re.M
        ),
        10,
    )
    resp = httpx.post(server.url("/v1/completions"), headers=AUTH, json=body, timeout=60)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 16


def test_sigterm_stops_everything(server):
    server.stop(signal.SIGTERM)
    assert server.leftovers() == ([], [])
