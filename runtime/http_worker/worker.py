"""One granian worker's state (HTTPWorker): its link to the engine, its TokenizerManager, the
watchdog on the engine's processes, its metrics; and what the routes ask of them."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gpu.models.model_files import ModelLoadError
from httpapi.errors import engine_unavailable
from httpapi.info import served_model_name, served_model_names
from httpapi.logprobs import LogprobVocab
from httpapi.responses import now
from httpapi.sampling import SamplingSpec
from protocol.sampling_params import SamplingParams
from runtime.config import ServerArgs
from runtime.engine_stats import EngineStats
from runtime.gc_tuning import settle_heap
from runtime.http_worker.disconnect import DisconnectWatches
from runtime.http_worker.metrics import WorkerMetrics, use_multiprocess_dir
from runtime.http_worker.tokenizer_manager import (
    ModelInfo,
    ReqGroup,
    ReqState,
    TokenizerManager,
    TracedTokenizerManager,
    read_chat_template,
)
from runtime.supervise.files import EngineProcess, ServerFiles
from runtime.supervise.launcher import EngineGaveUp, EngineLink, attach_engine, kill_and_wait
from runtime.supervise.watchdog import HEARTBEAT_STALE_S, EngineWatchdog, stalled_heartbeats
from runtime.ttft_trace import TtftTrace
from structured.reasoning import make_reasoning_parser
from structured.tool_parsers import template_tool_call_parser
from structured.tools import HERMES_TEMPLATE

logger = logging.getLogger("ringserve.app")

METRICS_FLUSH_S = 1.0  # locally counted latencies reach the shared metrics files this often
HEARTBEAT_CHECK_S = 1.0  # the engine's heartbeats are checked this often (at most)
GRAMMAR_CHECK_THREADS = 2  # grammar checks of one worker at once
# grammar checks a worker holds at once, running or queued: a client's distinct pathological
# grammars (a second of CPU each) cannot queue without end; past it, a 503 to retry
MAX_GRAMMAR_CHECKS = 64
REATTACH_RETRY_S = 1.0  # a failed attach to a new engine is tried again after this (ensure_engine backs off)


class HTTPWorker:
    """One granian worker's state: its engine link, TokenizerManager, watchdog and metrics."""

    def __init__(
        self,
        args: ServerArgs,
        files: ServerFiles,
        link: EngineLink,
        tm: TokenizerManager,
        vocab: LogprobVocab,
        metrics: WorkerMetrics,
    ) -> None:
        self.args, self.files, self.link, self.tm = args, files, link, tm
        self.model = tm.model
        self.served_names = served_model_names(args.model_path, args.served_model_name)  # the first: tm.model's
        # --log-requests: each request's endpoint, for its log line
        self._endpoints: weakref.WeakKeyDictionary[ReqGroup, str] = weakref.WeakKeyDictionary()
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
        self.watchdog = EngineWatchdog(link.procs, files.server_pid, self._engine_exited)
        self.watches = DisconnectWatches()
        self._tasks: list[asyncio.Task] = []  # metrics flushing, disconnect watches, heartbeats
        self._healing: asyncio.Task | None = None  # attaching to a new engine
        self._grammar_checks = GrammarChecks(GRAMMAR_CHECK_THREADS, MAX_GRAMMAR_CHECKS)

    @classmethod
    async def start(cls) -> HTTPWorker:
        args = ServerArgs.from_env()
        _configure_logging(args.log_level)
        files = ServerFiles.of(os.getppid())  # granian's main process: the server
        use_multiprocess_dir(files.metrics_dir)  # before prometheus_client is imported
        loading = asyncio.ensure_future(asyncio.to_thread(_load_tokenizer, args))  # while the engine starts
        try:
            link = await asyncio.to_thread(attach_engine, args, files)
        except BaseException:
            await asyncio.gather(loading, return_exceptions=True)
            raise
        try:
            tokenizer, model, vocab = await loading
            metrics = WorkerMetrics(model.served_name)
        except BaseException:
            link.close(files)
            raise
        tm_args = (link.worker, link.request_ch, link.text_ch, link.waker, tokenizer, model, args.request_timeout)
        trace_dir = TtftTrace.directory()
        if trace_dir is None:
            tm = TokenizerManager(*tm_args, args.stream_interval)
        else:
            trace = TtftTrace(trace_dir, f"worker{link.worker}")
            tm = TracedTokenizerManager(*tm_args, args.stream_interval, trace=trace)
        worker = cls(args, files, link, tm, vocab, metrics)
        if trace_dir is not None:
            observe_delta = worker.observe_delta

            def traced_observe_delta(state: ReqState, now_ns: int) -> None:
                tm.woken(state, now_ns)
                observe_delta(state, now_ns)

            worker.observe_delta = traced_observe_delta
        tm.start()
        worker.watchdog.start(asyncio.get_running_loop())
        worker._tasks = [
            asyncio.create_task(worker._flush_metrics()),
            asyncio.create_task(worker.watches.run()),
            asyncio.create_task(worker._watch_heartbeats()),
        ]
        settle_heap()
        logger.info(
            "HTTP worker %d (pid %d) attached to the engine of server %d: scheduler pid %d, detokenizer pid %d",
            link.worker,
            os.getpid(),
            files.server_pid,
            *(p.pid for p in link.procs),
        )
        return worker

    async def close(self) -> None:
        self.watchdog.close()
        for task in [*self._tasks, self._healing]:
            if task is not None:
                task.cancel()
        if self._healing is not None:
            await asyncio.gather(self._healing, return_exceptions=True)
        self.metrics.flush()
        await self.tm.close()
        if self.stats is not None:
            self.stats.close()
        self._grammar_checks.close()
        self.link.close(self.files)

    # ---------------------------------------------------------------- the engine dies, hangs, heals

    def _engine_exited(self, role: str) -> None:
        self._engine_lost(f"The engine's {role} process exited")

    def _engine_lost(self, why: str, hung: EngineProcess | None = None) -> None:
        """Every request in flight fails now, and new ones while a new engine starts (one per
        server: whichever worker comes first starts it, under the flock of ensure_engine).
        `hung`: an engine process to kill first. The old watchdog keeps watching granian's
        main process until the new engine is attached."""
        if self._healing is not None:
            return
        self.tm.fail_all(engine_unavailable(f"{why}; a new engine is starting, retry shortly."))
        self._healing = asyncio.create_task(self._heal(why, hung))

    async def _heal(self, why: str, hung: EngineProcess | None) -> None:
        cancel = threading.Event()  # a worker that stops meanwhile: the thread's waits end
        try:
            if hung is not None:
                await asyncio.to_thread(kill_and_wait, hung)
            await self.tm.detach_channels()
            old = self.link
            if self.stats is not None:  # the new scheduler publishes afresh
                self.stats.close()
                self.stats = None
            claimed = (old.worker, old.worker_lock_fd)
            while True:
                try:
                    link = await asyncio.to_thread(attach_engine, self.args, self.files, claimed, cancel)
                    break
                except EngineGaveUp as e:
                    logger.error("%s", e)
                    self.tm.dead = engine_unavailable(str(e))
                    return  # _healing stays set: this worker does not start the engine again
                except Exception as e:  # it died starting (EngineStartError), a connect failed: the next try
                    logger.error("attaching to a new engine failed (%s): trying again", e)
                    await asyncio.sleep(REATTACH_RETRY_S)
        except asyncio.CancelledError:
            cancel.set()
            raise
        old.close_channels()
        self.watchdog.close()
        for proc in old.procs:  # the old engine is gone (ensure_engine saw to it): no zombie of ours stays
            with contextlib.suppress(ChildProcessError):
                os.waitpid(proc.pid, os.WNOHANG)
        self.link = link
        self.kv_tokens = link.meta.get("max_total_tokens")
        self.watchdog = EngineWatchdog(link.procs, self.files.server_pid, self._engine_exited)
        self.tm.attach_channels(link.request_ch, link.text_ch, link.waker)
        self.watchdog.start(asyncio.get_running_loop())
        self._healing = None
        logger.warning(
            "HTTP worker %d attached to a new engine: scheduler pid %d, detokenizer pid %d",
            link.worker,
            *(p.pid for p in link.procs),
        )

    async def _watch_heartbeats(self) -> None:
        """A scheduler or detokenizer whose heartbeat is older than --watchdog-timeout is hung:
        it is killed (so that it can be replaced, and so is its peer, which watches it) and
        treated as dead at once."""
        timeout_ns = int(self.args.watchdog_timeout * 1e9)
        while True:
            await asyncio.sleep(min(HEARTBEAT_CHECK_S, self.args.watchdog_timeout / 4))
            if self._healing is not None:
                continue
            link = self.link
            for role, age_s in stalled_heartbeats(
                {"scheduler": link.request_ch, "detokenizer": link.text_ch}, timeout_ns
            ).items():
                proc = next(p for p in link.procs if p.role == role)
                logger.error(
                    "the engine's %s (pid %d) has not beaten for %.1f s (--watchdog-timeout %g): killing it",
                    role,
                    proc.pid,
                    age_s,
                    self.args.watchdog_timeout,
                )
                self._engine_lost(f"The engine's {role} stopped responding for {age_s:.0f} s", hung=proc)
                break

    async def _flush_metrics(self) -> None:
        while True:
            await asyncio.sleep(METRICS_FLUSH_S)
            self.metrics.flush()

    # ---------------------------------------------------------------- used by the routes

    def check_alive(self) -> None:
        if self.tm.dead is not None:
            raise self.tm.dead

    async def check_grammars(self, specs: Sequence[SamplingSpec]) -> None:
        """Each spec's grammar checked before any engine work (APIError 400 naming its field):
        inline when its verdict is memoized, else in a grammar-check thread."""
        backend, any_whitespace = self.args.grammar_backend, self.args.constrained_json_any_whitespace
        for spec in {id(s): s for s in specs}.values():  # a batch shares one spec
            if backend == "none" or spec.grammar_checked(any_whitespace):
                spec.check_grammar(backend, any_whitespace)
            else:
                await self._grammar_checks.run(spec.check_grammar, backend, any_whitespace)

    def sampling_params(self, spec: SamplingSpec, prompt_ids: list[int]) -> SamplingParams:
        """A request's final sampling parameters for one tokenized prompt; raises APIError(400)."""
        m = self.model
        return spec.resolve(prompt_ids, m.context_length, m.vocab_size, self.kv_tokens)

    async def submit(
        self, endpoint: str, prompts: list, params: list[SamplingParams], n: int, rids: list[str], stream: bool
    ) -> ReqGroup:
        """n choices of each prompt, prompt-major. A seeded prompt's j-th choice samples with
        seed + j, as vLLM's: the n samples differ, and the request is still reproducible."""
        self.metrics.count_request(endpoint)
        choice_params = [
            p if p.seed is None or j == 0 else dataclasses.replace(p, seed=_wrap_int64(p.seed + j))
            for p in params
            for j in range(n)
        ]
        group = await self.tm.submit([ids for ids in prompts for _ in range(n)], choice_params, rids, stream)
        if self.args.log_requests:
            self._endpoints[group] = endpoint
        return group

    def observe(self, group: ReqGroup) -> None:
        """A request that ended, whichever way: ran to its end, aborted (/abort_request, its
        client gone, timed out) or failed; once, when it ended."""
        end_ns = time.monotonic_ns()
        self.metrics.observe_request(group.arrival_ns, end_ns, group.states)
        if self.args.log_requests:
            self.log_request(group, end_ns)

    def log_request(self, group: ReqGroup, end_ns: int) -> None:
        """--log-requests: one line a request, once it ended; never its text."""
        states = group.states
        logger.info(
            "request %s %s: %d prompt tokens, %d completion tokens, finish %s, %.3f s",
            ",".join(group.rids),
            self._endpoints.get(group, "?"),
            sum(s.prompt_tokens for s in states),
            sum(s.completion_tokens for s in states),
            ",".join(s.finish.api_name if s.finished else "none" for s in states),
            (end_ns - group.arrival_ns) * 1e-9,
        )

    def observe_delta(self, state: ReqState, now_ns: int) -> None:
        """Inter-token latency of a streamed delta: its interval spread over its tokens."""
        k = state.completion_tokens - state.sent_tokens
        if k > 0:
            if state.sent_tokens:
                self.metrics.itl.observe((now_ns - state.last_ns) * 1e-9 / k, k)
            state.sent_tokens, state.last_ns = state.completion_tokens, now_ns

    def engine_stats(self) -> dict[str, int] | None:
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
                return f"The scheduler has not completed a step for {age:.0f} s."
        return None

    def engine_state(self) -> dict:
        """What /get_server_info adds to the arguments: the engine as the scheduler described it."""
        meta = self.link.meta
        return {
            "max_total_num_tokens": meta.get("max_total_tokens"),
            "context_length": self.model.context_length,
            "attention_backend": meta.get("attention_backend"),
            "worker_index": self.link.worker,
            "engine": {p.role: p.pid for p in self.link.procs},
            "engine_up": self.tm.dead is None,
            "internal_states": [self.engine_stats() or {}],
        }


