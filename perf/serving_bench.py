"""Serving benchmark: a real server (`python -m runtime serve`) driven over HTTP through its
OpenAI API by a lean client of its own, for the ring and the ZMQ + pickle transport in one
run, with the real model and with the null model (instant tokens).

Workload (the one the targets below are set for): streamed chat completions, prompts of
about 110 tokens (random words from a fixed seed, counted with the real tokenizer through
the chat template, as the server counts them), 64 output tokens, ignore_eos, temperature 0
(greedy; --temperature).
Each concurrency level is a closed loop: C keep-alive connections, each sending its next
request as soon as the previous one ended, until --num-requests were sent. Every level
gets prompts of its own, so nothing but the chat template's system prompt is in the
prefix cache from an earlier level.

Per (model, transport, concurrency):
  TTFT      request written -> first SSE event with non-empty content
  ITL       gap between consecutive content events of a request. One event can carry
            several tokens (the server coalesces a client's pending deltas, and a token
            that completes no character sends nothing), so the JSON also has tokens/event
  tok/step  tokens the scheduler generated per step in the window (its mean batch), from /metrics
  TPOT      (e2e - TTFT) / (completion_tokens - 1), completion_tokens from usage
  E2E       request written -> end of the response ([DONE] and the last chunk)
  req/s, output tok/s over the level's window (first request written -> last one ended)
  failed    non-200, an error event, a broken connection, a timeout, or not exactly
            --output-tokens completion tokens
  server CPU  utime+stime (/proc/<pid>/stat) of every process of the server's tree
            (granian main, workers, ringserve::scheduler, ringserve::detokenizer) over
            the window, per streamed token; the client's own CPU (this process) is
            measured apart and is not in it

The client is an asyncio.Protocol per connection (HTTP/1.1, chunked bodies, SSE events
split and parsed here, orjson for each event's JSON), on uvloop when it is installed:
it shares the CPUs with the server, so it must cost little per event.

    python -m perf.serving_bench                     # full run (~10-15 min on 2 cores)
    python -m perf.serving_bench --quick             # smoke run
    python -m perf.serving_bench --models null --transports ring --concurrency 256 --num-requests 1024
    python -m perf.serving_bench --models real --concurrency 1,32 --num-requests 8,64
    python -m perf.serving_bench --server-args "--max-running-requests 128"
Prints the tables; writes perf/results/serving.json and serving.md (perf/report.py), each
server's log beside them (not committed).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import http.client
import itertools
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson

from perf import report

MODELS = ("real", "null")
TRANSPORTS = ("ring", "zmq")
TRANSPORT_LABELS = {"ring": "ring", "zmq": "zmq+pickle"}
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 60.0
INSTRUCTION = "Continue this list of words with more words of the same kind:"
CLK_TCK = os.sysconf("SC_CLK_TCK")
THREAD_ENV = ("OMP_", "GOMP_", "KMP_", "MKL_", "TORCH_")  # settings of torch's CPU threads, recorded
PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)

# Targets on the 2-core machine. llama.cpp's server streams 116 tok/s at c=32 on the same model,
# with a 10 ms ITL at c=1; SGLang's token path costs ~140 µs of CPU a token: the null model's bound.
TARGET_C32_TOKENS_PER_S = 230.0
TARGET_C1_ITL_P50_MS = 1.5 * 10.0
TARGET_NULL_STREAMS = 256
TARGET_NULL_CPU_US_PER_TOKEN = 14.0


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int = 110
    output_tokens: int = 64
    temperature: float = 0.0
    seed: int = 0


# ---------------------------------------------------------------- prompts


def load_tokenizer(model_path: str | None):
    from transformers import AutoTokenizer

    from gpu.models.model_files import resolve_model_dir

    return AutoTokenizer.from_pretrained(str(resolve_model_dir(model_path)))


class ChatCounter:
    """Prompt tokens of one user message, counted as the server counts them (chat template
    rendered, then encoded without special tokens). The template is rendered once around a
    marker: jinja per prompt would cost more than the encoding."""

    MARK = "\x00CONTENT\x00"

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": self.MARK}], add_generation_prompt=True, tokenize=False
        )
        self.head, self.tail = text.split(self.MARK)

    def __call__(self, content: str) -> int:
        return len(self.tokenizer.encode(self.head + content + self.tail, add_special_tokens=False))


def vocab_words(tokenizer) -> list[str]:
    """Lower-case ASCII words that are one vocabulary entry each with their leading space
    (byte-level BPE writes the space as U+0120, SentencePiece as U+2581)."""
    return sorted(
        t[1:]
        for t in tokenizer.get_vocab()
        if t[:1] in ("\u0120", "\u2581")
        and t[1:].isascii()
        and t[1:].isalpha()
        and t[1:].islower()
        and 3 <= len(t) - 1 <= 8
    )


def make_prompts(
    tokenizer, n: int, target_tokens: int, seed: int, count: Callable[[str], int] | None = None
) -> tuple[list[str], list[int]]:
    """`n` user messages of `target_tokens` tokens each (the next count above when one word
    more jumps past it): an instruction and random whole-word vocabulary entries. Counted
    through the chat template unless `count` says otherwise (a raw completions prompt).
    Returns the messages and their token counts."""
    count = count or ChatCounter(tokenizer)
    words = vocab_words(tokenizer)
    rng = np.random.default_rng(seed)
    overhead = count(INSTRUCTION)
    prompts, lengths = [], []
    for _ in range(n):
        pool = [words[i] for i in rng.integers(0, len(words), target_tokens * 2)]
        k = max(1, target_tokens - overhead)  # each " word" is one token; the loops correct it if not
        while count(text := INSTRUCTION + " " + " ".join(pool[:k])) < target_tokens and k < len(pool):
            k += 1
        while k > 1 and count(shorter := INSTRUCTION + " " + " ".join(pool[: k - 1])) >= target_tokens:
            k, text = k - 1, shorter
        prompts.append(text)
        lengths.append(count(text))
    return prompts, lengths


def request_body(model: str, content: str, w: Workload) -> bytes:
    return orjson.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": w.output_tokens,
            "temperature": w.temperature,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )


# ---------------------------------------------------------------- HTTP client


@dataclass
class RequestResult:
    start: float
    end: float = 0.0
    content_times: list[float] = field(default_factory=list)  # arrival of each content event
    # tokens of each content event, counted from its logprobs (one entry per token); 0 without logprobs
    event_tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)  # each content event's text
    prompt_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens, where the server reports it
    completion_tokens: int = 0
    error: str | None = None


CHAT_PATH = "/v1/chat/completions"


class StreamConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection that POSTs streamed chat completions (or, with
    `path` /v1/completions, text completions) one at a time and timestamps each SSE event
    when the bytes that complete it arrive."""

    def __init__(self, host: str, port: int, path: str = CHAT_PATH) -> None:
        self.head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\nContent-Length: "
        )
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.buf = bytearray()  # bytes received, not yet parsed as HTTP
        self.body = bytearray()  # de-chunked body bytes not yet split into events
        self.state = "idle"  # idle | headers | size | data | data_end | trailer | fixed
        self.remaining = 0  # bytes left in the current chunk (or fixed-length body)
        self.status = 0
        self.result: RequestResult | None = None
        self.done: asyncio.Future | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.done is not None and not self.done.done():
            self.result.error = f"connection lost: {exc or 'closed by the server'}"
            self.done.set_result(self.result)

    async def request(self, body: bytes, timeout: float) -> RequestResult:
        loop = asyncio.get_running_loop()
        self.done = loop.create_future()
        self.buf.clear()
        self.body.clear()
        self.state = "headers"
        self.result = RequestResult(time.perf_counter())
        self.transport.write(self.head.encode() + str(len(body)).encode() + b"\r\n\r\n" + body)
        try:
            return await asyncio.wait_for(self.done, timeout)
        except asyncio.TimeoutError:  # wait_for cancelled self.done: connection_lost leaves the error alone
            self.result.error = f"no complete response within {timeout:g} s"
            self.transport.close()
            self.state = "idle"
            return self.result

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self.buf += data
        while self.state != "idle":
            if not self._parse(now):
                return

    def _parse(self, now: float) -> bool:
        """One step of the response parser; False when it needs more bytes."""
        buf = self.buf
        if self.state == "headers":
            i = buf.find(b"\r\n\r\n")
            if i < 0:
                return False
            lines = bytes(buf[:i]).split(b"\r\n")
            del buf[: i + 4]
            self.status = int(lines[0].split()[1])
            headers = dict(line.lower().split(b": ", 1) for line in lines[1:])
            if headers.get(b"transfer-encoding") == b"chunked":
                self.state = "size"
            else:
                self.state, self.remaining = "fixed", int(headers.get(b"content-length", b"0"))
            return True
        if self.state == "size":
            i = buf.find(b"\r\n")
            if i < 0:
                return False
            self.remaining = int(bytes(buf[:i]).split(b";")[0], 16)
            del buf[: i + 2]
            self.state = "data" if self.remaining else "trailer"
            return True
        if self.state in ("data", "fixed"):
            n = min(len(buf), self.remaining)
            if n == 0 and self.remaining:
                return False
            self.body += buf[:n]
            del buf[:n]
            self.remaining -= n
            if self.status == 200:
                self._events(now)
            if self.remaining:
                return False
            if self.state == "fixed":
                self._finish(now)
            else:
                self.state = "data_end"
            return True
        if self.state == "data_end":
            if len(buf) < 2:
                return False
            del buf[:2]
            self.state = "size"
            return True
        # trailer: the empty line after the last chunk (the server sends no trailer fields)
        if len(buf) < 2:
            return False
        del buf[:2]
        self._finish(now)
        return True

    def _events(self, now: float) -> None:
        body = self.body
        start = 0
        while (end := body.find(b"\n\n", start)) >= 0:
            event = bytes(body[start:end])
            start = end + 2
            if not event.startswith(b"data: "):
                continue
            payload = event[6:]
            if payload == b"[DONE]":
                continue
            obj = orjson.loads(payload)
            if "error" in obj:
                self.result.error = f"error event: {obj['error'].get('message')}"
                continue
            for choice in obj["choices"]:
                delta = choice.get("delta")
                text = delta.get("content") if delta is not None else choice.get("text")
                # completions' logprobs list "tokens" (llama.cpp's: "content"), chat's "content"
                logprobs = choice.get("logprobs")
                n = len(logprobs.get("tokens") or logprobs.get("content") or ()) if logprobs else 0
                if text or n:  # a token that completes no character may come with logprobs and no text
                    self.result.content_times.append(now)
                    self.result.event_tokens.append(n)
                    self.result.text.append(text or "")
            usage = obj.get("usage")
            if usage:
                self.result.prompt_tokens, self.result.completion_tokens = (
                    usage["prompt_tokens"],
                    usage["completion_tokens"],
                )
                self.result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        if start:
            del body[:start]

    def _finish(self, now: float) -> None:
        result = self.result
        result.end = now
        if self.status != 200:
            result.error = f"HTTP {self.status}: {bytes(self.body[:300]).decode(errors='replace')}"
        self.state = "idle"
        self.done.set_result(result)


