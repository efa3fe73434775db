"""The ASGI app: `granian --interface asgi runtime.app:app [--workers N]`.

Each granian worker runs this module's lifespan: it starts the engine or attaches to
the one another worker started (runtime/supervise/launcher.py), takes a worker index, connects
its REQUEST and TEXT_OUT channels, and runs one TokenizerManager. Settings come from
RINGSERVE_* environment variables (ServerArgs.from_env; `python -m runtime serve`
sets them from its flags).

Routes stay thin: httpapi/ does the protocol (parsing, validation, bodies, SSE
templates), the TokenizerManager the engine side. Every route answers APIError with
its OpenAI-format body; anything else is a bug, logged, and a 500.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import os
import time
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.responses import Response

from gpu.model_files import ModelLoadError
from httpapi.auth import check_api_key
from httpapi.errors import APIError, engine_unavailable, internal_error, model_not_found
from httpapi.info import check_model, model_card, model_info_body, models_body, served_model_name, server_info_body
from httpapi.logprobs import LogprobVocab
from httpapi.requests import (parse_abort, parse_chat_completion, parse_completion, parse_detokenize, parse_generate,
                              parse_tokenize)
from httpapi.responses import (ChoiceResult, Usage, chat_completion_body, completion_body, generate_body,
                               new_request_id, now)
from httpapi.sampling import SamplingSpec, check_token_ids
from httpapi.sse import DONE, HEADERS, ChatStream, CompletionStream, GenerateStream, error_event
from runtime.config import ServerArgs
from runtime.gc_tuning import settle_heap
from runtime.supervise.launcher import EngineLink, EngineStartError, ServerFiles, attach_engine
from runtime.http_worker.metrics import EngineStats, WorkerMetrics, use_multiprocess_dir
from protocol.sampling_params import SamplingParams
from runtime.http_worker.tokenizer_manager import ClientGone, ModelInfo, ReqGroup, ReqState, TokenizerManager, read_chat_template
from runtime.supervise.watchdog import HEARTBEAT_STALE_S, EngineWatchdog

logger = logging.getLogger("ringserve.app")

JSON = "application/json"
WORKER_HEADER = "x-ringserve-worker"  # which HTTP worker answered (its index)
MODEL_PATH = "/v1/models/"  # + the served name: its card (routed at start-up)
HEALTH_GENERATE_TIMEOUT_S = 30.0
METRICS_FLUSH_S = 1.0  # locally counted latencies reach the shared metrics files this often
_SSE_HEADERS = [(k.encode(), v.encode()) for k, v in HEADERS.items()]


def json_response(body: bytes, status: int = 200) -> Response:
    return Response(body, status, media_type=JSON)


async def read_body(request: Request) -> bytes:
    """The request body, from receive() itself: one message for a usual body, where
    starlette's Request.body() runs an async generator a request (~5% of the worker's
    Python time). A client that leaves before sending it all is gone (ClientGone)."""
    chunks = []
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def error_response(err: APIError) -> Response:
    return json_response(err.body(), err.status)


def api_route(handler: Callable[..., Awaitable[Response]], key_required: bool = True
              ) -> Callable[[Request], Awaitable[Response]]:
    """Checks the API key (probe_route: none), hands the route the worker's state, and turns
    APIError into its response; anything else raised is a bug: logged, answered with a 500."""
    @functools.wraps(handler)
    async def route(request: Request) -> Response:
        worker = request.app.worker
        try:
            if key_required and worker.args.api_key is not None:  # else no header to read
                check_api_key(request.headers.get("authorization"), worker.args.api_key)
            response = await handler(worker, request)
        except APIError as err:
            response = error_response(err)
        except ClientGone:  # nobody reads the answer; the request was aborted
            response = Response(b"", 499)
        except Exception:
            logger.exception("%s %s failed", request.method, request.url.path)
            response = error_response(internal_error())
        response.headers.append(WORKER_HEADER, worker.index_header)
        return response
    return route


# Probes and scrapes answer without the API key, as SGLang's /health* and /metrics do (vLLM
# guards only /v1): a load balancer or Prometheus need not hold the key.
probe_route = functools.partial(api_route, key_required=False)


class EventStream:
    """An SSE response fed by an async iterator of ready-made event bytes, one write each;
    the item ending with DONE is the last and ends the body with it. The status line and
    headers go out with the first event, not before it: granian hands each send to its I/O
    thread, which then wakes ~3.8 times a streamed request instead of ~4.6 (null model). A
    disconnected client (http.disconnect) calls `on_disconnect`, which aborts the request,
    so the iterator ends at its next wait."""

    def __init__(self, events: AsyncIterator[bytes], on_disconnect: Callable[[], None],
                 watches: DisconnectWatches) -> None:
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


class DisconnectWatch:
    """Calls `on_disconnect` when the client goes away (http.disconnect; the request body
    was read already), from a callback on receive()'s future rather than a task awaiting it
    (a task a request, and its cancellation at the end, cost 30-60 µs of server CPU a
    streamed request). Another message (granian sends an empty http.request after the body)
    re-arms it.

    Armed only once the request has run for WATCH_AFTER_S (DisconnectWatches): granian
    runs each receive() as a task on its I/O thread, which posts the result back to the
    event loop (~6% of the HTTP worker's Python time in a short streamed request); a client
    that left sooner is still seen then (granian keeps the connection's close for the next
    receive), so its request runs at most that much longer."""

    def __init__(self, receive: Callable[[], Awaitable[dict]], on_disconnect: Callable[[], None],
                 watches: "DisconnectWatches") -> None:
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
    a timer a request (call_later, and its cancel) cost ~2% of the worker's Python time."""

    WATCH_AFTER_S = 1.0

    def __init__(self) -> None:
        self.unarmed: dict[DisconnectWatch, float] = {}  # -> when it started (time.monotonic)

    def watch(self, receive: Callable[[], Awaitable[dict]], on_disconnect: Callable[[], None]) -> DisconnectWatch:
        return DisconnectWatch(receive, on_disconnect, self)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.WATCH_AFTER_S / 2)
            due = time.monotonic() - self.WATCH_AFTER_S
            ready = list(itertools.takewhile(lambda item: item[1] <= due, self.unarmed.items()))
            for watch, _ in ready:
                del self.unarmed[watch]
                try:
                    watch.arm()
                except Exception:  # a bug in one request's abort must not leave the later ones unwatched
                    logger.exception("a disconnect watch failed")


