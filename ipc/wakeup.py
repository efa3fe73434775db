"""eventfd wakeups: one `Waker` per process, shared by every channel it uses.

Why one eventfd per process rather than one per channel plus epoll: a process
waits for "anything to do" (the scheduler: a record on any worker's request
ring; an HTTP worker: a text delta or room in its request ring), so one fd is
all it ever needs to block on. Each channel's peer holds a dup of it and writes
it only when the channel's flag says this process announced it would sleep on
that channel; after waking, the process re-checks its channels. Waiting on N
channels costs one poll() on one fd, and an asyncio loop registers one reader.

The sleep protocol (spin, announce on each channel's SleepFlag, barrier, re-check, sleep;
the peer writes the eventfd after publishing or freeing room when the flag is up) and why
no wakeup is lost: docs/architecture.md, "Sleeping and waking".

Waits (all take channels of ipc/channel.py, through the Waitable protocol):
  wait_readable(channels, spin_us, timeout)   sync: spin, then sleep (consumer)
  wait_readable_async(channels, timeout)      asyncio, via loop.add_reader
  wait_room(channel, nbytes, timeout)         sync back-pressure (producer)
  wait_room_async(channel, nbytes, timeout)   asyncio back-pressure
  wait_any(readable, room, spin_us, timeout)  sync: records in some channels OR room in others

`wait_any` is both waits at once, for a process that consumes some channels and produces
into others and must not sleep on one of them alone (the detokenizer: records from the
scheduler, or room in any HTTP worker's ring whose records wait in its backlog). It is the
same protocol: it announces on every channel (a consumer's flag on those it reads, a
producer's on those it waits to write), runs the barrier once, and re-checks every
condition before it sleeps; each channel's peer writes the one eventfd, so whichever
condition comes true first wakes it. The Dekker argument holds channel by channel: for each,
the waiter's flag store precedes its check, the peer's counter store precedes its flag load.

Consumer modes: spin_us=0 sleeps at once (eventfd), spin_us=math.inf never sleeps
(pure spin), anything between spins that long then sleeps (the server's mode: on
few cores a spinning consumer steals the producer's CPU).
"""

from __future__ import annotations

import asyncio
import math
import os
import select
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from ipc.memory import model


class SleepFlag:
    """One channel's announcement, in its ring's header, that this process is about to sleep
    on its eventfd (step 2 above). Several coroutines of one process may wait on the same
    channel at once: the first to announce sets the flag, the last to withdraw clears it."""

    def __init__(self, set_flag: Callable[[bool], None]) -> None:
        self._set = set_flag
        self._announcers = 0

    def announce(self, on: bool) -> None:
        self._announcers += 1 if on else -1
        if self._announcers == int(on):  # first to announce, or last to withdraw
            self._set(on)


class Waitable(Protocol):
    """What the waits need of a channel."""

    sleep_flag: SleepFlag

    def readable(self) -> bool: ...

    def room_for(self, nbytes: int = 0) -> bool: ...


