"""A single-producer single-consumer ring of fixed-layout records plus its payload arena,
in one shared segment: the segment's layout (the offsets below) and `Ring`, the Python data
path, used where ipc/ring_core.c (the C one, the default) cannot be built; either side of a
segment may use either.

The protocol's one full account is docs/architecture.md, "Rings": the layout, the order of
a push (blob, then bounds and records, then TAIL) and of a pop (TAIL, then the copies, then
ARENA_HEAD and HEAD) and why it needs no lock on each CPU, and the sleep / wake handshake
whose barrier ipc/memory.py supplies. The methods below keep those orders.
"""

from __future__ import annotations

import mmap
import os
import time
import zlib
from dataclasses import dataclass

import numpy as np

from ipc.arena import Arena, align_up
from ipc.memory import Counters, model
from ipc.native import ring_core
from protocol.records import RecordLayout

MAGIC = 0x52494E4753455256  # "RINGSERV"
VERSION = 1
LINE_WORDS = 16  # 128 bytes
HEADER_BYTES = 4 * LINE_WORDS * 8
# word indices into the header
_MAGIC, _VERSION, _CAPACITY, _ARENA_BYTES, _ITEMSIZE, _LAYOUT_HASH, _BARRIER = range(7)
TAIL, PRODUCER_WAITING = LINE_WORDS, LINE_WORDS + 1
HEAD, ARENA_HEAD, CONSUMER_SLEEPING = 2 * LINE_WORDS, 2 * LINE_WORDS + 1, 2 * LINE_WORDS + 2
HEARTBEAT = 3 * LINE_WORDS
_BARRIERS = {"membarrier": 1, "fence": 2}

_U8 = np.dtype(np.uint8)
_NO_PAYLOAD = np.empty(0, _U8)
_NO_PAYLOAD.flags.writeable = False


@dataclass(slots=True)
class Batch:
    """Records popped in one call and the payloads they reference (both private copies)."""

    records: np.ndarray  # [n] of the channel's layout dtype
    payload: np.ndarray  # [bytes] uint8; records' `*_off` fields index into it

    def __len__(self) -> int:
        return len(self.records)

    def view(self, off: int, nbytes: int, dtype: np.dtype | type = np.uint8) -> np.ndarray:
        """The payload bytes [off, off + nbytes) as an array of `dtype`, without a copy."""
        return self.payload[off : off + nbytes].view(dtype)


def layout_hash(layout: RecordLayout) -> int:
    return zlib.crc32(f"{layout.name}|{layout.dtype.descr}|{layout.offset_fields}".encode())


