"""One granian worker's engine client (HTTPWorkerProcess): its rings to the engine (the REQUEST
records it sends, the TEXT_OUT batches it reads), its TokenizerManager, the healer of its
engine, its metrics; and what the routes ask of them. Started by main.py's start_http_worker."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import numpy as np

from httpapi.errors import bad_request, engine_unavailable
from httpapi.info import served_model_names
from httpapi.logprobs import LogprobVocab
from httpapi.responses import now
from httpapi.sampling import SamplingSpec, check_max_logprobs, logprob_entries
from protocol.sampling_params import MAX_LOGPROB_ENTRIES, SamplingParams
from runtime.config import ServerArgs
from runtime.engine_stats import EngineStats
from runtime.http_worker.core import TokenizerManager
from runtime.http_worker.disconnect import DisconnectWatches
from runtime.http_worker.grammar_checks import GrammarChecks
from runtime.http_worker.metrics import WorkerMetrics
from runtime.http_worker.req_state import ReqGroup, ReqState
from runtime.http_worker.request_dump import RequestDump
from runtime.http_worker.request_log import RequestLog
from runtime.http_worker.response_store import ResponseStore
from runtime.lora_registry import LoraRegistry
from runtime.supervise.files import ServerFiles
from runtime.supervise.healer import EngineHealer
from runtime.supervise.launcher import EngineLink
from runtime.supervise.watchdog import HEARTBEAT_STALE_S
from runtime.supervise.worker_watch import WorkerBeat, granian_replaces_workers
from structured.reasoning import make_reasoning_parser
from structured.tool_parsers import template_tool_call_parser

logger = logging.getLogger("ringserve.app")

METRICS_FLUSH_S = 1.0  # locally counted latencies reach the shared metrics files this often
TIMEOUT_SWEEP_S = 1.0  # requests past their deadline are failed this often (at most)


class RequestOutbox:
    """REQUEST records to the scheduler, in order: pushed at once when the ring has room,
    else queued behind what waits and pushed as room comes (run)."""

    def __init__(self, request_ch: Any) -> None:
        self.request_ch = request_ch
        self._waiting: list[tuple[np.ndarray, bytes | None]] = []
        self._ready = asyncio.Event()

    def send(self, records: np.ndarray, blob: bytes | None) -> None:
        if not self._waiting:
            done = self.request_ch.push(records, blob)
            if done == len(records):
                return
            records = records[done:]
        self._waiting.append((records, blob))
        self._ready.set()

    async def run(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._waiting:
                records, blob = self._waiting[0]
                await self.request_ch.push_all_async(records, blob)
                self._waiting.pop(0)

    def clear(self) -> None:
        """The engine is lost (its requests failed): what waited for room is dropped."""
        self._waiting.clear()

    def attach(self, request_ch: Any) -> None:
        """A new engine's channel, for a new run()."""
        self.request_ch = request_ch
        self._ready = asyncio.Event()