def _wrap_int64(value: int) -> int:
    return (value + 2**63) % 2**64 - 2**63


class GrammarChecks:
    """The grammar checks not memoized (a 200 KB schema takes 0.1 s to parse; xgrammar frees the
    GIL meanwhile), in threads of their own so that they never queue behind tokenizing, at most
    `limit` held at once: past it, a 503."""

    def __init__(self, threads: int, limit: int) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar-check")
        self._limit = limit
        self._held = 0

    async def run(self, check: Callable[..., None], *args: Any) -> None:
        if self._held >= self._limit:
            raise engine_unavailable(
                f"{self._held} grammars are being checked on this worker, its limit; retry shortly."
            )
        self._held += 1
        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, check, *args)
        finally:
            self._held -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _configure_logging(level: str) -> None:
    log = logging.getLogger("ringserve")
    log.setLevel(level.upper())
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s worker {os.getpid()}: %(message)s"))
        log.addHandler(handler)
        log.propagate = False


def _load_tokenizer(args: ServerArgs) -> tuple[Any, ModelInfo, LogprobVocab]:
    from transformers import AutoTokenizer

    from gpu.models.model_config import ModelConfig
    from gpu.models.model_files import resolve_model_dir

    model_dir = resolve_model_dir(args.model_path)
    cfg = ModelConfig.from_dir(model_dir, args.context_length)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or str(model_dir))
    # the embedded model's own template renders no tools; the Hermes one renders everything
    # else as it does (tests/unit/test_hermes_template.py), and tool calls as the hermes parser reads them
    template = args.chat_template or (str(HERMES_TEMPLATE) if args.model_path is None else None)
    if template is not None:
        try:
            tokenizer.chat_template = read_chat_template(template)
        except (OSError, ValueError) as e:
            raise ModelLoadError(str(e)) from None
    model = ModelInfo(
        str(model_dir),
        served_model_name(args.model_path, args.served_model_name),
        cfg.architecture,
        cfg.context_length,
        cfg.vocab_size,
    )
    return tokenizer, model, LogprobVocab.from_tokenizer(tokenizer, cfg.vocab_size)
