"""Streamed answers: the SSE response and the loop that turns a request group's deltas
into its writes."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from starlette.datastructures import MutableHeaders

from httpapi.errors import APIError
from httpapi.sse import DONE, HEADERS, error_event
from runtime.http_worker.disconnect import DisconnectWatches
from runtime.http_worker.req_state import ClientGone, ReqGroup, ReqState

_SSE_HEADERS = [(k.encode(), v.encode()) for k, v in HEADERS.items()]


class EventStream:
    """An SSE response fed by an async iterator of ready-made event bytes, one write each;
    the item ending with DONE is the last and ends the body with it. The status line and
    headers go out with the first event, not before it: granian hands each send to its I/O
    thread, which then wakes fewer times a streamed request (the headers do not wake it on
    their own). A disconnected client (http.disconnect) calls `on_disconnect`, which aborts
    the request, so the iterator ends at its next wait."""

    def __init__(
        self, events: AsyncIterator[bytes], on_disconnect: Callable[[], None], watches: DisconnectWatches
    ) -> None:
        self.events = events
        self.on_disconnect = on_disconnect
        self.watches = watches
        self.headers = MutableHeaders(raw=list(_SSE_HEADERS))

    async def __call__(self, scope, receive, send) -> None:
        start: dict | None = {"type": "http.response.start", "status": 200, "headers": self.headers.raw}
        watch = self.watches.watch(receive, self.on_disconnect)
        more = True
        try:
            async for chunk in self.events:
                if start is not None:
                    await send(start)
                    start = None
                more = not chunk.endswith(DONE)
                await send({"type": "http.response.body", "body": chunk, "more_body": more})
            if start is not None:  # no event at all (the client left first)
                await send(start)
            if more:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watch.close()


async def sse_events(
    worker, group: ReqGroup, render: Callable[[ReqState], bytes | None], head: bytes, tail: Callable[[], bytes]
) -> AsyncIterator[bytes]:
    """A stream's writes: each carries the events of every delta that arrived since the
    previous one (a client that fell behind gets its pending deltas coalesced); the first
    also carries `head` (role chunks, echoes), the last the tail (usage, DONE). The request is
    observed once it ended, however: finished, aborted, failed, or its client gone (then the
    iterator is closed at a yield, or ends at its next wait)."""
    pending = [head] if head else []
    observed = False
    try:
        while True:
            news = await group.next_news()
            now_ns = time.monotonic_ns()
            for state in news:
                worker.observe_delta(state, now_ns)
                event = render(state)
                if event is not None:
                    pending.append(event)
            if group.done:
                break
            if pending:
                yield pending[0] if len(pending) == 1 else b"".join(pending)
                pending = []
    except ClientGone:
        return
    except APIError as err:
        observed = True
        worker.observe(group)
        yield b"".join(pending) + error_event(err) + DONE
        return
    finally:
        if not observed:
            worker.observe(group)
    pending.append(tail())
    yield b"".join(pending)
