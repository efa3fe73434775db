"""Handing channels between processes that were not forked from each other.

Messages on a unix socket (SOCK_STREAM or SOCK_SEQPACKET): a 4-byte length, a
JSON header, and up to MAX_FDS file descriptors attached with SCM_RIGHTS to the
first byte. Received fds are new descriptors (close-on-exec) owned by the receiver.

The usual exchange, e.g. an HTTP worker (W) connecting to the engine (E):
    W: send_waker(sock, waker, {"worker": k})        hello: W's eventfd
    E: meta, w_fd = recv_waker(sock)
    E: chans = [Channel.create(spec, role, e_waker, w_fd), ...]; send_channels(sock, chans)
    W: chans, meta = recv_channels(sock, waker)      W attaches with the opposite roles
Both sides now hold every fd they need, and the segments have no name left
(ipc/shm.py), so nothing outlives the two processes.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from protocol.records import RecordLayout

MAX_FDS = 64
_LEN = struct.Struct("<I")


def send_message(sock: socket.socket, header: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
    if len(fds) > MAX_FDS:
        raise ValueError(f"at most {MAX_FDS} fds per message, not {len(fds)}")
    body = json.dumps(header).encode()
    frame = _LEN.pack(len(body)) + body
    sent = socket.send_fds(sock, [frame], list(fds)) if fds else sock.send(frame)
    if sent < len(frame):
        sock.sendall(frame[sent:])


def recv_message(sock: socket.socket) -> tuple[dict, list[int]]:
    """The next message: (header, fds). Raises ConnectionError on EOF."""
    data, fds, flags, _ = socket.recv_fds(sock, _LEN.size, MAX_FDS, socket.MSG_CMSG_CLOEXEC)
    try:
        if flags & socket.MSG_CTRUNC:
            raise ConnectionError(f"a message carried more than {MAX_FDS} fds")
        data += _recv_exactly(sock, _LEN.size - len(data))
        (length,) = _LEN.unpack(data)
        return json.loads(_recv_exactly(sock, length)), list(fds)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n > 0:
        chunk = sock.recv(n)
        if not chunk:
            raise ConnectionError("peer closed the handoff socket")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def send_waker(sock: socket.socket, waker: Any, meta: Mapping[str, Any] | None = None) -> None:
    """Hello: this process's waker fd (none for the zmq transport), plus `meta`."""
    send_message(sock, {"meta": dict(meta or {})}, waker.fds)


def recv_waker(sock: socket.socket) -> tuple[dict, int | None]:
    """(meta, peer's waker fd or None); the caller owns and eventually closes the fd."""
    header, fds = recv_message(sock)
    return header["meta"], (fds[0] if fds else None)


def send_channels(sock: socket.socket, channels: Sequence[Any], meta: Mapping[str, Any] | None = None) -> None:
    descs, fds = [], []
    for ch in channels:
        desc, ch_fds = ch.describe()
        descs.append({**desc, "nfds": len(ch_fds)})
        fds.extend(ch_fds)
    send_message(sock, {"channels": descs, "meta": dict(meta or {})}, fds)


def recv_channels(
    sock: socket.socket, waker: Any, layouts: Mapping[str, RecordLayout] | None = None
) -> tuple[list[Any], dict]:
    """Attaches every channel of the next message: (channels, meta). `layouts` by name
    override protocol.records.LAYOUTS (for tests and benchmarks)."""
    from ipc.channel import Channel

    header, fds = recv_message(sock)
    channels: list[Any] = []
    pos = 0
    try:
        for desc in header["channels"]:
            mine = fds[pos : pos + desc["nfds"]]
            pos += desc["nfds"]
            layout = (layouts or {}).get(desc["layout"])
            if desc["transport"] == "ring":
                channels.append(Channel.attach(desc, mine, waker, layout))
            elif desc["transport"] == "zmq":
                from ipc.zmq_transport import ZmqChannel

                channels.append(ZmqChannel.attach(desc, mine, waker, layout))
            else:
                raise ValueError(f"unknown transport {desc['transport']!r}")
    except BaseException:
        for ch in channels:
            ch.close()
        raise
    finally:
        for fd in fds:
            os.close(fd)
    return channels, header["meta"]