async def connect(host: str, port: int, path: str = CHAT_PATH) -> StreamConnection:
    loop = asyncio.get_running_loop()
    _, conn = await loop.create_connection(lambda: StreamConnection(host, port, path), host, port)
    conn.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


async def run_closed_loop(
    host: str,
    port: int,
    bodies: list[bytes],
    concurrency: int,
    timeout: float,
    on_start,
    on_end,
    path: str = CHAT_PATH,
    fresh: bool = False,
) -> list[RequestResult]:
    """`concurrency` connections sending `bodies` one after another each to `path`; `on_start()`
    runs right before the first request is written, `on_end()` right after the last one ends.
    `fresh`: a new connection for every request after a connection's first (llama.cpp's server
    closes the connection after each streamed response, so a request written on it races the close)."""
    conns = await asyncio.gather(*(connect(host, port, path) for _ in range(concurrency)))
    order = iter(range(len(bodies)))
    results: list[RequestResult | None] = [None] * len(bodies)

    async def user(conn: StreamConnection) -> None:
        used = False
        try:
            for i in order:
                if conn.closed or (fresh and used):
                    conn.transport.close()
                    try:
                        conn = await connect(host, port, path)
                    except OSError as e:  # the server is gone: every request left fails fast
                        results[i] = RequestResult(time.perf_counter(), error=f"cannot connect: {e}")
                        continue
                results[i] = await conn.request(bodies[i], timeout)
                used = True
        finally:  # also when cancelled (Ctrl-C): the server then aborts the request
            conn.transport.close()

    on_start()
    await asyncio.gather(*(user(c) for c in conns))
    on_end()
    return results


