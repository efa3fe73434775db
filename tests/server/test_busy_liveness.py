"""Liveness that tells busy from dead: one prefill forward many times longer than the
heartbeat limits (--watchdog-timeout, which /health's limit follows when shorter) keeps
/health at 200 and the engine alive, because the scheduler beats between the forward's
layers; the same scheduler stopped (SIGSTOP) in the middle of such a forward still turns
/health 503 and is killed and replaced."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import numpy as np

from tests.conftest import Server, alive, wait_until

WATCHDOG_S = 3.0  # --watchdog-timeout: a heartbeat older than this is a hung engine, /health 503
# The long forward is sized to take about this many times WATCHDOG_S (so that a heartbeat
# only before each forward would fail it), its 30 layers then each about a sixth of it.
FORWARD_OVER_WATCHDOG = 5.0
CALIBRATION_TOKENS = 1024
MAX_PROMPT_TOKENS = 8000  # of the default model's 8192 of context: one forward (the chunk below)
HEALTH_POLL_S = 0.2


def prompt(seed: int, tokens: int) -> list[int]:
    """Token ids no prefix cache holds (a new seed each time): the whole prompt is computed."""
    return np.random.default_rng(seed).integers(1000, 40000, tokens).tolist()


def long_prompt_tokens(calibration_s: float) -> int:
    """The prompt length whose prefill takes about FORWARD_OVER_WATCHDOG x WATCHDOG_S, from the
    time of a CALIBRATION_TOKENS one (prefill time grows a little faster than its length on a
    CPU: 2048 tokens took 2.3x 1024's here, 8000 took 6.8x 2048's)."""
    growth = (FORWARD_OVER_WATCHDOG * WATCHDOG_S / calibration_s) ** (1 / 1.3)
    return int(min(MAX_PROMPT_TOKENS, max(CALIBRATION_TOKENS, CALIBRATION_TOKENS * growth)))


def complete(server: Server, prompt: list[int], timeout: float = 600) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    resp = httpx.post(server.url("/v1/completions"), json={"prompt": prompt, "max_tokens": 1}, timeout=timeout)
    return resp, time.monotonic() - t0


class HealthPoller:
    """Polls /health from a thread: every (seconds since start, status) seen."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.seen: list[tuple[float, int | str]] = []
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                status: int | str = httpx.get(self.server.url("/health"), timeout=10).status_code
            except httpx.HTTPError as e:
                status = type(e).__name__
            self.seen.append((time.monotonic() - self._t0, status))
            self._stop.wait(HEALTH_POLL_S)

    def stop(self) -> list[tuple[float, int | str]]:
        self._stop.set()
        self._thread.join(15)
        return self.seen


def test_long_prefill_is_busy_not_hung(start_server):
    server = start_server(
        Server.granian,
        device="cpu",
        watchdog_timeout=WATCHDOG_S,
        chunked_prefill_size=MAX_PROMPT_TOKENS,
        log_level="info",
    )
    scheduler = server.engine["scheduler"]
    resp, calibration_s = complete(server, prompt(0, CALIBRATION_TOKENS))
    assert resp.status_code == 200, resp.text
    tokens = long_prompt_tokens(calibration_s)

    # busy: /health 200 all along, the request served, the same scheduler
    poller = HealthPoller(server)
    resp, took = complete(server, prompt(1, tokens))
    seen = poller.stop()
    assert resp.status_code == 200, resp.text
    print(
        f"{CALIBRATION_TOKENS} tokens: {calibration_s:.1f} s; a {tokens}-token prefill took {took:.1f} s, "
        f"/health polled {len(seen)} times"
    )
    # shorter, and the old heartbeat (before each forward only) would have passed too
    assert took > 2 * WATCHDOG_S, f"the prefill took {took:.1f} s: too short to tell busy from hung"
    assert [s for s in seen if s[1] != 200] == [], seen
    assert len(seen) >= took / (HEALTH_POLL_S + 10)
    server.refresh()
    assert server.engine["scheduler"] == scheduler

    # dead: stopped in the middle of the same kind of forward
    poller = HealthPoller(server)
    answer: list[tuple[httpx.Response, float]] = []
    request = threading.Thread(target=lambda: answer.append(complete(server, prompt(2, tokens))))
    request.start()
    time.sleep(min(took / 3, 2.0))  # the forward is under way (it takes `took`)
    os.kill(scheduler, signal.SIGSTOP)
    stopped = time.monotonic()
    request.join(60)
    assert answer and answer[0][0].status_code == 503 and "scheduler stopped responding" in answer[0][0].text
    assert time.monotonic() - stopped < WATCHDOG_S + 30
    assert wait_until(lambda: not alive(scheduler), 15)  # killed, not left stopped
    server.wait_ready(120)
    seen = poller.stop()
    assert any(status == 503 for _, status in seen), seen  # from the stop until the new engine serves
    assert server.engine["scheduler"] != scheduler
    resp, _ = complete(server, [1000, 1001, 1002])
    assert resp.status_code == 200, resp.text
