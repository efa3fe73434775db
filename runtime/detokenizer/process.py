"""The detokenizer process's loop (`ringserve::detokenizer`), DetokenizerProcess: pops the
scheduler's TOKEN_OUT batches, has the Detokenizer core (core.py) turn them into text deltas
and pushes each HTTP worker's TEXT_OUT records to that worker's channel, one push per worker
per batch.

Channels come from the detokenizer's own unix socket (ipc/peers.py), at start-up or later
(a worker that granian respawns reconnects).

    launcher:       run_detokenizer(server_args, socket_path)               main.py
    scheduler:      ch = connect_detokenizer(socket_path, waker)            TOKEN_OUT, producer side
    HTTP worker k:  ch = connect_detokenizer(socket_path, waker, worker=k)  TEXT_OUT, consumer side

The socket is listening as soon as the process has started (before the tokenizer is
loaded), so peers can connect right away. The process stops on SIGTERM / SIGINT; it then
closes its channels and removes the socket file.

No worker's stall stops the others (one stopped worker must not hold every stream of the
server). The loop never blocks on one worker's ring: records that do not fit a worker's
TEXT_OUT ring wait in that worker's backlog (in order: while a backlog exists, that worker's
new records go behind it), pushed as room appears, retried every iteration. With nothing
to pop the loop sleeps on its waker for both records in TOKEN_OUT and room in any
backlogged ring (`Waker.wait_any`). A backlog is bounded (BACKLOG_BYTES): past it the loop
stops popping TOKEN_OUT until that worker takes some (the back-pressure a slow worker
always got).

A worker that has records waiting and takes none for `--worker-stall-timeout` s (SIGSTOP, an
event loop stuck in synchronous work), or none for STALL_GRACE_S with its backlog past the
bound (a worker still reading gets back-pressure, a stopped one would hold every other
worker's streams until the deadline), is given up on: its backlog is dropped, every request
of it that was open here or had records in the backlog is closed here (its later tokens are
dropped as stale), and the backlog becomes one ERROR record (OVERLOADED) per such request,
pushed when the worker reads again. The scheduler is asked to abort those requests at once,
with ABORT records on a REQUEST channel the detokenizer opens to it for this (the stopped
worker cannot ask); the worker, reading the ERROR records later, sends its own ABORTs too,
which then find nothing to abort. The worker's text ring still
holds what it held when it stopped, so a resumed worker reads that text, then the errors.
A worker whose process exits or is replaced loses its backlog with its channel.

A push whose blob exceeds what the ring takes in one push is split (ipc/channel.py
`split_payload`); a record that alone can never fit (a request's text or logprobs of one
batch over half the arena) fails its request with an ERROR record instead. A batch that
the Detokenizer cannot handle is handled again one record at a time, failing only the
requests whose records raise (runtime/detokenizer/core.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import Any

import numpy as np

from ipc import ChannelSpec, get_transport
from ipc.channel import payload_sizes, split_payload
from ipc.peers import PeerServer, connect
from protocol.records import TEXT_OUT, TOKEN_OUT, TOKEN_OUT_ARENA_BYTES, ErrorCode, RequestKind
from protocol.request_records import pack_control
from runtime.config import ServerArgs
from runtime.detokenizer.core import Detokenizer
from runtime.detokenizer.text_out import error_records, split_by_worker

logger = logging.getLogger(__name__)

TOKEN_OUT_SPEC = ChannelSpec(TOKEN_OUT, capacity=16384, arena_bytes=TOKEN_OUT_ARENA_BYTES)  # scheduler -> detokenizer
TEXT_OUT_SPEC = ChannelSpec(TEXT_OUT, capacity=8192, arena_bytes=8 << 20)  # detokenizer -> worker k
SPIN_US = 50.0  # spin this long on an empty ring before sleeping on the eventfd
IDLE_WAKE_S = 0.1  # an idle loop still wakes this often: new channels, stop flag, heartbeat
BACKLOG_BYTES = 64 << 20  # a worker's backlog past this stops the loop's pops (back-pressure) until it takes some
ABORTS_CONNECT_TIMEOUT_S = 5.0  # the scheduler, asked to abort a stalled worker's requests, answers at once
STALL_GRACE_S = 1.0  # ... unless the worker took nothing for this long: then it is given up on at once
STALLED = b"the HTTP worker read none of its text for longer than --worker-stall-timeout: its requests were failed"


class Backlog:
    """One worker's TEXT_OUT records that its ring had no room for, in order."""

    __slots__ = ("pieces", "bytes", "since")

    def __init__(self, now: float) -> None:
        self.pieces: deque[tuple[np.ndarray, np.ndarray]] = deque()  # (records, their blob)
        self.bytes = 0  # records and blobs held
        self.since = now  # when the worker last took a record (or the backlog began)

    def add(self, records: np.ndarray, blob: np.ndarray) -> None:
        self.pieces.append((records, blob))
        self.bytes += records.nbytes + blob.nbytes


