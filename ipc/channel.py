"""A channel: one direction between two processes = ring + payload arena + both wakers.

    producer                                   consumer
    ch.push(records, blob) -> n pushed         batch = ch.pop()  -> Batch | None
    ch.push_all(records, blob, timeout)        waker.wait_readable([ch, ...], spin_us, timeout)
    await ch.push_all_async(records, blob)     await waker.wait_readable_async([ch, ...])
    split_payload(records, blob, layout, limit) -> [(records, blob), ...], each blob <= limit

A push's blob must fit the arena: `max_push_bytes` (half the arena: a blob of up to half
always finds room once the consumer has read everything, ipc/arena.py places a blob whole
and never across the end, so a larger one may never find room, wherever the tail stands).
`push_all` and `push_all_async` split a bigger blob into pushes of at most that many bytes
(`split_payload`: each piece's records with their payloads gathered into a blob of their
own, offsets re-based), checking first that every record's own payload fits
(`PayloadTooLarge`, before anything is pushed); a producer that must fail such a record
instead of raising checks `payload_sizes` first. The common case costs one length check.

The process that creates a channel needs the peer's waker fd first (the peer sends
it in its hello, ipc/handoff.py); `describe()` then gives what the peer needs to
attach: a JSON-able dict and [segment fd, creator's waker fd], sent with SCM_RIGHTS.
Channels dup the fds they are given; callers keep ownership of their own.
"""

from __future__ import annotations

import math
import mmap
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ipc.arena import ALIGN
from ipc.ring import Batch, as_bytes, open_ring, segment_size
from ipc.shm import create_segment, map_segment
from ipc.wakeup import SleepFlag, Waker
from protocol.records import LAYOUTS, RecordLayout

ROLES = ("producer", "consumer")


class PayloadTooLarge(ValueError):
    """A record whose own payload can never fit the channel's arena (`index`: its place in the push)."""

    def __init__(self, layout: RecordLayout, index: int, nbytes: int, limit: int) -> None:
        super().__init__(
            f"{layout.name} record {index}: its payload of {nbytes} bytes can never fit a push "
            f"(at most {limit} bytes on this channel)"
        )
        self.index, self.nbytes, self.limit = index, nbytes, limit


def payload_sizes(records: np.ndarray, layout: RecordLayout) -> np.ndarray:
    """int64 [n]: the bytes each record's payloads take in a blob of its own (each span 8-aligned)."""
    size = np.zeros(len(records), np.int64)
    for ref in layout.payloads:
        size += (records[ref.len].astype(np.int64) + (ALIGN - 1)) & ~(ALIGN - 1)
    return size