async def finished(worker, request: Request, group: ReqGroup) -> list[ReqState]:
    """A non-streamed request's choices, all finished; aborted if the client leaves first."""
    watch = worker.watches.watch(request.receive, lambda: worker.tm.abort(group))
    try:
        return await group.finished()
    finally:
        watch.close()


def choice_results(states: list[ReqState], prefixes: list[str] | None = None) -> list[ChoiceResult]:
    results = []
    for state in states:
        text, lp, finish = state.take()
        if prefixes is not None:
            text = prefixes[state.index] + text
        results.append(ChoiceResult(state.index, text, finish, usage_of(state), lp, state.matched_stop,
                                    e2e_latency(state), output_ids_of(state)))
    return results


def output_ids_of(state: ReqState) -> list[int] | None:
    return state.output_ids if state.params.return_ids else None


def e2e_latency(state: ReqState) -> float:
    """Seconds from the request's arrival to now (its end, when asked of a finished choice)."""
    return (time.monotonic_ns() - state.group.arrival_ns) * 1e-9


def usage_of(state: ReqState) -> Usage:
    return Usage(state.prompt_tokens, state.completion_tokens, state.cached_tokens)


# ---------------------------------------------------------------- OpenAI

@api_route
async def chat_completions(worker, request: Request) -> Response:
    req = parse_chat_completion(await read_body(request))
    check_model(req.model, worker.model.served_name)
    ids = await worker.tm.chat_ids(req.messages)
    params = worker.sampling_params(req.sampling, ids)
    request_id, created = new_request_id("chatcmpl"), now()  # also the rid /abort_request takes
    group = await worker.submit("chat", [ids], [params], req.n, [request_id], req.stream)
    vocab = worker.vocab if params.logprobs else None
    if req.stream:
        stream = ChatStream(request_id, created, worker.model.served_name, req.n, vocab)
        events = openai_events(worker, group, stream, req.n, req.include_usage, stream.start())
        return EventStream(events, lambda: worker.tm.abort(group), worker.watches)
    states = await finished(worker, request, group)
    worker.observe(group)
    return json_response(chat_completion_body(request_id, created, worker.model.served_name,
                                              choice_results(states), req.n, vocab))