class Pacing:
    """The process's CPU policy, by load. Busy (more than LATENCY_OPEN requests open), it runs
    as SCHED_BATCH: the scheduler wakes it with each step's tokens, and a SCHED_NORMAL wakee
    preempts its waker on the waker's CPU, where the kernel likes to place it; as a batch task
    it runs when a CPU is free or at the next tick instead, and the scheduler goes on with its
    next step (the path a forward waits on): less server CPU a token on the null model
    (docs/perf-notes.md). With few requests open it is a normal task: a batch task waking on
    a busy machine waits for the next tick (milliseconds), and a lone request's first token
    would wait with it (perf/results/ttft.md). One syscall a switch, none otherwise. Linux only."""

    LATENCY_OPEN = 4

    def __init__(self) -> None:
        self.batch = False
        self.available = hasattr(os, "sched_setscheduler")

    def follow(self, num_open: int) -> None:
        """The policy for `num_open` open requests (call after each batch)."""
        if self.available and (num_open > self.LATENCY_OPEN) != self.batch:
            try:
                os.sched_setscheduler(0, os.SCHED_OTHER if self.batch else os.SCHED_BATCH, os.sched_param(0))
                self.batch = not self.batch
            except OSError as e:  # a sandbox that forbids it: a normal task
                logger.info("SCHED_BATCH unavailable (%s): the detokenizer runs as a normal task", e)
                self.available = False


def connect_detokenizer(socket_path: str, waker, worker: int | None = None, timeout: float = 60.0):
    """The caller's channel from the detokenizer at `socket_path`, waiting up to `timeout` s
    for it to listen: the scheduler's TOKEN_OUT (worker=None, producer side) or HTTP worker
    k's TEXT_OUT (consumer side). `waker` is the caller's (ipc.Waker, or the zmq one)."""
    hello = {"role": "scheduler"} if worker is None else {"role": "worker", "worker": worker, "pid": os.getpid()}
    return connect(socket_path, waker, hello, timeout)[0]