def _offsets(layout: RecordLayout, capacity: int, arena_bytes: int) -> tuple[int, int, int]:
    """(slots offset, arena offset, segment size)."""
    bounds = 2 * 8 * capacity if arena_bytes else 0
    slots = -(-(HEADER_BYTES + bounds) // 64) * 64
    arena = -(-(slots + layout.dtype.itemsize * capacity) // 64) * 64
    return slots, arena, arena + arena_bytes


def segment_size(layout: RecordLayout, capacity: int, arena_bytes: int) -> int:
    return _offsets(layout, capacity, arena_bytes)[2]


def open_ring(
    buf: mmap.mmap,
    layout: RecordLayout,
    capacity: int,
    arena_bytes: int,
    *,
    initialise: bool,
    peer_fd: int,
    native: bool | None = None,
) -> Ring:
    """This side's view of a channel segment, with the C data path (ipc/ring_core.c) unless
    `native` is False or it cannot be built here (None: whichever is available)."""
    core = ring_core() if native is not False else None
    if native and core is None:
        raise RuntimeError("the C ring data path is unavailable here (see the warning above)")
    if core is None:
        return Ring(buf, layout, capacity, arena_bytes, initialise=initialise, peer_fd=peer_fd)
    return NativeRing(buf, layout, capacity, arena_bytes, initialise=initialise, peer_fd=peer_fd, core=core)


class Ring:
    """One side's view of a channel segment: the producer uses push/room_for/free_records,
    the consumer pop/readable/len (ipc/channel.py keeps each side to its own). The data path
    here is Python; NativeRing runs the same one in C. After publishing, push and pop wake
    the peer through `peer_fd` (its eventfd; the caller owns it) if it announced a wait."""

    def __init__(
        self, buf: mmap.mmap, layout: RecordLayout, capacity: int, arena_bytes: int, *, initialise: bool, peer_fd: int
    ) -> None:
        self.layout, self.capacity = layout, capacity
        self._peer_fd = peer_fd
        self._publish_barrier = model().publish_barrier
        slots_at, arena_at, size = _offsets(layout, capacity, arena_bytes)
        if len(buf) < size:
            raise ValueError(f"segment of {len(buf)} bytes is too small for this channel ({size} bytes)")
        self._buf = buf
        self._hdr = Counters(buf, 0, HEADER_BYTES // 8)
        self._load, self._store = self._hdr.load, self._hdr.store  # hot-path shortcuts
        const = np.frombuffer(buf, np.uint64, 7, 0)
        expected = (
            MAGIC,
            VERSION,
            capacity,
            arena_bytes,
            layout.dtype.itemsize,
            layout_hash(layout),
            _BARRIERS[model().barrier],
        )
        if initialise:
            const[:] = expected
        elif tuple(const.tolist()) != expected:
            names = ("magic", "version", "capacity", "arena_bytes", "itemsize", "layout", "barrier mode")
            diff = [n for n, a, b in zip(names, const.tolist(), expected) if a != b]
            raise ValueError(
                f"shared segment does not match this {layout.name} channel: {', '.join(diff)} "
                "differ (a different build, layout or memory model on the other side?)"
            )
        self._dtype, self._itemsize = layout.dtype, layout.dtype.itemsize
        self._slots_mv = memoryview(buf)[slots_at : slots_at + capacity * self._itemsize]  # [capacity * itemsize]
        self.arena = Arena(np.frombuffer(buf, np.uint8, arena_bytes, arena_at)) if arena_bytes else None
        if self.arena is not None:
            # bounds: [capacity, 2] (start, end) of the blob of each slot's push; _bound reads one word
            self._bounds = np.frombuffer(buf, np.uint64, 2 * capacity, HEADER_BYTES).reshape(capacity, 2)
            self._bound = Counters(buf, HEADER_BYTES, 2 * capacity)
            self._load_bound, self._store_bound = self._bound.load, self._bound.store
            self._pair = np.zeros(2, np.uint64)
        self._rebase = layout.offset_fields
        self._tail = self._hdr.load(TAIL)  # producer: authoritative; consumer: last seen
        self._head = self._hdr.load(HEAD)  # consumer: authoritative; producer: cached
        self._arena_head = self._hdr.load(ARENA_HEAD)  # producer's cache
        self._arena_tail = 0  # producer: next free arena position

    # ---------------------------------------------------------------- producer

    def push(self, records: np.ndarray, payload: np.ndarray | bytes | None = None) -> int:
        """Publishes the longest prefix of `records` that fits, all referencing `payload`
        (one blob, copied once). Returns how many records were published: 0 when the
        ring or the arena is full (nothing is dropped: push the rest later)."""
        # the common path is a few memoryview accesses and one numpy call: every numpy call has
        # a fixed cost that dwarfs the copy, and several times that with cold caches
        if records.dtype is not self._dtype or records.ndim != 1:  # the common case costs no comparison of dtypes
            check_records(records, self.layout)
        blob = _NO_PAYLOAD if payload is None else as_bytes(payload)
        nbytes = blob.size
        arena = self.arena
        if nbytes and (arena is None or nbytes > arena.size):
            raise ValueError(
                f"payload: the {self.layout.name} channel was created without an arena"
                if arena is None
                else f"payload of {nbytes} bytes can never fit this channel's {arena.size}-byte arena"
            )
        n = len(records)
        tail, cap = self._tail, self.capacity
        free = cap - (tail - self._head)
        if free < n:
            self._head = self._load(HEAD)
            free = cap - (tail - self._head)
        k = n if n <= free else free
        if k == 0:
            return 0
        i = tail % cap
        first = k if k <= cap - i else cap - i  # records before the wrap
        if arena is not None:
            start = self._arena_tail
            if nbytes:
                start = arena.place(start, nbytes)
                if start + nbytes - self._arena_head > arena.size:
                    self._arena_head = self._load(ARENA_HEAD)
                    if start + nbytes - self._arena_head > arena.size:
                        return 0
                arena.write(start, blob)
                self._arena_tail = align_up(start + nbytes)
            if k == 1:
                self._store_bound(2 * i, start)
                self._store_bound(2 * i + 1, start + nbytes)
            else:
                self._pair[0], self._pair[1] = start, start + nbytes
                self._bounds[i : i + first] = self._pair
                if first < k:
                    self._bounds[: k - first] = self._pair
        # copied as bytes: numpy assigns structured arrays field by field, many times slower
        try:
            src = np.frombuffer(records, np.uint8)
        except ValueError:  # not C-contiguous
            src = np.frombuffer(np.ascontiguousarray(records), np.uint8)
        size = self._itemsize
        # numpy's stubs give ndarray the buffer protocol only from Python 3.12; it has it in every version
        self._slots_mv[i * size : (i + first) * size] = src if first == n else src[: first * size]  # type: ignore[call-overload]
        if first < k:
            self._slots_mv[: (k - first) * size] = src[first * size : k * size]  # type: ignore[call-overload]
        self._tail = tail + k
        self._store(TAIL, tail + k)
        self._wake_if(CONSUMER_SLEEPING)
        return k

    def free_records(self) -> int:
        self._head = self._hdr.load(HEAD)
        return self.capacity - (self._tail - self._head)

    def room_for(self, nbytes: int) -> bool:
        """Whether a push of at least one record with an `nbytes` payload would succeed now."""
        if self.free_records() == 0:
            return False
        if self.arena is None or nbytes == 0:
            return True
        self._arena_head = self._hdr.load(ARENA_HEAD)
        pos = self.arena.place(self._arena_tail, nbytes)
        return pos + nbytes - self._arena_head <= self.arena.size

    # ---------------------------------------------------------------- consumer

    def readable(self) -> bool:
        return self._load(TAIL) != self._head

    def __len__(self) -> int:
        """Records published and not yet popped."""
        return self._hdr.load(TAIL) - self._hdr.load(HEAD)

    def pop(self, max_records: int | None = None) -> Batch | None:
        """Copies out up to `max_records` (default: all) published records and the payload
        span they reference, frees their slots and arena space; None if empty."""
        if max_records is not None:
            check_max_records(max_records)
        tail = self._load(TAIL)
        head = self._head
        n = tail - head
        if n == 0:
            return None
        if max_records is not None and n > max_records:
            n = max_records
        cap = self.capacity
        i = head % cap
        first = n if n <= cap - i else cap - i  # records before the wrap
        size = self._itemsize
        raw = bytearray(self._slots_mv[i * size : (i + first) * size])
        if first < n:
            raw += self._slots_mv[: (n - first) * size]
        records = np.frombuffer(raw, self._dtype)
        payload = _NO_PAYLOAD
        new_head = head + n
        if self.arena is not None:
            last = (new_head - 1) % cap
            bound = self._load_bound
            start, end = bound(2 * i), bound(2 * last + 1)
            if end > start:
                payload = self.arena.read(start, end)
                if self._rebase and bound(2 * last) != start:
                    # read before HEAD is stored: then the producer may reuse these slots' bounds
                    self._rebase_offsets(
                        records, self._bounds[(head + np.arange(n, dtype=np.uint64)) % np.uint64(cap), 0]
                    )
            # free up to the first blob still referenced by an unpopped record
            self._store(ARENA_HEAD, end if new_head == tail else bound(2 * (new_head % cap)))
        self._head = new_head
        self._store(HEAD, new_head)
        self._wake_if(PRODUCER_WAITING)
        return Batch(records, payload)

    def _wake_if(self, flag: int) -> None:
        """After publishing a counter: wakes the peer if it announced it waits on `flag`."""
        if self._publish_barrier is not None:
            self._publish_barrier()
        if self._load(flag):
            os.eventfd_write(self._peer_fd, 1)

    def _rebase_offsets(self, records: np.ndarray, starts: np.ndarray) -> None:
        """Blob-relative offsets -> offsets into the popped span, for pops covering several pushes.
        starts: [n] u64, each record's blob position in the arena; the first is the span's."""
        base = (starts - starts[0]).astype(np.uint32)
        for field in self._rebase:
            records[field] += base

    # ---------------------------------------------------------------- flags, heartbeat

    def set_consumer_sleeping(self, on: bool) -> None:
        self._store(CONSUMER_SLEEPING, int(on))

    def consumer_sleeping(self) -> bool:
        return self._load(CONSUMER_SLEEPING) != 0

    def set_producer_waiting(self, on: bool) -> None:
        self._store(PRODUCER_WAITING, int(on))

    def producer_waiting(self) -> bool:
        return self._load(PRODUCER_WAITING) != 0

    def beat(self) -> None:
        self._hdr.store(HEARTBEAT, time.monotonic_ns())

    def heartbeat_ns(self) -> int:
        """CLOCK_MONOTONIC ns of the last beat(), 0 if never."""
        return self._hdr.load(HEARTBEAT)

    def close(self) -> None:
        """Drops this side's views of the segment; the caller closes the mapping."""
        self._hdr.close()
        self._load, self._store = self._hdr.load, self._hdr.store  # now raise instead of touching unmapped memory
        if self.arena is not None:
            self._bound.close()
            del self._bounds, self._pair  # _bounds views the mapping, which cannot close while it lives
        self._slots_mv.release()
        self.arena = None


class NativeRing(Ring):
    """A Ring whose push, pop, readable, free_records and room_for are one C call each
    (ipc/ring_core.c); the flags, heartbeat and close are Ring's."""

    def __init__(
        self,
        buf: mmap.mmap,
        layout: RecordLayout,
        capacity: int,
        arena_bytes: int,
        *,
        initialise: bool,
        peer_fd: int,
        core: type,
    ) -> None:
        super().__init__(buf, layout, capacity, arena_bytes, initialise=initialise, peer_fd=peer_fd)
        slots_at, arena_at, _ = _offsets(layout, capacity, arena_bytes)
        self._core = core(
            buf,
            slots_at,
            capacity,
            self._itemsize,
            HEADER_BYTES,
            arena_at,
            arena_bytes,
            (TAIL, HEAD, ARENA_HEAD, CONSUMER_SLEEPING, PRODUCER_WAITING),
            model().barrier == "fence",
            peer_fd,
            layout.name,
        )
        # the consumer's wait loop calls readable() per spin: bound C methods, no Python frame
        self.readable, self.free_records, self.room_for = (
            self._core.readable,
            self._core.free_records,
            self._core.room_for,
        )

    def push(self, records: np.ndarray, payload: np.ndarray | bytes | None = None) -> int:
        if records.dtype is not self._dtype or records.ndim != 1:  # the common case costs no comparison of dtypes
            check_records(records, self.layout)
        pushed = self._core.push(records, payload)
        if pushed is NotImplemented:  # not C-contiguous
            pushed = self._core.push(np.ascontiguousarray(records), as_bytes(payload))
        return pushed

    def pop(self, max_records: int | None = None) -> Batch | None:
        if max_records is not None:
            check_max_records(max_records)
        got = self._core.pop(max_records or 0)
        if got is None:
            return None
        raw, blob, starts = got
        records = np.frombuffer(raw, self._dtype)
        if blob is None:
            return Batch(records, _NO_PAYLOAD)
        if starts is not None and self._rebase:
            self._rebase_offsets(records, np.frombuffer(starts, np.uint64))
        return Batch(records, np.frombuffer(blob, np.uint8))

    def close(self) -> None:
        self._core.close()
        super().close()


def check_records(records: np.ndarray, layout: RecordLayout) -> None:
    """Refuses anything but a 1-D array of `layout`'s dtype (every transport's push)."""
    if records.dtype != layout.dtype or records.ndim != 1:
        raise TypeError(
            f"records: expected a 1-D array of the {layout.name} layout's dtype, "
            f"got {records.dtype} with shape {records.shape}"
        )


def check_max_records(max_records: int) -> None:
    if max_records < 1:
        raise ValueError(f"max_records must be at least 1, not {max_records}")


def as_bytes(payload: np.ndarray | bytes | bytearray | memoryview | None) -> np.ndarray:
    if payload is None:
        return _NO_PAYLOAD
    if isinstance(payload, np.ndarray):
        if payload.dtype is _U8 and payload.ndim == 1 and payload.flags.c_contiguous:
            return payload
        return np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
    return np.frombuffer(payload, np.uint8)
