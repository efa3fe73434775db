"""Supervision, tried as an unlucky or hostile operator would (issue 19): the API key is on no
command line, during start-up included."""

from __future__ import annotations

import os
import secrets
import signal
import sys
import time
from pathlib import Path

import httpx

from tests.conftest import Server, alive, free_port


def cmdlines() -> dict[int, bytes]:
    """Every process's command line, as any local user can read it."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = (entry / "cmdline").read_bytes()
            except (FileNotFoundError, ProcessLookupError):
                pass
    return out


def showing(key: str) -> dict[int, str]:
    return {
        pid: line.replace(b"\0", b" ").decode(errors="replace")
        for pid, line in cmdlines().items()
        if key.encode() in line and pid != os.getpid()
    }


def watch_start(server: Server, key: str, grace_s: float = 0.0, timeout: float = 300.0) -> dict[int, str]:
    """Polls every command line from the moment `server` was started until it is healthy:
    the processes that showed `key`, `grace_s` after the start onwards."""
    t0 = time.monotonic()
    seen: dict[int, str] = {}
    while time.monotonic() - t0 < timeout:
        if time.monotonic() - t0 >= grace_s:
            seen.update(showing(key))
        if server.proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {server.proc.returncode}")
        try:
            if httpx.get(server.url("/health"), timeout=0.5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
    else:
        raise TimeoutError("the server did not start")
    server.refresh()
    seen.update(showing(key))
    return seen


def check_key_works(server: Server, key: str) -> None:
    assert httpx.get(server.url("/v1/models"), timeout=10).status_code == 401
    ok = httpx.get(server.url("/v1/models"), headers={"authorization": f"Bearer {key}"}, timeout=10)
    assert ok.status_code == 200


# ---------------------------------------------------------------- secrets (item 4)


def test_api_key_on_no_command_line_granian():
    key = "k-" + secrets.token_hex(16)
    server = Server.granian(workers=2, null_model=1, api_key=key, log_level="warning")
    try:
        seen = watch_start(server, key)
        assert seen == {}, seen
        assert len(server.engine) == 2 and all(alive(p) for p in server.engine.values())
        check_key_works(server, key)
        server.stop()
    finally:
        if server.proc.poll() is None:
            server.kill()


def test_api_key_on_no_command_line_serve():
    """`serve --api-key K`: the key is gone from serve's own command line at once (it is what
    the user typed: only the interpreter's start shows it), and never reaches granian's or the
    engine's; given as RINGSERVE_API_KEY it is on no command line at all."""
    key = "k-" + secrets.token_hex(16)
    server = Server.serve("--null-model", "--log-level", "warning", "--api-key", key)
    try:
        seen = watch_start(server, key, grace_s=1.0)
        assert seen == {}, seen
        check_key_works(server, key)
        server.stop()
    finally:
        if server.proc.poll() is None:
            server.kill()
    key = "k-" + secrets.token_hex(16)
    port = free_port()
    server = Server(
        [sys.executable, "-m", "runtime", "serve", "--port", str(port), "--null-model", "--log-level", "warning"],
        {"RINGSERVE_API_KEY": key},
        port,
    )
    try:
        seen = watch_start(server, key)
        assert seen == {}, seen
        check_key_works(server, key)
        server.stop(signal.SIGTERM)
    finally:
        if server.proc.poll() is None:
            server.kill()