def cancel_pending(loop: asyncio.AbstractEventLoop) -> None:
    """Cancels what an interrupted run_until_complete left running (its connections close)."""
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.wait(pending))


def new_event_loop() -> tuple[asyncio.AbstractEventLoop, str]:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop(), "asyncio"
    return uvloop.new_event_loop(), "uvloop"


# ---------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (children of any of its threads)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except FileNotFoundError:
            continue
        for tid in tids:
            try:
                todo += [int(c) for c in Path(f"/proc/{p}/task/{tid}/children").read_text().split()]
            except FileNotFoundError:
                pass
    return found


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, utime + stime in clock ticks) of a process, or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0], int(fields[11]) + int(fields[12])


def proc_title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except FileNotFoundError:
        return "?"


def role_of(title: str, pid: int, server_pid: int) -> str:
    if pid == server_pid:
        return "granian main"
    for role in ("ringserve::scheduler", "ringserve::detokenizer"):
        if title.startswith(role):
            return role
    return "http worker" if "worker" in title else title[:40]


class Server:
    """`python -m runtime serve` (granian after its exec: same pid) on a free port, in a
    session of its own, its output in `log`; run from `cwd` (another checkout's code: `-m`
    imports the working directory's packages first), this one's by default."""

    def __init__(self, extra_args: list[str], log: Path, cwd: Path | None = None) -> None:
        self.port = free_port()
        self.extra_args = extra_args
        self.argv = [
            sys.executable,
            "-m",
            "runtime",
            "serve",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *extra_args,
        ]
        self._launch({k: v for k, v in os.environ.items() if not k.startswith("RINGSERVE_")}, log, cwd)

    def _launch(self, env: dict[str, str] | None, log: Path, cwd: Path | None) -> None:
        """Starts self.argv in a session of its own, its output in `log` (env None: this one's)."""
        self.log = log
        self.started = time.monotonic()
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                self.argv,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                start_new_session=True,
                preexec_fn=_sigint_when_parent_dies,
            )
        self.pids: list[int] = []  # the whole tree, once healthy

    def get(self, path: str) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def wait_healthy(self) -> float:
        """Seconds from the start until /health answered 200; the process tree is known afterwards."""
        while time.monotonic() - self.started < START_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited with status {self.proc.returncode} during start-up; see {self.log}"
                )
            try:
                if self.get("/health")[0] == 200:
                    self.pids = descendants(self.proc.pid)
                    return time.monotonic() - self.started
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server was not healthy within {START_TIMEOUT_S:.0f} s; see {self.log}")

    def model_name(self) -> str:
        status, body = self.get("/v1/models")
        if status != 200:
            raise RuntimeError(f"GET /v1/models answered {status}: {body[:200]!r}")
        return orjson.loads(body)["data"][0]["id"]

    def engine_counters(self) -> dict[str, float]:
        """The scheduler's step and generated-token counters, from /metrics (empty if absent)."""
        status, body = self.get("/metrics")
        wanted = ("ringserve_steps_total", "ringserve_engine_generated_tokens_total")
        if status != 200:
            return {}
        return {
            name: float(value)
            for name, value in (line.split(None, 1) for line in body.decode().splitlines() if line.startswith(wanted))
        }

    def cpu_ticks(self) -> dict[int, int]:
        """utime+stime of every live process of the tree (re-walked: nothing may have respawned)."""
        ticks = {}
        for pid in descendants(self.proc.pid):
            stat = proc_stat(pid)
            if stat is not None:
                ticks[pid] = stat[1]
        return ticks

    def cpu_by_role(self, before: dict[int, int], after: dict[int, int]) -> dict[str, float]:
        roles: dict[str, float] = {}
        for pid, ticks in after.items():
            role = role_of(proc_title(pid), pid, self.proc.pid)
            roles[role] = roles.get(role, 0.0) + (ticks - before.get(pid, 0)) / CLK_TCK
        return roles

    def stop(self) -> dict:
        """SIGINT, then what is left behind: processes of the tree still running, shared
        memory segments they created, engine files in the runtime directory."""
        from ipc.shm import our_segments, segment_pid
        from runtime.supervise.files import ServerFiles

        pids = sorted(set(self.pids) | set(descendants(self.proc.pid)))
        t0 = time.monotonic()
        clean_exit = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            clean_exit = False
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_running(p) for p in pids):
            time.sleep(0.1)
        running = [p for p in pids if _running(p)]
        for pid in running + ([self.proc.pid] if self.proc.poll() is None else []):
            os.kill(pid, signal.SIGKILL)  # the benchmark's own server: nothing may outlive it
        self.proc.wait()
        segments = [n for n in our_segments() if segment_pid(n) in pids]
        files = sorted(p.name for p in ServerFiles.of(self.proc.pid).root.glob(f"engine-{self.proc.pid}.*"))
        return {
            "exit_status": self.proc.returncode,
            "stopped_by_sigint": clean_exit,
            "stop_s": time.monotonic() - t0,
            "processes": running,
            "shm_segments": segments,
            "engine_files": files,
        }


