"""The Detokenizer process (`ringserve::detokenizer`): pops the scheduler's TOKEN_OUT batches,
turns them into text deltas (deltas.py -> incremental.py) and pushes each
HTTP worker's TEXT_OUT records to that worker's channel, one push per worker per batch.

Channels come from the detokenizer's own unix socket (ipc/peers.py), at start-up or later
(a worker that granian respawns reconnects).

    launcher:       run_detokenizer(server_args, socket_path)
    scheduler:      ch = connect_detokenizer(socket_path, waker)            TOKEN_OUT, producer side
    HTTP worker k:  ch = connect_detokenizer(socket_path, waker, worker=k)  TEXT_OUT, consumer side

The socket is listening as soon as the process has started (before the tokenizer is
loaded), so peers can connect right away. The process stops on SIGTERM / SIGINT; it then
closes its channels and removes the socket file.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from ipc import ChannelSpec, get_transport
from ipc.peers import PeerServer, connect
from protocol.records import TEXT_OUT, TOKEN_OUT
from runtime.config import ServerArgs
from runtime.detokenizer.deltas import TextDeltas, split_by_worker
from runtime.gc_tuning import settle_heap

logger = logging.getLogger(__name__)

PROCESS_TITLE = "ringserve::detokenizer"
TOKEN_OUT_SPEC = ChannelSpec(TOKEN_OUT, capacity=16384, arena_bytes=8 << 20)  # scheduler -> detokenizer
TEXT_OUT_SPEC = ChannelSpec(TEXT_OUT, capacity=8192, arena_bytes=8 << 20)  # detokenizer -> worker k
SPIN_US = 50.0  # spin this long on an empty ring before sleeping on the eventfd
IDLE_WAKE_S = 0.1  # an idle loop still wakes this often: new channels, stop flag, heartbeat
PUSH_RETRY_S = 0.5  # a worker's full ring is re-checked this often (a respawned worker replaces it)


def run_detokenizer(server_args: ServerArgs, socket_path: str, max_open: int = 8192) -> None:
    """The process's entry point (spawn it). server_args: model_path (for the tokenizer),
    transport, log_level. socket_path: where peers connect (must not exist yet).
    max_open: requests the detokenizer keeps open at once (queued ones included)."""
    from setproctitle import setproctitle

    setproctitle(PROCESS_TITLE)
    logging.basicConfig(
        level=server_args.log_level.upper(), format="%(asctime)s %(levelname)s detokenizer: %(message)s"
    )
    run_as_batch()
    detok = Detokenizer(server_args, socket_path)
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
    scheduler goes on with its next step (the path a forward waits on): less server CPU a
    token on the null model (docs/perf-notes.md). Linux only."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError) as e:  # another OS, or a sandbox that forbids it: a normal task
        logger.info("SCHED_BATCH unavailable (%s): the detokenizer runs as a normal task", e)


def connect_detokenizer(socket_path: str, waker, worker: int | None = None, timeout: float = 60.0):
    """The caller's channel from the detokenizer at `socket_path`, waiting up to `timeout` s
    for it to listen: the scheduler's TOKEN_OUT (worker=None, producer side) or HTTP worker
    k's TEXT_OUT (consumer side). `waker` is the caller's (ipc.Waker, or the zmq one)."""
    hello = {"role": "scheduler"} if worker is None else {"role": "worker", "worker": worker, "pid": os.getpid()}
    return connect(socket_path, waker, hello, timeout)[0]


class Detokenizer:
    def __init__(self, server_args: ServerArgs, socket_path: str) -> None:
        self.args = server_args
        self.socket_path = socket_path
        self.transport = get_transport(server_args.transport)
        self.waker = self.transport.make_waker()
        self.deltas: TextDeltas | None = None
        self.inputs: list = []  # TOKEN_OUT channels (one per scheduler; one in practice)
        self.outputs: dict[int, object] = {}  # worker -> its TEXT_OUT channel
        self.worker_pids: dict[int, int] = {}  # worker -> the pid of the process holding its channel
        self._stopping = False
        self.peers = PeerServer(socket_path, self._peer_channel, {"pid": os.getpid()})
        self.peers.start()

    def load(self, max_open: int) -> None:
        from transformers import AutoTokenizer

        from gpu.model_files import resolve_model_dir

        model_dir = resolve_model_dir(self.args.model_path)
        t0 = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.deltas = TextDeltas(tokenizer, max_open=max_open)
        core = self.deltas.core
        how = "numpy byte table" if core.table is not None else f"window decode ({core.fallback_reason})"
        logger.info(
            "tokenizer of %s (%d tokens) loaded in %.1f s; decoding with the %s; listening on %s",
            model_dir,
            core.vocab_size,
            time.perf_counter() - t0,
            how,
            self.socket_path,
        )

    def stop(self) -> None:
        self._stopping = True

    def serve(self) -> None:
        deltas, waker = self.deltas, self.waker
        while not self._stopping:
            if self.peers.has_events():
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
            if ch is None and self.peers.has_events():  # attached after this loop's last look
                self._attach_new()
                ch = self.outputs.get(worker)
            if ch is None:
                logger.warning("no channel to worker %d: %d text records dropped", worker, len(recs))
                continue
            done = ch.push(recs, part)
            while done < len(recs) and not self._stopping:  # back-pressure: wait for the worker
                self.waker.wait_room(ch, len(part), PUSH_RETRY_S)
                if self.peers.has_events():
                    self._attach_new()
                    if self.outputs.get(worker) is not ch:  # the worker exited, or was respawned
                        logger.warning(
                            "worker %d's process is gone: %d text records for it dropped", worker, len(recs) - done
                        )
                        break
                done += ch.push(recs[done:], part)

    def _attach_new(self) -> None:
        for event in self.peers.events():
            hello, ch = event.hello, event.channel
            if event.kind == "failed":
                if ch in self.inputs:
                    self.inputs.remove(ch)
                for worker in [w for w, c in self.outputs.items() if c is ch]:
                    del self.outputs[worker], self.worker_pids[worker]
                ch.close()
            elif hello["role"] == "scheduler":
                self.inputs.append(ch)
                logger.info("scheduler attached")
            elif event.kind == "exited":
                worker, pid = hello["worker"], hello["pid"]
                if self.worker_pids.get(worker) == pid:  # and no successor has taken its place
                    del self.worker_pids[worker]
                    self.outputs.pop(worker).close()
                    logger.info("worker %d (pid %d) exited: its channel is closed", worker, pid)
            else:
                old = self.outputs.pop(hello["worker"], None)
                if old is not None:
                    old.close()
                self.outputs[hello["worker"]] = ch
                self.worker_pids[hello["worker"]] = hello["pid"]
                logger.info("worker %d attached", hello["worker"])

    def _peer_channel(self, hello: dict, peer_waker_fd: int | None):
        """The scheduler's TOKEN_OUT or a worker's TEXT_OUT channel (the PeerServer's acceptor
        thread calls this)."""
        if hello.get("role") == "scheduler":
            return self.transport.create_channel(TOKEN_OUT_SPEC, "consumer", self.waker, peer_waker_fd)
        if (
            hello.get("role") == "worker"
            and isinstance(hello.get("worker"), int)
            and hello["worker"] >= 0
            and "pid" in hello
        ):
            return self.transport.create_channel(TEXT_OUT_SPEC, "producer", self.waker, peer_waker_fd)
        raise ValueError(
            f"unknown peer {hello!r}: expected role 'scheduler', or 'worker' with a worker index and its pid"
        )

    def close(self) -> None:
        self._stopping = True
        self.peers.close()
        for ch in [*self.inputs, *self.outputs.values()]:
            ch.close()
        self.inputs, self.outputs = [], {}
        self.waker.close()