@api_route
async def completions(worker, request: Request) -> Response:
    req = parse_completion(await read_body(request))
    check_model(req.model, worker.model.served_name)
    prompt_ids = [await prompt_tokens(worker, p) for p in req.prompts]
    params = [worker.sampling_params(req.sampling, ids) for ids in prompt_ids]
    n = req.n
    request_id, created = new_request_id("cmpl"), now()  # also the rid /abort_request takes
    group = await worker.submit("completions", prompt_ids, params, n, [request_id], req.stream)
    echoes = None
    if req.echo:
        echoes = [p if isinstance(p, str) else worker.tm.decode(p) for p in req.prompts for _ in range(n)]
    vocab = worker.vocab if params[0].logprobs else None
    if req.stream:
        stream = CompletionStream(request_id, created, worker.model.served_name, len(group.states), vocab)
        first = b"".join(stream.delta(i, text) for i, text in enumerate(echoes)) if echoes else b""
        events = openai_events(worker, group, stream, n, req.include_usage, first)
        return EventStream(events, lambda: worker.tm.abort(group), worker.watches)
    states = await finished(worker, request, group)
    worker.observe(group)
    return json_response(completion_body(request_id, created, worker.model.served_name,
                                         choice_results(states, echoes), n, vocab))


def openai_events(worker, group: ReqGroup, stream: ChatStream | CompletionStream, n: int,
                  include_usage: bool, head: bytes) -> AsyncIterator[bytes]:
    def render(state: ReqState) -> bytes | None:
        text, lp, finish = state.take()
        if text or finish or lp is not None:
            return stream.delta(state.index, text, finish, lp)
        return None

    def tail() -> bytes:
        if include_usage:
            return stream.usage(Usage.combine([usage_of(s) for s in group.states], n)) + DONE
        return DONE

    return sse_events(worker, group, render, head, tail)


async def sse_events(worker, group: ReqGroup, render: Callable[[ReqState], bytes | None], head: bytes,
                     tail: Callable[[], bytes]) -> AsyncIterator[bytes]:
    """A stream's writes: each carries the events of every delta that arrived since the
    previous one (a client that fell behind gets its pending deltas coalesced); the first
    also carries `head` (role chunks, echoes), the last the tail (usage, DONE)."""
    pending = [head] if head else []
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
        yield b"".join(pending) + error_event(err) + DONE
        return
    worker.observe(group)
    pending.append(tail())
    yield b"".join(pending)


async def prompt_tokens(worker, prompt: str | list[int]) -> list[int]:
    return await worker.tm.encode(prompt) if isinstance(prompt, str) else prompt


@api_route
async def models(worker, request: Request) -> Response:
    m = worker.model
    return json_response(models_body(m.served_name, worker.started, m.context_length, m.model_dir))


@api_route
async def retrieve_model(worker, request: Request) -> Response:
    """GET /v1/models/{id}: routed at start-up, once the served name is known; another id is a 404."""
    m = worker.model
    return json_response(orjson_dumps(model_card(m.served_name, worker.started, m.context_length, m.model_dir)))


# ---------------------------------------------------------------- SGLang native

@api_route
async def generate(worker, request: Request) -> Response:
    req = parse_generate(await read_body(request))
    prompt_ids = [await prompt_tokens(worker, p) for p in req.prompts]
    params = [worker.sampling_params(spec, ids) for spec, ids in zip(req.samplings, prompt_ids)]
    n = req.n
    rids = [rid or new_request_id("gen") for rid in req.rids]
    choice_rids = [rid if n == 1 else f"{rid}-{j}" for rid in rids for j in range(n)]
    group = await worker.submit("generate", prompt_ids, params, n, rids, req.stream)
    vocab = worker.vocab if req.return_logprob else None
    if req.stream:
        stream = GenerateStream(choice_rids, req.batch, vocab, req.return_text_in_logprobs)
        return EventStream(generate_events(worker, group, stream), lambda: worker.tm.abort(group),
                           worker.watches)
    states = await finished(worker, request, group)
    worker.observe(group)
    return json_response(generate_body(choice_rids, choice_results(states), req.batch, vocab,
                                       req.return_text_in_logprobs))