def _sigint_when_parent_dies() -> None:
    """In the server's child before its exec: a benchmark killed outright (kill -9) still
    stops its server cleanly (PR_SET_PDEATHSIG survives the exec into granian)."""
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGINT)


def _running(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat[0] not in "ZX"


# ---------------------------------------------------------------- statistics


def percentiles(values: list[float], scale: float = 1.0) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "mean": None}
    a = np.asarray(values) * scale
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}


def itl_per_token(times: list[float], counts: list[int]) -> list[float]:
    """Inter-token latencies of one request as SGLang's bench_serving counts them under
    speculative decoding: an event carrying n tokens after a gap g adds n latencies of g / n
    (the first event's tokens add none: they are the TTFT's)."""
    out: list[float] = []
    for a, b, n in zip(times, times[1:], counts[1:]):
        out += [(b - a) / n] * n
    return out


def summarize(results: list[RequestResult], w: Workload, window_s: float) -> dict:
    """The level's statistics; with per-event token counts (logprobs were asked for), also
    the per-token ITL and the tokens the events' logprobs missed against usage."""
    ok, failures = [], []
    for r in results:
        if r.error is None and r.completion_tokens != w.output_tokens:
            r.error = f"{r.completion_tokens} completion tokens, not {w.output_tokens}"
        if r.error is None and sum(r.event_tokens) > r.completion_tokens:
            r.error = f"{sum(r.event_tokens)} tokens in the events' logprobs, more than usage's {r.completion_tokens}"
        (failures if r.error else ok).append(r)
    ttft = [r.content_times[0] - r.start for r in ok if r.content_times]
    tpot = [
        (r.end - r.content_times[0]) / (r.completion_tokens - 1)
        for r in ok
        if r.content_times and r.completion_tokens > 1
    ]
    itl = [b - a for r in ok for a, b in zip(r.content_times, r.content_times[1:])]
    events = sum(len(r.content_times) for r in ok)
    tokens = sum(r.completion_tokens for r in ok)
    counted = {}
    if any(any(r.event_tokens) for r in ok):
        counted = {
            "itl_token_ms": percentiles(
                [x for r in ok for x in itl_per_token(r.content_times, [max(n, 1) for n in r.event_tokens])], 1e3
            ),
            "uncounted_tokens": sum(r.completion_tokens - sum(r.event_tokens) for r in ok),
            "cached_tokens_mean": float(np.mean([r.cached_tokens for r in ok])),
        }
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(failures),
        "failures": sorted({r.error for r in failures})[:5],
        "duration_s": window_s,
        "request_throughput": len(ok) / window_s,
        "output_throughput": tokens / window_s,
        "output_tokens": tokens,
        "prompt_tokens_mean": float(np.mean([r.prompt_tokens for r in ok])) if ok else None,
        "tokens_per_event": tokens / events if events else None,
        "ttft_ms": percentiles(ttft, 1e3),
        "tpot_ms": percentiles(tpot, 1e3),
        "itl_ms": percentiles(itl, 1e3),
        "e2e_ms": percentiles([r.end - r.start for r in ok], 1e3),
        **counted,
    }