def split_payload(
    records: np.ndarray, payload: np.ndarray | bytes | None, layout: RecordLayout, limit: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """`records` (offsets into `payload`) as consecutive pieces, in order, each with a blob of
    its own of at most `limit` bytes holding just its records' payloads (every span 8-byte
    aligned, so uint32 / float32 parts stay aligned), the records' offsets re-based into it.
    Raises PayloadTooLarge if one record's payloads alone exceed `limit`."""
    blob = as_bytes(payload)
    sizes = payload_sizes(records, layout)
    big = np.flatnonzero(sizes > limit)
    if len(big):
        raise PayloadTooLarge(layout, int(big[0]), int(sizes[big[0]]), limit)
    records = records.copy()
    cum = np.cumsum(sizes)
    pieces, start, n = [], 0, len(records)
    while start < n:
        base = int(cum[start - 1]) if start else 0
        end = max(int(np.searchsorted(cum, base + limit, "right")), start + 1)
        pieces.append(_gathered(records[start:end], blob, layout))
        start = end
    return pieces


def _remaining(deadline: float) -> float | None:
    """Seconds left until `deadline` (perf_counter), None for no deadline."""
    return None if deadline == math.inf else max(0.0, deadline - time.perf_counter())


def _gathered(records: np.ndarray, blob: np.ndarray, layout: RecordLayout) -> tuple[np.ndarray, np.ndarray]:
    """(records, a blob of just their payloads); `records` (a copy) is re-based in place."""
    offs, lens = [], []
    for ref in layout.payloads:
        offs.append(records[ref.off].astype(np.int64))
        lens.append(records[ref.len].astype(np.int64))
    off, length = np.concatenate(offs), np.concatenate(lens)
    padded = (length + (ALIGN - 1)) & ~(ALIGN - 1)
    new = np.cumsum(padded) - padded  # where each span starts in the new blob
    out = np.zeros(int(padded.sum()), np.uint8)
    total = int(length.sum())
    if total:
        src = np.repeat(off - np.cumsum(length) + length, length) + np.arange(total)
        dst = np.repeat(new - np.cumsum(length) + length, length) + np.arange(total)
        out[dst] = blob[src]
    n = len(records)
    for k, ref in enumerate(layout.payloads):
        records[ref.off] = np.where(lens[k] > 0, new[k * n : (k + 1) * n], 0)
    return records, out


@dataclass(frozen=True)
class ChannelSpec:
    layout: RecordLayout
    capacity: int  # records
    arena_bytes: int = 0  # payload arena; 0 for channels whose records carry no payload

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity must be at least 1 record, not {self.capacity}")
        if self.arena_bytes < 0 or self.arena_bytes % 8:
            raise ValueError(f"arena_bytes must be a non-negative multiple of 8, not {self.arena_bytes}")


class Channel:
    transport = "ring"

    def __init__(
        self,
        spec: ChannelSpec,
        role: str,
        waker: Waker,
        buf: mmap.mmap,
        segment_fd: int | None,
        peer_waker_fd: int,
        *,
        initialise: bool,
        native: bool | None = None,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        self.spec, self.role, self.waker = spec, role, waker
        self._buf = buf
        self._peer_fd = os.dup(peer_waker_fd)
        try:
            self._ring = open_ring(
                buf,
                spec.layout,
                spec.capacity,
                spec.arena_bytes,
                initialise=initialise,
                peer_fd=self._peer_fd,
                native=native,
            )
        except BaseException:
            os.close(self._peer_fd)
            raise
        self._segment_fd = segment_fd  # kept by the creator, to hand over
        # the largest blob one push may carry (see the module docstring); None: no payloads
        self.max_push_bytes = spec.arena_bytes // 2 - ALIGN if spec.arena_bytes else None
        self.sleep_flag = SleepFlag(
            self._ring.set_producer_waiting if role == "producer" else self._ring.set_consumer_sleeping
        )
        # this side's hot calls go straight to the ring: a Python frame costs more than the C
        # operation itself, more still with cold caches; the methods below remain to refuse the
        # other side's calls
        if role == "producer":
            self.push = self._ring.push
        else:
            self.pop, self.readable = self._ring.pop, self._ring.readable

    @classmethod
    def create(
        cls, spec: ChannelSpec, role: str, waker: Waker, peer_waker_fd: int, *, native: bool | None = None
    ) -> Channel:
        """A new channel in a fresh segment; this process is `role` ("producer"/"consumer").
        `native`: the C data path (True), the Python one (False), whichever is available (None)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        fd, buf = create_segment(segment_size(spec.layout, spec.capacity, spec.arena_bytes))
        try:
            return cls(spec, role, waker, buf, fd, peer_waker_fd, initialise=True, native=native)
        except BaseException:
            buf.close()
            os.close(fd)
            raise

    def describe(self) -> tuple[dict, list[int]]:
        """What the peer passes to `attach`: (JSON-able dict, fds to send with SCM_RIGHTS)."""
        if self._segment_fd is None:
            raise ValueError("only the process that created a channel can hand it over")
        peer_role = ROLES[1 - ROLES.index(self.role)]
        desc = {
            "transport": self.transport,
            "layout": self.spec.layout.name,
            "capacity": self.spec.capacity,
            "arena_bytes": self.spec.arena_bytes,
            "role": peer_role,
        }
        return desc, [self._segment_fd, *self.waker.fds]

    @classmethod
    def attach(
        cls,
        desc: dict,
        fds: Sequence[int],
        waker: Waker,
        layout: RecordLayout | None = None,
        *,
        native: bool | None = None,
    ) -> Channel:
        """The peer's side of a described channel. `layout` is looked up by name in
        protocol.records.LAYOUTS unless given (tests and benchmarks use their own)."""
        layout = layout or LAYOUTS.get(desc["layout"])
        if layout is None or layout.name != desc["layout"]:
            raise ValueError(f"unknown record layout {desc['layout']!r}")
        if len(fds) != 2:
            raise ValueError(f"a ring channel is handed over with 2 fds, got {len(fds)}")
        spec = ChannelSpec(layout, desc["capacity"], desc["arena_bytes"])
        segment_fd, peer_waker_fd = fds
        buf = map_segment(segment_fd, segment_size(layout, spec.capacity, spec.arena_bytes))
        try:
            return cls(spec, desc["role"], waker, buf, None, peer_waker_fd, initialise=False, native=native)
        except BaseException:
            buf.close()
            raise

    # ---------------------------------------------------------------- producer

    def push(self, records: np.ndarray, payload: np.ndarray | bytes | None = None) -> int:
        """Publishes the longest prefix of `records` that fits (all sharing the one
        `payload` blob their `*_off` fields point into); returns how many, 0 if full."""
        if self.role != "producer":
            raise ValueError(f"push: this process is the consumer of the {self.spec.layout.name} channel")
        return self._ring.push(records, payload)  # wakes the consumer if it announced sleep

    def push_all(
        self, records: np.ndarray, payload: np.ndarray | bytes | None = None, timeout: float | None = None
    ) -> None:
        """Pushes every record, sleeping on this process's waker while the channel is full; a
        blob over max_push_bytes goes in several pushes (split_payload)."""
        deadline = math.inf if timeout is None else time.perf_counter() + timeout
        for recs, blob in self._pushes(records, payload):
            done = self.push(recs, blob)
            while done < len(recs):
                if not self.waker.wait_room(self, blob.size, _remaining(deadline)):
                    raise TimeoutError(f"{self.spec.layout.name} channel stayed full for {timeout} s")
                done += self.push(recs[done:], blob)

    async def push_all_async(
        self, records: np.ndarray, payload: np.ndarray | bytes | None = None, timeout: float | None = None
    ) -> None:
        deadline = math.inf if timeout is None else time.perf_counter() + timeout
        for recs, blob in self._pushes(records, payload):
            done = self.push(recs, blob)
            while done < len(recs):
                if not await self.waker.wait_room_async(self, blob.size, _remaining(deadline)):
                    raise TimeoutError(f"{self.spec.layout.name} channel stayed full for {timeout} s")
                done += self.push(recs[done:], blob)

    def _pushes(
        self, records: np.ndarray, payload: np.ndarray | bytes | None
    ) -> Sequence[tuple[np.ndarray, np.ndarray]]:
        """The pushes `records` take: one, or several when the blob is over max_push_bytes."""
        blob = as_bytes(payload)
        if self.max_push_bytes is not None and blob.size > self.max_push_bytes:
            return split_payload(records, blob, self.spec.layout, self.max_push_bytes)
        return ((records, blob),)

    def free_records(self) -> int:
        return self._ring.free_records()

    def room_for(self, nbytes: int = 0) -> bool:
        return self._ring.room_for(nbytes)

    # ---------------------------------------------------------------- consumer

    def pop(self, max_records: int | None = None) -> Batch | None:
        """All published records (at most `max_records`) and their payloads; None if empty."""
        if self.role != "consumer":
            raise ValueError(f"pop: this process is the producer of the {self.spec.layout.name} channel")
        return self._ring.pop(max_records)  # wakes the producer if it waits for room

    def readable(self) -> bool:
        return self._ring.readable()

    def __len__(self) -> int:
        return len(self._ring)

    # ---------------------------------------------------------------- heartbeat

    def beat(self) -> None:
        """Stamps the heartbeat; called every loop iteration by the process owning the loop."""
        self._ring.beat()

    def heartbeat_ns(self) -> int:
        return self._ring.heartbeat_ns()

    def close(self) -> None:
        if self._peer_fd < 0:
            return
        self._ring.close()
        self._buf.close()
        if self._segment_fd is not None:
            os.close(self._segment_fd)
        os.close(self._peer_fd)
        self._peer_fd = -1

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
