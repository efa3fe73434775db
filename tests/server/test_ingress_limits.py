"""Ingress bounds: what one client sends is bounded before the
server spends work on it. Stop strings by count and bytes; a request's payload by what the
rings' arenas carry; its prompt tokens by the KV cache; the caches keyed by client data by
bytes; bodies by size (413) and by time (408); idle connections closed; and a submit that
fails leaves nothing registered. Against a real server (`python -m runtime serve`, the null
model) where it takes one."""

from __future__ import annotations

import asyncio
import resource
import socket
import time
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest

from httpapi.errors import APIError
from httpapi.requests import parse_completion, parse_generate
from httpapi.sampling import check_request_size
from protocol.memo import ENTRY_OVERHEAD_BYTES, ByteLRU
from protocol.records import (
    MAX_OPEN_PAYLOAD_BYTES,
    MAX_REQUEST_PAYLOAD_BYTES,
    REQUEST,
    REQUEST_ARENA_BYTES,
    TEXT_OUT,
    TOKEN_OUT_ARENA_BYTES,
)
from protocol.request_records import MEMO_BYTES, pack_request, unpack_request
from protocol.sampling_params import MAX_STOP_BYTES, MAX_STOP_STRING_BYTES, InvalidParam, SamplingParams

BODY_READ_TIMEOUT_S = 3
KV_TOKENS = 65536


# ---------------------------------------------------------------- unit: limits and memos