# ---------------------------------------------------------------- one level, one server


def measure_level(
    loop,
    server: Server,
    bodies: list[bytes],
    concurrency: int,
    w: Workload,
    timeout: float,
    path: str = CHAT_PATH,
    results_into: list[RequestResult] | None = None,
    fresh: bool = False,
) -> dict:
    """One closed-loop level on `server` (anything with its port, cpu_ticks, cpu_by_role and
    engine_counters); `results_into` receives the requests' results when given."""
    marks: dict[str, object] = {}

    def on_start() -> None:  # the /metrics scrapes stay outside the CPU window
        marks["engine0"], marks["load0"], marks["ticks0"] = (
            server.engine_counters(),
            os.getloadavg(),
            server.cpu_ticks(),
        )
        marks["client0"], marks["t0"] = time.process_time(), time.perf_counter()

    def on_end() -> None:
        marks["t1"], marks["client1"] = time.perf_counter(), time.process_time()
        marks["ticks1"], marks["load1"], marks["engine1"] = (
            server.cpu_ticks(),
            os.getloadavg(),
            server.engine_counters(),
        )

    results = loop.run_until_complete(
        run_closed_loop("127.0.0.1", server.port, bodies, concurrency, timeout, on_start, on_end, path, fresh)
    )
    if results_into is not None:
        results_into += results
    window = marks["t1"] - marks["t0"]
    level = {"concurrency": concurrency, **summarize(results, w, window)}
    by_role = server.cpu_by_role(marks["ticks0"], marks["ticks1"])
    server_cpu = sum(by_role.values())
    client_cpu = marks["client1"] - marks["client0"]
    tokens = level["output_tokens"]
    e0, e1 = marks["engine0"], marks["engine1"]
    steps = e1.get("ringserve_steps_total", 0) - e0.get("ringserve_steps_total", 0)
    generated = e1.get("ringserve_engine_generated_tokens_total", 0) - e0.get(
        "ringserve_engine_generated_tokens_total", 0
    )
    level.update(
        {
            "engine_steps": steps,
            "tokens_per_step": generated / steps if steps else None,
            "server_cpu_s": server_cpu,
            "server_cpu_by_process_s": by_role,
            "server_cpu_us_per_token": server_cpu / tokens * 1e6 if tokens else None,
            "client_cpu_s": client_cpu,
            "client_cpu_us_per_token": client_cpu / tokens * 1e6 if tokens else None,
            "loadavg_before": marks["load0"],
            "loadavg_after": marks["load1"],
        }
    )
    return level


