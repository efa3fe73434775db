"""The ZMQ baseline: the Channel/Waker interface of ipc/channel.py over ZMQ PUSH/PULL
sockets, with the two encodings today's servers use. perf/ measures the rings
against it, and the server runs on it with `--transport zmq`.

- "pickle" (SGLang): one Python object per message holding a list per field and a
  list of Python objects per payload (token ids as lists of ints), pickled.
- "msgpack" (vLLM v1): msgspec msgpack of one array per record (vLLM's array_like
  structs) plus the payload objects.

Both sides convert from and to the same numpy `Batch` a ring channel pops, so
the cost of building those Python objects is part of the measurement, as it is
part of those servers' hot path.

The creating side binds `ipc://<private 0700 temp dir>/<layout>.sock` and removes
the dir on close (a kill -9 of the creator leaves the empty dir behind; this
transport exists only as a baseline). The heartbeat lives in a one-line shared
segment handed over like a ring's, so watchdog code is the same for both.
"""

from __future__ import annotations

import asyncio
import math
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import msgspec
import numpy as np
import zmq

from ipc.channel import ROLES, ChannelSpec
from ipc.memory import Counters
from ipc.ring import Batch, as_bytes, check_max_records, check_records
from ipc.shm import create_segment, map_segment
from protocol.records import LAYOUTS, RecordLayout, fields_of

_HEARTBEAT_BYTES = 64


@dataclass
class ColumnBatch:
    """What the pickle codec sends, shaped like SGLang's BatchTokenIDOut / TokenizedGenerateReqInput."""

    columns: dict[str, list]  # field -> one value per record
    payloads: dict[str, list]  # offset field -> one list[int] (token ids) or bytes per record