def generate_events(worker, group: ReqGroup, stream: GenerateStream) -> AsyncIterator[bytes]:
    def render(state: ReqState) -> bytes:
        text, lp, finish = state.take()
        return stream.delta(state.index, text, usage_of(state), finish, state.matched_stop, lp,
                            e2e_latency(state) if finish else None, output_ids_of(state))

    return sse_events(worker, group, render, b"", lambda: DONE)


@api_route
async def tokenize(worker, request: Request) -> Response:
    req = parse_tokenize(await read_body(request))
    check_model(req.model, worker.model.served_name)
    if req.messages is not None:
        tokens = [await worker.tm.chat_ids(req.messages)]
    else:
        tokens = [await worker.tm.encode(p, req.add_special_tokens) for p in req.prompts]
    body = {"tokens": tokens, "count": [len(t) for t in tokens]} if req.batch else \
        {"tokens": tokens[0], "count": len(tokens[0])}
    return json_response(orjson_dumps({**body, "max_model_len": worker.model.context_length}))


@api_route
async def detokenize(worker, request: Request) -> Response:
    req = parse_detokenize(await read_body(request))
    check_model(req.model, worker.model.served_name)
    for ids in req.token_ids:
        check_token_ids(ids, worker.model.vocab_size, "tokens")
    texts = [worker.tm.decode(ids, req.skip_special_tokens) for ids in req.token_ids]
    return json_response(orjson_dumps({"text": texts if req.batch else texts[0]}))


@api_route
async def get_model_info(worker, request: Request) -> Response:
    m = worker.model
    return json_response(model_info_body(m.served_name, m.model_dir, m.context_length, m.vocab_size, m.architecture))


@api_route
async def get_server_info(worker, request: Request) -> Response:
    return json_response(server_info_body(worker.args, **worker.engine_state()))


@api_route
async def flush_cache(worker, request: Request) -> Response:
    worker.check_alive()
    worker.tm.flush_cache()
    return Response("Cache flushed.\n", media_type="text/plain")


@api_route
async def abort_request(worker, request: Request) -> Response:
    req = parse_abort(await read_body(request))
    aborted = worker.tm.abort_rid(None if req.abort_all else req.rid)
    return json_response(orjson_dumps({"aborted": aborted}))


# ---------------------------------------------------------------- health and metrics

async def health(request: Request) -> Response:
    problem = request.app.worker.health_problem()
    if problem:
        return error_response(engine_unavailable(problem))
    return Response(b"", 200)


@probe_route
async def health_generate(worker, request: Request) -> Response:
    """Runs one greedy token through the whole engine."""
    worker.check_alive()
    params = SamplingParams(max_new_tokens=1, temperature=0.0)
    group = await worker.tm.submit([[worker.health_token]], [params])
    try:
        await asyncio.wait_for(group.finished(), HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        worker.tm.abort(group)
        raise engine_unavailable(f"a 1-token generation did not finish within {HEALTH_GENERATE_TIMEOUT_S:g} s")
    return Response(b"", 200)


@probe_route
async def metrics(worker, request: Request) -> Response:
    body, content_type = worker.metrics.render(worker.engine_stats(), {
        "dead": worker.tm.dead is not None, "index": worker.link.worker, "rings": worker.tm.ring_depths()})
    return Response(body, media_type=content_type)


# ---------------------------------------------------------------- the app

def orjson_dumps(obj) -> bytes:
    import orjson
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)


