"""The Detokenizer process (`ringserve::detokenizer`): pops the scheduler's TOKEN_OUT batches,
turns them into text deltas (runtime/detokenizer/deltas.py -> detok_batch.py) and pushes each
HTTP worker's TEXT_OUT records to that worker's channel, one push per worker per batch.

Channels come from the detokenizer's own unix socket, at start-up or later (a worker
that granian respawns reconnects), with the exchange of ipc/handoff.py: the peer sends
its waker, the detokenizer creates the channel and sends it back.

    launcher:       spawn run_detokenizer(server_args, socket_path, parent_pid=...)
    scheduler:      ch = connect_detokenizer(socket_path, waker)            TOKEN_OUT, producer side
    HTTP worker k:  ch = connect_detokenizer(socket_path, waker, worker=k)  TEXT_OUT, consumer side

The socket is listening as soon as the process has started (before the tokenizer is
loaded), so peers can connect right away. The process stops on SIGTERM / SIGINT, or when
`parent_pid` exits; it then closes its channels and removes the socket file.
"""
from __future__ import annotations

import logging
import os
import queue
import select
import signal
import socket
import threading
import time

from ipc import ChannelSpec, get_transport
from ipc.handoff import recv_channels, recv_waker, send_channels, send_waker
from protocol.records import TEXT_OUT, TOKEN_OUT
from runtime.config import ServerArgs
from runtime.detokenizer.deltas import TextDeltas, split_by_worker
from runtime.gc_tuning import settle_heap
from runtime.supervise.watchdog import WorkerWatch

logger = logging.getLogger(__name__)

PROCESS_TITLE = "ringserve::detokenizer"
TOKEN_OUT_SPEC = ChannelSpec(TOKEN_OUT, capacity=16384, arena_bytes=8 << 20)  # scheduler -> detokenizer
TEXT_OUT_SPEC = ChannelSpec(TEXT_OUT, capacity=8192, arena_bytes=8 << 20)     # detokenizer -> worker k
SPIN_US = 50.0        # spin this long on an empty ring before sleeping on the eventfd
IDLE_WAKE_S = 0.1     # an idle loop still wakes this often: new channels, stop flag, heartbeat
PUSH_RETRY_S = 0.5    # a worker's full ring is re-checked this often (a respawned worker replaces it)


def run_detokenizer(server_args: ServerArgs, socket_path: str, parent_pid: int | None = None,
                    max_open: int = 8192) -> None:
    """The process's entry point (spawn it). server_args: model_path (for the tokenizer),
    transport, log_level. socket_path: where peers connect (must not exist yet).
    max_open: requests the detokenizer keeps open at once (queued ones included)."""
    from setproctitle import setproctitle

    setproctitle(PROCESS_TITLE)
    logging.basicConfig(level=server_args.log_level.upper(),
                        format="%(asctime)s %(levelname)s detokenizer: %(message)s")
    run_as_batch()
    detok = Detokenizer(server_args, socket_path, parent_pid)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: detok.stop())
    try:
        detok.load(max_open)
        settle_heap()
        detok.serve()
    finally:
        detok.close()


