"""The ZMQ baseline is a drop-in for ring channels: same calls, same popped batches."""

from __future__ import annotations

import asyncio
import os
import socket

import numpy as np
import pytest

from ipc import get_transport
from ipc.channel import ChannelSpec
from ipc.handoff import recv_channels, send_channels
from protocol.payloads import pack_top_logprobs, unpack_top_logprobs
from protocol.records import REQUEST, TOKEN_OUT
from protocol.request_records import pack_request, unpack_request
from protocol.sampling_params import SamplingParams


def open_pair(name: str, spec: ChannelSpec):
    """(producer, consumer, wakers) of `name`'s transport, handed over a real unix socket."""
    transport = get_transport(name)
    wp, wc = transport.make_waker(), transport.make_waker()
    peer_fd = os.dup(wc.fds[0]) if wc.fds else None
    prod = transport.create_channel(spec, "producer", wp, peer_fd)
    if peer_fd is not None:
        os.close(peer_fd)
    a, b = socket.socketpair()
    with a, b:
        send_channels(a, [prod])
        (cons,), _ = recv_channels(b, wc)
    return prod, cons, (wp, wc)


def close_all(*things) -> None:
    for thing in things:
        thing.close()


@pytest.mark.parametrize("name", ["ring", "zmq", "zmq-msgpack"])
def test_same_batches_through_every_transport(name: str) -> None:
    prod, cons, wakers = open_pair(name, ChannelSpec(REQUEST, 64, 1 << 20))
    try:
        params = SamplingParams(temperature=0.5, stop=("x", "yz"), stop_token_ids=(2, 3), seed=11).validate()
        prompts = [np.arange(n, dtype=np.uint32) * 3 for n in (1, 1000, 8000)]
        for slot, prompt in enumerate(prompts):
            rec, blob = pack_request(1, slot, 5, params, prompt, 99)
            prod.push_all(rec, blob, timeout=5)
        got = []
        while len(got) < len(prompts):
            assert wakers[1].wait_readable([cons], timeout=5)
            batch = cons.pop()
            got += [unpack_request(r, batch.payload) for r in batch.records]
        for (p, prompt), expect in zip(got, prompts):
            assert p == params and np.array_equal(prompt, expect)
    finally:
        close_all(prod, cons, *wakers)


@pytest.mark.parametrize("name", ["zmq", "zmq-msgpack"])
def test_token_batches_and_split_pops(name: str) -> None:
    prod, cons, wakers = open_pair(name, ChannelSpec(TOKEN_OUT, 64, 1 << 16))
    try:
        recs = np.zeros(256, TOKEN_OUT.dtype)
        recs["token"], recs["slot"], recs["logprob"] = np.arange(256), np.arange(256) * 2, -np.arange(256) / 7
        ids = np.arange(256 * 3).reshape(256, 3)
        blob, offsets = pack_top_logprobs(ids, -ids.astype(np.float32))
        recs["payload_off"], recs["payload_len"], recs["n_top"] = offsets, 24, 3
        prod.push_all(recs, blob, timeout=5)
        assert wakers[1].wait_readable([cons], timeout=5)
        first, rest = cons.pop(max_records=100), cons.pop()
        assert (len(first), len(rest)) == (100, 156) and cons.pop() is None
        for batch, part in ((first, recs[:100]), (rest, recs[100:])):
            for field in ("token", "slot", "logprob", "n_top"):
                assert np.array_equal(batch.records[field], part[field])
            for r, expect in zip(batch.records, part["token"]):
                got_ids, got_vals = unpack_top_logprobs(batch.view(r["payload_off"], r["payload_len"]), 3)
                assert np.array_equal(got_ids, ids[expect]) and np.array_equal(got_vals, -ids[expect])
    finally:
        close_all(prod, cons, *wakers)


@pytest.mark.parametrize("name", ["ring", "zmq"])
def test_waits_time_out_and_wake(name: str) -> None:
    prod, cons, (wp, wc) = open_pair(name, ChannelSpec(TOKEN_OUT, 8, 64))
    try:
        assert not wc.wait_readable([cons], spin_us=100, timeout=0.05)

        async def scenario() -> None:
            assert not await wc.wait_readable_async([cons], timeout=0.05)
            loop = asyncio.get_running_loop()
            loop.call_later(0.05, prod.push, np.zeros(3, TOKEN_OUT.dtype))
            assert await wc.wait_readable_async([cons], timeout=5)
            assert len(cons.pop()) == 3

        asyncio.run(scenario())
        prod.beat()
        assert cons.heartbeat_ns() > 0
    finally:
        close_all(prod, cons, wp, wc)


def test_zmq_back_pressure_and_private_dir() -> None:
    prod, cons, wakers = open_pair("zmq", ChannelSpec(TOKEN_OUT, 1, 0))
    directory = os.path.dirname(prod.address[len("ipc://") :])
    try:
        assert oct(os.stat(directory).st_mode & 0o777) == "0o700"
        recs = np.zeros(200, TOKEN_OUT.dtype)
        sent = 0
        while prod.push(recs):
            sent += 1
            assert sent < 100_000, "the high-water mark never pushed back"
        while cons.pop() is not None or wakers[1].wait_readable([cons], timeout=0.2):
            pass
        assert wakers[0].wait_room(prod, 0, timeout=5) and prod.push(recs) == 200
    finally:
        close_all(prod, cons, *wakers)
    assert not os.path.exists(directory)