def test_stop_strings_bounded_by_bytes_each_and_in_all():
    SamplingParams(stop=("x" * MAX_STOP_STRING_BYTES, "y" * (MAX_STOP_BYTES - MAX_STOP_STRING_BYTES))).validate()
    for stop in (
        ("x" * (MAX_STOP_STRING_BYTES + 1),),
        ("é" * (MAX_STOP_STRING_BYTES // 2 + 1),),  # bytes, not characters
        ("x" * MAX_STOP_STRING_BYTES,) * (MAX_STOP_BYTES // MAX_STOP_STRING_BYTES + 1),
        ("x" * 4500,) * 16,  # 16 strings of 4500 bytes: 72 KB in one request
    ):
        with pytest.raises(InvalidParam) as e:
            SamplingParams(stop=stop).validate()
        assert e.value.param == "stop"


def test_a_72kb_stop_request_is_refused_at_parse_naming_stop():
    body = orjson.dumps({"prompt": "hi", "n": 128, "stop": ["s" * 4500 + str(i) for i in range(16)]})
    with pytest.raises(APIError) as e:
        parse_completion(body)
    assert (e.value.status, e.value.param) == (400, "stop")
    body = orjson.dumps({"text": "hi", "sampling_params": {"stop": ["s" * 9000]}})
    with pytest.raises(APIError) as e:
        parse_generate(body)
    assert e.value.param == "sampling_params.stop"


def test_the_rings_carry_what_one_request_may_hold():
    """The arena sizes protocol/ bounds requests by are the rings' own, and the largest request
    the limits let through fits its share of them."""
    from protocol.sampling_params import MAX_STOP_STRINGS
    from runtime.detokenizer.process import TOKEN_OUT_SPEC
    from runtime.scheduler.process import REQUEST_SPEC

    assert REQUEST_SPEC.arena_bytes == REQUEST_ARENA_BYTES
    assert TOKEN_OUT_SPEC.arena_bytes == TOKEN_OUT_ARENA_BYTES
    from httpapi.request_fields import MAX_CHOICES

    largest_stops = 4 + 4 * MAX_STOP_STRINGS + MAX_STOP_BYTES
    assert MAX_CHOICES * largest_stops <= MAX_OPEN_PAYLOAD_BYTES < TOKEN_OUT_ARENA_BYTES // 2
    assert MAX_REQUEST_PAYLOAD_BYTES < REQUEST_ARENA_BYTES // 2


def test_byte_lru_is_bounded_by_bytes_and_bypassed_by_big_entries():
    memo = ByteLRU(max_bytes=100_000, max_entries=1000, max_entry_bytes=20_000)
    for i in range(200):
        assert memo.put(i, str(i), 9_000)
        assert memo.bytes <= 100_000
    assert len(memo) == 100_000 // (9_000 + ENTRY_OVERHEAD_BYTES)
    assert memo.get(199) == "199" and memo.get(0) is None
    assert memo.get(191) == "191"  # the oldest, now used: kept over the others
    for i in range(200, 205):
        memo.put(i, i, 9_000)
    assert memo.get(191) == "191" and memo.get(192) is None
    assert not memo.put("big", "x", 20_000)  # more than an entry may take: not kept
    assert memo.get("big") is None
    assert ByteLRU(max_bytes=1 << 20).max_entry_bytes == (1 << 20) // 16
    small = ByteLRU(max_bytes=1 << 20, max_entries=3)
    for i in range(10):
        small.put(i, i, 0)
    assert len(small) == 3


def big_stops(i: int) -> list[str]:
    """Stop strings as large as a request may send, distinct for each i."""
    each = MAX_STOP_BYTES // 4
    return [f"{i:08d}{j}" + "s" * (each - 9) for j in range(4)]


def test_sampling_memos_are_bounded_by_bytes():
    """The memos keyed by what clients send (SamplingSpec.build's, pack_request's and
    unpack_request's) keep at most MEMO_BYTES each, however many distinct stop strings come."""
    from httpapi import sampling
    from protocol import request_records

    specs = []
    for i in range(2000):
        spec = parse_completion(orjson.dumps({"prompt": "hi", "stop": big_stops(i)})).sampling
        specs.append(spec)
        rec, blob = pack_request(0, 0, 1, spec.params, [1, 2, 3], 0)
        params, _ = unpack_request(rec[0], np.frombuffer(blob, np.uint8))
        assert params.stop == spec.params.stop
    for memo in (sampling._SPECS, request_records._PACKED, request_records._PARAMS):
        assert isinstance(memo, ByteLRU)
        assert 0 < memo.bytes <= MEMO_BYTES and len(memo) < 2000
    # the same settings again: the same objects (the memos still serve their purpose)
    again = parse_completion(orjson.dumps({"prompt": "hi", "stop": big_stops(1999)})).sampling
    assert again is specs[-1]


def test_request_size_names_n_or_the_prompt():
    params = [SamplingParams()]
    check_request_size([1000], params, 64, "prompt", max_tokens=KV_TOKENS)
    with pytest.raises(APIError) as e:
        check_request_size([1000], params, 128, "prompt", max_tokens=KV_TOKENS)
    assert (e.value.status, e.value.param) == (400, "n")
    with pytest.raises(APIError) as e:  # one choice of each prompt is too much already
        check_request_size([600] * 128, params * 128, 1, "prompt", max_tokens=KV_TOKENS)
    assert e.value.param == "prompt"
    tokens = MAX_REQUEST_PAYLOAD_BYTES // 4  # past the REQUEST ring's share, whatever the KV cache
    with pytest.raises(APIError) as e:
        check_request_size([tokens // 2], params, 4, "text", "sampling_params.n", max_tokens=None)
    assert e.value.param == "sampling_params.n"
    stops = [SamplingParams(stop=tuple(big_stops(0)))]
    check_request_size([10], stops, 128, "prompt", max_tokens=KV_TOKENS)  # the largest that parses fits
    with pytest.raises(APIError) as e:  # stop strings past what the parser lets through
        check_request_size([10], [SamplingParams(stop=("s" * (MAX_REQUEST_PAYLOAD_BYTES // 2),))], 3, "prompt")
    assert e.value.param == "n"
    with pytest.raises(APIError) as e:
        check_request_size([10], [SamplingParams(stop=("s" * MAX_REQUEST_PAYLOAD_BYTES,))], 1, "prompt")
    assert e.value.param == "stop"


# ---------------------------------------------------------------- unit: TokenizerManager


def small_tm(tokenizer, made: list):
    from ipc.channel import Channel, ChannelSpec
    from ipc.wakeup import Waker
    from runtime.http_worker.core import ModelInfo, TokenizerManager
    from runtime.http_worker.process import RequestOutbox

    tm_waker, engine_waker = Waker(), Waker()
    req = Channel.create(ChannelSpec(REQUEST, 64, 1 << 16), "producer", tm_waker, engine_waker.fd)
    req_in = Channel.attach(*req.describe(), engine_waker)
    text = Channel.create(ChannelSpec(TEXT_OUT, 64, 1 << 16), "producer", engine_waker, tm_waker.fd)
    text_in = Channel.attach(*text.describe(), tm_waker)
    made += [req, req_in, text, text_in, tm_waker, engine_waker]
    model = ModelInfo("", "m", "LlamaForCausalLM", 2048, tokenizer.vocab_size)
    return TokenizerManager(0, RequestOutbox(req).send, tokenizer, model, request_timeout=60), req_in


def test_failed_submit_leaves_nothing_registered(tokenizer):
    """A submit whose push raises (here: a payload larger than the ring's arena) must not keep
    its rid "already in use" or its slots until the request timeout."""
    made: list = []
    try:

        async def run() -> None:
            tm, req_in = small_tm(tokenizer, made)
            try:
                free = len(tm._free)
                too_big = [list(range(1, 40_000))]  # 160 KB of ids: more than the 64 KiB arena
                with pytest.raises(ValueError):
                    await tm.submit(too_big * 2, [SamplingParams()] * 2, ["my-rid"])
                assert len(tm._free) == free and not tm._groups and not tm._by_rid
                assert not tm._gens.any() and all(s is None for s in tm._states)
                group = await tm.submit([[1, 2, 3]], [SamplingParams()], ["my-rid"])  # the rid is free
                assert req_in.pop().records["kind"].tolist() == [1]
                assert tm.abort_rid("my-rid") == 1 and group.unfinished == 0
            finally:
                tm.close()

        asyncio.run(run())
    finally:
        for thing in made:
            thing.close()


def test_prompt_text_bounded_before_tokenizing(tokenizer):
    made: list = []
    try:

        async def run() -> None:
            tm, _ = small_tm(tokenizer, made)
            assert tm.max_prompt_chars >= 2048 * 81  # SmolLM2's longest token: 81 characters
            text = "a" * (tm.max_prompt_chars + 1)
            t0 = time.perf_counter()
            with pytest.raises(APIError) as e:
                await tm.chat_ids([{"role": "user", "content": text}])
            assert (e.value.param, e.value.code) == ("messages", "context_length_exceeded")
            with pytest.raises(APIError) as e:  # more messages than the context has tokens
                await tm.chat_ids([{"role": "user", "content": ""}] * 2049)
            assert e.value.param == "messages"
            assert time.perf_counter() - t0 < 0.5  # nothing was rendered or tokenized

        asyncio.run(run())
    finally:
        for thing in made:
            thing.close()


def test_serve_gives_granian_connection_limits():
    from runtime.__main__ import granian_command
    from runtime.config import ServerArgs

    argv = granian_command(ServerArgs(body_read_timeout=5))
    flags = dict(zip(argv, argv[1:]))
    assert flags["--http"] == "1"  # auto-detecting HTTP/2 waits for a first byte with no timeout
    assert flags["--http1-header-read-timeout"] == "5000"
    assert int(flags["--backpressure"]) > 2048
    args = ServerArgs.from_env({"RINGSERVE_MAX_REQUEST_BYTES": "2048", "RINGSERVE_BODY_READ_TIMEOUT": "1.5"})
    assert (args.max_request_bytes, args.body_read_timeout) == (2048, 1.5)
    for bad in ({"max_request_bytes": 10}, {"body_read_timeout": 0}):
        with pytest.raises(ValueError):
            ServerArgs(**bad)


class FakeRequest:
    """What read_body uses of a starlette Request: headers, the worker's arguments, receive()."""

    def __init__(self, messages: list[dict], delay: float = 0.0, headers: list | None = None, **args) -> None:
        from types import SimpleNamespace

        from runtime.config import ServerArgs
        from runtime.http_worker.asgi import BodyReads

        self.scope = {"headers": headers or []}
        self.app = SimpleNamespace(worker=SimpleNamespace(args=ServerArgs(**args)), body_reads=BodyReads())
        self.messages, self.delay, self.received = list(messages), delay, 0

    async def receive(self) -> dict:
        self.received += 1
        await asyncio.sleep(self.delay)
        return self.messages.pop(0) if self.messages else {"type": "http.request", "body": b"x", "more_body": True}


def test_read_body_bounds_size_and_time():
    from runtime.http_worker.asgi import read_body

    async def status(request: FakeRequest) -> int | bytes:
        try:
            return await read_body(request)
        except APIError as e:
            return e.status

    def run(request: FakeRequest) -> int | bytes:
        return asyncio.run(status(request))

    whole = [{"type": "http.request", "body": b"ab", "more_body": True}, {"type": "http.request", "body": b"c"}]
    assert run(FakeRequest(whole)) == b"abc"
    told = FakeRequest(whole, headers=[(b"content-length", b"5000")], max_request_bytes=4096)
    assert run(told) == 413 and told.received == 0  # refused before reading any of it
    chunked = [{"type": "http.request", "body": b"y" * 3000, "more_body": True}] * 2
    assert run(FakeRequest(chunked, max_request_bytes=4096)) == 413
    t0 = time.monotonic()
    trickle = FakeRequest([], delay=0.05, body_read_timeout=0.3)  # a byte every 50 ms, for ever
    assert run(trickle) == 408
    assert 0.3 <= time.monotonic() - t0 < 1.0 and trickle.received >= 5
    assert not trickle.app.body_reads.reading
    assert run(FakeRequest([], delay=10, body_read_timeout=0.2)) == 408  # nothing at all


# ---------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def server(start_server):
    raise_open_files_limit(4096)
    return start_server(
        start_server.Server.serve,
        "--null-model",
        "--log-level",
        "warning",
        "--max-total-tokens",
        str(KV_TOKENS),
        "--body-read-timeout",
        str(BODY_READ_TIMEOUT_S),
    )


def raise_open_files_limit(want: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < want:
        pytest.skip(f"needs {want} open files")


def post(server, path: str, body: dict | bytes, timeout: float = 60) -> httpx.Response:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    return httpx.post(server.url(path), content=content, headers={"content-type": "application/json"}, timeout=timeout)


def error_of(response: httpx.Response) -> dict:
    return response.json()["error"]


def normal_request_works(server) -> None:
    r = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_the_72kb_request_is_refused_and_the_server_serves_on(server):
    body = {"prompt": "Hello", "n": 128, "max_tokens": 4, "stop": ["s" * 4500 + str(i) for i in range(16)]}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400 and error_of(r)["param"] == "stop", r.text
    normal_request_works(server)
    # the largest stop strings the limits let through, on every one of 128 choices: served
    body = {"prompt": "Hello", "n": 128, "max_tokens": 4, "stop": big_stops(7)}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 128
    normal_request_works(server)


def vm_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_big_stop_requests_leave_the_worker_rss_bounded(server):
    """24 requests with 8 MB of stop strings each are refused, and neither the HTTP worker nor
    the scheduler keeps them (before the bounds: worker 454 -> 847 MB, scheduler 423 -> 779 MB)."""
    server.refresh()
    (worker,) = server.workers
    normal_request_works(server)
    before = {pid: vm_rss_mb(pid) for pid in (worker, server.engine["scheduler"])}
    for i in range(24):
        stops = [f"{i:04d}{j:02d}" + "z" * 499_994 for j in range(16)]
        r = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "stop": stops})
        assert r.status_code == 400 and error_of(r)["param"] == "stop", r.text
    normal_request_works(server)
    grown = {pid: vm_rss_mb(pid) - mb for pid, mb in before.items()}
    assert max(grown.values()) < 100, f"grown (MB): {grown}"


def test_amplified_prompts_are_refused_naming_n_or_prompt(server):
    ids = list(range(10, 1010))  # 1000 tokens; 128 of them are past the 65536-token KV cache
    r = post(server, "/v1/completions", {"prompt": ids, "n": 128, "max_tokens": 1})
    assert r.status_code == 400 and error_of(r)["param"] == "n", r.text
    r = post(server, "/v1/completions", {"prompt": [ids] * 100, "max_tokens": 1})
    assert r.status_code == 400 and error_of(r)["param"] == "prompt", r.text
    r = post(server, "/generate", {"input_ids": ids, "sampling_params": {"n": 100, "max_new_tokens": 1}})
    assert r.status_code == 400 and error_of(r)["param"] == "sampling_params.n", r.text
    r = post(server, "/v1/completions", {"prompt": ids, "n": 8, "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_huge_prompt_text_is_refused_before_tokenizing(server):
    t0 = time.monotonic()
    r = post(server, "/v1/completions", {"prompt": "word " * 1_500_000, "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert error_of(r)["code"] == "context_length_exceeded" and "characters" in error_of(r)["message"]
    assert time.monotonic() - t0 < 5


def test_too_big_body_is_413_before_it_is_read(server):
    big = b'{"prompt": "' + b"x" * (8 << 20) + b'"}'
    r = post(server, "/v1/completions", big)
    assert r.status_code == 413, r.text
    assert error_of(r)["code"] == "request_too_large"

    def chunks():
        yield b'{"prompt": "'
        for _ in range(9):
            yield b"y" * (1 << 20)
        yield b'"}'

    r = httpx.post(server.url("/v1/completions"), content=chunks(), timeout=60)  # chunked: no Content-Length
    assert r.status_code == 413, r.text
    # a Content-Length over the limit is answered before the body is sent
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100000000\r\n\r\n")
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 413"), head
    normal_request_works(server)


async def slow_body(port: int, results: list, stop: asyncio.Event) -> None:
    """A POST that announces 100000 bytes and sends one every second."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n")
    t0 = time.monotonic()
    try:
        while not stop.is_set():
            writer.write(b" ")
            await writer.drain()
            try:
                head = await asyncio.wait_for(reader.read(64), 1.0)
            except asyncio.TimeoutError:
                continue
            results.append((head[:12], time.monotonic() - t0))
            return
        results.append((b"still open", time.monotonic() - t0))
    except OSError:
        results.append((b"reset", time.monotonic() - t0))
    finally:
        writer.close()


def test_slow_bodies_do_not_block_health(server):
    """1100 clients that trickle their bodies (more than granian's default backpressure of
    1024 a worker: /health once timed out for 75 s under them) get a 408 after the body read
    timeout, and /health and /v1/models answer at once meanwhile."""

    async def run() -> tuple[list, float]:
        stop, results = asyncio.Event(), []
        tasks = [asyncio.create_task(slow_body(server.port, results, stop)) for _ in range(1100)]
        worst = 0.0
        async with httpx.AsyncClient() as client:
            t_end = time.monotonic() + BODY_READ_TIMEOUT_S + 4
            await asyncio.sleep(0.5)
            while time.monotonic() < t_end:
                t0 = time.monotonic()
                for path in ("/health", "/v1/models"):
                    r = await client.get(server.url(path), timeout=30)
                    assert r.status_code == 200
                worst = max(worst, time.monotonic() - t0)
                await asyncio.sleep(0.25)
        stop.set()
        await asyncio.gather(*tasks)
        return results, worst

    results, worst = asyncio.run(run())
    assert worst < 2.0, f"/health and /v1/models took {worst:.1f} s"
    heads = [head for head, _ in results]
    assert heads.count(b"HTTP/1.1 408") > 1000, sorted(set(heads))
    assert max(t for head, t in results if head == b"HTTP/1.1 408") < BODY_READ_TIMEOUT_S + 3
    normal_request_works(server)


def test_idle_connections_are_closed(server):
    """Connections that never send a byte are closed after the header read timeout."""

    async def idle(results: list) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        t0 = time.monotonic()
        try:
            data = await asyncio.wait_for(reader.read(64), BODY_READ_TIMEOUT_S + 5)
            results.append(("closed" if not data else "data", time.monotonic() - t0))
        except asyncio.TimeoutError:
            results.append(("open", time.monotonic() - t0))
        except OSError:
            results.append(("closed", time.monotonic() - t0))
        finally:
            writer.close()

    async def run() -> list:
        results: list = []
        await asyncio.gather(*(idle(results) for _ in range(50)))
        return results

    results = asyncio.run(run())
    assert [what for what, _ in results] == ["closed"] * 50, results[:3]


def engine_state(server) -> dict:
    return httpx.get(server.url("/get_server_info"), timeout=10).json()["internal_states"][0]


def test_a_client_that_leaves_a_multi_prompt_request_has_its_work_aborted(server):
    """A non-streamed request of several prompts is watched like any other: its client leaving
    aborts every choice within the watch's delay (about a second), not at their ends."""
    body = {"prompt": [[10 + i] * 8 for i in range(4)], "n": 32, "max_tokens": 8000, "ignore_eos": True}
    asked = 128 * 8000  # more than the KV cache holds at once: at least 16 rounds of 8000 steps
    start = engine_state(server)["generated_tokens"]
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/completions", body, timeout=0.5)
    left = time.monotonic()
    assert server.wait_until(lambda: engine_state(server)["running"] + engine_state(server)["queued"] == 0, 10)
    stopped = time.monotonic() - left
    generated = engine_state(server)["generated_tokens"] - start
    assert generated < asked / 2, f"{generated} of {asked} tokens generated: the work ran to its end"
    assert stopped < 3, f"the work stopped {stopped:.1f} s after the client left"


def test_prompt_encoder_piece_cache_is_bounded_by_bytes(tokenizer, monkeypatch):
    """The prompt encoder's cache of pieces (words of the clients' text, up to 256 characters
    each) is cleared by the bytes it holds, not only by its count of pieces."""
    from runtime.http_worker import prompt_encoder

    monkeypatch.setattr(prompt_encoder, "PIECE_CACHE_BYTES", 64 << 10, raising=False)
    encoder = prompt_encoder.PromptEncoder(tokenizer)
    assert encoder.fast
    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)
    for _ in range(40):
        words = [rng.choice(letters, 200).tobytes().decode() for _ in range(50)]  # 50 distinct 200-letter pieces
        text = " ".join(words)
        assert encoder.encode(text) == tokenizer.encode(text)
    assert len(encoder._pieces) * 200 <= 64 << 10