class HTTPWorkerProcess:
    """One granian worker's state: its rings, TokenizerManager, engine healer and metrics."""

    def __init__(
        self,
        args: ServerArgs,
        files: ServerFiles,
        link: EngineLink,
        outbox: RequestOutbox,
        tm: TokenizerManager,
        vocab: LogprobVocab,
        metrics: WorkerMetrics,
    ) -> None:
        self.args, self.files, self.outbox, self.tm = args, files, outbox, tm
        self.model = tm.model
        self.served_names = served_model_names(args.model_path, args.served_model_name)  # the first: tm.model's
        self.loras: LoraRegistry | None = None  # the engine's adapters, opened on first use: the scheduler creates it
        self.request_log = RequestLog() if args.log_requests else None
        self.dump = (
            RequestDump(args.dump_requests_folder, link.worker, args.dump_requests_max_bytes)
            if args.dump_requests_folder
            else None
        )
        self.vocab = vocab
        self.metrics = metrics
        self.kv_tokens: int | None = link.meta.get("max_total_tokens")  # may hold less than the context
        self.started = now()
        self.index_header = str(link.worker)
        template = tm.tokenizer.chat_template if isinstance(tm.tokenizer.chat_template, str) else None
        self.reasoning = make_reasoning_parser(args.reasoning_parser) if args.reasoning_parser else None
        self.tool_call_parser = args.tool_call_parser or template_tool_call_parser(template)
        self.template_renders_tools = template is not None and "tools" in template
        self.health_token = tm.tokenizer.bos_token_id if tm.tokenizer.bos_token_id is not None else 0
        self.stats: EngineStats | None = None  # opened on first use: the scheduler creates it
        self.healer = EngineHealer(args, files, link, self)
        # the worker index, hence its file, stays when the engine is replaced
        self.beat = WorkerBeat(files.worker_lock(link.worker), args.worker_stall_timeout, granian_replaces_workers())
        self.watches = DisconnectWatches()
        self.grammar_checks = GrammarChecks(args.grammar_backend, args.constrained_json_any_whitespace)
        self.responses = ResponseStore(files.responses)
        self.background: set[asyncio.Task] = set()  # background responses running in this worker
        self.text_ch, self.waker = link.text_ch, link.waker
        self._io: list[asyncio.Task] = []  # the reader and the outbox, on the engine's channels
        self._tasks: list[asyncio.Task] = []  # timeouts, metrics flushing, disconnect watches

    @property
    def link(self) -> EngineLink:
        """The engine attached now."""
        return self.healer.link

    def start(self) -> None:
        self.beat.start()
        self._start_io()
        self.healer.start()
        self._tasks = [
            asyncio.create_task(self._sweep_loop(), name="tm-timeouts"),
            asyncio.create_task(self._flush_metrics()),
            asyncio.create_task(self.watches.run()),
        ]

    async def close(self) -> None:
        self.beat.close()
        await self.healer.close()
        for task in self._tasks:
            task.cancel()
        self.metrics.flush()
        self.tm.close()
        await self._stop_io()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.stats is not None:
            self.stats.close()
        if self.loras is not None:
            self.loras.close()
        self.grammar_checks.close()
        for task in self.background:
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        self.responses.close()
        if self.dump is not None:
            self.dump.close()
        self.link.close(self.files)

    # ---------------------------------------------------------------- the rings

    def _start_io(self) -> None:
        self._io = [
            asyncio.create_task(self._read_loop(), name="tm-reader"),
            asyncio.create_task(self.outbox.run(), name="tm-sender"),
        ]

    async def _stop_io(self) -> None:
        for task in self._io:
            task.cancel()
        await asyncio.gather(*self._io, return_exceptions=True)
        self._io = []

    async def _read_loop(self) -> None:
        ch, waker = self.text_ch, self.waker
        while True:
            batch = ch.pop()
            if batch is None:
                await waker.wait_readable_async([ch])
                continue
            try:
                self.tm.dispatch(batch.records, batch.payload)
            except Exception:  # a bug here must not silence every stream of the worker
                logger.exception("text-out batch of %d records dropped", len(batch.records))

    async def _sweep_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(TIMEOUT_SWEEP_S)
            self.tm.sweep_timeouts(loop.time())

    async def _flush_metrics(self) -> None:
        while True:
            await asyncio.sleep(METRICS_FLUSH_S)
            self.metrics.flush()

    def ring_depths(self) -> dict[str, int]:
        """Records waiting in this worker's rings (the zmq baseline cannot tell)."""
        return {
            name: len(ch)
            for name, ch in (("request", self.outbox.request_ch), ("text_out", self.text_ch))
            if hasattr(ch, "__len__")
        }

    # ---------------------------------------------------------------- the healer's (EngineClient)

    def engine_lost(self, message: str) -> None:
        self.tm.fail_all(engine_unavailable(message))

    async def detach(self) -> None:
        """The channels stay open (an abort still pushes into them, harmlessly) until the
        healer closes them."""
        await self._stop_io()
        self.outbox.clear()
        if self.stats is not None:  # the new scheduler publishes afresh
            self.stats.close()
            self.stats = None
        if self.loras is not None:  # its adapters are --lora-paths' again
            self.loras.close()
            self.loras = None

    def attach(self, link: EngineLink) -> None:
        self.kv_tokens = link.meta.get("max_total_tokens")
        self.outbox.attach(link.request_ch)
        self.text_ch, self.waker = link.text_ch, link.waker
        self._start_io()
        self.tm.resume()

    def engine_gone(self, message: str) -> None:
        self.tm.dead = engine_unavailable(message)

    # ---------------------------------------------------------------- used by the routes

    def check_alive(self) -> None:
        if self.tm.dead is not None:
            raise self.tm.dead.fresh()

    def sampling_params(self, spec: SamplingSpec, prompt_ids: list[int], lora_id: int = 0) -> SamplingParams:
        """A request's final sampling parameters for one tokenized prompt, run with LoRA adapter
        `lora_id` (0: the base model); raises APIError(400)."""
        m = self.model
        params = spec.resolve(prompt_ids, m.context_length, m.vocab_size, self.kv_tokens)
        check_max_logprobs(params, spec.names, self.args.max_logprobs, len(prompt_ids))
        return dataclasses.replace(params, lora_id=lora_id) if lora_id else params

    async def submit(
        self, endpoint: str, prompts: list, params: list[SamplingParams], n: int, rids: list[str], stream: bool
    ) -> ReqGroup:
        """n choices of each prompt, prompt-major. A seeded prompt's j-th choice samples with
        seed + j, as vLLM's: the n samples differ, and the request is still reproducible."""
        if any(p.logprobs or p.prompt_logprobs >= 0 for p in params):
            self._check_logprob_entries(prompts, params, n)
        self.metrics.count_request(endpoint)
        for p in params:
            if p.lora_id and self.loras is not None:
                self.metrics.name_adapter(p.lora_id, self.loras.name_of(p.lora_id))
        choice_params = [
            p if p.seed is None or j == 0 else dataclasses.replace(p, seed=_wrap_int64(p.seed + j))
            for p in params
            for j in range(n)
        ]
        group = await self.tm.submit([ids for ids in prompts for _ in range(n)], choice_params, rids, stream)
        if self.request_log is not None:
            self.request_log.submitted(group, endpoint)
        if self.dump is not None:
            self.dump.submitted(group, endpoint, prompts, params, n)
        return group

    @staticmethod
    def _check_logprob_entries(prompts: list, params: list[SamplingParams], n: int) -> None:
        """A 400 naming n when the choices' logprobs alternatives in all are more than
        MAX_LOGPROB_ENTRIES (each choice's were bounded on its own: check_max_logprobs)."""
        entries = n * sum(sum(logprob_entries(p, len(ids)).values()) for p, ids in zip(params, prompts))
        if entries > MAX_LOGPROB_ENTRIES:
            raise bad_request(
                f"n: {n} choices of {len(prompts)} prompts ask for {entries} logprobs in all; a request may ask "
                f"for at most {MAX_LOGPROB_ENTRIES}",
                "n",
            )

    def observe(self, group: ReqGroup) -> None:
        """A request that ended, whichever way: ran to its end, aborted (/abort_request, its
        client gone, timed out) or failed; once, when it ended."""
        end_ns = time.monotonic_ns()
        self.metrics.observe_request(group.arrival_ns, end_ns, group.states)
        if self.request_log is not None:
            self.request_log.ended(group, end_ns)
        if self.dump is not None:
            self.dump.ended(group)

    def observe_delta(self, state: ReqState, now_ns: int) -> None:
        """A streamed delta about to be sent."""
        self.metrics.observe_delta(state, now_ns)

    @property
    def adapters(self) -> dict[str, int] | None:
        """LoRA adapter name -> the id its requests carry, as the scheduler published them now
        (runtime/lora_registry.py); None without --enable-lora."""
        if not self.args.enable_lora:
            return None
        if self.loras is None:
            self.loras = LoraRegistry.open(self.files.stats, self.args.max_loaded_loras)
            if self.loras is None:
                return {}
        return self.loras.names()

    def lora_counters(self) -> dict[str, int] | None:
        """The engine's adapter pool: registered, resident, loads, evictions (/metrics)."""
        return None if self.adapters is None or self.loras is None else self.loras.counters()

    def engine_stats(self) -> dict[str, int | float] | None:
        if self.stats is None:
            self.stats = EngineStats.open(self.files.stats)
        return None if self.stats is None else self.stats.read()

    def health_problem(self) -> str | None:
        """Why /health is not 200, or None."""
        if self.tm.dead is not None:
            return self.tm.dead.message
        stats = self.engine_stats()
        if stats is not None and stats["updated_ns"]:
            age = (time.monotonic_ns() - stats["updated_ns"]) * 1e-9
            if age > min(HEARTBEAT_STALE_S, self.args.watchdog_timeout):
                return f"The scheduler has made no progress (no step, no layer of a forward) for {age:.0f} s."
        return None

    def engine_state(self) -> dict:
        """What /get_server_info adds to the arguments: the engine as the scheduler described it."""
        link = self.link
        return {
            "max_total_num_tokens": link.meta.get("max_total_tokens"),
            "context_length": self.model.context_length,
            "attention_backend": link.meta.get("attention_backend"),
            "worker_index": link.worker,
            "engine": {p.role: p.pid for p in link.procs},
            "engine_up": self.tm.dead is None,
            "internal_states": [self.engine_stats() or {}],
        }


def _wrap_int64(value: int) -> int:
    return (value + 2**63) % 2**64 - 2**63