class DetokenizerProcess:
    def __init__(self, server_args: ServerArgs, socket_path: str, scheduler_socket: str | None = None) -> None:
        self.args = server_args
        self.socket_path = socket_path
        self.scheduler_socket = scheduler_socket
        self.aborts: Any = None  # a REQUEST channel to the scheduler, opened when first needed
        self.transport = get_transport(server_args.transport)
        self.waker = self.transport.make_waker()
        self.detokenizer: Detokenizer  # made by load()
        self.inputs: list = []  # TOKEN_OUT channels (one per scheduler; one in practice)
        self.outputs: dict[int, Any] = {}  # worker -> its TEXT_OUT channel
        self.worker_pids: dict[int, int] = {}  # worker -> the pid of the process holding its channel
        self.backlogs: dict[int, Backlog] = {}  # worker -> records waiting for room in its ring (none: empty)
        self.stall_timeout = server_args.worker_stall_timeout
        self._stopping = False
        self.peers = PeerServer(socket_path, self._peer_channel, {"pid": os.getpid()})
        self.peers.start()

    def load(self, max_open: int) -> None:
        from gpu.models.model_files import resolve_model_dir
        from runtime.tokenizer_load import load_tokenizer

        model_dir = resolve_model_dir(self.args.model_path)
        t0 = time.perf_counter()
        # --tokenizer-path; decoding is all this process does with it
        tokenizer = load_tokenizer(self.args.tokenizer_path or model_dir, decode_only=True)
        self.detokenizer = Detokenizer(tokenizer, max_open=max_open)
        core = self.detokenizer.incremental
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
        detokenizer, waker, pacing = self.detokenizer, self.waker, Pacing()
        while not self._stopping:
            if self.peers.has_events():
                self._attach_new()
            for ch in self.outputs.values():  # before any push: a reader that sees text sees a beat
                ch.beat()
            held = False  # a backlog past its bound: pop nothing until its worker takes some
            if self.backlogs:
                held = self._drain_backlogs()
            busy = False
            if not held:
                for ch in self.inputs:
                    batch = ch.pop()
                    if batch is not None:
                        busy = True
                        try:
                            records, blob = detokenizer.handle(batch)
                        except Exception:  # a bug: find the requests it concerns, fail only them
                            logger.exception("a batch of %d records failed: handled one record at a time", len(batch))
                            records, blob = detokenizer.handle_isolated(batch)
                        if len(records):
                            self._send(records, blob)
            if busy:
                pacing.follow(detokenizer.num_open)
                continue
            if self.backlogs:
                self._wait(held)
            else:
                waker.wait_readable(self.inputs, spin_us=SPIN_US, timeout=IDLE_WAKE_S)

    def _send(self, records, blob) -> None:
        """Each worker's records to its ring, never waiting: what does not fit goes to its backlog."""
        for worker, (recs, part) in split_by_worker(records, blob).items():
            ch = self.outputs.get(worker)
            if ch is None and self.peers.has_events():  # attached after this loop's last look
                self._attach_new()
                ch = self.outputs.get(worker)
            if ch is None:
                logger.warning("no channel to worker %d: %d text records dropped", worker, len(recs))
                continue
            limit = getattr(ch, "max_push_bytes", None)
            if limit is not None and len(part) > limit:
                pieces = self._pieces(recs, part, limit)
            else:
                pieces = [(recs, part)]
            backlog = self.backlogs.get(worker)
            for recs, part in pieces:
                if backlog is None:
                    done = ch.push(recs, part)
                    if done == len(recs):
                        continue
                    recs = recs[done:]
                    backlog = self.backlogs[worker] = Backlog(time.monotonic())
                backlog.add(recs, part)

    def _pieces(self, recs: np.ndarray, blob: np.ndarray, limit: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """A worker's records of one batch as pushes the ring can take; a record whose own
        payload never fits one fails its request instead."""
        big = np.flatnonzero(payload_sizes(recs, TEXT_OUT) > limit).tolist()
        if big:
            for k in big:
                w, s, gen = int(recs["worker"][k]), int(recs["slot"][k]), int(recs["gen"][k])
                logger.warning("request (%d, %d, %d): a text record over %d bytes: the request fails", w, s, gen, limit)
                recs[k : k + 1] = self.detokenizer.fail(w, s, gen, ErrorCode.INTERNAL, b"")[0]  # no payload
        return split_payload(recs, blob, TEXT_OUT, limit)

    def _drain_backlogs(self) -> bool:
        """Pushes what each backlogged worker's ring takes now; gives up on a worker stalled
        past the deadline. True when some backlog is still past its bound."""
        now, held = time.monotonic(), False
        for worker, backlog in list(self.backlogs.items()):
            ch = self.outputs.get(worker)
            if ch is None:  # the worker is gone: nobody will read them
                del self.backlogs[worker]
                continue
            pieces = backlog.pieces
            while pieces:
                recs, blob = pieces[0]
                done = ch.push(recs, blob)
                if done == 0:
                    break
                backlog.since = now
                if done < len(recs):
                    pieces[0] = (recs[done:], blob)
                    backlog.bytes -= done * recs.itemsize
                    break
                pieces.popleft()
                backlog.bytes -= recs.nbytes + blob.nbytes
            if not pieces:
                del self.backlogs[worker]
            elif now - backlog.since > self.stall_timeout:
                self._give_up(worker, backlog, now)
            elif backlog.bytes > BACKLOG_BYTES:
                if now - backlog.since > STALL_GRACE_S:  # not reading at all: no back-pressure for it
                    self._give_up(worker, backlog, now)
                else:
                    held = True
        return held

    def _give_up(self, worker: int, backlog: Backlog, now: float) -> None:
        """Worker `worker` took nothing for stall_timeout s: its backlog becomes one ERROR record
        per request it concerned or that is open here, and those requests are closed here."""
        seen = self.detokenizer.close_worker(worker)
        for recs, _ in backlog.pieces:
            seen.extend(zip(recs["slot"].tolist(), recs["gen"].tolist()))
        addrs = list(dict.fromkeys(seen))
        slots, gens = [a[0] for a in addrs], [a[1] for a in addrs]
        errors, message = error_records(worker, slots, gens, ErrorCode.OVERLOADED, STALLED)
        logger.warning(
            "worker %d read none of its text for %.1f s (%d bytes waiting for it): %d of its requests fail",
            worker,
            now - backlog.since,
            backlog.bytes,
            len(addrs),
        )
        self._abort_in_scheduler(worker, slots, gens)
        fresh = Backlog(now)
        if len(errors):
            fresh.add(errors, message)
        self.backlogs[worker] = fresh

    def _abort_in_scheduler(self, worker: int, slots: list[int], gens: list[int]) -> None:
        """The scheduler stops generating for the requests given up on, which the stopped worker
        cannot ask it to: ABORT records on a REQUEST channel of the detokenizer's own."""
        if self.scheduler_socket is None or not slots:
            return
        recs = pack_control(RequestKind.ABORT, worker, slots, gens)
        try:
            if self.aborts is None:
                hello = {"role": "detokenizer", "pid": os.getpid()}
                self.aborts = connect(self.scheduler_socket, self.waker, hello, ABORTS_CONNECT_TIMEOUT_S)[0]
            self.aborts.push_all(recs, timeout=ABORTS_CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as e:  # they run to their end instead: logged, nothing else lost
            logger.error("could not ask the scheduler to abort worker %d's %d requests: %s", worker, len(slots), e)

    def _wait(self, held: bool) -> None:
        """Sleeps until TOKEN_OUT has records (unless held back) or a backlogged ring has room
        for its next push, IDLE_WAKE_S at most (the stall deadlines are checked on waking)."""
        room = [
            (self.outputs[w], len(b.pieces[0][1])) for w, b in self.backlogs.items() if w in self.outputs and b.pieces
        ]
        wait_any = getattr(self.waker, "wait_any", None)
        if wait_any is None:  # the zmq baseline: poll
            time.sleep(0.001)
            return
        wait_any([] if held else self.inputs, room, spin_us=SPIN_US, timeout=IDLE_WAKE_S)

    def _attach_new(self) -> None:
        for event in self.peers.events():
            hello, ch = event.hello, event.channel
            if event.kind == "failed":
                if ch in self.inputs:
                    self.inputs.remove(ch)
                for worker in [w for w, c in self.outputs.items() if c is ch]:
                    del self.outputs[worker], self.worker_pids[worker]
                    self.backlogs.pop(worker, None)
                ch.close()
            elif hello["role"] == "scheduler":
                self.inputs.append(ch)
                logger.info("scheduler attached")
            elif event.kind == "exited":
                worker, pid = hello["worker"], hello["pid"]
                if self.worker_pids.get(worker) == pid:  # and no successor has taken its place
                    del self.worker_pids[worker]
                    self.outputs.pop(worker).close()
                    self.backlogs.pop(worker, None)
                    logger.info("worker %d (pid %d) exited: its channel is closed", worker, pid)
            else:
                old = self.outputs.pop(hello["worker"], None)
                if old is not None:
                    old.close()
                self.backlogs.pop(hello["worker"], None)  # records for the previous process's requests
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
        for ch in [*self.inputs, *self.outputs.values(), *([self.aborts] if self.aborts is not None else [])]:
            ch.close()
        self.inputs, self.outputs, self.aborts = [], {}, None
        self.waker.close()