def start_server(model: str, transport: str, args) -> Server:
    extra = [
        "--transport",
        transport,
        *(["--null-model"] if model == "null" else []),
        *(["--model-path", args.model_path] if args.model_path else []),
        *shlex.split(args.server_args),
    ]
    log = args.out.with_name(f"serving_server_{model}_{transport}.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[{model} / {TRANSPORT_LABELS[transport]}] starting: {' '.join(extra)}", flush=True)
    return Server(extra, log)


def run_server(
    server: Server, model: str, transport: str, levels: list[int], prompts: list[str], w: Workload, args, loop
) -> dict:
    """Every level on one started server, which is stopped afterwards whatever happens."""
    run = {"model": model, "transport": transport, "server_args": server.extra_args, "levels": []}
    try:
        run["startup_s"] = server.wait_healthy()
        name = server.model_name()
        bodies = [request_body(name, p, w) for p in prompts]
        warm, *per_level = split(bodies, [args.warmup, *(requests_at(c, model, args) for c in levels)])
        if warm:
            loop.run_until_complete(
                run_closed_loop(
                    "127.0.0.1", server.port, warm, min(len(warm), 8), args.request_timeout, lambda: None, lambda: None
                )
            )
        for c, level_bodies in zip(levels, per_level):
            level = measure_level(loop, server, level_bodies, c, w, args.request_timeout)
            run["levels"].append(level)
            print(row_text(model, transport, level), flush=True)
    finally:
        cancel_pending(loop)
        run["leftovers"] = server.stop()
    left = run["leftovers"]
    if left["processes"] or left["shm_segments"] or left["engine_files"] or not left["stopped_by_sigint"]:
        print(f"  LEFT BEHIND after SIGINT: {left}", flush=True)
    return run


def requests_at(concurrency: int, model: str, args) -> int:
    """--num-requests' count for the level, else two waves (the null model: four, and at
    least 128 requests, so that its sub-second windows are long enough for /proc's 10 ms
    CPU ticks); --quick: one."""
    if concurrency in args.request_counts:
        return args.request_counts[concurrency]
    if args.quick:
        return max(8, concurrency)
    return max(32, 2 * concurrency) if model == "real" else max(128, 4 * concurrency)


def split(items: list, sizes: list[int]) -> list[list]:
    it = iter(items)
    return [list(itertools.islice(it, n)) for n in sizes]


# ---------------------------------------------------------------- output


def _pair(stat: dict, fmt: str = "{:.0f}") -> str:
    if stat["p50"] is None:
        return "-"
    return f"{fmt.format(stat['p50'])} / {fmt.format(stat['p99'])}"