def _payload_objects(layout: RecordLayout, records: np.ndarray, blob: np.ndarray) -> dict[str, list]:
    out = {}
    for ref in layout.payloads:
        offs, lens = records[ref.off].tolist(), records[ref.len].tolist()
        if ref.elem == np.uint32:
            out[ref.off] = [np.frombuffer(blob, np.uint32, n // 4, o).tolist() if n else [] for o, n in zip(offs, lens)]
        else:
            out[ref.off] = [blob[o : o + n].tobytes() for o, n in zip(offs, lens)]
    return out


def _batch_from_objects(layout: RecordLayout, records: np.ndarray, payloads: dict[str, list]) -> Batch:
    parts, size = [], 0
    for ref in layout.payloads:
        offs, lens = [], []
        for obj in payloads[ref.off]:
            raw = np.asarray(obj, np.uint32).tobytes() if ref.elem == np.uint32 else obj
            size += -size % 4
            parts.append((size, raw))
            offs.append(size)
            lens.append(len(raw))
            size += len(raw)
        records[ref.off], records[ref.len] = offs, lens
    payload = np.zeros(size, np.uint8)
    for off, raw in parts:
        payload[off : off + len(raw)] = np.frombuffer(raw, np.uint8)
    return Batch(records, payload)


class PickleCodec:
    name = "pickle"

    def encode(self, layout: RecordLayout, records: np.ndarray, blob: np.ndarray) -> bytes:
        columns = {name: records[name].tolist() for name in fields_of(layout.dtype)}
        return pickle.dumps(ColumnBatch(columns, _payload_objects(layout, records, blob)))

    def decode(self, layout: RecordLayout, data: bytes) -> Batch:
        obj: ColumnBatch = pickle.loads(data)
        n = len(next(iter(obj.columns.values())))
        records = np.zeros(n, layout.dtype)
        for name, values in obj.columns.items():
            records[name] = values
        return _batch_from_objects(layout, records, obj.payloads)


class MsgpackCodec:
    name = "msgpack"

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=lambda arr: arr.tolist())  # subarray fields
        self._decoder = msgspec.msgpack.Decoder(tuple[list[tuple], dict[str, list]])

    def encode(self, layout: RecordLayout, records: np.ndarray, blob: np.ndarray) -> bytes:
        return self._encoder.encode((records.tolist(), _payload_objects(layout, records, blob)))

    def decode(self, layout: RecordLayout, data: bytes) -> Batch:
        rows, payloads = self._decoder.decode(data)
        return _batch_from_objects(layout, np.array(rows, layout.dtype), payloads)


CODECS: dict[str, Callable[[], Any]] = {"pickle": PickleCodec, "msgpack": MsgpackCodec}


class ZmqWaker:
    """The ZMQ counterpart of ipc.wakeup.Waker: sockets wake their own pollers, so it holds no fd."""

    fds: tuple[int, ...] = ()

    def __init__(self) -> None:
        # one poller per set of sockets waited on; the entry pins the sockets, so ids are not reused
        self._pollers: dict[tuple[int, ...], tuple[zmq.Poller, tuple[zmq.Socket, ...]]] = {}

    def wait_readable(self, channels: Sequence[ZmqChannel], spin_us: float = 0.0, timeout: float | None = None) -> bool:
        if any(ch.readable() for ch in channels):
            return True
        now = time.perf_counter()
        deadline = math.inf if timeout is None else now + timeout
        if spin_us > 0:
            spin_end = min(deadline, now + spin_us * 1e-6)
            while time.perf_counter() < spin_end:
                if any(ch.readable() for ch in channels):
                    return True
            if spin_end >= deadline:
                return False
        socks = tuple(ch.sock for ch in channels)
        entry = self._pollers.get(tuple(map(id, socks)))
        if entry is None:
            entry = self._pollers[tuple(map(id, socks))] = (zmq.Poller(), socks)
            for sock in socks:
                entry[0].register(sock, zmq.POLLIN)
        poller = entry[0]
        remaining = None if deadline == math.inf else max(0.0, deadline - time.perf_counter())
        poller.poll(None if remaining is None else math.ceil(remaining * 1000))
        return any(ch.readable() for ch in channels)

    def wait_room(self, channel: ZmqChannel, nbytes: int = 0, timeout: float | None = None) -> bool:
        return bool(channel.sock.poll(None if timeout is None else math.ceil(timeout * 1000), zmq.POLLOUT))

    async def wait_readable_async(self, channels: Sequence[ZmqChannel], timeout: float | None = None) -> bool:
        return await self._wait_async(
            [ch.sock for ch in channels], lambda: any(ch.readable() for ch in channels), timeout
        )

    async def wait_room_async(self, channel: ZmqChannel, nbytes: int = 0, timeout: float | None = None) -> bool:
        return await self._wait_async([channel.sock], lambda: channel.room_for(nbytes), timeout)

    @staticmethod
    async def _wait_async(socks: list[zmq.Socket], ready: Callable[[], bool], timeout: float | None) -> bool:
        # ZMQ_FD is edge-triggered: it fires when the socket's events may have changed,
        # so `ready()` (which reads ZMQ_EVENTS) is checked before every sleep
        loop = asyncio.get_running_loop()
        deadline = math.inf if timeout is None else loop.time() + timeout
        while not ready():
            fut = loop.create_future()

            def wake() -> None:
                if not fut.done():
                    fut.set_result(None)

            fds = [sock.fileno() for sock in socks]  # zmq.FD
            for fd in fds:
                loop.add_reader(fd, wake)
            try:
                remaining = None if deadline == math.inf else deadline - loop.time()
                await asyncio.wait_for(fut, remaining)
            except asyncio.TimeoutError:
                return ready()
            finally:
                for fd in fds:
                    loop.remove_reader(fd)
        return True

    def close(self) -> None:
        self._pollers.clear()


class ZmqChannel:
    transport = "zmq"

    def __init__(
        self,
        spec: ChannelSpec,
        role: str,
        waker: ZmqWaker,
        codec: str,
        address: str,
        heartbeat_fd: int,
        private_dir: str | None,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        if codec not in CODECS:
            raise ValueError(f"codec must be one of {sorted(CODECS)}, not {codec!r}")
        self.spec, self.role, self.waker = spec, role, waker
        self.codec_name, self._codec, self.address = codec, CODECS[codec](), address
        self._private_dir = private_dir  # the creator's, removed on close
        self._heartbeat_fd = os.dup(heartbeat_fd)
        self._heartbeat_buf = map_segment(self._heartbeat_fd, _HEARTBEAT_BYTES)
        self._heartbeat = Counters(self._heartbeat_buf, 0, 1)
        self.sock: zmq.Socket = zmq.Context.instance().socket(zmq.PUSH if role == "producer" else zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM if role == "producer" else zmq.RCVHWM, spec.capacity)
        (self.sock.bind if private_dir else self.sock.connect)(address)
        self._pending: Batch | None = None

    @classmethod
    def create(
        cls, spec: ChannelSpec, role: str, waker: ZmqWaker, peer_waker_fd: int | None = None, codec: str = "pickle"
    ) -> ZmqChannel:
        private_dir = tempfile.mkdtemp(prefix="ringserve-zmq-")
        fd, buf = create_segment(_HEARTBEAT_BYTES)
        buf.close()
        try:
            return cls(spec, role, waker, codec, f"ipc://{private_dir}/{spec.layout.name}.sock", fd, private_dir)
        except BaseException:
            shutil.rmtree(private_dir, ignore_errors=True)
            raise
        finally:
            os.close(fd)

    def describe(self) -> tuple[dict, list[int]]:
        if self._private_dir is None:
            raise ValueError("only the process that created a channel can hand it over")
        desc = {
            "transport": self.transport,
            "layout": self.spec.layout.name,
            "capacity": self.spec.capacity,
            "arena_bytes": self.spec.arena_bytes,
            "role": ROLES[1 - ROLES.index(self.role)],
            "codec": self.codec_name,
            "address": self.address,
        }
        return desc, [self._heartbeat_fd]

    @classmethod
    def attach(cls, desc: dict, fds: Sequence[int], waker: ZmqWaker, layout: RecordLayout | None = None) -> ZmqChannel:
        layout = layout or LAYOUTS.get(desc["layout"])
        if layout is None or layout.name != desc["layout"]:
            raise ValueError(f"unknown record layout {desc['layout']!r}")
        spec = ChannelSpec(layout, desc["capacity"], desc["arena_bytes"])
        return cls(spec, desc["role"], waker, desc["codec"], desc["address"], fds[0], None)

    # ---------------------------------------------------------------- producer

    def push(self, records: np.ndarray, payload: np.ndarray | bytes | None = None) -> int:
        """Sends all of `records` as one message (0 if the socket is at its high-water mark)."""
        check_records(records, self.spec.layout)
        if len(records) == 0:
            return 0
        try:
            self.sock.send(self._codec.encode(self.spec.layout, records, as_bytes(payload)), zmq.NOBLOCK)
        except zmq.Again:
            return 0
        return len(records)

    def push_all(
        self, records: np.ndarray, payload: np.ndarray | bytes | None = None, timeout: float | None = None
    ) -> None:
        deadline = math.inf if timeout is None else time.perf_counter() + timeout
        while len(records) and not self.push(records, payload):
            remaining = None if deadline == math.inf else max(0.0, deadline - time.perf_counter())
            if not self.waker.wait_room(self, 0, remaining):
                raise TimeoutError(f"{self.spec.layout.name} channel stayed full for {timeout} s")

    async def push_all_async(
        self, records: np.ndarray, payload: np.ndarray | bytes | None = None, timeout: float | None = None
    ) -> None:
        deadline = math.inf if timeout is None else time.perf_counter() + timeout
        while len(records) and not self.push(records, payload):
            remaining = None if deadline == math.inf else max(0.0, deadline - time.perf_counter())
            if not await self.waker.wait_room_async(self, 0, remaining):
                raise TimeoutError(f"{self.spec.layout.name} channel stayed full for {timeout} s")

    def room_for(self, nbytes: int = 0) -> bool:
        # pyzmq's stub types every option's value int | bytes; EVENTS is an int
        return bool(cast(int, self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLOUT)

    # ---------------------------------------------------------------- consumer

    def pop(self, max_records: int | None = None) -> Batch | None:
        """The records of the next message (at most `max_records`; the rest stay pending)."""
        if max_records is not None:
            check_max_records(max_records)
        batch, self._pending = self._pending, None
        if batch is None:
            try:
                data = self.sock.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return None
            batch = self._codec.decode(self.spec.layout, data)
        if max_records is not None and len(batch) > max_records:
            self._pending = Batch(batch.records[max_records:], batch.payload)
            batch = Batch(batch.records[:max_records], batch.payload)
        return batch

    def readable(self) -> bool:
        # pyzmq's stub types every option's value int | bytes; EVENTS is an int
        return self._pending is not None or bool(cast(int, self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    # ---------------------------------------------------------------- heartbeat

    def beat(self) -> None:
        self._heartbeat.store(0, time.monotonic_ns())

    def heartbeat_ns(self) -> int:
        return self._heartbeat.load(0)

    def close(self) -> None:
        if self.sock.closed:
            return
        self.sock.close(linger=0)
        self._heartbeat.close()
        self._heartbeat_buf.close()
        os.close(self._heartbeat_fd)
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)

    def __enter__(self) -> ZmqChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
