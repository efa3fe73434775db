"""Where peers attach to a process that owns channels: the one unix socket server the
scheduler and the detokenizer both run, and the client side, `connect`.

    owner:  server = PeerServer(path, make_channel, reply); server.start()
            in its loop:  for event in server.events(): ...   (PeerEvent)
    peer:   channels, reply = connect(path, waker, hello)

The handshake is ipc/handoff.py's: the peer sends its waker and a JSON hello, the
acceptor thread calls `make_channel(hello, peer_waker_fd)` (which validates the hello and
raises to refuse it), sends the channel back and reports it to the owner's loop. A hello
with a "pid" names an HTTP worker's process: its exit (kill -9 included) is reported too,
from a pidfd, so that a ring nobody reads any more cannot block the owner.

The acceptor never touches the owner's state: every change reaches the owner's loop as a
PeerEvent, taken when the loop is ready for it.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ipc.handoff import recv_channels, recv_waker, send_channels, send_waker

logger = logging.getLogger(__name__)

POLL_S = 0.1  # how often the acceptor looks at its stop flag
HANDSHAKE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class PeerEvent:
    kind: str  # "attached": `channel` is the peer's; "failed": its handshake broke after `channel`
    #            was reported attached; "exited": the process of `hello["pid"]` is gone
    hello: dict
    channel: Any = None


class PeerServer:
    def __init__(
        self, socket_path: str, make_channel: Callable[[dict, int | None], Any], reply: dict[str, Any]
    ) -> None:
        """make_channel(hello, peer_waker_fd): the new peer's channel (the fd is the caller's to
        dup, not to close); raises ValueError for a hello it refuses. reply: what every peer
        gets with its channel."""
        self.socket_path = socket_path
        self._make_channel = make_channel
        self._reply = reply
        self._events: queue.SimpleQueue[PeerEvent] = queue.SimpleQueue()
        self._pidfds: dict[int, dict] = {}  # pidfd -> the hello of the peer whose process it watches
        self._listener: socket.socket | None = None
        self._stopping = False

    def start(self) -> None:
        """Binds the socket (its file appearing means this process is ready) and starts the acceptor."""
        listener = self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.socket_path)
        os.chmod(self.socket_path, 0o600)
        listener.listen(64)
        threading.Thread(
            target=self._accept, args=(listener,), name=f"accept {os.path.basename(self.socket_path)}", daemon=True
        ).start()

    def has_events(self) -> bool:
        return not self._events.empty()

    def events(self) -> Iterator[PeerEvent]:
        """Every event reported so far, in order."""
        while not self._events.empty():
            yield self._events.get()

    def close(self) -> None:
        """Stops accepting, removes the socket file and closes channels never taken by events()."""
        self._stopping = True
        if self._listener is not None:
            self._listener.close()
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
        for event in self.events():
            if event.kind == "attached":
                event.channel.close()
        for fd in self._pidfds:
            os.close(fd)
        self._pidfds = {}

    # ---------------------------------------------------------------- the acceptor thread

    def _accept(self, listener_socket: socket.socket) -> None:
        listener = listener_socket.fileno()
        while not self._stopping:
            try:
                ready, _, _ = select.select([listener, *self._pidfds], [], [], POLL_S)
            except (OSError, ValueError):  # closed by close()
                return
            for fd in ready:
                if fd in self._pidfds:
                    self._events.put(PeerEvent("exited", self._pidfds.pop(fd)))
                    os.close(fd)
            if listener not in ready:
                continue
            try:
                conn, _ = listener_socket.accept()
            except OSError:
                return
            with conn:
                try:
                    self._handshake(conn)
                except Exception:
                    logger.exception("a peer failed to attach")

    def _handshake(self, conn: socket.socket) -> None:
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        hello, peer_fd = recv_waker(conn)
        try:
            pid = hello.get("pid")
            if pid is not None and not isinstance(pid, int):
                raise ValueError(f"unknown peer {hello!r}: its pid must be an integer")
            channel = self._make_channel(hello, peer_fd)
        finally:
            if peer_fd is not None:
                os.close(peer_fd)
        # reported before the peer holds it: what the peer then causes to be sent finds it attached
        self._events.put(PeerEvent("attached", hello, channel))
        try:
            send_channels(conn, [channel], self._reply)
        except BaseException:
            self._events.put(PeerEvent("failed", hello, channel))
            raise
        if pid is not None:
            try:
                self._pidfds[os.pidfd_open(pid)] = hello
            except ProcessLookupError:
                self._events.put(PeerEvent("exited", hello))


def connect(socket_path: str, waker: Any, hello: dict[str, Any], timeout: float = 60.0) -> tuple[Any, dict]:
    """This process's channel from the PeerServer at `socket_path` (waiting up to `timeout` s
    for it to listen), and the server's reply. `waker`: this process's (ipc.Waker, or the zmq
    baseline's); `hello`: what the server's make_channel reads, with "pid" for a process whose
    exit the server must notice."""
    deadline = time.monotonic() + timeout
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        while True:
            try:
                sock.connect(socket_path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nothing listening on {socket_path} after {timeout} s") from None
                time.sleep(0.02)
        sock.settimeout(max(deadline - time.monotonic(), 1.0))
        send_waker(sock, waker, hello)
        (channel,), reply = recv_channels(sock, waker)
        return channel, reply
    finally:
        sock.close()