class HTTPWorker:
    """One granian worker's state: its engine link, TokenizerManager, watchdog and metrics."""

    def __init__(self, args: ServerArgs, files: ServerFiles, link: EngineLink, tm: TokenizerManager,
                 vocab: LogprobVocab, metrics: WorkerMetrics) -> None:
        self.args, self.files, self.link, self.tm = args, files, link, tm
        self.model = tm.model
        self.vocab = vocab
        self.metrics = metrics
        self.kv_tokens: int | None = link.meta.get("max_total_tokens")  # may hold less than the context
        self.started = now()
        self.index_header = str(link.worker)
        self.health_token = tm.tokenizer.bos_token_id if tm.tokenizer.bos_token_id is not None else 0
        self.stats: EngineStats | None = None  # opened on first use: the scheduler creates it
        self.watchdog = EngineWatchdog(link.procs, files.server_pid, self._engine_exited)
        self.watches = DisconnectWatches()
        self._tasks: list[asyncio.Task] = []  # metrics flushing, disconnect watches

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
            metrics = WorkerMetrics()
        except BaseException:
            link.close(files)
            raise
        tm = TokenizerManager(link.worker, link.request_ch, link.text_ch, link.waker, tokenizer, model,
                              args.request_timeout, args.stream_interval)
        worker = cls(args, files, link, tm, vocab, metrics)
        tm.start()
        worker.watchdog.start(asyncio.get_running_loop())
        worker._tasks = [asyncio.create_task(worker._flush_metrics()), asyncio.create_task(worker.watches.run())]
        settle_heap()
        logger.info("HTTP worker %d (pid %d) attached to the engine of server %d: scheduler pid %d, "
                    "detokenizer pid %d", link.worker, os.getpid(), files.server_pid,
                    *(p.pid for p in link.procs))
        return worker

    async def close(self) -> None:
        self.watchdog.close()
        for task in self._tasks:
            task.cancel()
        self.metrics.flush()
        await self.tm.close()
        if self.stats is not None:
            self.stats.close()
        self.link.close(self.files)

    def _engine_exited(self, role: str) -> None:
        self.tm.fail_all(engine_unavailable(f"The engine's {role} process exited; restart the server."))

    async def _flush_metrics(self) -> None:
        while True:
            await asyncio.sleep(METRICS_FLUSH_S)
            self.metrics.flush()

    # ---------------------------------------------------------------- used by the routes

    def check_alive(self) -> None:
        if self.tm.dead is not None:
            raise self.tm.dead

    def sampling_params(self, spec: SamplingSpec, prompt_ids: list[int]) -> SamplingParams:
        """A request's final sampling parameters for one tokenized prompt; raises APIError(400)."""
        m = self.model
        return spec.resolve(prompt_ids, m.context_length, m.vocab_size, self.kv_tokens)

    async def submit(self, endpoint: str, prompts: list, params: list[SamplingParams], n: int, rids: list[str],
                     stream: bool) -> ReqGroup:
        """n choices of each prompt, prompt-major. A seeded prompt's j-th choice samples with
        seed + j, as vLLM's: the n samples differ, and the request is still reproducible."""
        self.metrics.count_request(endpoint)
        choice_params = [p if p.seed is None or j == 0 else dataclasses.replace(p, seed=_wrap_int64(p.seed + j))
                         for p in params for j in range(n)]
        return await self.tm.submit([ids for ids in prompts for _ in range(n)], choice_params, rids, stream)

    def observe(self, group: ReqGroup) -> None:
        """A request that ran to its end (not one that failed or whose client left)."""
        self.metrics.observe_request(group.arrival_ns, time.monotonic_ns(), group.states)

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
            if age > HEARTBEAT_STALE_S:
                return f"The scheduler has not completed a step for {age:.0f} s."
        return None

    def engine_state(self) -> dict:
        """What /get_server_info adds to the arguments: the engine as the scheduler described it."""
        meta = self.link.meta
        return {"max_total_num_tokens": meta.get("max_total_tokens"), "context_length": self.model.context_length,
                "attention_backend": meta.get("attention_backend"), "worker_index": self.link.worker,
                "engine": {p.role: p.pid for p in self.link.procs}, "engine_up": self.tm.dead is None,
                "internal_states": [self.engine_stats() or {}]}


