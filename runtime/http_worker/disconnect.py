"""Noticing a client that leaves while its request runs, so that the request is aborted and
its KV pages freed."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

logger = logging.getLogger("ringserve.app")

T = TypeVar("T")


class DisconnectWatch:
    """Calls `on_disconnect` when the client goes away (http.disconnect; the request body
    was read already), from a callback on receive()'s future rather than a task awaiting it
    (a task a request, and its cancellation at the end, are a noticeable part of a streamed
    request's server CPU). Another message (granian sends an empty http.request after the
    body) re-arms it.

    Armed only once the request has run for WATCH_AFTER_S (DisconnectWatches): granian
    runs each receive() as a task on its I/O thread, which posts the result back to the
    event loop (a visible share of the HTTP worker's Python time in a short streamed
    request); a client that left sooner is still seen then (granian keeps the connection's
    close for the next receive), so its request runs at most that much longer."""

    def __init__(
        self, receive: Callable[[], Awaitable[dict]], on_disconnect: Callable[[], None], watches: DisconnectWatches
    ) -> None:
        self._receive, self._on_disconnect, self._watches = receive, on_disconnect, watches
        self._waiting: asyncio.Future | None = None
        watches.unarmed[self] = time.monotonic()

    def arm(self) -> None:
        try:
            self._waiting = asyncio.ensure_future(self._receive())
        except Exception:  # receive() refused: the connection is gone, nobody is there to answer
            self._on_disconnect()
            return
        self._waiting.add_done_callback(self._received)

    def _received(self, fut: asyncio.Future) -> None:
        if fut.cancelled() or fut is not self._waiting:
            return
        if fut.exception() is None and fut.result()["type"] != "http.disconnect":
            self.arm()
        else:  # gone, or receive() failed: nobody is there to answer
            self._on_disconnect()

    def close(self) -> None:
        self._watches.unarmed.pop(self, None)
        waiting, self._waiting = self._waiting, None
        if waiting is not None:
            waiting.cancel()


class DisconnectWatches:
    """A worker's watches not yet armed, oldest first; run() arms those that have waited
    WATCH_AFTER_S, every half of that (so after 1-1.5 times it). One task for all of them:
    a timer a request (call_later, and its cancel) costs a measurable share of the worker's
    Python time."""

    WATCH_AFTER_S = 1.0

    def __init__(self) -> None:
        self.unarmed: dict[DisconnectWatch, float] = {}  # -> when it started (time.monotonic)

    def watch(self, receive: Callable[[], Awaitable[dict]], on_disconnect: Callable[[], None]) -> DisconnectWatch:
        return DisconnectWatch(receive, on_disconnect, self)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.WATCH_AFTER_S / 2)
            for watch in take_due(self.unarmed, self.WATCH_AFTER_S):
                try:
                    watch.arm()
                except Exception:  # a bug in one request's abort must not leave the later ones unwatched
                    logger.exception("a disconnect watch failed")


def take_due(started: dict[T, float], after_s: float) -> list[T]:
    """The items of `started` (item -> when it started, time.monotonic, oldest first) that
    started `after_s` ago or more, taken out of it: the one periodic task that serves all of
    a worker's deadlines, where a timer an item (call_later, and its cancel) costs more than
    the work it guards."""
    due = time.monotonic() - after_s
    ready = [item for item, _ in itertools.takewhile(lambda entry: entry[1] <= due, started.items())]
    for item in ready:
        del started[item]
    return ready
