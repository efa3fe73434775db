"""The Scheduler+Worker process's loop (`ringserve::scheduler`), SchedulerProcess: a plain synchronous loop around
the Scheduler core (runtime/scheduler/core.py) and the model runner.

Each iteration: pop every HTTP worker's REQUEST channel (new requests, aborts, cache
flushes), run one step, and push that step's TOKEN_OUT records to the detokenizer in one
batch (the protocol: docs/architecture.md, "Records"): an OPEN record per request received since
the last step, then one record per request with news. While there is work the loop never
makes a syscall to look for more; idle, it sleeps on its eventfd. The heartbeats (each ring's header and the
published EngineStats) advance after each iteration, before each forward and between a
forward's layers (so a prefill of minutes is seen busy, and a stopped or stuck one hung), at
most once a millisecond while busy, and always before the loop sleeps.

    launcher:       run_scheduler(server_args, socket_path, detokenizer_socket, stats_path)  main.py
    HTTP worker k:  request_ch, meta = connect_scheduler(socket_path, waker, worker=k)

The socket (ipc/peers.py) is bound only once the model is loaded and the detokenizer
connected, so a socket file means the scheduler is ready. A worker that connects again
(granian respawned it) replaces its channel, and the requests of its previous process are
aborted. The scheduler core builds the TOKEN and ERROR records itself; token_out.py adds the
OPEN records and the payloads.

No request can stop the loop: an exception that concerns one request (its record cannot be
read, adding it fails, its OPEN record cannot be built) ends that request with an ERROR
record, logged, and the loop goes on. A step's push whose blob exceeds what one push of the
TOKEN_OUT channel may carry (`Channel.max_push_bytes`, half its arena) goes in several pushes
(`Channel.push_all` splits it); a record whose own payload can never fit (an OPEN whose stop
strings, so many or so long, exceed that limit) is replaced by an ERROR record for its
request (INVALID_REQUEST), which is aborted here. The common case pays one length check.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from ipc import ChannelSpec, get_transport
from ipc.channel import payload_sizes
from ipc.peers import PeerServer
from protocol.payloads import PayloadBuilder
from protocol.records import REQUEST, REQUEST_ARENA_BYTES, TOKEN_OUT, ErrorCode, RequestKind
from protocol.request_records import call_args, unpack_request
from runtime.config import ServerArgs
from runtime.heap_trim import IdleTrim
from runtime.scheduler.config import SchedulerConfig
from runtime.scheduler.connect import connect_scheduler as connect_scheduler
from runtime.scheduler.control import EngineControl, Pending, parse_args, reply
from runtime.scheduler.core import Scheduler
from runtime.scheduler.step_result import StepResult
from runtime.scheduler.token_out import error_record, reply_record, step_records

if TYPE_CHECKING:
    from runtime.engine_stats import EngineStats  # imported by start() when the stats are published

logger = logging.getLogger(__name__)

REQUEST_SPEC = ChannelSpec(REQUEST, capacity=4096, arena_bytes=REQUEST_ARENA_BYTES)  # worker k -> scheduler
ABORTS_SPEC = ChannelSpec(REQUEST, capacity=4096)  # detokenizer -> scheduler: ABORT records, no payload
DETOKENIZER_INPUT = -1  # the key of the detokenizer's channel among the inputs (workers are 0, 1, ...)
SPIN_US = 50.0  # spin this long on empty rings before sleeping on the eventfd
IDLE_WAKE_S = 0.1  # an idle loop still wakes this often: new channels, stop flag, heartbeat
TRIM_AFTER_IDLE_S = 1.0  # idle this long after a burst, the heap is trimmed (runtime/heap_trim.py)
GRAMMAR_POLL_S = 0.002  # with only grammar compiles pending, the loop looks for a finished one this often
PUBLISH_EVERY_NS = 1_000_000  # heartbeats and stats while busy (watchdogs allow seconds)
_NEW, _ABORT, _FLUSH, _ABORT_RID, _ABORT_ALL, _CONTROL = map(
    int,
    (
        RequestKind.NEW,
        RequestKind.ABORT,
        RequestKind.FLUSH_CACHE,
        RequestKind.ABORT_RID,
        RequestKind.ABORT_ALL,
        RequestKind.CONTROL,
    ),
)


class SchedulerProcess:
    def __init__(
        self, server_args: ServerArgs, socket_path: str, detokenizer_socket: str, stats_path: str | None
    ) -> None:
        self.args = server_args
        self.socket_path = socket_path
        self.detokenizer_socket = detokenizer_socket
        self.stats_path = stats_path
        self.transport = get_transport(server_args.transport)
        self.waker = self.transport.make_waker()
        self.inputs: dict[int, Any] = {}  # worker -> its REQUEST channel
        self.worker_pids: dict[int, int] = {}  # worker -> the pid of the process holding its channel
        self._input_list: list = []
        self.token_out: Any = None  # the TOKEN_OUT channel, from start()
        self._max_push = math.inf  # the most payload bytes one TOKEN_OUT push may carry
        self._has_depth = False
        self._published_ns = 0  # when _publish last stored
        self.stats: EngineStats | None = None
        self.scheduler: Scheduler  # made by start(), as the peers below
        self.meta: dict = {}
        self.peers: PeerServer
        self._stopping = False
        self._trim: IdleTrim  # made by start(), with the runner whose buffers it releases

    def start(self) -> None:
        from runtime.detokenizer.process import connect_detokenizer
        from runtime.scheduler.runner import make_runner

        t0 = time.perf_counter()
        runner = make_runner(self.args, progress=self._publish)  # forwards run only once start() is done
        cfg = runner.model_config
        config = SchedulerConfig.from_server_args(self.args, cfg.context_length)
        self.scheduler = Scheduler(runner, config, heartbeat=self._publish)
        self._trim = IdleTrim(TRIM_AFTER_IDLE_S, release=runner.idle)
        self.control = EngineControl(self.scheduler)
        self._pending: list[tuple[Pending, int, int, int]] = []  # engine calls answered later, and their callers
        pool = runner.pool
        self.meta = {
            "pid": os.getpid(),
            "context_length": cfg.context_length,
            "vocab_size": cfg.vocab_size,
            "eos_token_ids": list(cfg.eos_token_ids),
            "page_size": pool.page_size,
            "kv_pages": pool.num_pages,
            "max_total_tokens": pool.num_pages * pool.page_size,
            "max_running_requests": config.max_running_requests,
            "attention_backend": getattr(runner, "attention_backend", "null"),
            "null_model": self.args.null_model,
        }
        logger.info(
            "%s loaded in %.1f s: KV cache of %d tokens (%d pages of %d), attention backend %s, "
            "up to %d running requests, context %d",
            "null model" if self.args.null_model else cfg.model_dir,
            time.perf_counter() - t0,
            self.meta["max_total_tokens"],
            pool.num_pages,
            pool.page_size,
            self.meta["attention_backend"],
            config.max_running_requests,
            cfg.context_length,
        )
        if self.stats_path is not None:
            from runtime.engine_stats import EngineStats

            self.stats = EngineStats.create(self.stats_path)
            loras = self.scheduler.loras
            if loras is not None:  # every worker reads the adapters' names and ids from here
                from runtime.lora_registry import LoraRegistry, loads_path

                loras.registry = LoraRegistry.create(self.stats_path, self.args.max_loaded_loras)
                loras.restore(loads_path(self.stats_path))  # a replaced engine's run-time loads
                loras.publish()
        self.token_out = connect_detokenizer(self.detokenizer_socket, self.waker)
        self._has_depth = hasattr(self.token_out, "__len__")  # the zmq baseline cannot tell
        self._max_push = getattr(self.token_out, "max_push_bytes", None) or math.inf  # zmq: no arena
        self.peers = PeerServer(self.socket_path, self._request_channel, self.meta)
        self.peers.start()
        self._publish()

    def stop(self) -> None:
        self._stopping = True

    # ---------------------------------------------------------------- the loop
    def serve(self) -> None:
        sched, waker = self.scheduler, self.waker
        while not self._stopping:
            if self.peers.has_events():
                self._attach_new()
            for ch in self._input_list:
                batch = ch.pop()
                if batch is not None:
                    self._handle_requests(batch)
            if sched.has_work:
                self._send(sched.step())
                self._trim.worked()
            if self._pending:
                self._answer_pending()
            self._publish(force=not sched.has_work)  # about to sleep: what /metrics shows is final
            if not sched.has_work:
                self._trim.idle()
                waker.wait_readable(self._input_list, spin_us=SPIN_US, timeout=IDLE_WAKE_S)
            elif sched.only_compiling:
                # Nothing runs until a compile (in the grammar pool) finishes: sleep on the
                # eventfd (a new request still wakes the loop at once) for a few ms at a time.
                # A wakeup from the pool's done-callback could be lost: the wait drains the
                # eventfd before it sleeps, and the grammar's readiness is not a ring it re-checks.
                waker.wait_readable(self._input_list, timeout=GRAMMAR_POLL_S)

    def _handle_requests(self, batch) -> None:
        sched = self.scheduler
        recs = batch.records
        for kind, worker, slot, gen, i in zip(
            recs["kind"].tolist(),
            recs["worker"].tolist(),
            recs["slot"].tolist(),
            recs["gen"].tolist(),
            range(len(recs)),
        ):
            if kind == _NEW:
                try:
                    params, prompt = unpack_request(recs[i], batch.payload)
                except Exception as e:  # a malformed record ends its own request, nothing else
                    logger.error("request (%d, %d, %d): unreadable record: %s", worker, slot, gen, e)
                    self._push_error(worker, slot, gen, ErrorCode.INVALID_REQUEST, "unreadable request record")
                    continue
                try:
                    sched.add_request(worker, slot, gen, prompt, params, tag=int(recs["rid_hash"][i]))
                except Exception:  # a bug that one request meets ends that request, nothing else
                    logger.exception("request (%d, %d, %d): could not be added", worker, slot, gen)
                    sched.abort(worker, slot, gen)  # whatever of it was registered
                    self._push_error(worker, slot, gen, ErrorCode.INTERNAL, "the scheduler could not add the request")
            elif kind == _ABORT:
                sched.abort(worker, slot, gen)
            elif kind == _ABORT_RID:
                rid = int(recs["rid_hash"][i])
                aborted = sched.abort_where(lambda r: r.tag == rid)
                logger.info("abort by rid from worker %d: %d requests", worker, aborted)
            elif kind == _ABORT_ALL:
                logger.info(
                    "abort of every request from worker %d: %d requests", worker, sched.abort_where(lambda r: True)
                )
            elif kind == _FLUSH:
                freed = sched.flush_cache()
                logger.info("cache flushed: %d pages freed", freed)
            elif kind == _CONTROL:
                self._call(worker, slot, gen, call_args(recs[i], batch.payload))
            else:
                logger.error("request record of unknown kind %d from worker %d dropped", kind, worker)

    # ---------------------------------------------------------------- token out
    def _send(self, res: StepResult) -> None:
        """This step's records (token_out.py) in one push, several when its blob is over what one
        push may carry."""
        if res.empty:
            return
        ev, blob = step_records(res, self.scheduler)
        if len(blob) > self._max_push:  # several pushes (push_all splits); none may be too big alone
            ev, blob = self._refuse_oversize(ev, blob)
        self.token_out.push_all(ev, blob)

    def _refuse_oversize(self, ev: np.ndarray, blob: bytes) -> tuple[np.ndarray, bytes]:
        """`ev` with every record whose own payload can never fit a push (an OPEN with too
        many or too long stop strings) replaced by an ERROR record for its request, which is
        aborted: the detokenizer then never opens it and drops its tokens, its worker gets
        the error."""
        sizes = payload_sizes(ev, TOKEN_OUT)
        big = np.flatnonzero(sizes > self._max_push).tolist()
        if not big:
            return ev, blob
        payload = PayloadBuilder()
        payload.add(blob)
        for k in big:
            w, s, g = int(ev["worker"][k]), int(ev["slot"][k]), int(ev["gen"][k])
            message = (
                f"the request's stop strings ({int(sizes[k])} bytes for the engine) exceed the "
                f"{int(self._max_push)} bytes the scheduler can pass on for one request"
            )
            logger.warning("request (%d, %d, %d) failed: %s", w, s, g, message)
            self.scheduler.abort(w, s, g)
            ev[k : k + 1] = np.frombuffer(
                error_record(w, s, g, ErrorCode.INVALID_REQUEST, payload, message.encode()), TOKEN_OUT.dtype
            )
        return ev, payload.blob()

    def _call(self, worker: int, slot: int, gen: int, raw: bytes) -> None:
        """An engine call (control.py), answered with its REPLY at once, or once it is ready (an
        unload waiting for its adapter's requests); the stats published then, so that /health
        shows a pause from every worker."""
        try:
            answer = self.control.call(parse_args(raw))
        except Exception as e:  # a bug, or a malformed call: its caller gets the reason
            logger.exception("engine call from worker %d failed", worker)
            answer = reply(False, f"the engine call failed: {e!r}")
        if isinstance(answer, Pending):
            self._pending.append((answer, worker, slot, gen))
            return
        self._reply(worker, slot, gen, answer)

    def _answer_pending(self) -> None:
        """The engine calls whose answer became ready (an unload whose last request ended)."""
        waiting = []
        for pending, worker, slot, gen in self._pending:
            answer = pending.poll()
            if answer is None:
                waiting.append((pending, worker, slot, gen))
            else:
                self._reply(worker, slot, gen, answer)
        self._pending = waiting

    def _reply(self, worker: int, slot: int, gen: int, answer: dict[str, Any]) -> None:
        payload = PayloadBuilder()
        rec = reply_record(worker, slot, gen, payload, orjson.dumps(answer))
        self.token_out.push_all(np.frombuffer(rec, TOKEN_OUT.dtype), payload.blob())
        self._publish(force=True)

    def _push_error(self, worker: int, slot: int, gen: int, code: ErrorCode, message: str) -> None:
        payload = PayloadBuilder()
        rec = error_record(worker, slot, gen, code, payload, message.encode())
        self.token_out.push_all(np.frombuffer(rec, TOKEN_OUT.dtype), payload.blob())

    def _publish(self, force: bool = False) -> None:
        """Heartbeats (each ring's header, EngineStats) and stats: plain stores, no syscall;
        after each iteration, before each forward and between its layers, at most every PUBLISH_EVERY_NS unless
        forced (each publish is a small but real share of a null-model step, whose speed the
        whole token path's cost follows; docs/perf-notes.md)."""
        now = time.monotonic_ns()
        if not force and now - self._published_ns < PUBLISH_EVERY_NS:
            return
        self._published_ns = now
        self.token_out.beat()
        for ch in self._input_list:
            ch.beat()
        if self.stats is not None:
            self.stats.publish(self.scheduler, len(self.token_out) if self._has_depth else 0)
        if self.scheduler.loras is not None:
            self.scheduler.loras.count()

    # ---------------------------------------------------------------- workers attaching
    def _attach_new(self) -> None:
        for event in self.peers.events():
            worker, pid = event.hello.get("worker", DETOKENIZER_INPUT), event.hello["pid"]
            if event.kind == "exited":
                if self.worker_pids.get(worker) == pid:  # and no successor has taken its place
                    del self.worker_pids[worker]
                    aborted = self._retire(worker)
                    logger.log(
                        logging.WARNING if aborted else logging.INFO,  # none: a clean stop
                        "worker %d (pid %d) exited: %d of its requests aborted",
                        worker,
                        pid,
                        aborted,
                    )
            elif event.kind == "failed":
                if self.inputs.get(worker) is event.channel:
                    del self.worker_pids[worker]
                    self._retire(worker)
                else:
                    event.channel.close()
            elif worker in self.inputs:
                logger.info(
                    "worker %d reconnected: %d requests of its previous process aborted", worker, self._retire(worker)
                )
                self._add_input(worker, pid, event.channel)
            else:
                logger.info("worker %d attached", worker)
                self._add_input(worker, pid, event.channel)

    def _add_input(self, worker: int, pid: int, channel) -> None:
        self.inputs[worker] = channel
        self.worker_pids[worker] = pid
        self._input_list = list(self.inputs.values())

    def _retire(self, worker: int) -> int:
        """Closes `worker`'s channel and ends every request of the process that held it."""
        self.inputs.pop(worker).close()
        self._input_list = list(self.inputs.values())
        return self.scheduler.abort_where(lambda r: r.worker == worker)

    def _request_channel(self, hello: dict, peer_waker_fd: int | None):
        """A worker's REQUEST channel, or the detokenizer's (its aborts of the requests of a
        worker it gave up on); the PeerServer's acceptor thread calls this."""
        if hello.get("role") == "detokenizer" and "pid" in hello:
            return self.transport.create_channel(ABORTS_SPEC, "consumer", self.waker, peer_waker_fd)
        worker = hello.get("worker")
        if not isinstance(worker, int) or not 0 <= worker < 1 << 16 or "pid" not in hello:
            raise ValueError(f"unknown peer {hello!r}: expected a worker index and its pid")
        return self.transport.create_channel(REQUEST_SPEC, "consumer", self.waker, peer_waker_fd)

    def close(self) -> None:
        self._stopping = True
        scheduler, peers = getattr(self, "scheduler", None), getattr(self, "peers", None)  # unset: start() failed first
        if scheduler is not None:
            scheduler.close()
        if peers is not None:
            peers.close()
        for ch in self.inputs.values():
            ch.close()
        self.inputs, self._input_list = {}, []
        if self.token_out is not None:
            self.token_out.close()
        if self.stats is not None:
            self.stats.close()
        loras = getattr(scheduler, "loras", None)
        if loras is not None and loras.registry is not None:
            loras.registry.close()
        self.waker.close()