class Waker:
    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._poll = select.poll()
        self._poll.register(self.fd, select.POLLIN)
        self._sleep_barrier = model().sleep_barrier
        self._loop: asyncio.AbstractEventLoop | None = None
        self._futures: set[asyncio.Future] = set()
        self.wakeups = 0  # times a peer's eventfd write woke this process (a measure of sleeping)

    @property
    def fds(self) -> tuple[int, ...]:
        """What the peer needs to wake this process (handed over by ipc/handoff.py)."""
        return (self.fd,)

    # ---------------------------------------------------------------- sync

    def wait_readable(self, channels: Sequence[Waitable], spin_us: float = 0.0, timeout: float | None = None) -> bool:
        """Blocks until one of `channels` has records (True) or `timeout` s pass (False)."""
        return _any_readable(channels) or self.wait_any(channels, (), spin_us, timeout)

    def wait_room(self, channel: Waitable, nbytes: int = 0, timeout: float | None = None) -> bool:
        """Blocks until `channel` takes at least one record with an `nbytes` payload."""
        return channel.room_for(nbytes) or self.wait_any((), ((channel, nbytes),), 0.0, timeout)

    def wait_any(
        self,
        readable: Sequence[Waitable],
        room: Sequence[tuple[Waitable, int]],
        spin_us: float = 0.0,
        timeout: float | None = None,
    ) -> bool:
        """Blocks until one of `readable` has records, or one of `room`'s channels takes a
        record with its `nbytes` payload (True), or `timeout` s pass (False)."""

        def ready() -> bool:
            if _any_readable(readable):
                return True
            for ch, nbytes in room:
                if ch.room_for(nbytes):
                    return True
            return False

        if ready():
            return True
        now = time.perf_counter()
        deadline = math.inf if timeout is None else now + timeout
        if spin_us > 0:
            spin_end = min(deadline, now + spin_us * 1e-6)
            while True:
                if ready():
                    return True
                if time.perf_counter() >= spin_end:
                    break
        flags = [ch.sleep_flag for ch in readable] + [ch.sleep_flag for ch, _ in room]
        while True:
            self._drain()
            for flag in flags:
                flag.announce(True)
            try:
                self._sleep_barrier()
                if ready():
                    return True
                if not self._sleep(deadline):
                    return ready()
            finally:
                for flag in flags:
                    flag.announce(False)
            if ready():
                return True

    def _sleep(self, deadline: float) -> bool:
        """Sleeps on the eventfd until written (True) or the deadline (False). The count is
        left in the eventfd: the sync waits drain it before their next announcement, so the
        read syscall is not on the path from a wakeup to the pop (a write that lands between
        that drain and the poll only makes the poll return at once)."""
        if deadline == math.inf:
            ready = self._poll.poll()
        else:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return False
            ready = self._poll.poll(math.ceil(remaining * 1000))
        if not ready:
            return False
        self.wakeups += 1
        return True

    def _drain(self) -> None:
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass

    # ---------------------------------------------------------------- asyncio

    async def wait_readable_async(self, channels: Sequence[Waitable], timeout: float | None = None) -> bool:
        def announce(on: bool) -> None:
            for ch in channels:
                ch.sleep_flag.announce(on)

        return await self._wait_async(lambda: _any_readable(channels), announce, timeout)

    async def wait_room_async(self, channel: Waitable, nbytes: int = 0, timeout: float | None = None) -> bool:
        return await self._wait_async(lambda: channel.room_for(nbytes), channel.sleep_flag.announce, timeout)

    async def _wait_async(
        self, ready: Callable[[], bool], announce: Callable[[bool], None], timeout: float | None
    ) -> bool:
        if ready():
            return True
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._detach_loop()
            loop.add_reader(self.fd, self._on_readable)
            self._loop = loop
        deadline = math.inf if timeout is None else loop.time() + timeout
        while True:
            announce(True)
            try:
                self._sleep_barrier()
                if ready():
                    return True
                fut = loop.create_future()
                self._futures.add(fut)
                remaining = None if deadline == math.inf else deadline - loop.time()
                try:
                    await asyncio.wait_for(fut, remaining)
                except asyncio.TimeoutError:
                    return ready()
                finally:
                    self._futures.discard(fut)
            finally:
                announce(False)
            if ready():
                return True

    def _on_readable(self) -> None:
        self._drain()
        self.wakeups += 1
        futures, self._futures = self._futures, set()
        for fut in futures:
            if not fut.done():
                fut.set_result(None)

    def _detach_loop(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.fd)
        self._loop = None

    def close(self) -> None:
        if self.fd < 0:
            return
        self._detach_loop()
        self._poll.unregister(self.fd)
        os.close(self.fd)
        self.fd = -1


def _any_readable(channels: Sequence[Waitable]) -> bool:
    for ch in channels:
        if ch.readable():
            return True
    return False