def run_as_batch() -> None:
    """SCHED_BATCH: the scheduler wakes this process with each step's tokens, and a
    SCHED_NORMAL wakee preempts its waker on the waker's CPU, where the kernel likes to place
    it; as a batch task it runs when a CPU is free or at the next tick instead, and the
    scheduler goes on with its next step (the path a forward waits on). On the null model at
    256 streams: ~5% less server CPU a token (interleaved A/B, 12 rounds). Linux only."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError) as e:  # another OS, or a sandbox that forbids it: a normal task
        logger.info("SCHED_BATCH unavailable (%s): the detokenizer runs as a normal task", e)


def connect_detokenizer(socket_path: str, waker, worker: int | None = None, timeout: float = 60.0):
    """The caller's channel from the detokenizer at `socket_path`, waiting up to `timeout` s
    for it to listen: the scheduler's TOKEN_OUT (worker=None, producer side) or HTTP worker
    k's TEXT_OUT (consumer side). `waker` is the caller's (ipc.Waker, or the zmq one)."""
    deadline = time.monotonic() + timeout
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        while True:
            try:
                sock.connect(socket_path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no detokenizer listening on {socket_path} after {timeout} s") from None
                time.sleep(0.02)
        sock.settimeout(max(deadline - time.monotonic(), 1.0))
        send_waker(sock, waker, {"role": "scheduler"} if worker is None else
                   {"role": "worker", "worker": worker, "pid": os.getpid()})
        (channel,), _ = recv_channels(sock, waker)
        return channel
    finally:
        sock.close()


class Detokenizer:
    def __init__(self, server_args: ServerArgs, socket_path: str, parent_pid: int | None) -> None:
        self.args = server_args
        self.socket_path = socket_path
        self.transport = get_transport(server_args.transport)
        self.waker = self.transport.make_waker()
        self.deltas: TextDeltas | None = None
        self.inputs: list = []        # TOKEN_OUT channels (one per scheduler; one in practice)
        self.outputs: dict[int, object] = {}  # worker -> its TEXT_OUT channel
        self.worker_pids: dict[int, int] = {}  # worker -> the pid of the process holding its channel
        # from the acceptor: (meta, channel) when a peer attaches, (meta, None) when a worker exits
        self._new: queue.SimpleQueue = queue.SimpleQueue()
        self._workers = WorkerWatch()
        self._stopping = False
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(socket_path)
        os.chmod(socket_path, 0o600)
        self._listener.listen(64)
        self._parent_fd = os.pidfd_open(parent_pid) if parent_pid is not None else None
        threading.Thread(target=self._accept, name="detok-accept", daemon=True).start()

    def load(self, max_open: int) -> None:
        from transformers import AutoTokenizer

        from gpu.model_files import resolve_model_dir

        model_dir = resolve_model_dir(self.args.model_path)
        t0 = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.deltas = TextDeltas(tokenizer, max_open=max_open)
        core = self.deltas.core
        how = "numpy byte table" if core.table is not None else f"window decode ({core.fallback_reason})"
        logger.info("tokenizer of %s (%d tokens) loaded in %.1f s; decoding with the %s; listening on %s",
                    model_dir, core.vocab_size, time.perf_counter() - t0, how, self.socket_path)

    def stop(self) -> None:
        self._stopping = True

    def serve(self) -> None:
        deltas, waker = self.deltas, self.waker
        while not self._stopping:
            if not self._new.empty():
                self._attach_new()
            for ch in self.outputs.values():  # before any push: a reader that sees text sees a beat
                ch.beat()
            busy = False
            for ch in self.inputs:
                batch = ch.pop()
                if batch is not None:
                    busy = True
                    records, blob = deltas.handle(batch)
                    if len(records):
                        self._send(records, blob)
            if not busy:
                waker.wait_readable(self.inputs, spin_us=SPIN_US, timeout=IDLE_WAKE_S)

    def _send(self, records, blob) -> None:
        for worker, (recs, part) in split_by_worker(records, blob).items():
            ch = self.outputs.get(worker)
            if ch is None and not self._new.empty():  # attached after this loop's last look
                self._attach_new()
                ch = self.outputs.get(worker)
            if ch is None:
                logger.warning("no channel to worker %d: %d text records dropped", worker, len(recs))
                continue
            done = ch.push(recs, part)
            while done < len(recs) and not self._stopping:  # back-pressure: wait for the worker
                self.waker.wait_room(ch, len(part), PUSH_RETRY_S)
                if not self._new.empty():
                    self._attach_new()
                    if self.outputs.get(worker) is not ch:  # the worker exited, or was respawned
                        logger.warning("worker %d's process is gone: %d text records for it dropped",
                                       worker, len(recs) - done)
                        break
                done += ch.push(recs[done:], part)

    def _attach_new(self) -> None:
        while not self._new.empty():
            meta, ch = self._new.get()
            if meta["role"] == "failed":  # its handshake broke after it was queued
                if ch in self.inputs:
                    self.inputs.remove(ch)
                for worker in [w for w, c in self.outputs.items() if c is ch]:
                    del self.outputs[worker], self.worker_pids[worker]
                ch.close()
                continue
            if meta["role"] == "scheduler":
                self.inputs.append(ch)
                logger.info("scheduler attached")
                continue
            worker, pid = meta["worker"], meta["pid"]
            if ch is None:  # the worker's process exited
                if self.worker_pids.get(worker) == pid:  # and no successor has taken its place
                    del self.worker_pids[worker]
                    self.outputs.pop(worker).close()
                    logger.info("worker %d (pid %d) exited: its channel is closed", worker, pid)
                continue
            old = self.outputs.pop(worker, None)
            if old is not None:
                old.close()
            self.outputs[worker] = ch
            self.worker_pids[worker] = pid
            logger.info("worker %d attached", worker)

    def _accept(self) -> None:
        """Acceptor thread: hands each peer its channel, reports the exit of each attached
        worker's process; stops the process if the parent exits."""
        watch = [self._listener.fileno()] + ([self._parent_fd] if self._parent_fd is not None else [])
        while not self._stopping:
            ready, _, _ = select.select(watch + self._workers.fds(), [], [], IDLE_WAKE_S)
            if self._parent_fd in ready:
                logger.info("parent process exited: stopping")
                self.stop()
                return
            for worker, pid in self._workers.exited(ready):
                self._new.put(({"role": "worker", "worker": worker, "pid": pid}, None))
            if self._listener.fileno() in ready:
                try:
                    conn, _ = self._listener.accept()
                except OSError:
                    return  # closed by close()
                with conn:
                    try:
                        self._handshake(conn)
                    except Exception:
                        logger.exception("a peer failed to attach")

    def _handshake(self, conn: socket.socket) -> None:
        conn.settimeout(10.0)
        meta, peer_fd = recv_waker(conn)
        try:
            if meta.get("role") == "scheduler":
                ch = self.transport.create_channel(TOKEN_OUT_SPEC, "consumer", self.waker, peer_fd)
            elif (meta.get("role") == "worker" and isinstance(meta.get("worker"), int) and meta["worker"] >= 0
                  and isinstance(meta.get("pid"), int)):
                ch = self.transport.create_channel(TEXT_OUT_SPEC, "producer", self.waker, peer_fd)
            else:
                raise ValueError(f"unknown peer {meta!r}: expected role 'scheduler', or 'worker' with a worker "
                                 "index and its pid")
        finally:
            if peer_fd is not None:
                os.close(peer_fd)
        # queued before the peer holds it: what the peer then causes to be sent finds it attached
        self._new.put((meta, ch))
        try:
            send_channels(conn, [ch], {"pid": os.getpid()})
        except BaseException:
            self._new.put(({"role": "failed"}, ch))
            raise
        if meta["role"] == "worker" and not self._workers.add(meta["worker"], meta["pid"]):
            self._new.put((meta, None))

    def close(self) -> None:
        self._stopping = True
        self._listener.close()
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        while not self._new.empty():
            ch = self._new.get()[1]
            if ch is not None:
                ch.close()
        for ch in [*self.inputs, *self.outputs.values()]:
            ch.close()
        self.inputs, self.outputs = [], {}
        if self._parent_fd is not None:
            os.close(self._parent_fd)
        self.waker.close()