def _wrap_int64(value: int) -> int:
    return (value + 2**63) % 2**64 - 2**63


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

    from gpu.model_config import ModelConfig
    from gpu.model_files import resolve_model_dir

    model_dir = resolve_model_dir(args.model_path)
    cfg = ModelConfig.from_dir(model_dir, args.context_length)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if args.chat_template is not None:
        try:
            tokenizer.chat_template = read_chat_template(args.chat_template)
        except (OSError, ValueError) as e:
            raise ModelLoadError(str(e)) from None
    model = ModelInfo(str(model_dir), served_model_name(args), cfg.architecture, cfg.context_length, cfg.vocab_size)
    return tokenizer, model, LogprobVocab.from_tokenizer(tokenizer, cfg.vocab_size)


Handler = Callable[[Request], Awaitable[Response]]


class App:
    """The ASGI app: a route is one dict lookup (path, then method) and its handler gets a
    starlette Request and returns a starlette Response; the lifespan is the app's own, so
    that a worker that cannot start says why in one line.

    No starlette application object: its two middlewares, router scan and exception wrapper
    cost ~120 µs of a streamed request (a granian app streaming 5 events: 145-149 µs of
    server CPU a request dispatched like this, 261-277 µs through Starlette()), an eighth of
    what the HTTP worker spends on one here. Nothing of it is needed: api_route turns every
    error into its response, and unknown paths and methods are answered here, in OpenAI's
    error format."""

    def __init__(self, routes: dict[str, dict[str, Handler]]) -> None:
        self.routes: dict[str, dict[str, Handler]] = {}
        for path, methods in routes.items():
            self.add_route(path, methods)
        self.worker: HTTPWorker | None = None

    def add_route(self, path: str, methods: dict[str, Handler]) -> None:
        """Routes `path`; HEAD is answered where GET is."""
        self.routes[path] = {**methods, **({"HEAD": methods["GET"]} if "GET" in methods else {})}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            scope["app"] = self  # what request.app returns
            request = Request(scope, receive)
            methods = self.routes.get(scope["path"])
            handler = None if methods is None else methods.get(scope["method"])
            if handler is not None:
                try:
                    response = await handler(request)
                except Exception:  # api_route answers errors; this is a bug in a route outside it
                    logger.exception("%s %s failed", scope["method"], scope["path"])
                    response = error_response(internal_error())
            elif methods is None and scope["path"].startswith(MODEL_PATH):  # another model's card
                response = error_response(model_not_found(scope["path"][len(MODEL_PATH):]))
            elif methods is None:
                response = error_response(APIError(404, f"{scope['method']} {scope['path']}: Not Found"))
            else:
                response = error_response(APIError(405, f"{scope['method']} {scope['path']}: Method Not Allowed"))
                response.headers["allow"] = ", ".join(methods)
            await response(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        else:  # a websocket: none is served
            await send({"type": "websocket.close"})

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    self.worker = await HTTPWorker.start()
                except (EngineStartError, ModelLoadError) as e:
                    await send({"type": "lifespan.startup.failed", "message": f"ringserve: {e}"})
                    return
                except Exception as e:
                    logger.exception("the worker failed to start")
                    await send({"type": "lifespan.startup.failed", "message": f"ringserve: {e!r}"})
                    return
                self.add_route(MODEL_PATH + self.worker.model.served_name, {"GET": retrieve_model})
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.worker is not None:
                    await self.worker.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


app = App({
    "/v1/chat/completions": {"POST": chat_completions},
    "/v1/completions": {"POST": completions},
    "/v1/models": {"GET": models},
    "/generate": {"POST": generate, "PUT": generate},
    "/tokenize": {"POST": tokenize},
    "/detokenize": {"POST": detokenize},
    "/v1/tokenize": {"POST": tokenize},
    "/v1/detokenize": {"POST": detokenize},
    "/get_model_info": {"GET": get_model_info},
    "/get_server_info": {"GET": get_server_info},
    "/flush_cache": {"POST": flush_cache, "GET": flush_cache},
    "/abort_request": {"POST": abort_request},
    "/health": {"GET": health},
    "/health_generate": {"GET": health_generate},
    "/metrics": {"GET": metrics},
})
