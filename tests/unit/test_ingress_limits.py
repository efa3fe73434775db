"""Ingress bounds, without a server: what one client sends is bounded before the server spends
work on it. Stop strings by count and bytes; a request's payload by what the rings' arenas
carry; its prompt tokens by the KV cache; the caches keyed by client data by bytes; bodies by
size (413) and by time (408) as read_body reads them; granian's connection limits; and a submit
that fails leaves nothing registered. The same bounds against a real server:
test_ingress_limits_server.py."""

from __future__ import annotations

import asyncio
import time

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
    REQUEST_ARENA_BYTES,
    TOKEN_OUT_ARENA_BYTES,
)
from protocol.request_records import MEMO_BYTES, pack_request, unpack_request
from protocol.sampling_params import MAX_STOP_BYTES, MAX_STOP_STRING_BYTES, InvalidParam, SamplingParams

KV_TOKENS = 65536


# ---------------------------------------------------------------- limits and memos


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


# ---------------------------------------------------------------- TokenizerManager


def small_tm(tokenizer, tm_rings):
    from runtime.http_worker.core import ModelInfo, TokenizerManager
    from runtime.http_worker.process import RequestOutbox

    _, req_out, req_in, _, _ = tm_rings
    model = ModelInfo("", "m", "LlamaForCausalLM", 2048, tokenizer.vocab_size)
    return TokenizerManager(0, RequestOutbox(req_out).send, tokenizer, model, request_timeout=60), req_in


def test_failed_submit_leaves_nothing_registered(tokenizer, tm_rings):
    """A submit whose push raises (here: a payload larger than the ring's arena) must not keep
    its rid "already in use" or its slots until the request timeout."""

    async def run() -> None:
        tm, req_in = small_tm(tokenizer, tm_rings)
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


def test_prompt_text_bounded_before_tokenizing(tokenizer, tm_rings):
    async def run() -> None:
        tm, _ = small_tm(tokenizer, tm_rings)
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


# ---------------------------------------------------------------- prompt encoder


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
