"""Shared-memory rings between ringserve's processes, and the ZMQ baseline with the same API.

One channel per direction and per pair of processes, single producer and single
consumer; many producers mean many channels, never a lock.

    protocol.records      record layouts of every channel (REQUEST, TOKEN_OUT, TEXT_OUT), addressing
                     (worker, slot, gen) and live_mask() for stale generations, payload helpers
    ipc.channel      Channel: ring + payload arena + wakeups; ChannelSpec(layout, capacity, arena_bytes)
    ipc.wakeup       Waker: this process's eventfd; sync and asyncio waits on several channels
    ipc.handoff      send/recv of channels and wakers over a unix socket (SCM_RIGHTS)
    ipc.ring         the segment layout and the Python data path (the protocol: docs/architecture.md)
    ipc.native       the C data path (ipc/ring_core.c), built on first use; the default
    ipc.arena        the payload byte ring
    ipc.memory       counters and barriers per CPU (x86-64 TSO / weakly ordered)
    ipc.shm          segments that never outlive their processes (0600, unlinked at once)
    ipc.zmq_transport  ZmqChannel / ZmqWaker: the baseline, pickle (SGLang) or msgpack (vLLM)

Producer:
    n = ch.push(records, blob)           # publishes the longest prefix that fits; 0 when full
    ch.push_all(records, blob, timeout)  # sleeps on its waker while full (back-pressure, no drop)
    await ch.push_all_async(records, blob)
Consumer:
    batch = ch.pop(max_records=None)     # Batch(records, payload) | None; one copy each
    ids = batch.view(r["prompt_off"], r["prompt_len"], np.uint32)
    waker.wait_readable([ch1, ch2], spin_us=50, timeout=1.0)   # sync loops, several channels
    await waker.wait_readable_async([ch])                      # asyncio, loop.add_reader(eventfd)
Both:
    ch.beat(); ch.heartbeat_ns()         # the loop owner stamps, the watchdog reads
    ch.close()

Setting up a pair (see ipc.handoff): the attaching process sends its waker
(`send_waker`), the creating process creates the channels with the peer's waker
fd and sends them (`send_channels`), the peer attaches (`recv_channels`).
`get_transport("ring" | "zmq" | "zmq-msgpack")` gives the Waker and channel
constructor of each transport so the server code is the same for all three.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from ipc.channel import Channel, ChannelSpec
from ipc.ring import Batch
from ipc.wakeup import Waker

TRANSPORTS = ("ring", "zmq", "zmq-msgpack")


@dataclass(frozen=True)
class Transport:
    name: str
    make_waker: Callable[[], Any]
    # (spec, role, waker, peer_waker_fd) -> channel; peer_waker_fd is None for zmq
    create_channel: Callable[..., Any]


def get_transport(name: str) -> Transport:
    if name == "ring":
        return Transport(name, Waker, Channel.create)
    if name in ("zmq", "zmq-msgpack"):
        from ipc.zmq_transport import ZmqChannel, ZmqWaker

        codec = "pickle" if name == "zmq" else "msgpack"
        return Transport(name, ZmqWaker, partial(ZmqChannel.create, codec=codec))
    raise ValueError(f"transport must be one of {list(TRANSPORTS)}, not {name!r}")


__all__ = ["Batch", "Channel", "ChannelSpec", "Transport", "TRANSPORTS", "Waker", "get_transport"]