def _num(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


COLUMNS = (
    "model",
    "transport",
    "conc",
    "reqs",
    "failed",
    "req/s",
    "out tok/s",
    "TTFT p50/p99 ms",
    "TPOT p50/p99 ms",
    "ITL p50/p99 ms",
    "E2E p50/p99 ms",
    "tok/event",
    "tok/step",
    "server CPU µs/tok",
    "client CPU µs/tok",
    "load",
)


def row_cells(model: str, transport: str, lv: dict) -> list[str]:
    return [
        model,
        TRANSPORT_LABELS[transport],
        str(lv["concurrency"]),
        str(lv["num_requests"]),
        str(lv["failed"]),
        f"{lv['request_throughput']:.2f}",
        f"{lv['output_throughput']:.0f}",
        _pair(lv["ttft_ms"]),
        _pair(lv["tpot_ms"], "{:.1f}"),
        _pair(lv["itl_ms"], "{:.1f}"),
        _pair(lv["e2e_ms"]),
        _num(lv["tokens_per_event"], "{:.2f}"),
        _num(lv["tokens_per_step"], "{:.1f}"),
        _num(lv["server_cpu_us_per_token"], "{:.1f}"),
        _num(lv["client_cpu_us_per_token"], "{:.1f}"),
        f"{lv['loadavg_before'][0]:.1f}",
    ]


def row_text(model: str, transport: str, lv: dict) -> str:
    return "  " + "  ".join(f"{h}={c}" for h, c in zip(COLUMNS[2:], row_cells(model, transport, lv)[2:]))


def table(runs: list[dict]) -> str:
    rows = [row_cells(r["model"], r["transport"], lv) for r in runs for lv in r["levels"]]
    widths = [max(len(h), *(len(c[i]) for c in rows)) if rows else len(h) for i, h in enumerate(COLUMNS)]
    return "\n".join("  ".join(c.rjust(wd) for c, wd in zip(cells, widths)) for cells in [list(COLUMNS), *rows])


def targets(runs: list[dict]) -> dict:
    """The TARGET_* bounds, for each transport that was measured at the level they name."""
    out = {}
    for r in runs:
        label = TRANSPORT_LABELS[r["transport"]]
        by_c = {lv["concurrency"]: lv for lv in r["levels"]}
        if r["model"] == "real" and 32 in by_c:
            lv = by_c[32]
            out[f"real {label} c32: output tok/s >= {TARGET_C32_TOKENS_PER_S:g} with no failed request"] = {
                "value": lv["output_throughput"],
                "failed": lv["failed"],
                "met": lv["output_throughput"] >= TARGET_C32_TOKENS_PER_S and lv["failed"] == 0,
            }
        if r["model"] == "real" and 1 in by_c and by_c[1]["itl_ms"]["p50"] is not None:
            itl = by_c[1]["itl_ms"]["p50"]
            out[f"real {label} c1: ITL p50 ms <= {TARGET_C1_ITL_P50_MS:g}"] = {
                "value": itl,
                "met": itl <= TARGET_C1_ITL_P50_MS,
            }
        if r["model"] == "null" and TARGET_NULL_STREAMS in by_c:
            cpu = by_c[TARGET_NULL_STREAMS]["server_cpu_us_per_token"]
            out[f"null {label} c{TARGET_NULL_STREAMS}: server CPU µs/token <= {TARGET_NULL_CPU_US_PER_TOKEN:g}"] = {
                "value": cpu,
                "met": cpu is not None and cpu <= TARGET_NULL_CPU_US_PER_TOKEN,
            }
    return out


# ---------------------------------------------------------------- main


def write_result(out: Path, result: dict, complete: bool, started: report.Started) -> None:
    result.update(complete=complete, loadavg_end=os.getloadavg(), targets=targets(result["runs"]))
    report.write_results("serving", result, markdown(result), started, out=out)


def markdown(result: dict) -> str:
    """The levels' table, the workload, and the targets that applied."""
    runs, w = result["runs"], result["workload"]
    rows = [row_cells(r["model"], r["transport"], lv) for r in runs for lv in r["levels"]]
    lines = [
        report.table(COLUMNS, rows),
        "",
        f"Streamed chat completions, prompts of {w['prompt_tokens_min']}-{w['prompt_tokens_max']} tokens, "
        f"{w['output_tokens']} output tokens, temperature {w['temperature']:g}, ignore_eos; client on "
        f"{result['client_loop']}; load is the 1-min load average before each level."
        + ("" if result["complete"] else " **Incomplete run.**"),
    ]
    lines += [""] + [
        f"- {name}: {_num(check['value'], '{:.1f}')} -> {'met' if check['met'] else 'NOT met'}"
        for name, check in result["targets"].items()
    ]
    return "\n".join(lines)


def parse_list(text: str, kind=str) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma list of: real, null")
    ap.add_argument("--transports", default=",".join(TRANSPORTS), help="comma list of: ring, zmq")
    ap.add_argument("--concurrency", default=None, help="comma list (default 1,8,32,128; --quick: 1,8)")
    ap.add_argument(
        "--null-streams",
        type=int,
        default=None,
        help=f"an extra concurrency level for the null model only (default {TARGET_NULL_STREAMS}; "
        f"--quick: none; 0: none)",
    )
    ap.add_argument(
        "--num-requests",
        default=None,
        help="requests per level: one count for every level, or one per --concurrency level "
        "(default: real max(32, 2 C), null max(128, 4 C); --quick: max(8, C))",
    )
    ap.add_argument("--warmup", type=int, default=None, help="requests before the first level (default 8, quick 2)")
    ap.add_argument("--prompt-tokens", type=int, default=Workload.prompt_tokens)
    ap.add_argument("--output-tokens", type=int, default=Workload.output_tokens)
    ap.add_argument("--temperature", type=float, default=Workload.temperature)
    ap.add_argument("--seed", type=int, default=Workload.seed)
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--model-path", default=None, help="passed to the server; default: the embedded SmolLM2")
    ap.add_argument("--server-args", default="", help="more `python -m runtime serve` flags, one string")
    ap.add_argument("--quick", action="store_true", help="few requests and levels: a smoke run")
    report.add_arguments(ap, "serving")  # the servers' logs go beside it too
    args = ap.parse_args(argv)
    started = report.start(args, argv)
    models, transports = parse_list(args.models), parse_list(args.transports)
    for name, values, allowed in (("--models", models, MODELS), ("--transports", transports, TRANSPORTS)):
        if not values or not set(values) <= set(allowed):
            ap.error(f"{name} must be a comma list of {', '.join(allowed)}, not {','.join(values)!r}")
    try:
        levels = parse_list(args.concurrency or ("1,8" if args.quick else "1,8,32,128"), int)
        counts = parse_list(args.num_requests or "", int)
    except ValueError:
        ap.error(
            f"--concurrency and --num-requests must be comma lists of integers, not "
            f"{args.concurrency!r} and {args.num_requests!r}"
        )
    null_streams = args.null_streams if args.null_streams is not None else (0 if args.quick else TARGET_NULL_STREAMS)
    if len(counts) not in (0, 1, len(levels)):
        ap.error(f"--num-requests needs one count or {len(levels)} (one per --concurrency level), not {len(counts)}")
    for name, value in (
        ("--concurrency", min(levels, default=0)),
        ("--num-requests", min(counts, default=1)),
        ("--output-tokens", args.output_tokens),
        ("--prompt-tokens", args.prompt_tokens),
    ):
        if value < 1:
            ap.error(f"{name} must be at least 1")
    if null_streams < 0:
        ap.error("--null-streams must be at least 0 (0: no extra level)")
    args.request_counts = (
        dict(zip(levels + [null_streams], counts * (len(levels) + 1)))
        if len(counts) == 1
        else dict(zip(levels, counts))
    )
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 8)
    w = Workload(args.prompt_tokens, args.output_tokens, args.temperature, args.seed)

    all_levels = {
        m: levels + ([null_streams] if m == "null" and null_streams and null_streams not in levels else [])
        for m in models
    }
    pairs = [(m, t) for m in models for t in transports]  # each transport gets the same prompts
    server = start_server(*pairs[0], args)  # it starts while the tokenizer loads here
    try:
        n_prompts = max(args.warmup + sum(requests_at(c, m, args) for c in lv) for m, lv in all_levels.items())
        prompts, prompt_lengths = make_prompts(load_tokenizer(args.model_path), n_prompts, w.prompt_tokens, w.seed)
    except BaseException:
        server.stop()
        raise
    loop, loop_name = new_event_loop()
    load_start = os.getloadavg()
    print(
        f"{len(prompts)} prompts of {min(prompt_lengths)}-{max(prompt_lengths)} tokens, {w.output_tokens} output "
        f"tokens, temperature {w.temperature:g}, ignore_eos; client on {loop_name}; load {load_start[0]:.1f}",
        flush=True,
    )
    out = args.out
    result = {
        "command": [Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)],
        "host": platform.node(),
        "cpus": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "client_loop": loop_name,
        "loadavg_start": load_start,
        "loadavg_end": None,
        "thread_env": {k: v for k, v in os.environ.items() if k.startswith(THREAD_ENV)},  # the server inherits it
        "workload": {
            "endpoint": "/v1/chat/completions",
            "stream": True,
            "ignore_eos": True,
            "prompt_tokens_target": w.prompt_tokens,
            "prompt_tokens_mean": float(np.mean(prompt_lengths)),
            "prompt_tokens_min": min(prompt_lengths),
            "prompt_tokens_max": max(prompt_lengths),
            "output_tokens": w.output_tokens,
            "temperature": w.temperature,
            "seed": w.seed,
        },
        "complete": False,
        "targets": {},
        "runs": [],
    }
    runs = result["runs"]
    try:
        for i, (model, transport) in enumerate(pairs):
            if i:
                server = start_server(model, transport, args)
            runs.append(run_server(server, model, transport, all_levels[model], prompts, w, args, loop))
            write_result(out, result, i == len(pairs) - 1, started)  # an interrupted run keeps the servers done
    finally:
        loop.close()
    checks = result["targets"]
    print(table(runs))
    for name, check in checks.items():
        print(
            f"  {name}: {check['value']:.1f} -> {'met' if check['met'] else 'NOT met'}"
            if check["value"] is not None
            else f"  {name}: no value -> NOT met"
        )
    print(
        f"load average {load_start[0]:.1f} at the start, {result['loadavg_end'][0]:.1f} at the end; "
        f"wrote {out} and {out.with_suffix('.md')}"
    )
    leftovers = [
        r
        for r in runs
        if r["leftovers"]["processes"] or r["leftovers"]["shm_segments"] or r["leftovers"]["engine_files"]
    ]
    return 1 if leftovers else 0


if __name__ == "__main__":
    sys.exit(main())
